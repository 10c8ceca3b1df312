"""Adam and AdamW, matching ``torch.optim.Adam`` / ``torch.optim.AdamW`` step for step."""

from __future__ import annotations

from typing import NamedTuple

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
    _check_state,
    _flatten,
    _lr_at,
    _params_leaves,
    _use_foreach,
    _zeros_count,
)
import optree


class AdamState(NamedTuple):
    """State of ``adam`` / ``adamw``.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        exp_avg: first moment, same tree as params.
        exp_avg_sq: second moment, same tree as params.
        max_exp_avg_sq: running maximum of ``exp_avg_sq`` when ``amsgrad=True``, else ``()``
            (an empty pytree, not ``None``: ``vmap`` accepts only tensors as outputs).
    """

    count: Tensor
    exp_avg: Updates
    exp_avg_sq: Updates
    max_exp_avg_sq: Updates | tuple


def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Adam with L2 weight decay added to the gradient, as ``torch.optim.Adam``.

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        betas: coefficients of the running averages of the gradient and its square, each in [0, 1).
        eps: term added to the denominator.
        weight_decay: L2 penalty (``grad + weight_decay * param``); needs ``params`` in ``update``.
        amsgrad: use the running maximum of the second moment (AMSGrad).

    Returns:
        A ``GradientTransformation`` whose state is an ``AdamState``.

    Example:
        >>> opt = fddp.optim.adam(lr=1e-3)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    return _adam("adam", lr, betas, eps, weight_decay, amsgrad, decoupled=False)


def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
) -> GradientTransformation:
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        betas: coefficients of the running averages of the gradient and its square, each in [0, 1).
        eps: term added to the denominator.
        weight_decay: decoupled decay: params shrink by ``lr * weight_decay`` each step.
        amsgrad: use the running maximum of the second moment (AMSGrad).

    Returns:
        A ``GradientTransformation`` whose state is an ``AdamState``.

    Example:
        >>> opt = fddp.optim.adamw(lr=1e-3, weight_decay=1e-2)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
        >>> params = fddp.optim.apply_updates(params, updates)
    """
    return _adam("adamw", lr, betas, eps, weight_decay, amsgrad, decoupled=True)


def _adam(
    name: str,
    lr: ScalarOrSchedule,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    *,
    decoupled: bool,
) -> GradientTransformation:
    _check_lr(lr, name)
    _check_nonneg(eps, "eps", name)
    _check_nonneg(weight_decay, "weight_decay", name)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{name}: invalid betas={betas!r}; expected a pair (beta1, beta2)")
    for i, b in enumerate(betas):
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0.0 <= b < 1.0:
            raise ValueError(f"{name}: invalid betas[{i}]={b!r}; expected a float in [0, 1)")
    b1, b2 = float(betas[0]), float(betas[1])
    where = f"{name}.update"

    def init(params: Params) -> AdamState:
        leaves, treedef = _flatten(params)
        zeros = lambda: optree.tree_unflatten(  # noqa: E731
            treedef, [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
        )
        return AdamState(_zeros_count(leaves), zeros(), zeros(), zeros() if amsgrad else ())

    def update(grads: Updates, state: AdamState, params: Params | None = None) -> tuple[Updates, AdamState]:
        _check_state(state, AdamState, where)
        if amsgrad != (not _is_empty(state.max_exp_avg_sq)):
            raise TypeError(
                f"{where}: the state was created with amsgrad={not amsgrad}, this optimizer has amsgrad={amsgrad}"
            )
        ms, treedef = _flatten(state.exp_avg)
        gs, _ = _check_grads(grads, treedef, where)
        vs = _flatten(state.exp_avg_sq)[0]
        vmaxs = _flatten(state.max_exp_avg_sq)[0] if amsgrad else None
        ps = _params_leaves(params, treedef, where, "weight_decay != 0") if weight_decay else None

        count = state.count
        lr_t = _lr_at(lr, count)
        # Bias corrections in float64 from the tensor step, as torch does in Python floats.
        t = (count + 1).to(torch.float64)
        bc1 = 1.0 - torch.pow(b1, t)
        bc2_sqrt = torch.sqrt(1.0 - torch.pow(b2, t))
        # torch: -lr/bc1 * m / (sqrt(v)/bc2_sqrt + eps). Multiplying through by bc2_sqrt saves one
        # full pass over the parameters: m * (-lr*bc2_sqrt/bc1) / (sqrt(v) + eps*bc2_sqrt).
        step = -lr_t * bc2_sqrt / bc1
        eps_hat = eps * bc2_sqrt
        l2 = weight_decay if (weight_decay and not decoupled) else 0.0
        decay = _decay_factors(lr_t, weight_decay, ps, count.device) if (decoupled and weight_decay) else None

        core = _foreach_core if _use_foreach(gs) else _per_leaf_core
        m, v, vmax, u = core(gs, ms, vs, vmaxs, ps, b1, b2, eps_hat, step, l2, decay)
        new_state = AdamState(
            count + 1,
            optree.tree_unflatten(treedef, m),
            optree.tree_unflatten(treedef, v),
            optree.tree_unflatten(treedef, vmax) if amsgrad else (),
        )
        return optree.tree_unflatten(treedef, u), new_state

    return GradientTransformation(init, update)


def _is_empty(x) -> bool:
    return isinstance(x, tuple) and len(x) == 0


def _decay_factors(lr_t, weight_decay: float, ps: list[Tensor], device) -> list[Tensor]:
    """Per-leaf ``c - 1`` where torch decays ``param.mul_(c)``, ``c = 1 - lr * weight_decay``.

    torch rounds ``c`` to the parameter's dtype, which changes the effective decay noticeably
    (fp32 rounding of 1 - 1e-5 is off by ~0.3% of the decay; in bf16 it is exactly 1). Using the
    rounded factor keeps trajectories on torch's.
    """
    c = torch.as_tensor(1.0 - lr_t * weight_decay, dtype=torch.float64, device=device)
    by_dtype: dict = {}
    for p in ps:
        if p.dtype not in by_dtype:
            # Exact: c rounded to the dtype minus 1 is representable in that dtype.
            by_dtype[p.dtype] = (c.to(p.dtype).to(torch.float64) - 1.0).to(p.dtype)
    return [by_dtype[p.dtype] for p in ps]


# Both cores run the same kernels in the same order, so they give bit-identical results; the
# foreach one works in place on freshly allocated buffers (never on inputs) to save allocations.


def _foreach_core(gs, ms, vs, vmaxs, ps, b1, b2, eps_hat, step, l2, decay):
    if l2:
        gs = torch._foreach_add(gs, ps, alpha=l2)
    m = torch._foreach_lerp(ms, gs, 1.0 - b1)
    v = torch._foreach_mul(vs, b2)
    torch._foreach_addcmul_(v, gs, gs, 1.0 - b2)
    vmax = None
    if vmaxs is not None:
        vmax = torch._foreach_maximum(vmaxs, v)
    u = torch._foreach_sqrt(v if vmax is None else vmax)
    torch._foreach_add_(u, eps_hat)
    torch._foreach_reciprocal_(u)
    torch._foreach_mul_(u, m)
    torch._foreach_mul_(u, step)
    if decay is not None:
        torch._foreach_addcmul_(u, ps, decay)
    return m, v, vmax, u


def _per_leaf_core(gs, ms, vs, vmaxs, ps, b1, b2, eps_hat, step, l2, decay):
    # Out of place throughout: under vmap an in-place op on an unbatched tensor with batched
    # arguments is an error, and inputs may be unbatched while grads are batched.
    if l2:
        gs = [torch.add(g, p, alpha=l2) for g, p in zip(gs, ps)]
    m = [torch.lerp(a, g, 1.0 - b1) for a, g in zip(ms, gs)]
    v = [torch.addcmul(torch.mul(a, b2), g, g, value=1.0 - b2) for a, g in zip(vs, gs)]
    vmax = None
    if vmaxs is not None:
        vmax = [torch.maximum(a, b) for a, b in zip(vmaxs, v)]
    u = []
    for i, src in enumerate(v if vmax is None else vmax):
        x = torch.reciprocal(torch.add(torch.sqrt(src), eps_hat))
        x = torch.mul(torch.mul(x, m[i]), step)
        if decay is not None:
            x = torch.addcmul(x, ps[i], decay[i])
        u.append(x)
    return m, v, vmax, u
