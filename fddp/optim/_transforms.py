"""optax's gradient transformations, under optax's names, arguments, defaults and arithmetic.

Each is a ``GradientTransformationExtraArgs`` of two pure functions over pytrees of tensors, whose
state is a ``NamedTuple`` (optax's name for it) holding tensors only: the step count is an int64
scalar tensor and nothing calls ``.item()``, so they run under ``torch.func.vmap`` and
``torch.compile`` and compose with :func:`chain`, :func:`masked`, :func:`multi_transform`,
:func:`inject_hyperparams`, :func:`apply_gradients` and ``fddp.zero``'s shards (every one is
elementwise: a shard's elements are updated as the same elements of the whole tree would be).

The arithmetic is optax's, operation for operation (``(1 - decay) * g + decay * t``, the bias
correction ``t / (1 - decay ** count)``), so results equal optax's in float64 to a few units in the
last place (``tests/test_optax.py``). The moment-based scalings (``scale_by_adam``, ...) are ``_moments``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optree
import torch
from torch import Tensor

from . import _checks as checks
from ._base import EmptyState, GradientTransformationExtraArgs
from ._checks import Params, ScalarOrSchedule, Updates
from ._groups import Labels, masked

__all__ = [
    "identity",
    "scale",
    "scale_by_schedule",
    "ScaleByScheduleState",
    "scale_by_learning_rate",
    "add_decayed_weights",
    "WeightDecaySchedule",
    "trace",
    "TraceState",
    "ema",
    "EmaState",
    "zero_nans",
    "ZeroNansState",
    "clip",
]


# --- shared pieces ---------------------------------------------------------------------------------


def _leaves(grads: Updates, like: Any, where: str) -> tuple[list[Tensor], optree.PyTreeSpec]:
    """The gradients' leaves, checked against a state tree shaped like them (or alone when ``like`` is None)."""
    if like is None:
        return checks.check_grads(grads, None, where)
    leaves, treedef = checks.flatten(like)
    gs, _ = checks.check_grads(grads, treedef, where)
    return gs, treedef


def _bias_correction(decay: float, count: Tensor) -> Tensor:
    """``1 - decay ** count`` in float64 (optax computes it in the default float, float64 under x64)."""
    return 1.0 - torch.pow(decay, count.to(torch.float64))


def _debias(xs: list[Tensor], bc: Tensor) -> list[Tensor]:
    """Each of ``xs`` divided by the bias correction ``bc`` (cast to its dtype, as optax's ``bias_correction``)."""
    return [x / bc.to(x.dtype) for x in xs]


def _moment(g: Tensor, t: Tensor, decay: float) -> Tensor:
    return (1 - decay) * g + decay * t  # optax's update_moment, order 1


def _moment2(g: Tensor, t: Tensor, decay: float) -> Tensor:
    return (1 - decay) * (g * g) + decay * t  # optax's update_moment_per_elem_norm, order 2 (g ** 2 is g * g)


def _zeros(leaves: list[Tensor], dtype: torch.dtype | None = None) -> list[Tensor]:
    return [torch.zeros_like(p, dtype=dtype) for p in leaves]


def _cast(xs: list[Tensor], dtype: torch.dtype | None) -> list[Tensor]:
    return xs if dtype is None else [x.to(dtype) for x in xs]


def _check_decay(value: float, name: str, where: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{where}: invalid {name}={value!r}; expected a float in [0, 1]")


def _check_bool(value: Any, name: str, where: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be a bool, got {checks.describe(value)}")


def _empty_init(params: Params) -> EmptyState:
    return EmptyState()


# --- stateless ---------------------------------------------------------------------------------------


def identity() -> GradientTransformationExtraArgs:
    """Return the updates unchanged (optax's ``identity``); stateless.

    Example:
        >>> opt = fddp.optim.identity()
        >>> updates, state = opt.update(grads, opt.init(params))
        >>> updates is grads
        True
    """

    def update(grads: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any) -> tuple[Updates, EmptyState]:
        return grads, state

    return GradientTransformationExtraArgs(_empty_init, update)


def scale(step_size: float) -> GradientTransformationExtraArgs:
    """Multiply the updates by a constant ``step_size`` (optax's ``scale``); stateless.

    Args:
        step_size: the factor (negative for descent: ``scale(-lr)``).

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.scale_by_adam(), fddp.optim.scale(-1e-3))
    """
    if not isinstance(step_size, (int, float)) or isinstance(step_size, bool):
        raise TypeError(f"scale: step_size must be a number, got {checks.describe(step_size)}; for a schedule use scale_by_schedule")
    where = "scale.update"

    def update(grads: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any) -> tuple[Updates, EmptyState]:
        gs, treedef = _leaves(grads, None, where)
        return optree.tree_unflatten(treedef, [step_size * g for g in gs]), state

    return GradientTransformationExtraArgs(_empty_init, update)


def clip(max_delta: float) -> GradientTransformationExtraArgs:
    """Clip every element of the updates to ``[-max_delta, max_delta]`` (optax's ``clip``); stateless.

    Args:
        max_delta: the largest absolute value an element keeps, >= 0.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.clip(1.0), fddp.optim.sgd(0.1))
    """
    checks.check_nonneg(max_delta, "max_delta", "clip")
    where = "clip.update"

    def update(grads: Updates, state: EmptyState, params: Params | None = None, **extra_args: Any) -> tuple[Updates, EmptyState]:
        gs, treedef = _leaves(grads, None, where)
        return optree.tree_unflatten(treedef, [torch.clamp(g, -max_delta, max_delta) for g in gs]), state

    return GradientTransformationExtraArgs(_empty_init, update)


# --- scaling by a learning rate ------------------------------------------------------------------------


class ScaleByScheduleState(NamedTuple):
    """State of :func:`scale_by_schedule`.

    Attributes:
        count: the number of updates so far (an int64 scalar tensor); the schedule's argument.
    """

    count: Tensor


def scale_by_schedule(step_size_fn: Callable[[Tensor], Any]) -> GradientTransformationExtraArgs:
    """Multiply the updates by ``step_size_fn(count)`` (optax's ``scale_by_schedule``).

    The schedule gets the step count (0 at the first update) as an int64 scalar tensor; its value
    is cast to each update's dtype before the product, as optax does.

    Args:
        step_size_fn: a schedule (``fddp.optim.cosine_decay_schedule(...)``, or any function of the
            count returning a number or a scalar tensor).

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByScheduleState`.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.scale_by_adam(), fddp.optim.scale_by_schedule(lambda count: -1e-3 * 0.99**count))
    """
    if not callable(step_size_fn):
        raise TypeError(f"scale_by_schedule: step_size_fn must be a function of the step count, got {checks.describe(step_size_fn)}")
    where = "scale_by_schedule.update"

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(checks.zeros_count(checks.flatten(params)[0]))

    def update(
        grads: Updates, state: ScaleByScheduleState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, ScaleByScheduleState]:
        checks.check_state(state, ScaleByScheduleState, where, grads=grads, params=params)
        gs, treedef = _leaves(grads, None, where)
        step_size = torch.as_tensor(step_size_fn(state.count))
        out = [step_size.to(device=g.device, dtype=g.dtype) * g for g in gs]
        return optree.tree_unflatten(treedef, out), ScaleByScheduleState(state.count + 1)

    return GradientTransformationExtraArgs(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule | None = None, *, flip_sign: bool = True) -> GradientTransformationExtraArgs:
    """Multiply the updates by ``-learning_rate`` (optax's ``scale_by_learning_rate``).

    A number gives ``scale(-learning_rate)``, a schedule ``scale_by_schedule`` of
    ``-learning_rate(count)``, ``None`` :func:`identity`.

    Args:
        learning_rate: a float, a schedule (a function of the step count), or ``None``.
        flip_sign: multiply by ``-learning_rate`` (descent, the default), else by ``learning_rate``.

    Example:
        >>> schedule = fddp.optim.warmup_cosine_decay_schedule(0.0, 3e-4, warmup_steps=100, decay_steps=1000)
        >>> opt = fddp.optim.chain(fddp.optim.scale_by_adam(b2=0.95), fddp.optim.scale_by_learning_rate(schedule))
    """
    _check_bool(flip_sign, "flip_sign", "scale_by_learning_rate")
    if learning_rate is None:
        return identity()
    m = -1 if flip_sign else 1
    if callable(learning_rate):
        return scale_by_schedule(lambda count: m * learning_rate(count))
    checks.check_lr(learning_rate, "scale_by_learning_rate")
    return scale(m * learning_rate)


# --- weight decay ----------------------------------------------------------------------------------------


class WeightDecaySchedule(NamedTuple):
    """State of :func:`add_decayed_weights` with a scheduled ``weight_decay`` (optax's name).

    Attributes:
        count: the number of updates so far (an int64 scalar tensor).

    Example:
        >>> opt = fddp.optim.add_decayed_weights(lambda count: 1e-4 * 0.9**count)
        >>> opt.init(params)
        WeightDecaySchedule(count=tensor(0))
    """

    count: Tensor


def add_decayed_weights(weight_decay: ScalarOrSchedule = 0.0, mask: Labels | None = None) -> GradientTransformationExtraArgs:
    """Add ``weight_decay * params`` to the updates (optax's ``add_decayed_weights``).

    Before :func:`scale_by_learning_rate` in a :func:`chain`, that is AdamW's decoupled decay:
    ``chain(scale_by_adam(), add_decayed_weights(wd), scale_by_learning_rate(lr))``.

    Args:
        weight_decay: the rate, a float or a schedule (a function of the step count).
        mask: where the decay applies: True for the leaves it decays, as a tree of bools shaped
            like the parameters (or a prefix of it) or a function of the parameters returning one
            (:func:`fddp.optim.by_path`); the other leaves' updates pass through (:func:`masked`).

    Returns:
        A ``GradientTransformationExtraArgs``; its ``update`` needs ``params``.

    Example:
        >>> decay = fddp.optim.by_path(lambda path, p: p.ndim >= 2)
        >>> opt = fddp.optim.chain(
        ...     fddp.optim.scale_by_adam(), fddp.optim.add_decayed_weights(0.1, mask=decay), fddp.optim.scale_by_learning_rate(1e-3)
        ... )
    """
    scheduled = callable(weight_decay)
    if not scheduled:
        checks.check_nonneg(weight_decay, "weight_decay", "add_decayed_weights")
    where = "add_decayed_weights.update"

    def init(params: Params) -> WeightDecaySchedule | EmptyState:
        if scheduled:
            return WeightDecaySchedule(checks.zeros_count(checks.flatten(params)[0]))
        return EmptyState()

    def update(grads: Updates, state: Any, params: Params | None = None, **extra_args: Any) -> tuple[Updates, Any]:
        checks.check_state(state, WeightDecaySchedule if scheduled else EmptyState, where, grads=grads, params=params)
        gs, treedef = _leaves(grads, None, where)
        ps = checks.params_leaves(params, treedef, where, "add_decayed_weights adds weight_decay * params")
        new_state = WeightDecaySchedule(state.count + 1) if scheduled else state
        if not scheduled and weight_decay == 0.0:
            return grads, new_state  # optax skips a zero constant too
        if scheduled:
            s = torch.as_tensor(weight_decay(state.count))
            out = [g + s.to(device=g.device, dtype=g.dtype) * p for g, p in zip(gs, ps)]
        else:
            out = [g + weight_decay * p for g, p in zip(gs, ps)]
        return optree.tree_unflatten(treedef, out), new_state

    plain = GradientTransformationExtraArgs(init, update)
    return plain if mask is None else masked(plain, mask)


# --- momentum and averages -----------------------------------------------------------------------------


class TraceState(NamedTuple):
    """State of :func:`trace`.

    Attributes:
        trace: the momentum buffer, a tree shaped like the parameters.
    """

    trace: Updates


def trace(decay: float, nesterov: bool = False, accumulator_dtype: torch.dtype | None = None) -> GradientTransformationExtraArgs:
    """Momentum: ``t = g + decay * t``, the updates ``t`` (or ``g + decay * t`` with Nesterov) (optax's ``trace``).

    ``torch.optim.SGD``'s momentum without dampening: the first step's buffer is ``g + decay * 0``,
    which is ``g``, as torch's first buffer is.

    Args:
        decay: the momentum factor.
        nesterov: use Nesterov momentum.
        accumulator_dtype: the buffer's dtype, if not the parameters'.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`TraceState`.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.trace(0.9, nesterov=True), fddp.optim.scale_by_learning_rate(0.1))
    """
    checks.check_nonneg(decay, "decay", "trace")
    _check_bool(nesterov, "nesterov", "trace")
    where = "trace.update"

    def init(params: Params) -> TraceState:
        leaves, treedef = checks.init_leaves(params, "trace")
        return TraceState(optree.tree_unflatten(treedef, _zeros(leaves, accumulator_dtype)))

    def update(grads: Updates, state: TraceState, params: Params | None = None, **extra_args: Any) -> tuple[Updates, TraceState]:
        checks.check_state(state, TraceState, where, grads=grads, params=params)
        gs, treedef = _leaves(grads, state.trace, where)
        ts = checks.flatten(state.trace)[0]
        new = [g + decay * t for g, t in zip(gs, ts)]
        out = [g + decay * t for g, t in zip(gs, new)] if nesterov else new
        return optree.tree_unflatten(treedef, out), TraceState(optree.tree_unflatten(treedef, _cast(new, accumulator_dtype)))

    return GradientTransformationExtraArgs(init, update)


class EmaState(NamedTuple):
    """State of :func:`ema`.

    Attributes:
        count: the number of updates so far (an int64 scalar tensor).
        ema: the moving average, a tree shaped like the parameters.
    """

    count: Tensor
    ema: Updates


def ema(decay: float, debias: bool = True, accumulator_dtype: torch.dtype | None = None) -> GradientTransformationExtraArgs:
    """An exponential moving average of the updates, ``e = (1 - decay) * g + decay * e`` (optax's ``ema``).

    The updates are the average, divided by ``1 - decay ** count`` with ``debias`` (Adam's bias
    correction); the state keeps it undivided.

    Args:
        decay: the average's decay, in [0, 1].
        debias: divide by ``1 - decay ** count``.
        accumulator_dtype: the average's dtype in the state, if not the parameters'.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is an :class:`EmaState`.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.ema(0.9), fddp.optim.scale_by_learning_rate(0.1))
    """
    _check_decay(decay, "decay", "ema")
    _check_bool(debias, "debias", "ema")
    where = "ema.update"

    def init(params: Params) -> EmaState:
        leaves, treedef = checks.init_leaves(params, "ema")
        return EmaState(checks.zeros_count(leaves), optree.tree_unflatten(treedef, _zeros(leaves, accumulator_dtype)))

    def update(grads: Updates, state: EmaState, params: Params | None = None, **extra_args: Any) -> tuple[Updates, EmaState]:
        checks.check_state(state, EmaState, where, grads=grads, params=params)
        gs, treedef = _leaves(grads, state.ema, where)
        new = [_moment(g, e, decay) for g, e in zip(gs, checks.flatten(state.ema)[0])]
        count = state.count + 1
        out = new
        if debias:
            out = _debias(new, _bias_correction(decay, count))
        return optree.tree_unflatten(treedef, out), EmaState(count, optree.tree_unflatten(treedef, _cast(new, accumulator_dtype)))

    return GradientTransformationExtraArgs(init, update)


# --- NaNs --------------------------------------------------------------------------------------------------


class ZeroNansState(NamedTuple):
    """State of :func:`zero_nans`.

    Attributes:
        found_nan: per leaf, a bool scalar tensor: whether the latest updates of that leaf held a NaN.
    """

    found_nan: Any


def zero_nans() -> GradientTransformationExtraArgs:
    """Replace NaNs in the updates by zeros, and record per leaf whether there were any (optax's ``zero_nans``).

    Infinities are kept. On ``fddp.zero``'s shards ``found_nan`` is this rank's verdict on its
    elements (no collective): combine the ranks' with ``fddp.psum`` if you branch on it.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`ZeroNansState`.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.zero_nans(), fddp.optim.sgd(0.1))
    """
    where = "zero_nans.update"

    def init(params: Params) -> ZeroNansState:
        leaves, treedef = checks.init_leaves(params, "zero_nans")
        return ZeroNansState(optree.tree_unflatten(treedef, [torch.zeros((), dtype=torch.bool, device=p.device) for p in leaves]))

    def update(grads: Updates, state: ZeroNansState, params: Params | None = None, **extra_args: Any) -> tuple[Updates, ZeroNansState]:
        checks.check_state(state, ZeroNansState, where, grads=grads, params=params)
        gs, treedef = _leaves(grads, None, where)
        nans = [torch.isnan(g) for g in gs]
        found = [n.any() for n in nans]
        out = [torch.where(n, torch.zeros_like(g), g) for n, g in zip(nans, gs)]
        return optree.tree_unflatten(treedef, out), ZeroNansState(optree.tree_unflatten(treedef, found))

    return GradientTransformationExtraArgs(init, update)
