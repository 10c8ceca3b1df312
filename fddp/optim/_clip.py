"""Gradient clipping by global norm, as ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

import torch

from fddp import _shard

from . import _flat as flat
from ._base import EmptyState, GradientTransformation, Params, Updates, _check_grads, _check_state
import optree


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
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
        A stateless ``GradientTransformation`` (state ``EmptyState``).

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.sgd(0.1))
    """
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: invalid max_norm={max_norm!r}; expected a float > 0")
    where = "clip_by_global_norm.update"

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None) -> tuple[Updates, EmptyState]:
        _check_state(state, EmptyState, where)
        gs, treedef = _check_grads(grads, None, where)
        if not gs:
            return grads, state
        if isinstance(grads, _shard.Sharded):
            total = _sharded_norm(grads, gs)
        elif _shard.spec_has_sharded(treedef):
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

        (out,) = flat.run(unit, flat.groups_for(gs), [gs], gs, 1)
        return optree.tree_unflatten(treedef, out), state

    return GradientTransformation(init, update)


def _sharded_norm(grads: _shard.Sharded, gs: list) -> torch.Tensor:
    """The global L2 norm of sharded gradients: local float64 sums of squares, one all-reduce.

    Padding is zero and adds nothing; the result is identical on every rank.
    """
    device = gs[0].device
    local = torch.zeros((), dtype=torch.float64, device=device)
    for g in gs:
        local = local + torch.linalg.vector_norm(g, dtype=torch.float64).to(device).square()
    total = _shard.all_reduce_sum(grads.layout, local, "optim.clip_by_global_norm")
    return total.sqrt().to(gs[0].dtype)
