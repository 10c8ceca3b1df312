"""Layer-wise trust ratios: optax's ``scale_by_trust_ratio``, and LAMB and LARS built on it.

Each parameter's update is scaled by ``trust_coefficient * |param| / (|update| + eps)`` (1 where
either norm is 0), its norms those of the whole parameter: on ``fddp.zero``'s shards, float64 sums
of squares added up over the ranks (``_by_leaf``), so a sharded step equals the replicated one.
optax's names for the block, optax's numbers for all three; ``lamb`` and ``lars`` take torch's
keyword names (``lr``, ``betas``, ``weight_decay``, ``momentum``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from . import _checks as checks
from . import _elementwise as ew
from ._base import EmptyState, GradientTransformationExtraArgs
from ._by_leaf import Layout, by_leaf, layout_of, leaf_flags, sums_of_squares
from ._checks import Params, ScalarOrSchedule, Updates
from ._groups import Labels
from ._names import torch_names

__all__ = ["scale_by_trust_ratio", "LambState", "lamb", "LarsState", "lars"]


def _ratios(layout: Layout, ps: list[Tensor], us: list[Tensor], min_norm: float, coef: float, eps: float) -> Tensor:
    """optax's trust ratio of every whole leaf, float64: ``coef * |p| / (|u| + eps)``, 1 where a norm is 0."""
    sums = sums_of_squares(layout, ps, us)
    pn, un = sums[0].sqrt(), sums[1].sqrt()
    if min_norm:
        pn, un = pn.clamp(min=min_norm), un.clamp(min=min_norm)
    ratio = coef * pn / (un + eps)
    return torch.where((pn == 0) | (un == 0), torch.ones_like(ratio), ratio)


def _scaled(layout: Layout, us: list[Tensor], ratio: Tensor, flags: list[bool] | None = None) -> list[Tensor]:
    """Each leaf's update times its ratio (cast to the update's dtype); unmasked leaves unchanged."""

    def one(i: int, u: Tensor) -> Tensor:
        if flags is not None and not flags[i]:
            return u
        return u * ratio[i].to(u.dtype)

    return by_leaf(layout, one, us)


def _decayed(layout: Layout, us: list[Tensor], ps: list[Tensor], weight_decay: float, flags: list[bool]) -> list[Tensor]:
    """optax's ``add_decayed_weights``: ``u + weight_decay * p`` on the masked leaves."""
    if not weight_decay:
        return us

    def one(i: int, u: Tensor, p: Tensor) -> Tensor:
        return u + weight_decay * p if flags[i] else u

    return by_leaf(layout, one, us, ps)


def _scale_by_lr(us: list[Tensor], lr: float | Tensor) -> list[Tensor]:
    """optax's ``scale_by_learning_rate``: ``-lr * u`` (a schedule's value cast to the update's dtype first)."""
    if isinstance(lr, Tensor):
        return [(-lr).to(u.dtype) * u for u in us]
    return [-lr * u for u in us]


def scale_by_trust_ratio(min_norm: float = 0.0, trust_coefficient: float = 1.0, eps: float = 0.0) -> GradientTransformationExtraArgs:
    """Scale each parameter's update by its trust ratio, as ``optax.scale_by_trust_ratio``.

    ``trust_coefficient * |param| / (|update| + eps)`` per parameter (norms floored at
    ``min_norm``; a ratio of 1 where either norm is 0). On ``fddp.zero``'s shards each norm is
    the whole parameter's (a float64 sum of squares over the ranks: one all-reduce per step, which
    every rank joins), so a sharded step equals the replicated one. The norms are float64 sums
    where optax takes them in the parameters' dtype: equal for float64 parameters, within
    float32's rounding of optax's for float32 ones.

    Args:
        min_norm: the smallest norm used for either side.
        trust_coefficient: multiplies the ratio.
        eps: added to the update's norm.

    Returns:
        A ``GradientTransformationExtraArgs`` with an ``EmptyState``; needs ``params`` in ``update``.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> t = fddp.optim.scale_by_trust_ratio()
        >>> scaled, _ = t.update({"w": torch.full((3,), 0.5)}, t.init(params), params)
    """
    for name, v in (("min_norm", min_norm), ("trust_coefficient", trust_coefficient), ("eps", eps)):
        checks.check_nonneg(v, name, "scale_by_trust_ratio")
    where = "scale_by_trust_ratio.update"

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(updates: Updates, state: EmptyState, params: Params | None = None, **extra: Any) -> tuple[Updates, EmptyState]:
        us, treedef = checks.check_grads(updates, None, where)
        ps = checks.params_leaves(params, treedef, where, "the trust ratio reads the parameters' norms")
        layout = layout_of(params, ps, treedef, where)
        ratio = _ratios(layout, ps, us, min_norm, trust_coefficient, eps)
        return optree.tree_unflatten(treedef, _scaled(layout, us, ratio)), state

    return GradientTransformationExtraArgs(init, update)


# --- LAMB ---------------------------------------------------------------------------------------


class LambState(NamedTuple):
    """State of :func:`lamb`.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        mu: first moment, same tree as params.
        nu: second moment, same tree as params.
    """

    count: Tensor
    mu: Updates
    nu: Updates


@torch_names
def lamb(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
    *,
    mask: Labels | None = None,
) -> GradientTransformationExtraArgs:
    """LAMB, as ``optax.lamb`` (optax's numbers and defaults, torch's keyword names).

    ``chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
    scale_by_trust_ratio(), scale_by_learning_rate(lr))``: Adam's direction plus weight decay,
    scaled per parameter by ``|param| / |direction|``. torch.optim has no LAMB. On
    ``fddp.zero``'s shards (ZeRO-1/2/3) the norms are the whole parameters' (one all-reduce per
    step), and the step equals the replicated one.

    Args:
        lr: learning rate, a float or a schedule (a function of the step count); optax's
            ``learning_rate``.
        betas: optax's ``(b1, b2)``.
        eps: added to the denominator outside the square root.
        eps_root: added inside the square root.
        weight_decay: decoupled decay, added to the direction before the trust ratio.
        mask: where weight decay applies (as in :func:`fddp.optim.adamw`); ``None`` decays every leaf.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`LambState`.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> opt = fddp.optim.lamb(lr=1e-3, weight_decay=1e-2)
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, {"w": torch.full((3,), 0.5)}, state, params)
    """
    ew.check_args("lamb", lr, betas, eps=eps, eps_root=eps_root, weight_decay=weight_decay)
    b1, b2 = float(betas[0]), float(betas[1])
    where = "lamb.update"

    def init(params: Params) -> LambState:
        leaves, treedef = checks.init_leaves(params, "lamb")
        return LambState(checks.zeros_count(leaves), ew.zeros(leaves, treedef), ew.zeros(leaves, treedef))

    def update(grads: Updates, state: LambState, params: Params | None = None, **extra: Any) -> tuple[Updates, LambState]:
        treedef, gs, (mus, nus), ps = ew.leaves(where, LambState, grads, state, params, ("mu", "nu"), True)
        layout = layout_of(params, ps, treedef, where)
        flags = leaf_flags(mask, params, ps, treedef, where) if weight_decay else None
        count = state.count + 1
        t = count.to(torch.float64)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        new_mu, new_nu, us = [], [], []
        for g, mu, nu in zip(gs, mus, nus):
            mu = (1 - b1) * g + b1 * mu
            nu = (1 - b2) * (g * g) + b2 * nu
            dt = g.dtype
            us.append((mu / bc1.to(dt)) / (torch.sqrt(nu / bc2.to(dt) + eps_root) + eps))
            new_mu.append(mu)
            new_nu.append(nu)
        if weight_decay:
            us = _decayed(layout, us, ps, weight_decay, flags)
        us = _scaled(layout, us, _ratios(layout, ps, us, 0.0, 1.0, 0.0))
        us = _scale_by_lr(us, checks.lr_at(lr, state.count))
        tree = functools.partial(optree.tree_unflatten, treedef)
        return tree(us), LambState(count, tree(new_mu), tree(new_nu))

    return GradientTransformationExtraArgs(init, update)


# --- LARS ---------------------------------------------------------------------------------------


class LarsState(NamedTuple):
    """State of :func:`lars`.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor), for a schedule.
        trace: the momentum (optax's ``trace`` of the scaled updates), same tree as params.
    """

    count: Tensor
    trace: Updates


@torch_names
def lars(
    lr: ScalarOrSchedule,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    nesterov: bool = False,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    *,
    mask: Labels | None = None,
    trust_ratio_mask: Labels | None = None,
) -> GradientTransformationExtraArgs:
    """LARS, as ``optax.lars`` (optax's numbers and defaults, torch's keyword names).

    ``chain(add_decayed_weights(weight_decay, mask), masked(scale_by_trust_ratio(trust_coefficient,
    eps), trust_ratio_mask), scale_by_learning_rate(lr), trace(momentum, nesterov))``: SGD with
    momentum whose step per parameter is scaled by ``trust_coefficient * |param| / |grad|``.
    torch.optim has no LARS. On ``fddp.zero``'s shards (ZeRO-1/2/3) the norms are the whole
    parameters' (one all-reduce per step), and the step equals the replicated one.

    Args:
        lr: learning rate, a float or a schedule; optax's ``learning_rate``.
        weight_decay: added to the gradient (``g + weight_decay * p``) before the trust ratio.
        momentum: the trace's decay (optax's ``momentum``).
        nesterov: use Nesterov momentum.
        trust_coefficient: multiplies the trust ratio.
        eps: added to the gradient's norm in the ratio.
        mask: where weight decay applies (optax's ``weight_decay_mask``); ``None``: every leaf.
        trust_ratio_mask: where the trust ratio applies; ``None``: every leaf. Biases and norms
            are commonly left out of both: ``fddp.optim.by_path(lambda path, p: p.ndim >= 2)``.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`LarsState`.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> opt = fddp.optim.lars(lr=0.1, weight_decay=1e-4)
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, {"w": torch.full((3,), 0.5)}, state, params)
    """
    ew.check_args("lars", lr, weight_decay=weight_decay, momentum=momentum, trust_coefficient=trust_coefficient, eps=eps)
    where = "lars.update"

    def init(params: Params) -> LarsState:
        leaves, treedef = checks.init_leaves(params, "lars")
        return LarsState(checks.zeros_count(leaves), ew.zeros(leaves, treedef))

    def update(grads: Updates, state: LarsState, params: Params | None = None, **extra: Any) -> tuple[Updates, LarsState]:
        treedef, gs, (traces,), ps = ew.leaves(where, LarsState, grads, state, params, ("trace",), True)
        layout = layout_of(params, ps, treedef, where)
        us = gs
        if weight_decay:
            us = _decayed(layout, us, ps, weight_decay, leaf_flags(mask, params, ps, treedef, where))
        trusted = leaf_flags(trust_ratio_mask, params, ps, treedef, where)
        us = _scaled(layout, us, _ratios(layout, ps, us, 0.0, trust_coefficient, eps), trusted)
        us = _scale_by_lr(us, checks.lr_at(lr, state.count))
        # optax's trace: t' = u + momentum * t; Nesterov's step u + momentum * t'.
        new_traces = [u + momentum * t for u, t in zip(us, traces)]
        out = [u + momentum * t for u, t in zip(us, new_traces)] if nesterov else new_traces
        tree = functools.partial(optree.tree_unflatten, treedef)
        return tree(out), LarsState(state.count + 1, tree(new_traces))

    return GradientTransformationExtraArgs(init, update)
