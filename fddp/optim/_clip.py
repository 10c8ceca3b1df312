"""The global L2 norm of a tree of gradients, and clipping by it, as ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
from torch import Tensor

from fddp import _dist
from fddp._layout import SplitTree, has_split
from fddp._tree import definition_order

from . import _flat as flat
from ._base import GradientTransformationExtraArgs
from ._checks import Params, Updates, check_grads, check_state, describe, flatten

try:  # torch's own grouping, whose order (not the tree's) is the order its norms are stacked in
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support
except ImportError:  # pragma: no cover - present since torch 2.0
    _group_tensors_by_device_and_dtype = _has_foreach_support = None

__all__ = ["ClipByGlobalNormState", "clip_by_global_norm", "global_norm"]


class ClipByGlobalNormState(NamedTuple):
    """State of :func:`clip_by_global_norm`: the norm it measured, for logging.

    Attributes:
        norm: the gradients' global L2 norm before clipping, at the latest update (what
            ``torch.nn.utils.clip_grad_norm_`` returns); 0 before the first. A scalar tensor of
            the gradients' dtype, on their device: reading it (``float(norm)``) is the only sync.
    """

    norm: Tensor


def global_norm(tree: Any, /) -> Tensor:
    """The L2 norm of all the leaves of ``tree`` taken together, as ``torch.nn.utils.get_total_norm``.

    On a replicated tree the arithmetic is torch's, to the bit: a norm per leaf
    (``torch._foreach_norm``), stacked in torch's order (the parameters' definition order,
    grouped by device and dtype as torch groups them), and the norm of those norms. Leaves are
    taken in the order the tree was built (a dict's insertion order, which is
    ``named_parameters()``'s for :func:`fddp.functionalize`), not optree's sorted order: the norm
    of the stacked norms rounds differently in another order.

    On ZeRO's shards (a :class:`fddp.zero.Sharded`, or a group of one cut by a mask) the norm is
    that of the whole tree, the same on every rank: each rank sums the squares of its elements in
    float64 and one scalar all-reduce adds them up (a collective: every rank of the group must
    call it). torch's per-tensor float32 norms round differently, so the two differ by about 1e-7
    relative (FSDP2's ``clip_grad_norm_`` differs from DDP's the same way).

    Args:
        tree: a pytree of tensors (gradients, updates, parameters), or this rank's shards.

    Returns:
        A scalar tensor (the leaves' dtype; ``tensor(0.)`` for a tree without leaves).

    Example:
        >>> grads, loss = step(params, x, y)
        >>> print(f"grad norm {float(fddp.optim.global_norm(grads)):.3f}")
    """
    leaves, treedef = check_grads(tree, None, "optim.global_norm")
    if isinstance(tree, SplitTree):
        return _split_norm(tree, leaves)
    if has_split(treedef):
        raise TypeError(
            "fddp.optim.global_norm: the tree holds a fddp.zero.Sharded below its root; take the norm of the "
            "sharded tree on its own (the Sharded itself), so that its squares are summed over the ranks once"
        )
    return _norm(tree, leaves)


def _norm(tree: Any, gs: list[Tensor]) -> Tensor:
    """``torch.nn.utils.get_total_norm(gs)`` with its foreach path, in the tree's definition order."""
    if not gs:
        return torch.tensor(0.0)
    order = definition_order(tree)
    if order is not None:
        gs = [gs[i] for i in order]
    first = gs[0].device
    if _group_tensors_by_device_and_dtype is None or not flat.multi_tensor_ok(gs):
        # Inside a torch.func transform: torch's foreach=False path, a norm per tensor.
        norms = [torch.linalg.vector_norm(g) for g in gs]
    else:
        norms = []
        for (device, _), ([ts], _) in _group_tensors_by_device_and_dtype([gs]).items():
            if _has_foreach_support(ts, device):
                norms.extend(torch._foreach_norm(ts))
            else:
                norms.extend(torch.linalg.vector_norm(t) for t in ts)
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]))


def clip_by_global_norm(max_norm: float) -> GradientTransformationExtraArgs:
    """Scale gradients so that their global L2 norm is at most ``max_norm``; keep the norm in the state.

    On a replicated tree, torch's ``clip_grad_norm_`` (foreach) to the bit: the norm of
    :func:`global_norm`, the scale ``clamp(max_norm / (norm + 1e-6), max=1)`` in the norm's
    dtype, and each gradient multiplied by it (without branching on its value). On ZeRO's shards
    the norm is :func:`global_norm`'s float64 sum over the ranks (one scalar all-reduce), which
    differs from torch's by rounding (about 1e-7 relative), and so does the scale; it is the same
    on every rank.

    The state holds the norm before clipping (what ``clip_grad_norm_`` returns), to log::

        opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(3e-4))
        params, state = fddp.optim.apply_gradients(opt, grads, state, params)
        grad_norm = state[0].norm  # a tensor; float(...) when you print it

    Args:
        max_norm: the largest allowed global norm, > 0.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`ClipByGlobalNormState`.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.sgd(0.1))
    """
    if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
        raise ValueError(f"clip_by_global_norm: invalid max_norm={max_norm!r}; expected a float > 0")
    where = "clip_by_global_norm.update"

    def init(params: Params) -> ClipByGlobalNormState:
        leaves = [x for x in flatten(params)[0] if isinstance(x, Tensor)]
        like = next((x for x in leaves if x.is_floating_point()), None)
        if like is None:
            return ClipByGlobalNormState(torch.zeros(()))
        return ClipByGlobalNormState(torch.zeros((), dtype=like.dtype, device=like.device))

    def update(
        grads: Updates, state: ClipByGlobalNormState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, ClipByGlobalNormState]:
        check_state(state, ClipByGlobalNormState, where, grads=grads, params=params)
        if not isinstance(state.norm, Tensor):
            raise TypeError(f"{where}: the state's norm must be a scalar tensor (from this optimizer's init), got {describe(state.norm)}")
        gs, treedef = check_grads(grads, None, where)
        if isinstance(grads, SplitTree):
            total = _split_norm(grads, gs)  # every rank joins the all-reduce, even one that holds nothing
        elif has_split(treedef):
            raise TypeError(
                f"{where}: the gradients hold a fddp.zero.Sharded below their root; clip a sharded tree "
                "on its own (the Sharded itself), so that its norm is summed over the ranks once"
            )
        else:
            total = _norm(grads, gs)
        new_state = ClipByGlobalNormState(total.detach().to(device=state.norm.device, dtype=state.norm.dtype))
        if not gs:
            return grads, new_state
        # torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1, then _foreach_mul_ by it,
        # which multiplies a bf16 gradient by the float32 scale in float32 and rounds once. On the
        # CPU torch.mul does the same with a 0-dim scale (read as a scalar), into a pooled buffer;
        # on CUDA a 0-dim CUDA tensor would be cast to bf16 first, so the foreach op itself runs.
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        scales: dict = {}
        foreach = flat.multi_tensor_ok(gs)

        def unit(g, new):
            if g.device not in scales:
                scales[g.device] = scale.to(g.device)
            if foreach and g.device.type != "cpu":
                return (torch._foreach_mul([g], scales[g.device])[0],)
            return (torch.mul(g, scales[g.device], out=new()),)

        (out,) = flat.run(unit, flat.step_plan(gs), [gs], gs, 1)
        return optree.tree_unflatten(treedef, out), new_state

    return GradientTransformationExtraArgs(init, update)


def _split_group(tree: SplitTree, *_: Any, **__: Any) -> Any:
    return tree.split.group


@_dist.entry("optim.global_norm", _split_group, headerless=True)
def _split_norm(tree: SplitTree, gs: list[Tensor]) -> Tensor:
    """The global L2 norm of sharded tensors: local float64 sums of squares, one all-reduce.

    Padding is zero and adds nothing; the result is identical on every rank. A rank that holds
    no element (a small group's cut) still joins the all-reduce.
    """
    what = "optim.global_norm"
    tree.check_group(what)
    device = gs[0].device if gs else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in gs:
        total = total + torch.linalg.vector_norm(g, dtype=torch.float64).to(device).square()
    total = summed_over_shards(total, tree.split, what, "the all-reduce of a sharded sum of squares")
    return total.sqrt().to(gs[0].dtype if gs else torch.float32)


def summed_over_shards(total: Tensor, split: Any, what: str, doing: str) -> Tensor:
    """``total`` (sums of the local shards, float64) summed over ``split``'s ranks, on its device:
    the one small all-reduce, on ``_dist.data_device`` (the GPU where the group uses NCCL)."""
    if split.world == 1:
        return total
    moved = total.to(_dist.data_device(split.group, like=total.device))
    work = dist.all_reduce(moved, group=split.group, async_op=True)
    _dist.wait(work, split.group, what, doing, host=moved.is_cpu)
    return moved.to(total.device)
