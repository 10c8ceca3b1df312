"""What fddp.ft's steps report: its errors, the quorum a group is in, and what one step did."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["DivergedError", "StateLostError", "StepFailed", "Quorum", "StepInfo"]


class DivergedError(RuntimeError):
    """Replica groups of one job committed different steps apart (their histories split).

    Raised on every member, by :class:`Replicas` made with ``on_divergence="raise"``, at the first
    quorum the groups meet in after committing apart: the same step count with different states,
    or a group that is behind but committed steps the others never saw. (The default,
    ``on_divergence="heal"``, gives every member the state of the one with the most committed
    steps, the lowest rank among equals, with a warning naming what was dropped.) The usual cause
    is a ``min_replicas`` that let groups commit alone while they could not reach each other: a
    Lighthouse restart, a group stopped past the heartbeat timeout.
    """


DivergedError.__module__ = "fddp.ft"


class StateLostError(RuntimeError):
    """No live replica group holds the job's state, and the job has run before.

    A group holds the job's state once it has committed a step, was a member of the job's first
    quorum, or met a holder in a quorum. When the Lighthouse has formed quorums before (its quorum
    id is past 1) and a quorum's members hold none of it, they wait for a holder: a live one can be
    missing from a quorum for a moment (the Lighthouse leaves out a group it has not heard from for
    its heartbeat timeout, on a loaded machine) and is met at its next quorum. When no holder has
    joined them for ``quorum_timeout``, every member raises this: every group that held the state
    is gone, and starting over from these groups' own initial states would make a second model
    under the same job. Resume from a checkpoint
    (``replicas.start(state, step=n)`` with the checkpoint's state and committed step count), or
    start a new Lighthouse for a new job.
    """


StateLostError.__module__ = "fddp.ft"


class StepFailed(RuntimeError):
    """A step (or a DiLoCo synchronisation) was not committed: a member of its quorum failed or was
    lost during it or during its vote, or the quorum could not be used. The state is as it was
    before the step; the next step takes a quorum without the lost member. ``__cause__`` is the
    failure as this group saw it (gloo's lost connection, a peer's :class:`fddp.PeerError`, a
    timeout), whose wording depends on where the member died.
    """


StepFailed.__module__ = "fddp.ft"


class Quorum(NamedTuple):
    """The quorum the Manager last configured the group for.

    Attributes:
        id: torchft's quorum id (it changes when the members change or a vote failed).
        rank: this replica group's rank among the members.
        size: the number of member groups.
        store: the address of the quorum's store (``host:port/prefix``).

    Example:
        >>> replicas.group.quorum  # what the Manager configured last
        Quorum(id=3, rank=0, size=2, store='10.0.0.1:29500/torchft/3/0')
    """

    id: int
    rank: int
    size: int
    store: str


class StepInfo(NamedTuple):
    """What one fault-tolerant step did (``return_info=True``).

    Attributes:
        committed: every member group finished the step and the vote passed; the returned state is
            the new one. Otherwise it is the input state (or the one this group healed to).
        step: the number of committed steps after this one (torchft's step).
        rank: this group's rank in the step's quorum.
        size: the number of replica groups in the step's quorum.
        members: their replica ids, by rank.
        healed: this group received a peer's state before the step (it joined or was behind).
        quorum_s: seconds spent waiting for the quorum and its checks (0 when the step ran on the
            previous step's quorum).
        error: why the step was not committed (``None`` when committed): a :class:`StepFailed`
            whose ``__cause__`` is the failure as this group saw it.

    Example:
        >>> state, loss, info = replicas.step(train_step, state, x, y, return_info=True)
        >>> if not info.committed:
        ...     print(f"step {info.step} not committed: {info.error}")  # the next call retries without the lost group
    """

    committed: bool
    step: int
    rank: int
    size: int
    members: tuple[str, ...]
    healed: bool
    quorum_s: float
    error: BaseException | None
