"""RAdam: ``radam`` as ``torch.optim.RAdam`` (to the bit in ``apply_gradients``), and optax's ``scale_by_radam``."""

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

__all__ = ["RAdamState", "radam", "ScaleByRAdamState", "scale_by_radam"]


class RAdamState(NamedTuple):
    """State of :func:`radam`.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        exp_avg: first moment, same tree as params.
        exp_avg_sq: second moment, same tree as params.
    """

    count: Tensor
    exp_avg: Updates
    exp_avg_sq: Updates


@dataclasses.dataclass(frozen=True)
class _RAdam:
    lr: ScalarOrSchedule
    b1: float
    b2: float
    eps: float
    weight_decay: float
    decoupled: bool


@torch_names
def radam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    decoupled_weight_decay: bool = False,
) -> GradientTransformationExtraArgs:
    """Rectified Adam, as ``torch.optim.RAdam`` (its keyword names and defaults).

    ``apply_gradients`` equals ``torch.optim.RAdam(foreach=False)`` to the bit, reading the
    count on the host as torch does, where it is on the CPU; on a GPU it reads nothing on the
    host (its scalars float64 tensors on the device, the same arithmetic); ``update`` +
    ``apply_updates`` agrees with it to float rounding. optax's numbers
    (``optax.radam``) are :func:`scale_by_radam`'s.

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        betas: coefficients of the running averages of the gradient and its square, each in [0, 1).
        eps: term added to the denominator.
        weight_decay: L2 penalty, or decoupled decay (``decoupled_weight_decay=True``, RAdamW).
        decoupled_weight_decay: shrink the parameters by ``lr * weight_decay`` each step instead.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`RAdamState`.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> opt = fddp.optim.radam(lr=1e-3)
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, {"w": torch.full((3,), 0.5)}, state, params)
    """
    ew.check_args("radam", lr, betas, eps=eps, weight_decay=weight_decay)
    cfg = _RAdam(lr, float(betas[0]), float(betas[1]), float(eps), float(weight_decay), bool(decoupled_weight_decay))
    return GradientTransformationExtraArgs(functools.partial(_init, cfg), ew.fused_update("radam", cfg, _step))


def _init(cfg: _RAdam, params: Params) -> RAdamState:
    leaves, treedef = checks.init_leaves(params, "radam")
    return RAdamState(checks.zeros_count(leaves), ew.zeros(leaves, treedef), ew.zeros(leaves, treedef))


_FIELDS = ("exp_avg", "exp_avg_sq")


def _step(cfg: _RAdam, grads, state: RAdamState, params, apply: bool, why=None):
    treedef, gs, (ms, vs), ps = ew.leaves("radam.update", RAdamState, grads, state, params, _FIELDS, bool(cfg.weight_decay) or apply)
    b1, b2 = cfg.b1, cfg.b2
    lr = checks.lr_at(cfg.lr, state.count)
    host = apply and ew.on_host(state.count)
    if host:  # torch's Python floats, from the step read once on the host (free on the CPU)
        lr, step = ew.host(lr), float(state.count.item() + 1)
    else:  # float64 tensors on the count's device, by the same operations (no host read: see ew.on_host)
        step = (state.count + 1).to(torch.float64)
    bc1, bc2 = 1 - b1**step, 1 - b2**step
    rho_inf = 2 / (1 - b2) - 1
    rho_t = rho_inf - 2 * step * (b2**step) / bc2
    rectified = rho_t > 5.0
    if host:
        rect = ew.power((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t), 0.5) if rectified else None
    else:  # both branches, chosen per element (vmap's count may differ per member); the other's NaN is dropped
        ratio = (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
        rect = torch.where(rectified, ew.power(ratio.clamp(min=0), 0.5), 0.0)
    decay = 1 - lr * cfg.weight_decay if cfg.weight_decay and cfg.decoupled else None
    scalars = ew.Scalars(lr=lr, bc1=bc1, bc2_sqrt=ew.power(bc2, 0.5), rect=rect, rectified=rectified, decay=decay)
    unit = functools.partial(_unit, cfg=cfg, scalars=scalars, apply=apply)
    out = ew.run(unit, gs, [ms, vs], ps, treedef, 3, labels=_FIELDS, apply=apply, why=why)
    if out is None:
        return None
    m, v, u = (optree.tree_unflatten(treedef, x) for x in out)
    return u, RAdamState(state.count + 1, m, v)


def _unit(g, m, v, p, new, *, cfg: _RAdam, scalars: ew.Scalars, apply: bool):
    """torch's ``_single_tensor_radam`` (not capturable) on one tensor, out of place."""
    s = scalars.get(g.dtype)
    decay, lr = s["decay"], s["lr"]
    if cfg.weight_decay and not cfg.decoupled:
        g = torch.add(g, p, alpha=cfg.weight_decay, out=new())
    m = torch.lerp(m, g, 1 - cfg.b1, out=new())
    o = new()
    v = torch.addcmul(torch.mul(v, cfg.b2, out=o), g, g, value=1 - cfg.b2, out=o)
    ox, oa = new(), new()  # pooled flat buffers, or None leaf by leaf
    x = torch.mul(torch.div(m, s["bc1"], out=ox), lr, out=ox)  # bias_corrected_exp_avg * lr
    rectified = s["rectified"]
    if rectified is not False:
        # torch: bc2 ** 0.5 / (sqrt(v) + eps) is Tensor.__rtruediv__: reciprocal, then a multiply.
        a = torch.mul(torch.reciprocal(torch.add(torch.sqrt(v, out=oa), cfg.eps, out=oa), out=oa), s["bc2_sqrt"], out=oa)
        xa = torch.mul(torch.mul(x, a, out=oa), s["rect"], out=oa)  # torch's (x * adaptive_lr) * rect
        # A tensor's choice (a count on the device, or vmap's) is per element; the other branch's NaN is dropped.
        x = torch.where(rectified, xa, x, out=ox) if isinstance(rectified, Tensor) else xa
    o = new()
    q = torch.mul(p, decay, out=o) if decay is not None else p
    if apply:
        return m, v, torch.sub(q, x, out=o)
    u = torch.neg(x, out=ox)
    return m, v, ew.axpy(u, p, decay - 1, o) if decay is not None else u


# --- optax's scale_by_radam -------------------------------------------------------------------


class ScaleByRAdamState(NamedTuple):
    """State of :func:`scale_by_radam` (optax's ``ScaleByAdamState``).

    Attributes:
        count: number of updates so far (int64 scalar tensor).
        mu: first moment, same tree as params.
        nu: second moment, same tree as params.
    """

    count: Tensor
    mu: Updates
    nu: Updates


def scale_by_radam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0, threshold: float = 5.0, *, nesterov: bool = False
) -> GradientTransformationExtraArgs:
    """Rescale updates by Rectified Adam, as ``optax.scale_by_radam`` (its names, defaults and numbers).

    Where the variance is tractable (``rho >= threshold``) the update is
    ``r * mu_hat / (sqrt(nu_hat + eps_root) + eps)``, else ``mu_hat`` (bias-corrected moments).
    It is a direction, not a step: chain it with a learning rate (optax's ``radam`` is
    ``chain(scale_by_radam(...), scale_by_learning_rate(lr))``).

    Args:
        b1: decay of the gradient's running average.
        b2: decay of the squared gradient's running average.
        eps: term added to the denominator outside the square root.
        eps_root: term added inside the square root.
        threshold: the smallest ``rho`` at which the rectified step is taken.
        nesterov: use Nesterov momentum (optax's variant).

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByRAdamState`.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> t = fddp.optim.scale_by_radam()
        >>> direction, state = t.update({"w": torch.full((3,), 0.5)}, t.init(params))
    """
    for name, v in (("eps", eps), ("eps_root", eps_root)):
        checks.check_nonneg(v, name, "scale_by_radam")
    ew.check_betas((b1, b2), "scale_by_radam")
    ro_inf = 2.0 / (1.0 - b2) - 1.0

    def init(params: Params) -> ScaleByRAdamState:
        leaves, treedef = checks.init_leaves(params, "scale_by_radam")
        return ScaleByRAdamState(checks.zeros_count(leaves), ew.zeros(leaves, treedef), ew.zeros(leaves, treedef))

    def update(grads: Updates, state: ScaleByRAdamState, params: Params | None = None, **extra_args) -> tuple[Updates, ScaleByRAdamState]:
        treedef, gs, (mus, nus), _ = ew.leaves("scale_by_radam.update", ScaleByRAdamState, grads, state, params, ("mu", "nu"), False)
        count = state.count + 1
        t = count.to(torch.float64)
        b2t = b2**t
        ro = ro_inf - 2 * t * b2t / (1 - b2t)
        r = torch.sqrt(((ro - 4.0) * (ro - 2.0) * ro_inf / ((ro_inf - 4.0) * (ro_inf - 2.0) * ro)).clamp(min=0))
        new_mu, new_nu, out = [], [], []
        for g, mu, nu in zip(gs, mus, nus):
            mu = (1 - b1) * g + b1 * mu
            nu = (1 - b2) * (g * g) + b2 * nu
            dt = g.dtype
            if nesterov:
                mu_hat = b1 * (mu / (1 - b1 ** (t + 1)).to(dt)) + (1 - b1) * (g / (1 - b1**t).to(dt))
            else:
                mu_hat = mu / (1 - b1**t).to(dt)
            nu_hat = nu / (1 - b2**t).to(dt)
            rect = r.to(dt) * mu_hat / (torch.sqrt(nu_hat + eps_root) + eps)
            out.append(torch.where(ro >= threshold, rect, mu_hat))
            new_mu.append(mu)
            new_nu.append(nu)
        tree = functools.partial(optree.tree_unflatten, treedef)
        return tree(out), ScaleByRAdamState(count, tree(new_mu), tree(new_nu))

    return GradientTransformationExtraArgs(init, update)


