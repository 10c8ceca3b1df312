"""optax's moment-based scalings: ``scale_by_adam``, ``scale_by_amsgrad``, ``scale_by_rms``, ``scale_by_stddev``.

Moving averages of the updates and their squares, bias-corrected, and the updates divided by
their root: optax's arithmetic operation for operation, as the other building blocks
(``_transforms``), whose helpers they share.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from . import _checks as checks
from ._base import GradientTransformationExtraArgs
from ._checks import Params, Updates
from ._transforms import _bias_correction, _cast, _check_bool, _check_decay, _debias, _leaves, _moment, _moment2, _zeros

__all__ = [
    "scale_by_adam",
    "ScaleByAdamState",
    "scale_by_amsgrad",
    "ScaleByAmsgradState",
    "scale_by_rms",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "scale_by_stddev",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
]


# --- Adam and RMS scalings ------------------------------------------------------------------------------


class ScaleByAdamState(NamedTuple):
    """State of :func:`scale_by_adam`.

    Attributes:
        count: the number of updates so far (an int64 scalar tensor).
        mu: the first moment, a tree shaped like the parameters.
        nu: the second moment, a tree shaped like the parameters.
    """

    count: Tensor
    mu: Updates
    nu: Updates


def _check_adam(b1: float, b2: float, eps: float, eps_root: float, where: str) -> None:
    _check_decay(b1, "b1", where)
    _check_decay(b2, "b2", where)
    checks.check_nonneg(eps, "eps", where)
    checks.check_nonneg(eps_root, "eps_root", where)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = False,
) -> GradientTransformationExtraArgs:
    """Scale the updates by Adam's ``m_hat / (sqrt(v_hat + eps_root) + eps)`` (optax's ``scale_by_adam``).

    ``m = (1 - b1) * g + b1 * m``, ``v = (1 - b2) * g * g + b2 * v``, each divided by its bias
    correction ``1 - b ** count``. No learning rate and no sign: follow it with
    :func:`scale_by_learning_rate`. With ``nesterov``, ``m_hat`` is Dozat's
    ``b1 * m / (1 - b1 ** (count + 1)) + (1 - b1) * g / (1 - b1 ** count)`` (NAdam).

    Args:
        b1: the first moment's decay.
        b2: the second moment's decay.
        eps: added to the denominator, outside the square root.
        eps_root: added inside the square root.
        mu_dtype: the first moment's dtype in the state, if not the parameters'.
        nesterov: use Nesterov momentum (NAdam).

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByAdamState`.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.scale_by_adam(b1=0.9, b2=0.95), fddp.optim.scale_by_learning_rate(3e-4))
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    _check_adam(b1, b2, eps, eps_root, "scale_by_adam")
    _check_bool(nesterov, "nesterov", "scale_by_adam")
    where = "scale_by_adam.update"

    def init(params: Params) -> ScaleByAdamState:
        leaves, treedef = checks.init_leaves(params, "scale_by_adam")
        zeros = lambda dtype: optree.tree_unflatten(treedef, _zeros(leaves, dtype))  # noqa: E731
        return ScaleByAdamState(checks.zeros_count(leaves), zeros(mu_dtype), zeros(None))

    def update(
        grads: Updates, state: ScaleByAdamState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, ScaleByAdamState]:
        checks.check_state(state, ScaleByAdamState, where, grads=grads, params=params)
        gs, treedef = _leaves(grads, state.nu, where)
        mus = [_moment(g, m, b1) for g, m in zip(gs, checks.flatten(state.mu)[0])]
        nus_old = checks.flatten(state.nu)[0]
        nus = [_moment2(g, v, b2) for g, v in zip(gs, nus_old)]
        count = state.count + 1
        bc1, bc2 = _bias_correction(b1, count), _bias_correction(b2, count)
        if nesterov:
            bc1_next = _bias_correction(b1, count + 1)
            mu_hat = [b1 * (m / bc1_next.to(m.dtype)) + (1 - b1) * (g / bc1.to(g.dtype)) for m, g in zip(mus, gs)]
        else:
            mu_hat = _debias(mus, bc1)
        out = [m / (torch.sqrt(v / bc2.to(v.dtype) + eps_root) + eps) for m, v in zip(mu_hat, nus)]
        mus = _cast(mus, mu_dtype)
        nus = [v.to(o.dtype) for v, o in zip(nus, nus_old)]
        new_state = ScaleByAdamState(count, optree.tree_unflatten(treedef, mus), optree.tree_unflatten(treedef, nus))
        return optree.tree_unflatten(treedef, out), new_state

    return GradientTransformationExtraArgs(init, update)


class ScaleByAmsgradState(NamedTuple):
    """State of :func:`scale_by_amsgrad`.

    Attributes:
        count: the number of updates so far (an int64 scalar tensor).
        mu: the first moment.
        nu: the second moment.
        nu_max: the running maximum of the bias-corrected second moment.
    """

    count: Tensor
    mu: Updates
    nu: Updates
    nu_max: Updates


def scale_by_amsgrad(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
    bias_correction_mu: bool = True,
    bias_correction_nu: bool = True,
) -> GradientTransformationExtraArgs:
    """AMSGrad: :func:`scale_by_adam` over the running maximum of the second moment (optax's ``scale_by_amsgrad``).

    Args:
        b1: the first moment's decay.
        b2: the second moment's decay.
        eps: added to the denominator, outside the square root.
        eps_root: added inside the square root.
        mu_dtype: the first moment's dtype in the state, if not the parameters'.
        bias_correction_mu: divide the first moment by ``1 - b1 ** count``.
        bias_correction_nu: divide the second moment by ``1 - b2 ** count`` before the maximum.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByAmsgradState`.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.scale_by_amsgrad(), fddp.optim.scale_by_learning_rate(1e-3))
    """
    _check_adam(b1, b2, eps, eps_root, "scale_by_amsgrad")
    where = "scale_by_amsgrad.update"

    def init(params: Params) -> ScaleByAmsgradState:
        leaves, treedef = checks.init_leaves(params, "scale_by_amsgrad")
        zeros = lambda dtype: optree.tree_unflatten(treedef, _zeros(leaves, dtype))  # noqa: E731
        return ScaleByAmsgradState(checks.zeros_count(leaves), zeros(mu_dtype), zeros(None), zeros(None))

    def update(
        grads: Updates, state: ScaleByAmsgradState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, ScaleByAmsgradState]:
        checks.check_state(state, ScaleByAmsgradState, where, grads=grads, params=params)
        gs, treedef = _leaves(grads, state.nu, where)
        mus = [_moment(g, m, b1) for g, m in zip(gs, checks.flatten(state.mu)[0])]
        nus = [_moment2(g, v, b2) for g, v in zip(gs, checks.flatten(state.nu)[0])]
        count = state.count + 1
        bc1, bc2 = _bias_correction(b1, count), _bias_correction(b2, count)
        mu_hat = _debias(mus, bc1) if bias_correction_mu else mus
        nu_eff = _debias(nus, bc2) if bias_correction_nu else nus
        nu_max = [torch.maximum(a, b) for a, b in zip(checks.flatten(state.nu_max)[0], nu_eff)]
        out = [m / (torch.sqrt(v + eps_root) + eps) for m, v in zip(mu_hat, nu_max)]
        unflat = lambda xs: optree.tree_unflatten(treedef, xs)  # noqa: E731
        return unflat(out), ScaleByAmsgradState(count, unflat(_cast(mus, mu_dtype)), unflat(nus), unflat(nu_max))

    return GradientTransformationExtraArgs(init, update)


class ScaleByRmsState(NamedTuple):
    """State of :func:`scale_by_rms` without bias correction.

    Attributes:
        nu: the moving average of the squared updates.
    """

    nu: Updates


class ScaleByRmsWithCountState(NamedTuple):
    """State of :func:`scale_by_rms` with ``bias_correction=True``.

    Attributes:
        count: the number of updates so far (an int64 scalar tensor).
        nu: the moving average of the squared updates.
    """

    count: Tensor
    nu: Updates


def _check_rms(decay: float, eps: float, initial_scale: float, where: str) -> None:
    _check_decay(decay, "decay", where)
    checks.check_nonneg(eps, "eps", where)
    checks.check_nonneg(initial_scale, "initial_scale", where)


def _scaling(n: Tensor, eps: float, eps_in_sqrt: bool) -> Tensor:
    return torch.rsqrt(n + eps) if eps_in_sqrt else 1 / (torch.sqrt(n) + eps)


def scale_by_rms(
    decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0, eps_in_sqrt: bool = True, bias_correction: bool = False
) -> GradientTransformationExtraArgs:
    """Divide the updates by the root of a moving average of their squares (optax's ``scale_by_rms``, RMSProp's core).

    ``nu = (1 - decay) * g * g + decay * nu``; the updates are ``g * rsqrt(nu + eps)``, or
    ``g / (sqrt(nu) + eps)`` with ``eps_in_sqrt=False`` (``torch.optim.RMSprop``'s placement).

    Args:
        decay: the average's decay.
        eps: the stabilising term.
        initial_scale: the average's first value (optax's default 0; TensorFlow's RMSProp uses 1).
        eps_in_sqrt: add ``eps`` inside the square root.
        bias_correction: divide ``nu`` by ``1 - decay ** count``.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByRmsState` (with
        ``bias_correction``, a :class:`ScaleByRmsWithCountState`).

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.scale_by_rms(decay=0.99), fddp.optim.scale_by_learning_rate(1e-2))
    """
    _check_rms(decay, eps, initial_scale, "scale_by_rms")
    where = "scale_by_rms.update"
    cls = ScaleByRmsWithCountState if bias_correction else ScaleByRmsState

    def init(params: Params) -> Any:
        leaves, treedef = checks.init_leaves(params, "scale_by_rms")
        nu = optree.tree_unflatten(treedef, [torch.full_like(p, initial_scale) for p in leaves])
        return ScaleByRmsWithCountState(checks.zeros_count(leaves), nu) if bias_correction else ScaleByRmsState(nu)

    def update(grads: Updates, state: Any, params: Params | None = None, **extra_args: Any) -> tuple[Updates, Any]:
        checks.check_state(state, cls, where, grads=grads, params=params)
        gs, treedef = _leaves(grads, state.nu, where)
        nus = [_moment2(g, v, decay) for g, v in zip(gs, checks.flatten(state.nu)[0])]
        nu_hat = nus
        if bias_correction:
            count = state.count + 1
            nu_hat = _debias(nus, _bias_correction(decay, count))
        out = [_scaling(n, eps, eps_in_sqrt) * g for n, g in zip(nu_hat, gs)]
        nu = optree.tree_unflatten(treedef, nus)
        return optree.tree_unflatten(treedef, out), (ScaleByRmsWithCountState(count, nu) if bias_correction else ScaleByRmsState(nu))

    return GradientTransformationExtraArgs(init, update)


class ScaleByRStdDevState(NamedTuple):
    """State of :func:`scale_by_stddev` without bias correction.

    Attributes:
        mu: the moving average of the updates.
        nu: the moving average of their squares.
    """

    mu: Updates
    nu: Updates


class ScaleByRStdDevWithCountState(NamedTuple):
    """State of :func:`scale_by_stddev` with ``bias_correction=True``.

    Attributes:
        count: the number of updates so far (an int64 scalar tensor).
        mu: the moving average of the updates.
        nu: the moving average of their squares.
    """

    count: Tensor
    mu: Updates
    nu: Updates


def scale_by_stddev(
    decay: float = 0.9, eps: float = 1e-8, initial_scale: float = 0.0, eps_in_sqrt: bool = True, bias_correction: bool = False
) -> GradientTransformationExtraArgs:
    """Divide the updates by a moving estimate of their standard deviation (optax's ``scale_by_stddev``, centred RMSProp).

    ``mu`` and ``nu`` are moving averages of ``g`` and ``g * g``; the updates are
    ``g * rsqrt(nu - mu * mu + eps)`` (or ``g / (sqrt(nu - mu * mu) + eps)``).

    Args:
        decay: the averages' decay.
        eps: the stabilising term.
        initial_scale: ``nu``'s first value.
        eps_in_sqrt: add ``eps`` inside the square root.
        bias_correction: divide both averages by ``1 - decay ** count``.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByRStdDevState` (with
        ``bias_correction``, a :class:`ScaleByRStdDevWithCountState`).

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.scale_by_stddev(decay=0.99), fddp.optim.scale_by_learning_rate(1e-2))
    """
    _check_rms(decay, eps, initial_scale, "scale_by_stddev")
    where = "scale_by_stddev.update"
    cls = ScaleByRStdDevWithCountState if bias_correction else ScaleByRStdDevState

    def init(params: Params) -> Any:
        leaves, treedef = checks.init_leaves(params, "scale_by_stddev")
        mu = optree.tree_unflatten(treedef, _zeros(leaves))
        nu = optree.tree_unflatten(treedef, [torch.full_like(p, initial_scale) for p in leaves])
        return ScaleByRStdDevWithCountState(checks.zeros_count(leaves), mu, nu) if bias_correction else ScaleByRStdDevState(mu, nu)

    def update(grads: Updates, state: Any, params: Params | None = None, **extra_args: Any) -> tuple[Updates, Any]:
        checks.check_state(state, cls, where, grads=grads, params=params)
        gs, treedef = _leaves(grads, state.nu, where)
        mus = [_moment(g, m, decay) for g, m in zip(gs, checks.flatten(state.mu)[0])]
        nus = [_moment2(g, v, decay) for g, v in zip(gs, checks.flatten(state.nu)[0])]
        mu_hat, nu_hat = mus, nus
        if bias_correction:
            count = state.count + 1
            bc = _bias_correction(decay, count)
            mu_hat, nu_hat = _debias(mus, bc), _debias(nus, bc)
        out = [_scaling(n - m * m, eps, eps_in_sqrt) * g for m, n, g in zip(mu_hat, nu_hat, gs)]
        mu, nu = optree.tree_unflatten(treedef, mus), optree.tree_unflatten(treedef, nus)
        new_state = ScaleByRStdDevWithCountState(count, mu, nu) if bias_correction else ScaleByRStdDevState(mu, nu)
        return optree.tree_unflatten(treedef, out), new_state

    return GradientTransformationExtraArgs(init, update)
