"""Gradient clipping by global norm, as ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp import _dist
from fddp._layout import SplitTree, has_split

from . import _flat as flat
from ._base import EmptyState, GradientTransformationExtraArgs
from ._checks import Params, Updates, check_grads, check_state

__all__ = ["clip_by_global_norm"]


def clip_by_global_norm(max_norm: float) -> GradientTransformationExtraArgs:
    """Scale gradients so that their global L2 norm is at most ``max_norm``.

    Same arithmetic as ``torch.nn.utils.clip_grad_norm_``: the scale is
    ``min(1, max_norm / (total_norm + 1e-6))``, applied without branching on its value.

    On ZeRO's sharded gradients (a :class:`fddp.zero.Sharded`) the norm is that of the whole
    gradient: each rank sums the squares of its shards in float64 and one scalar all-reduce adds
    them up. torch takes per-tensor float32 norms first, so the two norms differ by torch's own
    rounding (about 1e-6 relative); the scale is the same on every rank.

    Args:
        max_norm: the largest allowed global norm, > 0.

    Returns:
        A stateless ``GradientTransformationExtraArgs`` (state ``EmptyState``).

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.sgd(0.1))
    """
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: invalid max_norm={max_norm!r}; expected a float > 0")
    where = "clip_by_global_norm.update"

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any) -> tuple[Updates, EmptyState]:
        check_state(state, EmptyState, where)
        gs, treedef = check_grads(grads, None, where)
        if not gs:
            return grads, state
        if isinstance(grads, SplitTree):
            total = _split_norm(grads, gs)
        elif has_split(treedef):
            raise TypeError(
                f"{where}: the gradients hold a fddp.zero.Sharded below their root; clip a sharded tree "
                "on its own (the Sharded itself), so that its norm is summed over the ranks once"
            )
        else:
            # Per-leaf norms on every path (as torch), so that the scale is bit-identical on all of them.
            if flat.multi_tensor_ok(gs):
                norms = torch._foreach_norm(gs)
            else:
                norms = [torch.linalg.vector_norm(g) for g in gs]
            total = torch.linalg.vector_norm(torch.stack([n.to(gs[0].device) for n in norms]))
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        scales: dict = {}

        def unit(g, new):
            if g.dtype not in scales:
                scales[g.dtype] = scale.to(device=g.device, dtype=g.dtype)
            return (torch.mul(g, scales[g.dtype], out=new()),)

        (out,) = flat.run(unit, flat.step_plan(gs), [gs], gs, 1)
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformationExtraArgs(init, update)


def _split_norm(grads: SplitTree, gs: list) -> torch.Tensor:
    """The global L2 norm of sharded gradients: local float64 sums of squares, one all-reduce.

    Padding is zero and adds nothing; the result is identical on every rank.
    """
    what = "optim.clip_by_global_norm"
    grads.check_group(what)
    device = gs[0].device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in gs:
        total = total + torch.linalg.vector_norm(g, dtype=torch.float64).to(device).square()
    split = grads.split
    if split.world > 1:
        moved = total.to(_dist.collective_device(split.group))
        with _dist.call(split.group, what, headerless=True):
            _dist.wait(dist.all_reduce(moved, group=split.group, async_op=True), split.group, what, "the all-reduce of a sharded sum")
        total = moved.to(device)
    return total.sqrt().to(gs[0].dtype)
