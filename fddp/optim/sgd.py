"""SGD with momentum, dampening, Nesterov and L2 weight decay, matching ``torch.optim.SGD``."""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch
from torch import Tensor

from .base import (
    GradientTransformation,
    Params,
    ScalarOrSchedule,
    Updates,
    _check_grads,
    _check_lr,
    _check_nonneg,
    _cast_per_leaf,
    _check_state,
    _flatten,
    _lr_at,
    _params_leaves,
    _use_foreach,
    _zeros_count,
)


class SGDState(NamedTuple):
    """State of ``sgd``.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        momentum_buffer: same tree as params when ``momentum != 0``, else ``()``.
    """

    count: Tensor
    momentum_buffer: Updates | tuple


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    As in torch, the momentum buffer at the first step is the gradient itself (not dampened).

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        momentum: momentum factor.
        dampening: dampening for momentum.
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        weight_decay: L2 penalty (``grad + weight_decay * param``); needs ``params`` in ``update``.

    Returns:
        A ``GradientTransformation`` whose state is an ``SGDState``.

    Example:
        >>> opt = fddp.optim.sgd(lr=0.1, momentum=0.9, nesterov=True)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    _check_lr(lr, "sgd")
    _check_nonneg(momentum, "momentum", "sgd")
    _check_nonneg(dampening, "dampening", "sgd")
    _check_nonneg(weight_decay, "weight_decay", "sgd")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"sgd: nesterov=True requires momentum > 0 and dampening == 0, got momentum={momentum!r}, "
            f"dampening={dampening!r}"
        )
    where = "sgd.update"

    def init(params: Params) -> SGDState:
        leaves, treedef = _flatten(params)
        buf = ()
        if momentum:
            buf = optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])
        return SGDState(_zeros_count(leaves), buf)

    def update(grads: Updates, state: SGDState, params: Params | None = None) -> tuple[Updates, SGDState]:
        _check_state(state, SGDState, where)
        if bool(momentum) != (not _is_empty(state.momentum_buffer)):
            raise TypeError(f"{where}: the state has no momentum buffer matching momentum={momentum!r}")
        if momentum:
            bufs, treedef = _flatten(state.momentum_buffer)
            gs, _ = _check_grads(grads, treedef, where)
        else:
            bufs = None
            gs, treedef = _check_grads(grads, None, where)
        ps = _params_leaves(params, treedef, where, "weight_decay != 0") if weight_decay else None

        count = state.count
        neg_lr = -_lr_at(lr, count)
        if not isinstance(neg_lr, Tensor):
            neg_lr = torch.tensor(neg_lr, dtype=torch.float64, device=count.device)
        # torch's first-step buffer is the raw gradient: with a zero buffer, ``0 * m + 1 * g == g``
        # exactly, so we only need per-step factors when dampening would scale the first gradient.
        first = count == 0
        keep = torch.where(first, 0.0, momentum).to(torch.float64) if dampening else momentum
        mix = torch.where(first, 1.0, 1.0 - dampening).to(torch.float64) if dampening else 1.0

        core = _foreach_core if _use_foreach(gs) else _per_leaf_core
        new_bufs, u = core(gs, bufs, ps, momentum, keep, mix, nesterov, weight_decay, neg_lr)
        new_buf = optree.tree_unflatten(treedef, new_bufs) if momentum else ()
        return optree.tree_unflatten(treedef, u), SGDState(count + 1, new_buf)

    return GradientTransformation(init, update)


def _is_empty(x) -> bool:
    return isinstance(x, tuple) and len(x) == 0


# Same kernels in the same order in both cores, so results are bit-identical.


def _foreach_core(gs, bufs, ps, momentum, keep, mix, nesterov, weight_decay, neg_lr):
    if weight_decay:
        gs = torch._foreach_add(gs, ps, alpha=weight_decay)
    new_bufs = None
    if momentum:
        new_bufs = torch._foreach_mul(bufs, keep)
        if isinstance(mix, Tensor):
            torch._foreach_addcmul_(new_bufs, gs, _cast_per_leaf(mix, gs))
        else:
            torch._foreach_add_(new_bufs, gs)
        gs = torch._foreach_add(gs, new_bufs, alpha=momentum) if nesterov else new_bufs
    return new_bufs, torch._foreach_mul(gs, neg_lr)


def _per_leaf_core(gs, bufs, ps, momentum, keep, mix, nesterov, weight_decay, neg_lr):
    if weight_decay:
        gs = [torch.add(g, p, alpha=weight_decay) for g, p in zip(gs, ps)]
    new_bufs = None
    if momentum:
        if isinstance(mix, Tensor):
            mixes = _cast_per_leaf(mix, gs)
            new_bufs = [torch.addcmul(torch.mul(b, keep), g, w) for b, g, w in zip(bufs, gs, mixes)]
        else:
            new_bufs = [torch.add(torch.mul(b, keep), g) for b, g in zip(bufs, gs)]
        if nesterov:
            gs = [torch.add(g, b, alpha=momentum) for g, b in zip(gs, new_bufs)]
        else:
            gs = new_bufs
    return new_bufs, [torch.mul(g, neg_lr) for g in gs]
