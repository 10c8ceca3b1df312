"""Waits that watch: a collective's wait that reads the error channel and finds deadlocks.

On gloo a wait is taken in slices of a tenth of a second. Between slices the group's error
channel is read (a peer's fatal failure raises :class:`PeerError` here), and after a couple of
seconds this rank posts what it waits for on the job's board, which finds ranks waiting in
*different* collectives (one on a new group, another on the default group): a deadlock, raised as
:class:`MismatchError` on each instead of waiting out the timeout. A wait the backend ends with a
lost connection names the peer that died (from the channel, the group's size, or the processes
on this host), never the rank that reports it. NCCL's waits do not block the host: there the
channel is read by a watcher thread that aborts the communicator (``_watcher``).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from fddp._dist import _channel
from fddp._dist._channel import Failure
from fddp._dist._errors import MismatchError, PeerError
from fddp._dist._failures import fail, peer_error
from fddp._dist._groups import GroupState, board, call_count, channel_of, control_group, global_ranks, label, rank, size, state, uses_nccl

__all__ = ["wait", "sliced", "batched"]

SLICE = datetime.timedelta(milliseconds=100)  # a wait looks at the channel this often
STUCK_S = 2.0  # a rank waiting this long posts what it waits for (deadlock detection)
_POSTED_S = 1.0  # after a lost connection, how long a dying peer's own post may take to arrive
_LOST = ("connection", "broken pipe", "reset by peer", "closed by peer", "end of file", "eof")


def wait(work: Any, group: dist.ProcessGroup | None, what: str, doing: str, *, head: bool = False, host: bool = False) -> None:
    """Wait for an async collective, watching for a peer's failure; on failure say which rank,
    which call and what it was doing. ``head``: the work is a head, on ``group``'s control group
    (an NCCL group's gloo side group: a host wait, taken in slices like gloo's own). ``host``:
    the work's tensors are on the CPU (gloo's, on a mixed group too: taken in slices).

    Raises:
        PeerError: a peer posted a fatal failure, or died (its connection was lost).
        MismatchError: the ranks wait in different collectives (a deadlock).
        RuntimeError: the group's timeout ran out.
    """
    try:
        if torch.compiler.is_compiling() or not hasattr(work, "is_completed"):
            work.wait()  # a traced collective's, or a hook's own kind of work: one plain wait
            return
        if work.is_completed():  # done already (a carried sum whose head was read): nothing to slice
            work.wait()  # raises here where the work failed
            return
        if not (host or sliced(control_group(group) if head else group)):
            work.wait()  # NCCL's: one plain wait
            return
        if not _slice(work):
            _watch(work, group, what, doing)
    except (PeerError, MismatchError):
        raise
    except Exception as e:  # gloo/NCCL raise RuntimeError (or DistBackendError) on timeout or a lost peer
        st = state(group)
        if st.failed is not None and not st.mine:  # the watcher aborted the group for a peer's failure
            raise peer_error(what, st.failed) from e
        text = str(e).lower()
        timed_out = "timed out" in text or "timeout" in text  # gloo: "Timed out waiting ...", "Application timeout caused pair closure"
        if not timed_out and any(w in text for w in _LOST):
            raise _lost(group, what, doing, e) from e
        r, w = rank(group), size(group)  # the group's, the membership epoch's under fault tolerance
        n = call_count(group, what)
        where = f" (call {n} to fddp.{what} in this process)" if n else ""
        verb = "timed out" if timed_out else "failed"
        raise RuntimeError(
            f"fddp.{what}: rank {r} of {w} {verb} during {doing}{where}: {e}. A peer may have crashed, "
            "be stuck, or have skipped or reordered this call (every rank must make the same fddp "
            "calls in the same order); the process group's timeout (fddp.init(timeout=...)) bounds "
            "the wait."
        ) from e


def _slice(work: Any) -> bool:
    """Wait up to one slice for ``work``; return whether it finished (a failure raises)."""
    try:
        return bool(work.wait(SLICE))
    except RuntimeError:
        if not work.is_completed():
            return False  # the slice ran out
        work.wait()  # finished as the slice ran out, or failed: this says which
        return True


def sliced(group: dist.ProcessGroup | None) -> bool:
    """Whether waits on ``group`` block the host (gloo: they can be taken in slices); asked of
    torch once per group state (a group's backend does not change, and every wait asks).

    Not on a group that uses NCCL, mixed ones (``"cpu:gloo,cuda:nccl"``) included: torch's NCCL
    wait with a timeout blocks the host until the GPU has run the collective, where a plain one
    only orders the streams. A work does not say which backend ran it: a mixed group's CPU
    collectives are taken in slices where the caller says so (:func:`wait`'s ``host``, which
    ``fddp.sync``'s ``Comm`` passes), else waited for plainly (a blocking wait that reads no
    channel: aborting the group does not end a gloo wait)."""
    st = state(group)
    if st.sliced is None:
        try:
            st.sliced = not uses_nccl(group)
        except Exception:  # noqa: BLE001 - a group torch.distributed does not register: wait plainly
            return False
    return st.sliced


def batched(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s known calls are checked in batches (``_agreement``): its waits do not
    block the host (NCCL) and its heads travel on a gloo side group, so a head per call would
    make the host wait for its peers' hosts at every call, where it should run ahead of the GPU."""
    return not sliced(group) and control_group(group) is not group


def _watch(work: Any, group: dist.ProcessGroup | None, what: str, doing: str) -> None:
    """The rest of a wait that did not finish in its first slice (see :func:`wait`)."""
    st = state(group)
    channel = channel_of(st, group)
    started = time.monotonic()
    posted: _channel.Waiting | None = None
    suspect: list | None = None
    deadlocked = False
    try:
        while True:
            failure = channel.fatal() if channel is not None else None
            if failure is not None:
                st.failed = failure
                raise peer_error(what, failure)
            if time.monotonic() - started > STUCK_S:
                try:
                    posted, suspect = _check_board(st, group, what, doing, posted, suspect)
                except MismatchError:
                    deadlocked = True  # the post stays: the peers it deadlocks with must see it to raise too
                    raise
            if _slice(work):
                return
    finally:
        if posted is not None and not deadlocked:
            b = board()
            if b is not None:
                try:
                    b.post(dist.get_rank(), None)
                except Exception:  # noqa: BLE001
                    pass


def _check_board(
    st: GroupState, group: dist.ProcessGroup | None, what: str, doing: str, posted: Any, suspect: list | None
) -> tuple[Any, list | None]:
    """Post what this rank waits for; raise if the board shows a deadlock twice in a row."""
    b = board()
    if b is None or st.rank is not None:
        return posted, None  # no shared store, or a fault-tolerant group (its manager watches it)
    pg = group if group is not None else dist.group.WORLD
    try:
        if posted is None:
            st.waits += 1
            ranks = tuple(global_ranks(group) or ())
            posted = _channel.Waiting(str(pg.group_name), label(group), ranks, st.agreed, what, doing, st.waits)
            b.post(dist.get_rank(), posted)
            return posted, None
        stuck = b.deadlock(dist.get_rank(), posted)
    except Exception:  # noqa: BLE001 - the board is a diagnosis, never a new failure
        return posted, None
    if stuck is None:
        return posted, None
    if suspect != stuck:
        return posted, stuck  # seen once: look again a slice later (a post may have been stale)
    who = "; ".join(f"rank {r} waits in fddp.{w.what} on {w.label} (its call {w.call}, {w.doing})" for r, w in stuck)
    e = MismatchError(
        f"fddp.{what}: ranks wait in different collectives, which can never complete: {who}. Every rank must make "
        "the same fddp calls on the same process groups in the same order (pass the same group= on every rank)."
    )
    fail(group, what, e)
    raise e


def _lost(group: dist.ProcessGroup | None, what: str, doing: str, e: BaseException) -> PeerError:
    """The backend lost a peer's connection: a :class:`PeerError` that names the peer, and the
    group marked as ended (its collectives cannot be matched any more).

    The peer is named from its own post on the channel (it raised before it died), else from the
    group's size (a pair) or the processes on this host that are gone; the first survivor that
    knows posts it, so that a survivor on another host names it too. Else the message says which
    ranks it may be (never the reporting one).
    """
    st = state(group)
    channel = channel_of(st, group)

    def posted() -> Failure | None:
        return channel.fatal() if channel is not None else None

    me = dist.get_rank()
    ranks = global_ranks(group)
    peers = [r for r in (ranks or []) if r != me]
    failure = posted()
    if failure is None:
        dead = _dead(peers) if len(peers) > 1 else peers
        if len(dead) == 1:
            message = f"it died or closed its connection while its peers waited in {doing} (the backend said: {_said(e)})"
            failure = Failure(ranks.index(dead[0]), what, st.agreed, "ConnectionError", message, True)  # type: ignore[union-attr]
            try:
                failure = channel.post(failure) if channel is not None else failure  # the first poster's words win
            except Exception:  # noqa: BLE001 - the store went with the peer: this rank's words stand
                pass
    deadline = time.monotonic() + _POSTED_S
    while failure is None and time.monotonic() < deadline:  # a survivor that can tell, or a dying peer's own post
        time.sleep(0.05)
        failure = posted()
    if failure is not None:
        st.failed, st.mine = failure, False
        return peer_error(what, failure)
    unknown = Failure(-1, what, st.agreed, "ConnectionError", f"the connection was lost while this rank waited in {doing}", True)
    st.failed, st.mine = unknown, False
    return PeerError(
        f"fddp.{what}: one of ranks {peers} (global; this rank is {me}) died or closed its connection (it posted no error: "
        f"it was killed, or its process ended) while this rank waited in {doing}. The backend said: {_said(e)}. The group's "
        "collectives cannot be matched any more: end the run on every rank and restart it from the last checkpoint "
        "(torchrun --max-restarts does), or, under fault tolerance, begin a new epoch.",
        unknown,
    )


def _said(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _dead(peers: list[int]) -> list[int]:
    """Those of ``peers`` (global ranks) whose process on this host is gone (the others, on other
    hosts or still alive, cannot be told apart from here)."""
    b = board()
    if b is None:
        return []
    try:
        who = b.who(peers)
    except Exception:  # noqa: BLE001 - the store went with the dead peer
        return []
    host, out = socket.gethostname(), []
    for r, (h, pid) in who.items():
        if h == host:
            if not _alive(pid):
                out.append(r)
    return out


def _alive(pid: int) -> bool:
    """Whether process ``pid`` on this host runs (a zombie, ended but not yet reaped by its
    launcher, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's, alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True  # no /proc to tell: taken as alive
