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

import functools
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from fddp._dist import _header
from fddp._dist._channel import Failure
from fddp._dist._errors import PeerError, collective, is_collective
from fddp._dist._groups import Frame, GroupState, channel_of, checks, collective_device, lock, rank, size, state, states

__all__ = ["call", "entry", "fail", "peer_error", "raise_if_failed", "raise_if_failed_here", "raise_announced", "owe", "frame"]


def peer_error(what: str, failure: Failure) -> PeerError:
    """The :class:`PeerError` a peer raises for ``failure``, with what it means for the group."""
    if failure.fatal:
        tail = (
            " The failure left collectives unmatched, so this process group carries no more fddp calls: end the run "
            "on every rank and restart it from the last checkpoint (torchrun --max-restarts does), or, under fault "
            "tolerance, begin a new epoch."
        )
    else:
        tail = " It failed before sending anything, so the ranks are still in step: a retry of the same call may go on."
    return PeerError(f"fddp.{what}: {failure.describe()}.{tail}", failure)


def raise_if_failed(st: GroupState, what: str) -> None:
    """Raise :class:`PeerError` if a fatal failure ended the group (this rank's or a peer's)."""
    if st.failed is not None:
        if st.mine:
            raise PeerError(
                f"fddp.{what}: this process group carries no more fddp calls: this rank failed in fddp.{st.failed.what} "
                f"(its call {st.failed.call}) with {st.failed.kind}: {st.failed.message}, leaving collectives its peers "
                "wait in unmatched. End the run on every rank and restart it from the last checkpoint.",
                st.failed,
            )
        raise peer_error(what, st.failed)


def raise_if_failed_here() -> None:
    """Raise :class:`PeerError` if this rank has failed some group (its own failure, posted while
    no fddp call was there to raise it: a graph freed without its backward)."""
    mine = [st for _, st in states() if st.failed is not None and st.mine]
    if mine:
        raise_if_failed(mine[0], mine[0].failed.what)


def raise_announced(group: dist.ProcessGroup | None, st: GroupState, what: str, call_: int, failed: int) -> None:
    """A peer announced its failure (``failed`` is its rank + 1) in place of this call's header: raise it here."""
    channel = channel_of(st, group)
    unread = Failure(failed - 1, "?", call_ + 1, "unknown", "(no store to read its report from)", False)
    raise peer_error(what, channel.announced(call_ + 1, failed - 1) if channel is not None else unread)


def fail(group: dist.ProcessGroup | None, what: str, e: BaseException) -> None:
    """Post ``e`` as this rank's fatal failure on the groups of the failing call, and refuse every
    later fddp call on them.

    The groups of the failing call are ``group`` and every group on which this rank's peers may be
    waiting for it: one with an fddp call in progress in this process (calls nest: a stage-3
    forward on the shard group inside a replica group's call), or a backward still owed (a
    forward that left its gradients' collectives to come). Other groups go on: a failure inside
    a two-rank subgroup does not end the job's default group.

    For a rank that finds, before issuing a collective, that it must not issue it (it left the
    agreed sequence): its peers are waiting for that collective and raise :class:`PeerError`.
    :class:`call` does the same for any exception that escapes after the call sent something.
    """
    if torch.compiler.is_compiling() or not dist.is_initialized():
        return
    st = state(group)
    if st.failed is not None:
        return
    pg = group if group is not None else dist.group.WORLD
    groups = [(pg, st)]
    if st.rank is None:
        # (A group across fault-tolerant replica groups fails alone: this rank's own replica
        # group's peers are not waiting for it; they meet at the step's vote.)
        groups += [(g, s) for g, s in states() if s is not st and s.failed is None and s.rank is None and s.busy()]
    for g, s in groups:
        mine = Failure(s.rank if s.rank is not None else dist.get_rank(g), what, s.agreed, type(e).__name__, _first_line(e), True)
        channel = channel_of(s, g)
        try:
            s.failed = channel.post(mine) if channel is not None else mine
        except Exception:  # noqa: BLE001 - the store is gone too: the peers' own timeouts remain
            s.failed = mine
        s.mine = s.failed == mine


def _first_line(e: BaseException) -> str:
    return (str(e).split("\n")[0] or repr(e))[:2000]


def _announce(group: dist.ProcessGroup | None, st: GroupState, what: str, e: BaseException) -> None:
    """This rank failed before sending anything for its call: post why, then send a header that
    says so in place of the call's agreement, so the peers raise at the same call."""
    if st.owed > 0:  # a backward of an earlier call still owes its collectives: the peers will wait in them
        fail(group, what, e)
        return
    call_ = st.agreed
    st.agreed += 1
    me = rank(group)
    failure = Failure(me, what, call_ + 1, type(e).__name__, _first_line(e), False)
    channel = channel_of(st, group)
    try:
        if channel is not None:
            channel.post(failure)
        t = torch.zeros(_header.SIZE, dtype=torch.int64, device=collective_device(group))
        t[_header.FAILED] = me + 1
        st.held = [w for w in st.held if not w.is_completed()][-8:]
        st.held.append(_header.exchange(t, group, what))
    except Exception:  # noqa: BLE001 - cannot announce: make it fatal, which needs nothing of the peers
        st.agreed -= 1
        fail(group, what, e)
        return
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

    __slots__ = ("group", "what", "headerless", "st", "frame")

    def __init__(self, group: dist.ProcessGroup | None, what: str, headerless: bool = False) -> None:
        self.group, self.what, self.headerless, self.st, self.frame = group, what, headerless, None, None

    def __enter__(self) -> "call":
        if torch.compiler.is_compiling() or not dist.is_initialized():
            return self  # no group yet: the call itself raises the error that says how to start one
        group = self.group if isinstance(self.group, dist.ProcessGroup) else None  # a bad group= is the call's own error
        self.group = group
        st = state(group)
        raise_if_failed(st, self.what)
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
        with lock:
            st.depth -= 1
            if st.depth == 0:
                st.owner = None
        if st.frames and st.frames[-1] is frame:
            st.frames.pop()
        if e is None or is_collective(e) or st.failed is not None or size(self.group) == 1:
            return
        if frame.sent or frame.headerless or not checks().agreement:
            fail(self.group, self.what, e)  # the peers wait in collectives this rank will not join
        else:
            _announce(self.group, st, self.what, e)


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
            argument too broken to name its group), the call runs on the default group.
        headerless: the function's first collective is not an agreement header (see :class:`call`).

    Example:
        >>> @entry("zero.gather", lambda shards, **_: shards.layout.group)
        ... def gather(shards): ...
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def scoped(*args: Any, **kwargs: Any) -> Any:
            if group is None:
                g = kwargs.get("group")
            else:
                try:
                    g = group(*args, **kwargs)
                except Exception:  # noqa: BLE001 - the body raises the error that names the bad argument
                    g = None
            with call(g, what, headerless):
                return fn(*args, **kwargs)

        scoped.__fddp_entry__ = what  # type: ignore[attr-defined]
        return scoped

    return wrap


def owe(group: dist.ProcessGroup | None, n: int) -> None:
    """Count collectives of the current call still to come after it returns (``+1`` when a
    forward leaves a backward to run, ``-1`` when it has run): a failure meanwhile is fatal."""
    if not torch.compiler.is_compiling() and dist.is_initialized():
        state(group).owed += n


def frame(st: GroupState) -> Frame | None:
    """The innermost call in progress on the group, if any."""
    return st.frames[-1] if st.frames else None
