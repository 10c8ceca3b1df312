"""NAdam, matching ``torch.optim.NAdam`` (to the bit in ``apply_gradients``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import optree
import torch
from torch import Tensor

from . import _checks as checks
from . import _elementwise as ew
from ._base import GradientTransformationExtraArgs
from ._checks import Params, ScalarOrSchedule, Updates
from ._names import torch_names

__all__ = ["NAdamState", "nadam"]


class NAdamState(NamedTuple):
    """State of :func:`nadam`.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        mu_product: the product of the momentum coefficients so far, one scalar tensor (torch keeps
            one per parameter, all equal), in torch's default dtype at ``init`` as torch keeps it.
        exp_avg: first moment, same tree as params.
        exp_avg_sq: second moment, same tree as params.
    """

    count: Tensor
    mu_product: Tensor
    exp_avg: Updates
    exp_avg_sq: Updates


@dataclasses.dataclass(frozen=True)
class _NAdam:
    lr: ScalarOrSchedule
    b1: float
    b2: float
    eps: float
    weight_decay: float
    momentum_decay: float
    decoupled: bool


@torch_names
def nadam(
    lr: ScalarOrSchedule = 2e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum_decay: float = 4e-3,
    decoupled_weight_decay: bool = False,
) -> GradientTransformationExtraArgs:
    """NAdam (Adam with Nesterov momentum), as ``torch.optim.NAdam`` (its keyword names and defaults).

    ``apply_gradients`` equals ``torch.optim.NAdam(foreach=False)`` to the bit, reading the
    count on the host as torch does, where it is on the CPU; on a GPU it reads nothing on the
    host (its scalars float64 tensors on the device, the same arithmetic); ``update`` +
    ``apply_updates`` agrees with it to float rounding.

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        betas: coefficients of the running averages of the gradient and its square, each in [0, 1).
        eps: term added to the denominator.
        weight_decay: L2 penalty, or decoupled decay (``decoupled_weight_decay=True``, NAdamW).
        momentum_decay: the momentum schedule's decay (``psi`` in torch's docs).
        decoupled_weight_decay: shrink the parameters by ``lr * weight_decay`` each step instead.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`NAdamState`.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> opt = fddp.optim.nadam(lr=2e-3)
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, {"w": torch.full((3,), 0.5)}, state, params)
    """
    ew.check_args("nadam", lr, betas, eps=eps, weight_decay=weight_decay, momentum_decay=momentum_decay)
    cfg = _NAdam(lr, float(betas[0]), float(betas[1]), float(eps), float(weight_decay), float(momentum_decay), bool(decoupled_weight_decay))
    return GradientTransformationExtraArgs(functools.partial(_init, cfg), ew.fused_update("nadam", cfg, _step))


def _init(cfg: _NAdam, params: Params) -> NAdamState:
    leaves, treedef = checks.init_leaves(params, "nadam")
    count = checks.zeros_count(leaves)
    # torch's _get_scalar_dtype(): float64 under a float64 default dtype, else float32.
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return NAdamState(count, torch.ones((), dtype=dtype, device=count.device), ew.zeros(leaves, treedef), ew.zeros(leaves, treedef))


_FIELDS = ("exp_avg", "exp_avg_sq")


def _step(cfg: _NAdam, grads, state: NAdamState, params, apply: bool, why=None):
    need = bool(cfg.weight_decay) or apply
    treedef, gs, (ms, vs), ps = ew.leaves("nadam.update", NAdamState, grads, state, params, _FIELDS, need)
    b1, b2, md = cfg.b1, cfg.b2, cfg.momentum_decay
    lr = checks.lr_at(cfg.lr, state.count)
    host = apply and ew.on_host(state.count)
    if host:  # torch's Python floats, from the step read once on the host (free on the CPU)
        lr, step = ew.host(lr), float(state.count.item() + 1)
    else:  # float64 tensors on the count's device, by the same operations (no host read: see ew.on_host)
        step = (state.count + 1).to(torch.float64)
    bc2 = 1 - b2**step
    mu = b1 * (1.0 - 0.5 * (0.96 ** (step * md)))
    mu_next = b1 * (1.0 - 0.5 * (0.96 ** ((step + 1) * md)))
    mu_product = state.mu_product * (mu if host else mu.to(state.mu_product.dtype))  # torch: mu_product *= mu
    prod = mu_product.item() if host else mu_product.to(torch.float64)
    c_grad = -lr * (1.0 - mu) / (1.0 - prod)
    c_avg = (-lr * mu_next) / (1.0 - prod * mu_next)
    decay = 1 - lr * cfg.weight_decay if cfg.weight_decay and cfg.decoupled else None
    scalars = ew.Scalars(bc2=bc2, c_grad=c_grad, c_avg=c_avg, decay=decay)
    unit = functools.partial(_unit, cfg=cfg, scalars=scalars, apply=apply)
    out = ew.run(unit, gs, [ms, vs], ps, treedef, 3, labels=_FIELDS, apply=apply, why=why)
    if out is None:
        return None
    m, v, u = (optree.tree_unflatten(treedef, x) for x in out)
    return u, NAdamState(state.count + 1, mu_product, m, v)


def _unit(g, m, v, p, new, *, cfg: _NAdam, scalars: ew.Scalars, apply: bool):
    """torch's ``_single_tensor_nadam`` (not capturable) on one tensor, out of place."""
    s = scalars.get(g.dtype)
    b1, b2 = cfg.b1, cfg.b2
    decay = s["decay"]
    if cfg.weight_decay and not cfg.decoupled:
        g = torch.add(g, p, alpha=cfg.weight_decay, out=new())
    m = torch.lerp(m, g, 1 - b1, out=new())
    o = new()
    v = torch.addcmul(torch.mul(v, b2, out=o), g, g, value=1 - b2, out=o)
    o = new()  # a pooled flat buffer, or None leaf by leaf
    denom = torch.add(torch.sqrt(torch.div(v, s["bc2"], out=o), out=o), cfg.eps, out=o)
    if apply:
        o = new()
        q = torch.mul(p, decay, out=o) if decay is not None else p
        if not isinstance(s["c_grad"], Tensor):
            q = torch.addcdiv(q, g, denom, value=s["c_grad"], out=o)
            return m, v, torch.addcdiv(q, m, denom, value=s["c_avg"], out=o)
        # Tensor scalars (a count on the device): torch's capturable form, value * g first, then / denom,
        # as addcdiv(value=) computes it on the CPU.
        o2 = new()
        q = torch.addcdiv(q, torch.mul(g, s["c_grad"], out=o2), denom, out=o)
        return m, v, torch.addcdiv(q, torch.mul(m, s["c_avg"], out=o2), denom, out=o)
    o, o2 = new(), new()
    u = torch.mul(torch.div(g, denom, out=o), s["c_grad"], out=o)
    u = torch.addcmul(u, torch.div(m, denom, out=o2), s["c_avg"], out=o)
    if decay is not None:
        u = ew.axpy(u, p, decay - 1, o)
    return m, v, u
