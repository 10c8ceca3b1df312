"""Learning-rate schedules: functions from the step count (an integer tensor) to a float64 tensor.

A schedule is evaluated with tensor ops on the optimizer's step count, never with ``.item()``, so
it works under ``torch.func.vmap`` and ``torch.compile``. Step 0 is the first update, as for a
``torch.optim.lr_scheduler`` stepped after each ``optimizer.step()``.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import Tensor

Schedule = Callable[[Tensor], Tensor]


def _check(value: float, name: str, where: str, *, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"{where}: invalid {name}={value!r}; expected a finite float {'>' if positive else '>='} 0")


def _t(count: Tensor) -> Tensor:
    return torch.as_tensor(count).to(torch.float64)


def constant(value: float) -> Schedule:
    """Return a schedule that is always ``value``.

    Example:
        >>> opt = fddp.optim.sgd(lr=fddp.optim.constant(0.1))
    """
    _check(value, "value", "constant")

    def schedule(count: Tensor) -> Tensor:
        return torch.full_like(_t(count), value)

    return schedule


def linear(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Return a schedule moving linearly from ``init_value`` to ``end_value``, then constant.

    Equals ``torch.optim.lr_scheduler.LinearLR(start_factor=init/base, end_factor=end/base,
    total_iters=transition_steps)`` with ``transition_begin=0``.

    Args:
        init_value: value before and at ``transition_begin``.
        end_value: value from ``transition_begin + transition_steps`` on.
        transition_steps: length of the ramp, > 0.
        transition_begin: steps to hold ``init_value`` first.

    Example:
        >>> warmup = fddp.optim.linear(0.0, 1e-3, transition_steps=100)
    """
    _check(init_value, "init_value", "linear")
    _check(end_value, "end_value", "linear")
    _check(transition_steps, "transition_steps", "linear", positive=True)
    _check(transition_begin, "transition_begin", "linear")

    def schedule(count: Tensor) -> Tensor:
        frac = torch.clamp((_t(count) - transition_begin) / transition_steps, 0.0, 1.0)
        return init_value + (end_value - init_value) * frac

    return schedule


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Return a half-cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    Equals ``torch.optim.lr_scheduler.CosineAnnealingLR(T_max=decay_steps,
    eta_min=alpha * init_value)`` for steps up to ``decay_steps`` (then it stays at the minimum).

    Args:
        init_value: value at step 0.
        decay_steps: steps to reach the minimum, > 0.
        alpha: the minimum as a fraction of ``init_value``.

    Example:
        >>> opt = fddp.optim.adamw(lr=fddp.optim.cosine_decay(1e-3, decay_steps=10_000))
    """
    _check(init_value, "init_value", "cosine_decay")
    _check(decay_steps, "decay_steps", "cosine_decay", positive=True)
    _check(alpha, "alpha", "cosine_decay")
    end = alpha * init_value

    def schedule(count: Tensor) -> Tensor:
        frac = torch.clamp(_t(count), max=decay_steps) / decay_steps
        return end + (init_value - end) * 0.5 * (1.0 + torch.cos(math.pi * frac))

    return schedule


def warmup_cosine_decay(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0
) -> Schedule:
    """Return a linear warmup from ``init_value`` to ``peak_value``, then a cosine decay to ``end_value``.

    ``decay_steps`` counts the whole schedule, warmup included (as in optax).

    Args:
        init_value: value at step 0.
        peak_value: value at ``warmup_steps``.
        warmup_steps: length of the warmup.
        decay_steps: step at which ``end_value`` is reached, > ``warmup_steps``.
        end_value: value from ``decay_steps`` on.

    Example:
        >>> lr = fddp.optim.warmup_cosine_decay(0.0, 1e-3, warmup_steps=500, decay_steps=10_000)
    """
    for name, v in [("init_value", init_value), ("peak_value", peak_value), ("end_value", end_value)]:
        _check(v, name, "warmup_cosine_decay")
    _check(warmup_steps, "warmup_steps", "warmup_cosine_decay")
    if not (isinstance(decay_steps, int) and decay_steps > warmup_steps):
        raise ValueError(
            f"warmup_cosine_decay: invalid decay_steps={decay_steps!r}; expected an int > warmup_steps={warmup_steps!r}"
        )
    span = decay_steps - warmup_steps

    def schedule(count: Tensor) -> Tensor:
        t = _t(count)
        warm = init_value + (peak_value - init_value) * (t / max(warmup_steps, 1))
        frac = torch.clamp(t - warmup_steps, 0.0, float(span)) / span
        cos = end_value + (peak_value - end_value) * 0.5 * (1.0 + torch.cos(math.pi * frac))
        return torch.where(t < warmup_steps, warm, cos)

    return schedule


def exponential_decay(
    init_value: float,
    transition_steps: float | None = None,
    decay_rate: float | None = None,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """Return ``init_value * decay_rate ** ((step - transition_begin) / transition_steps)`` (optax's ``exponential_decay``).

    ``init_value`` until ``transition_begin``; with ``staircase`` the exponent is rounded down (a
    step every ``transition_steps``); ``end_value`` bounds the value (below for a decay, above for
    a growth). With ``transition_steps=1`` it is ``torch.optim.lr_scheduler.ExponentialLR(gamma=decay_rate)``.
    As optax, a ``transition_steps`` or ``decay_rate`` of 0 gives the constant ``init_value``.

    fddp's earlier two-argument form ``exponential_decay(init_value, decay_rate)`` still works: with
    no ``decay_rate=`` the second argument is the rate, and ``transition_steps`` is 1.

    Args:
        init_value: the value up to ``transition_begin``.
        transition_steps: steps per factor of ``decay_rate``.
        decay_rate: the factor per ``transition_steps`` steps.
        transition_begin: steps to hold ``init_value`` first.
        staircase: decay in whole steps of ``transition_steps``.
        end_value: the bound the value stops at, if any.

    Example:
        >>> lr = fddp.optim.exponential_decay(0.1, transition_steps=1000, decay_rate=0.5, staircase=True)
        >>> lr = fddp.optim.exponential_decay(0.1, decay_rate=0.99)  # ExponentialLR(gamma=0.99)
    """
    where = "exponential_decay"
    if decay_rate is None:
        if transition_steps is None:
            raise TypeError("exponential_decay: missing decay_rate; call exponential_decay(init_value, transition_steps, decay_rate)")
        transition_steps, decay_rate = 1, transition_steps  # fddp's (init_value, decay_rate)
    elif transition_steps is None:
        transition_steps = 1
    _check(init_value, "init_value", where)
    _check(decay_rate, "decay_rate", where)
    _finite(transition_steps, "transition_steps", where)
    _finite(transition_begin, "transition_begin", where)
    if end_value is not None:
        _check(end_value, "end_value", where)
    if transition_steps <= 0 or decay_rate == 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)
    bound = (torch.maximum if decay_rate < 1.0 else torch.minimum) if end_value is not None else None

    def schedule(count: Tensor) -> Tensor:
        decreased = _t(count) - transition_begin
        p = decreased / transition_steps
        if staircase:
            p = torch.floor(p)
        value = torch.where(decreased <= 0, init_value, init_value * torch.pow(decay_rate, p))
        if bound is not None:
            value = bound(value, torch.full_like(value, end_value))
        return value

    return schedule


# --- optax's schedules, under optax's names and with optax's arithmetic --------------------------------


def _finite(value: float, name: str, where: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok:
        raise ValueError(f"{where}: invalid {name}={value!r}; expected a finite number")


def constant_schedule(value: float) -> Schedule:
    """Return a schedule that is always ``value`` (optax's ``constant_schedule``), as a float64 tensor.

    Example:
        >>> fddp.optim.constant_schedule(0.1)(torch.tensor(7))
        tensor(0.1000, dtype=torch.float64)
    """
    _finite(value, "value", "constant_schedule")

    def schedule(count: Tensor) -> Tensor:
        return torch.full_like(_t(count), value)

    return schedule


def polynomial_schedule(
    init_value: float, end_value: float, power: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Return ``(init_value - end_value) * (1 - t / transition_steps) ** power + end_value`` (optax's ``polynomial_schedule``).

    ``t`` is the step minus ``transition_begin``, clipped to ``[0, transition_steps]``. As optax, a
    ``transition_steps`` <= 0 gives the constant ``init_value``.

    Args:
        init_value: the value up to ``transition_begin``.
        end_value: the value from ``transition_begin + transition_steps`` on.
        power: the polynomial's power (1: linear).
        transition_steps: the length of the transition.
        transition_begin: steps to hold ``init_value`` first.

    Example:
        >>> lr = fddp.optim.polynomial_schedule(1e-2, 1e-4, power=2, transition_steps=1000)
    """
    where = "polynomial_schedule"
    for name, v in (("init_value", init_value), ("end_value", end_value), ("power", power)):
        _finite(v, name, where)
    _finite(transition_steps, "transition_steps", where)
    _finite(transition_begin, "transition_begin", where)
    if transition_steps <= 0:
        return constant_schedule(init_value)
    transition_begin = max(transition_begin, 0)

    def schedule(count: Tensor) -> Tensor:
        t = torch.clamp(_t(count) - transition_begin, 0, transition_steps)
        frac = 1 - t / transition_steps
        return (init_value - end_value) * (frac**power) + end_value

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
    """Return a linear ramp from ``init_value`` to ``end_value`` over ``transition_steps`` (optax's ``linear_schedule``).

    :func:`polynomial_schedule` with ``power=1``.

    Example:
        >>> warmup = fddp.optim.linear_schedule(0.0, 1e-3, transition_steps=100)
    """
    return polynomial_schedule(init_value, end_value, 1, transition_steps, transition_begin)


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0) -> Schedule:
    """Return a cosine decay from ``init_value`` to ``alpha * init_value`` (optax's ``cosine_decay_schedule``).

    ``init_value * ((1 - alpha) * c ** exponent + alpha)`` with ``c = (1 + cos(pi * t / decay_steps)) / 2``;
    ``t`` is the step, held at ``decay_steps`` after it.

    Args:
        init_value: the value at step 0.
        decay_steps: the steps to the minimum, > 0.
        alpha: the minimum as a fraction of ``init_value``.
        exponent: the power of the cosine factor.

    Example:
        >>> lr = fddp.optim.cosine_decay_schedule(1e-3, decay_steps=10_000, alpha=0.1)
    """
    where = "cosine_decay_schedule"
    for name, v in (("init_value", init_value), ("alpha", alpha), ("exponent", exponent)):
        _finite(v, name, where)
    _finite(decay_steps, "decay_steps", where)
    if not decay_steps > 0:
        raise ValueError(f"cosine_decay_schedule: invalid decay_steps={decay_steps!r}; expected > 0")
    decay_steps = float(decay_steps)

    def schedule(count: Tensor) -> Tensor:
        t = torch.clamp(_t(count), max=decay_steps)
        cosine = 0.5 * (1 + torch.cos(math.pi * t / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules`` one after the other, switching at ``boundaries`` (optax's ``join_schedules``).

    Each schedule after the first gets the steps since its boundary.

    Args:
        schedules: the schedules, in order.
        boundaries: the steps at which each schedule after the first starts; one fewer than the schedules.

    Example:
        >>> lr = fddp.optim.join_schedules(
        ...     [fddp.optim.linear_schedule(0.0, 1e-3, 100), fddp.optim.constant_schedule(1e-3)], boundaries=[100]
        ... )
    """
    schedules, boundaries = list(schedules), list(boundaries)
    if not schedules or not all(map(callable, schedules)):
        raise TypeError("join_schedules: schedules must be a non-empty list of schedules (functions of the step count)")
    if len(boundaries) != len(schedules) - 1:
        raise ValueError(f"join_schedules: {len(schedules)} schedules need {len(schedules) - 1} boundaries, got {len(boundaries)}")
    for b in boundaries:
        _finite(b, "boundary", "join_schedules")

    def schedule(count: Tensor) -> Tensor:
        count = torch.as_tensor(count)
        out = torch.as_tensor(schedules[0](count))
        for boundary, later in zip(boundaries, schedules[1:]):
            out = torch.where(count < boundary, out, torch.as_tensor(later(count - boundary)))
        return out

    return schedule


def piecewise_constant_schedule(init_value: float, boundaries_and_scales: dict[int, float] | None = None) -> Schedule:
    """Return ``init_value`` multiplied by each scale whose boundary the step has reached (optax's ``piecewise_constant_schedule``).

    ``torch.optim.lr_scheduler.MultiStepLR(milestones, gamma)`` is ``{m: gamma for m in milestones}``.

    Args:
        init_value: the value before the first boundary.
        boundaries_and_scales: ``{step: scale}``; from ``step`` on the value is multiplied by ``scale`` (>= 0).

    Example:
        >>> lr = fddp.optim.piecewise_constant_schedule(0.1, {30: 0.1, 60: 0.1})  # MultiStepLR([30, 60], 0.1)
    """
    _finite(init_value, "init_value", "piecewise_constant_schedule")
    items = sorted((boundaries_and_scales or {}).items())
    for b, s in items:
        _finite(b, "boundary", "piecewise_constant_schedule")
        _check(s, f"scale at {b}", "piecewise_constant_schedule")

    def schedule(count: Tensor) -> Tensor:
        t = _t(count)
        v = torch.full_like(t, init_value)
        for threshold, scale in items:
            indicator = torch.clamp(torch.sign(threshold - t), min=0.0)
            v = v * indicator + (1 - indicator) * scale * v
        return v

    return schedule


def warmup_constant_schedule(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """Return a linear warmup from ``init_value`` to ``peak_value``, then ``peak_value`` (optax's ``warmup_constant_schedule``).

    Example:
        >>> lr = fddp.optim.warmup_constant_schedule(0.0, 1e-3, warmup_steps=100)
    """
    return linear_schedule(init_value, peak_value, warmup_steps)


def warmup_cosine_decay_schedule(
    init_value: float, peak_value: float, warmup_steps: int, decay_steps: int, end_value: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Return a linear warmup to ``peak_value``, then a cosine decay to ``end_value`` (optax's ``warmup_cosine_decay_schedule``).

    ``decay_steps`` counts the whole schedule, warmup included. optax's arithmetic: the cosine part
    is :func:`cosine_decay_schedule` with ``alpha = end_value / peak_value``, so its values differ
    from :func:`warmup_cosine_decay`'s (torch's ``CosineAnnealingLR`` arithmetic) by rounding.

    Args:
        init_value: the value at step 0.
        peak_value: the value at ``warmup_steps``.
        warmup_steps: the warmup's length.
        decay_steps: the step at which ``end_value`` is reached, > ``warmup_steps``.
        end_value: the value from ``decay_steps`` on.
        exponent: the power of the cosine factor.

    Example:
        >>> lr = fddp.optim.warmup_cosine_decay_schedule(0.0, 3e-4, warmup_steps=500, decay_steps=10_000, end_value=3e-5)
    """
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    return join_schedules([warmup, cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)], [warmup_steps])


def warmup_exponential_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    transition_steps: int,
    decay_rate: float,
    transition_begin: int = 0,
    staircase: bool = False,
    end_value: float | None = None,
) -> Schedule:
    """Return a linear warmup to ``peak_value``, then :func:`exponential_decay` from it (optax's ``warmup_exponential_decay_schedule``).

    Example:
        >>> lr = fddp.optim.warmup_exponential_decay_schedule(0.0, 1e-3, 100, transition_steps=1000, decay_rate=0.5)
    """
    return join_schedules(
        [
            linear_schedule(init_value, peak_value, warmup_steps),
            exponential_decay(peak_value, transition_steps, decay_rate, transition_begin, staircase, end_value),
        ],
        [warmup_steps],
    )
