"""Learning-rate schedules: functions from the step count (an integer tensor) to a float64 tensor.

A schedule is evaluated with tensor ops on the optimizer's step count, never with ``.item()``, so
it works under ``torch.func.vmap`` and ``torch.compile``. Step 0 is the first update, as for a
``torch.optim.lr_scheduler`` stepped after each ``optimizer.step()``.
"""

from __future__ import annotations

import math
from typing import Callable

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


def exponential_decay(init_value: float, decay_rate: float) -> Schedule:
    """Return ``init_value * decay_rate ** step``, as ``torch.optim.lr_scheduler.ExponentialLR(gamma=decay_rate)``.

    Example:
        >>> lr = fddp.optim.exponential_decay(0.1, decay_rate=0.99)
    """
    _check(init_value, "init_value", "exponential_decay")
    _check(decay_rate, "decay_rate", "exponential_decay", positive=True)

    def schedule(count: Tensor) -> Tensor:
        return init_value * torch.pow(decay_rate, _t(count))

    return schedule
