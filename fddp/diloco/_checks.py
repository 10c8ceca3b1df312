"""What DiLoCo checks of its arguments before an outer step: the parameters against the state's
snapshot (shapes, dtypes, tree), this step's weight, and the words for a difference between ranks.

Pure helpers of ``_outer``: they read and compare, and never communicate.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import optree
import torch

from fddp import _caches, _tree
from fddp.sync._setup import nan_where_invalid

__all__ = ["specs", "specs_of", "against", "mismatch", "name_difference", "leaves_of", "as_weight"]

_WHAT = "diloco.step"


def specs(params: Any) -> tuple:
    return specs_of(optree.tree_leaves(params, none_is_leaf=True))


def specs_of(leaves: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in leaves)


def against(params: Any, snapshot: Any) -> tuple[list, Any, list, Any, str | None]:
    """Both trees' leaves and structures, and :func:`mismatch`'s words (a few microseconds for
    trees that match: this runs at every step)."""
    leaves, spec = _tree.flatten(params)
    snap_leaves, snap_spec = _tree.flatten(snapshot)
    try:
        if spec == snap_spec and shapes_of(leaves) == snapshot_shapes(snap_leaves):
            return leaves, spec, snap_leaves, snap_spec, None
    except AttributeError:  # a leaf that is not a tensor: leaves_of names it
        leaves_of(params, _WHAT)
    return leaves, spec, snap_leaves, snap_spec, mismatch(leaves, spec, snap_leaves, snap_spec)


def shapes_of(leaves: list) -> list:
    return [(t.shape, t.dtype) for t in leaves]


# The last snapshot's shapes, while its first and last leaves live (weakly held): between two
# syncs the state carries the same snapshot, so its shapes are read once per sync, not per step.
_last_snapshot: list[Any] = [None, None, None]


def snapshot_shapes(leaves: list) -> list:
    refs, n, shapes = _last_snapshot
    if refs is not None and n == len(leaves) and refs[0]() is leaves[0] and refs[1]() is leaves[-1]:
        return shapes
    shapes = shapes_of(leaves)
    _last_snapshot[:] = [(weakref.ref(leaves[0]), weakref.ref(leaves[-1])) if leaves else None, len(leaves), shapes]
    return shapes


_caches.register("fddp.diloco._checks._last_snapshot", lambda: _last_snapshot.__setitem__(slice(None), [None, None, None]))


def mismatch(leaves: list, spec: Any, snap_leaves: list, snap_spec: Any) -> str | None:
    """Words for how ``params`` differ from the state's snapshot in structure, shapes or dtypes, or ``None``."""
    advice = "make the state with outer.init(params) for these params (or load the checkpoint of this model)"
    if spec != snap_spec:
        mine, theirs = _tree.paths(spec), _tree.paths(snap_spec)
        diff = next((f"params have {a!r} where the state has {b!r}" for a, b in zip(mine, theirs) if a != b), None)
        diff = diff or f"params have {len(mine)} leaves, the state {len(theirs)}"
        return f"params do not match the DiLoCo state's structure: {diff}; {advice}"
    for i, (a, b) in enumerate(zip(leaves, snap_leaves)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return (
                f"params do not match the DiLoCo state at leaf {_tree.paths(spec)[i]!r}: params have shape "
                f"{tuple(a.shape)} and dtype {a.dtype}, the state {tuple(b.shape)} and {b.dtype}; {advice}"
            )
    return None


# The (group, configuration) pairs that have made their first step in this process.
def name_difference(per_rank: Sequence[list[tuple]]) -> str:
    """Words for the first row where a rank's DiLoCo state differs from rank 0's, with the fix."""
    ref = per_rank[0]
    for r, rows in enumerate(per_rank[1:], start=1):
        diff = _tree.first_difference(ref, rows, "rank 0", f"rank {r}")
        if diff is None:
            continue
        at = next(i for i, (a, b) in enumerate(zip(ref, rows)) if a != b) if len(ref) == len(rows) else None
        name = ref[at][0] if at is not None else ""
        if name == "option diloco step":
            return (
                f"The ranks are at different inner steps of their DiLoCo state: rank 0 at step {ref[at][1]}, rank {r} "
                f"at step {rows[at][1]}. A rank resumed from another checkpoint than the others (an older file), or "
                "made more outer.step calls: load every rank's state saved at the same step, and call outer.step "
                "once per inner step on every rank."
            )
        if name == "option diloco params":
            bad = next(q for q, x in enumerate(per_rank) if x[at][1] != "match the state's shapes")
            return f"Rank {bad}'s {per_rank[bad][at][1]}."
        if name.startswith("snapshot "):
            differ = [a[0][len("snapshot ") :] for a, b in zip(ref, rows) if a[0].startswith("snapshot ") and a != b]
            more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
            step = int(next(x[1] for x in ref if x[0] == "option diloco step"))
            why = (
                "The ranks started from different parameters: call params = fddp.broadcast(params) on every rank "
                "before outer.init(params)."
                if step == 1
                else "A rank's state comes from another run or another checkpoint than the others', or the ranks "
                "started from different parameters (params = fddp.broadcast(params) before outer.init(params))."
            )
            return (
                f"The ranks hold different global parameters (state.snapshot, which every rank must hold alike) at "
                f"leaf {differ[0]!r}{more}: rank {r}'s differ from rank 0's. {why}"
            )
        return diff[0].upper() + diff[1:] + ". Every rank must run the same outer step on the same model."
    return "The DiLoCo states hash differently but compare equal."  # pragma: no cover


def leaves_of(params: Any, what: str) -> tuple[list[torch.Tensor], Any]:
    leaves, spec = _tree.flatten(params)
    for i, t in enumerate(leaves):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            path = _tree.paths(spec)[i]
            got = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a {t.dtype} tensor"
            raise TypeError(f"fddp.{what}: every leaf must be a floating-point tensor, but leaf {path!r} is {got}")
    return leaves, spec


def as_weight(weight: Any) -> torch.Tensor:
    """This inner step's weight as a float64 scalar: a number or a CPU tensor checked on the host;
    a GPU tensor kept there, NaN where negative or not finite (``fddp.ddp_step``'s ``weight=``
    says why), since reading it would make the host wait for the GPU at every inner step."""
    if isinstance(weight, torch.Tensor) and weight.requires_grad:
        raise ValueError(f"fddp.{_WHAT}: weight must not require grad")
    if isinstance(weight, torch.Tensor) and not weight.is_cpu:
        if weight.numel() != 1 or weight.is_complex() or weight.dtype == torch.bool:
            raise ValueError(f"fddp.{_WHAT}: weight must be a non-negative scalar (this step's sample count), got shape "
                             f"{tuple(weight.shape)}, dtype {weight.dtype}")  # fmt: skip
        return nan_where_invalid(weight.detach().to(torch.float64).reshape(()))
    w = torch.as_tensor(weight, dtype=torch.float64).detach().cpu()
    if w.numel() != 1 or not bool(w >= 0):
        raise ValueError(f"fddp.{_WHAT}: weight must be a non-negative scalar (this step's sample count), got {weight!r}")
    return w.reshape(())
