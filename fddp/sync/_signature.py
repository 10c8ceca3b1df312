"""The cross-rank signature check, the per-group state behind it, and the errors it raises.

Before the first collective on a new tree, the ranks compare a hash of its *signature*: the tree's
structure (a dict's keys in insertion order, which is the order buckets fill in), every leaf's
shape, dtype and device type, and every option that shapes the collectives (bucket caps, the comm
hook, whether a weight rides along). One small all-reduce answers "do all ranks agree?"; only on a
mismatch do the ranks gather their descriptions, to name the first difference, and all raise the
same :class:`MismatchError`. A signature that agreed is remembered per process group, so steady
steps pay nothing.

State lives per group object (weakly held): a group that is destroyed takes its remembered
signatures and call counts with it, and a new group (``destroy_process_group()`` then
``fddp.init()``) is checked afresh.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Any, Callable, Hashable, Sequence

import torch
import torch.distributed as dist

from fddp._tree import first_difference
from fddp.runtime import collective_device

__all__ = ["MismatchError", "check_signature", "count_call", "wait", "collective_device", "forget"]


class MismatchError(RuntimeError):
    """Ranks disagree on a tree (structure, leaf paths, shapes, dtypes or devices) or on an option
    that shapes the collectives (bucket caps, compression, weight).

    Raised on every rank of the group, with the same message, before any bucket is sent: the
    alternative is a hang, a crash inside the backend, or a silent mix of unrelated values.
    """


class _GroupState:
    def __init__(self) -> None:
        self.checked: set[Hashable] = set()
        self.calls: dict[str, int] = {}


_lock = threading.Lock()
_states: "weakref.WeakKeyDictionary[Any, _GroupState]" = weakref.WeakKeyDictionary()


def _state(group: dist.ProcessGroup | None) -> _GroupState:
    pg = group if group is not None else dist.group.WORLD
    with _lock:
        st = _states.get(pg)
        if st is None:
            st = _states[pg] = _GroupState()
        return st


def forget() -> None:
    """Drop every remembered signature and call count (all groups)."""
    with _lock:
        _states.clear()


def count_call(group: dist.ProcessGroup | None, what: str) -> None:
    """Number the calls to ``fddp.<what>`` on ``group``, for the error :func:`wait` raises."""
    if torch.compiler.is_compiling():
        return  # dynamo cannot trace the lock; a compiled step's errors come from the backend
    st = _state(group)
    with _lock:
        st.calls[what] = st.calls.get(what, 0) + 1


def call_count(group: dist.ProcessGroup | None, what: str) -> int:
    """The number of calls to ``fddp.<what>`` on ``group`` so far in this process."""
    return _state(group).calls.get(what, 0)


def check_signature(
    key: Hashable,
    rows: Callable[[], list[tuple]],
    group: dist.ProcessGroup | None,
    what: str,
) -> None:
    """Raise :class:`MismatchError` on every rank unless all ranks hold the same signature.

    Args:
        key: a local, hashable stand-in for the signature (cheap to build on every call); a key
            already checked on ``group`` costs nothing.
        rows: builds the signature as ``fddp._tree`` rows, called only for a new key.
        group: the process group.
        what: the public function's name, for messages.

    The check catches ranks that build different trees or pass different options. It cannot catch
    one rank switching, mid-run, to a signature it has not used before while its peers keep one
    they already checked: their caches then disagree on whether to check, and only a collective
    on every step could tell. That would cost what this design saves.
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the cache or the digest; a compiled step relies on its guards (a new
        # tree re-traces) and on an eager call (fddp.broadcast, a first eager step) having checked.
        return
    st = _state(group)
    if key in st.checked:
        return
    described = rows()
    d = int.from_bytes(hashlib.blake2b(repr(described).encode(), digest_size=8).digest(), "little", signed=True) >> 1
    t = torch.tensor([d, -d], dtype=torch.int64, device=collective_device(group))
    wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True), group, what, "the signature check")
    if t[0].item() == -t[1].item():
        with _lock:
            st.checked.add(key)
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, described, group=group)
    raise MismatchError(f"fddp.{what}: ranks disagree on the tree or the options. {_name_difference(gathered)}")


def _name_difference(per_rank: Sequence[list[tuple]]) -> str:
    for r, rows in enumerate(per_rank[1:], start=1):
        diff = first_difference(per_rank[0], rows, "rank 0", f"rank {r}")
        if diff is not None:
            return diff[0].upper() + diff[1:] + "."
    return "The signatures hash differently but compare equal."  # pragma: no cover


def wait(work: Any, group: dist.ProcessGroup | None, what: str, doing: str) -> None:
    """Wait for an async collective; on failure say which rank, which call and what it was doing."""
    try:
        work.wait()
    except Exception as e:  # gloo/NCCL raise RuntimeError (or DistBackendError) on timeout
        r, w = dist.get_rank(), dist.get_world_size()
        n = call_count(group, what)
        call = f" (call {n} to fddp.{what} in this process)" if n else ""
        verb = "timed out" if "timed out" in str(e).lower() else "failed"
        raise RuntimeError(
            f"fddp.{what}: rank {r} of {w} {verb} during {doing}{call}: {e}. A peer may have crashed, "
            "be stuck, or have skipped or reordered this call (every rank must make the same fddp "
            "calls in the same order); the process group's timeout (fddp.init(timeout=...)) bounds "
            "the wait."
        ) from e
