"""The two errors every rank of a group raises alike, and the mark for exceptions that are collective.

A :class:`MismatchError` says the ranks disagree on what they run; a :class:`PeerError` says
another rank failed. Both are raised on every rank from values the ranks share, so they leave the
group in step: the call scope (``_scope``) neither announces nor posts them. :func:`collective`
gives any other exception the same standing when it is decided from agreed values.
"""

from __future__ import annotations

from fddp._dist._channel import Failure

__all__ = ["MismatchError", "PeerError", "collective", "is_collective"]


class MismatchError(RuntimeError):
    """Ranks disagree on what they are about to run: a tree (structure, leaf paths, shapes, dtypes
    or devices), an option that shapes the collectives (bucket caps, compression, weight), the
    order of fddp calls (a rank a call behind or ahead), the group, or the kind of call; or, where
    checked, on values that must be identical (the parameters, the replicas).

    Raised on every rank of the group, with the same message, before any bucket is sent: the
    alternative is a hang, a crash inside the backend, or a silent mix of unrelated values.

    Example:
        >>> try:
        ...     grads = fddp.ddp_step(params, grads)
        ... except fddp.MismatchError as e:
        ...     print(e)  # names the first leaf or option where the ranks differ
    """


class PeerError(RuntimeError):
    """Another rank of the group failed inside an fddp call, and this rank stopped waiting for it.

    The message names the rank, its fddp call and its exception (type and message). The failing
    rank itself raises its own exception. When the failure left collectives unmatched
    (``fatal``), the group refuses every later fddp call with this error on every rank: end the
    run and restart it from a checkpoint (``torchrun --max-restarts``), or start a new membership
    epoch under fault tolerance. Otherwise (the peer failed before it sent anything) the group
    is still in step, and the next call may go on.

    Attributes:
        rank: the failing rank (``None`` where the dead peer could not be told apart from the
            others of its group: see the message).
        what: the fddp function it failed in.
        kind: its exception's type name.
        cause: its exception's message.
        fatal: whether the group can no longer carry fddp calls.

    Example:
        >>> try:
        ...     grads, loss = step(params, x, y)
        ... except fddp.PeerError as e:
        ...     print(e.rank, e.kind)  # 1 ValueError
    """

    def __init__(self, message: str, failure: Failure) -> None:
        super().__init__(message)
        self.rank, self.what, self.kind, self.cause, self.fatal = failure.rank, failure.what, failure.kind, failure.message, failure.fatal


MismatchError.__module__ = "fddp"  # raised and caught as fddp.MismatchError
PeerError.__module__ = "fddp"


def collective(e: BaseException) -> BaseException:
    """Mark ``e`` as raised on every rank alike (decided from agreed values): it leaves the group
    in step, so the call scope neither announces nor posts it. Returns ``e``, to ``raise collective(...)``."""
    e._fddp_collective = True  # type: ignore[attr-defined]
    return e


def is_collective(e: BaseException) -> bool:
    """Whether every rank raises ``e`` alike (an fddp error of the group, or one marked :func:`collective`)."""
    return isinstance(e, (MismatchError, PeerError)) or getattr(e, "_fddp_collective", False)
