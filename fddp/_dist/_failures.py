"""Failure posting: how a rank's fatal failure reaches the channel of every group its peers may wait on.

A fatal failure (one that leaves collectives unmatched) is posted on the error channel of the
groups of the failing call (:func:`fail`); every wait on those groups reads it (``_waits``) and
raises :class:`PeerError`, and every later fddp call on them is refused (:func:`raise_if_failed`).
A failure announced in place of a call's header (``_scope``) is read back here too
(:func:`raise_announced`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fddp._dist._channel import Failure
from fddp._dist._errors import PeerError
from fddp._dist._groups import GroupState, channel_of, size, state, states

__all__ = ["fail", "peer_error", "raise_if_failed", "raise_if_failed_here", "raise_announced", "first_line"]


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


def raise_announced(group: dist.ProcessGroup | None, st: GroupState, what: str, call_: int, failed: int | None) -> None:
    """A peer announced its failure in place of this call's head (``failed``: its rank; ``None``:
    several did, and the first that posted its report is named): raise it here."""
    channel = channel_of(st, group)
    if channel is not None and failed is None:
        failed = next((r for r in range(size(group)) if channel.posted(call_ + 1, r)), 0)
    unread = Failure(-1 if failed is None else failed, "?", call_ + 1, "unknown", "(no store to read its report from)", False)
    raise peer_error(what, channel.announced(call_ + 1, failed) if channel is not None else unread)


def fail(group: dist.ProcessGroup | None, what: str, e: BaseException, everywhere: bool = False) -> None:
    """Post ``e`` as this rank's fatal failure on the groups of the failing call, and refuse every
    later fddp call on them.

    The groups of the failing call are ``group`` and every group on which this rank's peers may be
    waiting for it: one with an fddp call in progress in this process (calls nest: a stage-3
    forward on the shard group inside a replica group's call), or a backward still owed (a
    forward that left its gradients' collectives to come). Other groups go on: a failure inside
    a two-rank subgroup does not end the job's default group.

    With ``everywhere``, every group this process knows: for a call whose arguments were too broken
    to name its group (its peers may wait on any of them).

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
        groups += [(g, s) for g, s in states() if s is not st and s.failed is None and s.rank is None and (everywhere or s.busy())]
    for g, s in groups:
        mine = Failure(s.rank if s.rank is not None else dist.get_rank(g), what, s.agreed, type(e).__name__, first_line(e), True)
        channel = channel_of(s, g)
        try:
            s.failed = channel.post(mine) if channel is not None else mine
        except Exception:  # noqa: BLE001 - the store is gone too: the peers' own timeouts remain
            s.failed = mine
        s.mine = s.failed == mine


def first_line(e: BaseException) -> str:
    return (str(e).split("\n")[0] or repr(e))[:2000]
