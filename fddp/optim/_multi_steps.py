"""An optimizer that steps once every k calls, on the mean of their gradients (optax's ``MultiSteps``).

Not to be confused with ``fddp.GradAccumulator`` (``fddp.sync._accumulate``): the local sum of a window's
gradients before one synchronisation. This wraps an optimizer; that one feeds ``ddp_step``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from ._base import GradientTransformation, GradientTransformationExtraArgs
from ._checks import Params, Updates, check_dtypes, check_grads, check_state, flatten, init_leaves, zeros_count

__all__ = ["AccumulateState", "accumulate"]


class AccumulateState(NamedTuple):
    """State of ``accumulate``.

    Attributes:
        mini_step: calls since the last emitted update, in ``[0, every_k)`` (int64 scalar tensor).
        grad_sum: running sum of the gradients of the current window, same tree as params.
        inner: the wrapped optimizer's state.
    """

    mini_step: Tensor
    grad_sum: Updates
    inner: Any


def accumulate(opt: GradientTransformation, every_k: int) -> GradientTransformationExtraArgs:
    """Accumulate gradients over ``every_k`` calls and apply ``opt`` to their mean on every k-th call.

    The other calls return zero updates and leave ``opt``'s state unchanged, so the wrapped
    optimizer sees one step per k micro-batches, on the mean gradient (as if the k micro-batches
    were one batch of k times the size).

    Data-parallel pattern (sync once per k steps): gradients are linear, so the mean over ranks of
    each rank's window sum is the global mean. Accumulate *local* gradients on the micro-steps and,
    on every k-th one, all-reduce the window sum with a single ``ddp_step``::

        opt = fddp.optim.accumulate(fddp.optim.adamw(1e-3), every_k=4)
        state = opt.init(params)
        for i, batch in enumerate(loader):
            grads = torch.func.grad(loss_fn)(params, batch)        # local, no communication
            if (i + 1) % 4 == 0:                                   # a Python counter: no device sync
                window = optree.tree_map(torch.add, state.grad_sum, grads)
                grads = fddp.ddp_step(params, window)              # one all-reduce per 4 micro-steps
                state = state._replace(grad_sum=optree.tree_map(torch.zeros_like, state.grad_sum))
            updates, state = opt.update(grads, state, params)
            params = fddp.optim.apply_updates(params, updates)

    Without ``.item()`` the emit decision is a tensor, so ``opt.update`` runs on every call and its
    result is selected with ``torch.where``; this keeps ``update`` pure, vmappable and compilable.

    Args:
        opt: the optimizer to wrap.
        every_k: number of micro-steps per update, >= 1.

    Returns:
        A ``GradientTransformation`` whose state is an ``AccumulateState``.

    Example:
        >>> opt = fddp.optim.accumulate(fddp.optim.sgd(0.1), every_k=4)
    """
    if not isinstance(opt, GradientTransformation):
        raise TypeError(f"accumulate: opt must be a GradientTransformation, got {type(opt).__name__}")
    if not isinstance(every_k, int) or isinstance(every_k, bool) or every_k < 1:
        raise ValueError(f"accumulate: invalid every_k={every_k!r}; expected an int >= 1")
    where = "accumulate.update"

    def init(params: Params) -> AccumulateState:
        leaves, treedef = init_leaves(params, "accumulate")
        zeros = optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])
        return AccumulateState(zeros_count(leaves), zeros, opt.init(params))

    def update(grads: Updates, state: AccumulateState, params: Params | None = None, **extra_args: Any) -> tuple[Updates, AccumulateState]:
        # No fused step: the inner update runs on every call and its result is selected.
        check_state(state, AccumulateState, where, grads=grads, params=params)
        sums, treedef = flatten(state.grad_sum)
        gs, _ = check_grads(grads, treedef, where)
        check_dtypes(gs, sums, treedef, where, "state.grad_sum")
        new_sums = [torch.add(s, g) for s, g in zip(sums, gs)]
        emit = state.mini_step == every_k - 1
        mean = optree.tree_unflatten(treedef, [torch.div(s, every_k) for s in new_sums])
        inner_updates, inner_state = opt.update(mean, state.inner, params)
        select = lambda new, old: torch.where(emit, new, old)  # noqa: E731
        updates = optree.tree_map(lambda u: torch.where(emit, u, torch.zeros_like(u)), inner_updates)
        inner = optree.tree_map(select, inner_state, state.inner)
        kept = [torch.where(emit, torch.zeros_like(s), s) for s in new_sums]
        mini_step = torch.where(emit, torch.zeros_like(state.mini_step), state.mini_step + 1)
        return updates, AccumulateState(mini_step, optree.tree_unflatten(treedef, kept), inner)

    return GradientTransformationExtraArgs(init, update)
