"""The watcher: where waits cannot read the error channel, a thread reads it and aborts the group.

A gloo wait blocks the host, so ``_waits`` takes it in slices and reads the channel between them.
An NCCL collective is queued on a CUDA stream: the host is not waiting when the peer fails, and
the stream would hang until NCCL's watchdog timeout. So, as torchft does, a daemon thread reads the
channel of every watched group while a call is in flight on it, or calls not yet checked (a batch,
``_agreement``) may still hold collectives on the stream (every tenth of a second, one store read a
group) and, when a peer's fatal failure is posted, marks the group failed and aborts its
communicator: the kernels waiting for the dead peer end with an error, and the next fddp wait
raises the peer's :class:`PeerError` instead of the backend's words (``_waits``).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable

import torch.distributed as dist

from fddp._dist import _header
from fddp._dist._channel import Failure
from fddp._dist._groups import GroupState, channel_of, rank, size, state, uses_nccl

__all__ = ["watch", "watch_if_needed", "POLL_S"]

POLL_S = 0.1

_lock = threading.Lock()
_watched: "weakref.WeakKeyDictionary[Any, Callable[[], None]]" = weakref.WeakKeyDictionary()
_thread: list[threading.Thread | None] = [None]


def watch(group: dist.ProcessGroup | None, abort: Callable[[], None] | None = None) -> None:
    """Watch ``group``'s channel from now on; on a peer's fatal failure, call ``abort`` (default:
    the group's own ``abort()``, which ends its NCCL communicators). Idempotent."""
    pg = group if group is not None else dist.group.WORLD
    with _lock:
        if pg in _watched:
            return
        _watched[pg] = abort if abort is not None else pg.abort
        if _thread[0] is None or not _thread[0].is_alive():
            _thread[0] = threading.Thread(target=_run, name="fddp-watcher", daemon=True)
            _thread[0].start()


def watch_if_needed(group: dist.ProcessGroup | None) -> bool:
    """Watch ``group`` if its waits cannot read the channel themselves (it uses NCCL, mixed or
    not: ``_groups.uses_nccl``); return whether it is watched."""
    try:
        needed = uses_nccl(group)
    except Exception:  # noqa: BLE001 - a group torch.distributed does not register (fault tolerance watches its own)
        return False
    if needed:
        watch(group)
    return needed


def _run() -> None:
    while True:
        time.sleep(POLL_S)
        with _lock:
            items = list(_watched.items())
        for pg, abort in items:
            try:
                _look(pg, abort)
            except Exception:  # noqa: BLE001 - a destroyed group or a gone store: nothing left to watch
                with _lock:
                    _watched.pop(pg, None)


def _look(pg: Any, abort: Callable[[], None]) -> None:
    group = None if pg is dist.group.WORLD else pg
    st = state(group)
    if st.failed is not None or not (st.busy() or st.unheaded or st.pending is not None):
        # Already ended, or nothing in flight that a failure could hold: no call, no backward owed,
        # and no batched call whose collectives may still wait on the stream (_agreement).
        return
    channel = channel_of(st, group)
    failure = channel.fatal() if channel is not None else None
    mine = False
    if failure is None:
        failure = _differed(group, st)
        if failure is None:
            return
        mine = True
    st.failed, st.mine = failure, mine
    with _lock:
        _watched.pop(pg, None)
    abort()


def _differed(group: Any, st: GroupState) -> Failure | None:
    """Where the group's unread head (a batch's check, ``_agreement``) has arrived and shows that
    the ranks differ, this rank's failure to say so. Every rank reads the same sum, so each aborts
    its own communicator: the batch's mismatched collectives would otherwise hold the stream, and
    a host blocked on it (``loss.item()``) would never reach the boundary that reads the head."""
    a = st.pending
    if a is None or a.work is None or not a.work.is_completed():
        return None
    v = _header.read(a.header, size(group))
    if v.agrees:
        return None
    return Failure(
        rank(group), a.context[1], a.call + 1, "MismatchError",
        "the check of this group's calls since its previous check shows that the ranks differ (read by fddp's watcher "
        "while this rank was not in an fddp call; the communicator was aborted, as those calls' collectives may not "
        "match); the next step boundary names the difference",
        True,
    )  # fmt: skip
