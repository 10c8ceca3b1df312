"""The call scope: how one rank's failure inside an fddp call becomes every rank's error.

Every public fddp function that issues a collective runs inside :class:`call` on its group, by
construction: it is decorated with :func:`entry`. The scope keeps other threads out while it
runs, and decides what a failure means for the peers:

- an exception this rank raises before it sent anything for the call (a validation error, an
  exception from ``loss_fn`` in the forward pass) is *announced*: its report goes to the group's
  error channel and a header that says "rank r failed" takes the place of the call's agreement,
  so every peer raises :class:`PeerError` at that call, and the group stays usable for the next
  one (a retry after a caught out-of-memory error works);
- an exception after this rank sent something (in backward, between two buckets, inside a
  fully sharded forward) is *fatal*: the peers are, or will be, waiting in collectives this rank
  will never join. It is posted on the channel of every group the failing call had business on
  (:func:`fail`); every fddp wait reads it, so every peer raises :class:`PeerError` within a
  fraction of a second; and those groups refuse every later fddp call, on every rank, with the
  same words. Groups this rank had nothing in flight on carry on.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from fddp._dist import _header, _waits, _watcher
from fddp._dist._channel import Failure
from fddp._dist._errors import collective, is_collective
from fddp._dist._failures import fail, first_line, raise_if_failed
from fddp._dist._groups import Frame, GroupState, channel_of, checks, lock, rank, size, state

__all__ = ["call", "entry", "owe", "backward_scope"]


def _announce(group: dist.ProcessGroup | None, st: GroupState, what: str, e: BaseException) -> None:
    """This rank failed before sending anything for its call: post why, then send a head that
    says so in place of the call's, so the peers raise at the same call. A head has one size
    whatever the call, so it pairs with the peers' heads (their data riding in them or not) and
    the group stays in step while every rank raises."""
    # A backward of an earlier call still owes its collectives (the peers will wait in them), or
    # the peers send no head for this call (an NCCL group's known calls: they issued its
    # collectives already): fatal, which needs no head.
    if st.owed > 0 or _waits.batched(group):
        fail(group, what, e)
        return
    call_ = st.agreed
    st.agreed += 1
    me = rank(group)
    channel = channel_of(st, group)
    try:
        if channel is not None:
            channel.post(Failure(me, what, call_ + 1, type(e).__name__, first_line(e), False))
        head = _header.build(0, failed=me)
        work = _header.exchange(head, group)
    except Exception:  # noqa: BLE001 - cannot announce: make it fatal, which needs nothing of the peers
        st.agreed -= 1
        fail(group, what, e)
        return
    # Not waited for here (this rank raises at once), but read before this rank's next agreement
    # or take_requested on the group: the peers learnt its sum's request bits at this call.
    st.held.append((work, head))
    collective(e)  # outer calls on this group see an exception every rank raises at this point


class call:
    """Run one fddp call on ``group`` (a context manager): one thread at a time, and a failure
    that every rank of the group learns.

    A second thread that starts an fddp call on the same group meanwhile raises at once: the
    ranks match collectives by their order on the group, and two threads' calls interleave
    differently on every rank. The thread inside may call fddp again (a ``loss_fn`` that
    synchronises). An exception that leaves the call is announced to the peers (before the call
    sent anything) or posted as fatal (after), as the module's docstring says; a call on a group
    that a fatal failure ended raises :class:`PeerError` at once. Public functions enter it
    through :func:`entry`; the library uses it directly only for work that runs later on behalf
    of such a call (a backward's collectives).

    Args:
        group: the process group.
        what: the fddp function, for messages.
        headerless: the call's first collective is not an agreement header (an all-reduce of a
            sharded sum): a failure before it cannot be announced with a header, and is fatal.

    Example:
        >>> with call(group, "ddp_step"):
        ...     ...  # this call's agreement, then its collectives
    """

    __slots__ = ("group", "what", "headerless", "st", "frame", "unknown")

    def __init__(self, group: dist.ProcessGroup | None, what: str, headerless: bool = False, unknown: bool = False) -> None:
        self.group, self.what, self.headerless, self.st, self.frame = group, what, headerless, None, None
        self.unknown = unknown  # the arguments were too broken to name the call's group

    def __enter__(self) -> "call":
        if torch.compiler.is_compiling() or not dist.is_initialized():
            return self  # no group yet: the call itself raises the error that says how to start one
        group = self.group
        if group is not None and not isinstance(group, dist.ProcessGroup):  # None first: ProcessGroup's isinstance runs Python
            group = None  # a bad group= is the call's own error
        self.group = group
        st = state(group)
        raise_if_failed(st, self.what)
        if st.watched is None:
            st.watched = _watcher.watch_if_needed(group)  # NCCL: a thread reads the channel for the waits
        me = threading.get_ident()
        with lock:
            if st.owner is not None and st.owner != me:
                raise RuntimeError(
                    f"fddp.{self.what}: thread {threading.current_thread().name!r} started a synchronisation on a "
                    f"process group while thread {st.owner_name!r} is inside fddp.{st.owner_what} on it. Collectives "
                    "on one group are matched across ranks by their order, and two threads interleave differently "
                    "on every rank; call fddp from one thread per group (give each thread its own group: "
                    "torch.distributed.new_group(), passed as group=)"
                )
            if st.owner is None:
                st.owner, st.owner_name, st.owner_what = me, threading.current_thread().name, self.what
            st.depth += 1
        self.st = st
        self.frame = Frame(self.what, self.headerless)
        st.frames.append(self.frame)
        return self

    def without_header(self) -> None:
        """Say that this call will not start with an agreement header after all (its collectives
        are someone else's: ``grad_and_value`` on fully sharded parameters): a failure in it is
        fatal, not announced."""
        if self.frame is not None:
            self.frame.headerless = True

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> None:
        st, frame = self.st, self.frame
        if st is None:
            return
        try:
            if e is None or is_collective(e) or st.failed is not None or size(self.group) == 1:
                return
            if self.unknown:  # the peers may wait on any group: tell them all
                fail(self.group, self.what, e, everywhere=True)
            elif frame.sent or frame.headerless or not checks().agreement:
                fail(self.group, self.what, e)  # the peers wait in collectives this rank will not join
            else:
                _announce(self.group, st, self.what, e)
        finally:
            with lock:
                st.depth -= 1
                if st.depth == 0:
                    st.owner = None
            if st.frames and st.frames[-1] is frame:
                st.frames.pop()


def entry(what: str, group: Callable[..., Any] | None = None, *, headerless: bool = False) -> Callable[[Callable], Callable]:
    """Make a public function one fddp call: its whole body runs inside :class:`call` on its group.

    The one way in for every function that issues a collective or must agree with its peers: a
    failure anywhere in the body (a bad argument, an OSError in housekeeping, a failure between
    two collectives) reaches every rank of the group, announced or fatal as :class:`call` decides,
    instead of leaving the peers waiting. ``tests/test_entries.py`` walks the public API and fails
    on a function that issues a collective outside such a scope.

    Args:
        what: the public name, for messages (``"checkpoint.save"``).
        group: a function of the call's arguments that returns its process group; default: the
            ``group=`` keyword argument (``None``: the default group). Where it raises (an
            argument too broken to name its group, such as shards that are not shards), the
            call's failure is posted, fatal, on every group this process knows: the peers may
            wait on any of them.
        headerless: the function's first collective is not an agreement header (see :class:`call`).

    Example:
        >>> @entry("zero.gather", lambda shards, **_: shards.layout.group)
        ... def gather(shards): ...
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def scoped(*args: Any, **kwargs: Any) -> Any:
            unknown = False
            if group is None:
                g = kwargs.get("group")
            else:
                try:
                    g = group(*args, **kwargs)
                except Exception:  # noqa: BLE001 - the body raises the error that names the bad argument
                    g, unknown = None, True
            with call(g, what, headerless, unknown):
                return fn(*args, **kwargs)

        scoped.__fddp_entry__ = what  # type: ignore[attr-defined]
        return scoped

    return wrap


def backward_scope(group: dist.ProcessGroup | None, what: str) -> Any:
    """The scope of collectives a backward issues for a call that has returned: where no fddp call
    is in progress on ``group`` and no backward is owed there (which cover it already), a headerless
    :class:`call` of its own (a failure in it is fatal: the peers wait in its reductions); else
    nothing (entering a call from autograd's device thread while the caller's call holds the
    group would be refused as a second thread)."""
    if torch.compiler.is_compiling() or not dist.is_initialized() or state(group).busy():
        return contextlib.nullcontext()
    return call(group, what, headerless=True)


def owe(group: dist.ProcessGroup | None, n: int) -> None:
    """Count collectives of the current call still to come after it returns (``+1`` when a
    forward leaves a backward to run, ``-1`` when it has run): a failure meanwhile is fatal."""
    if not torch.compiler.is_compiling() and dist.is_initialized():
        state(group).owed += n
