"""Skip updates whose gradients are not finite, on every rank together; dynamic loss scaling.

With ``check_finite=True`` (and ``return_info=True``), :func:`fddp.ddp_step` and
:func:`fddp.grad_and_value` return ``info.finite``: one bool tensor computed from the reduced
buckets. Those are bitwise identical on every rank, so every rank reaches the same verdict without
another collective, and a NaN on one rank makes every rank skip. :func:`apply_if_finite` turns the
verdict into "keep the old parameters and optimizer state" with ``torch.where``: no ``.item()``, no
host sync, so it works under ``torch.func.vmap`` and ``torch.compile``. :class:`DynamicLossScale` is
``torch.amp.GradScaler``'s scale schedule as pure functions of a :class:`LossScaleState`.

Example:
    >>> loss_scale = fddp.DynamicLossScale()
    >>> ls = loss_scale.init()
    >>> scaled = lambda p, x, y: loss_scale.scale_loss(ls, loss_fn(p, x, y))
    >>> grads, _, info = fddp.grad_and_value(scaled, check_finite=True, return_info=True)(params, x, y)
    >>> grads = loss_scale.unscale_grads(ls, grads)
    >>> updates, new_state = opt.update(grads, state, params)
    >>> new_params = fddp.optim.apply_updates(params, updates)
    >>> params, state = fddp.apply_if_finite(info.finite, (new_params, new_state), (params, state))
    >>> ls = loss_scale.update(ls, info.finite)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import optree
import torch

from fddp.optim._finite import apply_if_finite

__all__ = ["apply_if_finite", "DynamicLossScale", "LossScaleState"]


class LossScaleState(NamedTuple):
    """The state of a :class:`DynamicLossScale`.

    Attributes:
        scale: the current loss scale, a float32 scalar tensor.
        growth_tracker: finite steps since the scale last changed, an int32 scalar tensor (torch's
            ``GradScaler._growth_tracker``).
    """

    scale: torch.Tensor
    growth_tracker: torch.Tensor


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Loss scaling for fp16 training, with ``torch.amp.GradScaler``'s schedule as pure functions.

    Multiply the loss by the scale before differentiating, so small fp16 gradients do not flush to
    zero; divide the gradients by it before the optimizer. When the gradients overflow (``finite``
    false) the step must be skipped (:func:`apply_if_finite`) and the scale is multiplied by
    ``backoff_factor``; after ``growth_interval`` finite steps in a row it is multiplied by
    ``growth_factor`` (unless that overflows float32). The arithmetic is GradScaler's: the scale is
    float32, updated in float64 and rounded, and grads are multiplied by ``float32(1 / scale)``.

    Every method is pure and keeps the state on the device (no ``.item()``). Checkpoint the state
    with the parameters so a resumed run continues with the same scale.

    Attributes:
        init_scale: the first scale (GradScaler's default, 2**16).
        growth_factor: the factor applied after ``growth_interval`` finite steps; > 1.
        backoff_factor: the factor applied after a non-finite step; in (0, 1).
        growth_interval: how many finite steps in a row trigger growth; >= 1.

    Example:
        >>> loss_scale = fddp.DynamicLossScale(init_scale=2.0**16)
        >>> ls = loss_scale.init()
        >>> ls = loss_scale.update(ls, torch.tensor(False))
        >>> ls.scale
        tensor(32768.)
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise ValueError(f"DynamicLossScale: init_scale must be a positive finite number, got {self.init_scale!r}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"DynamicLossScale: growth_factor must be > 1, got {self.growth_factor!r}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"DynamicLossScale: backoff_factor must be in (0, 1), got {self.backoff_factor!r}")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) or self.growth_interval < 1:
            raise ValueError(f"DynamicLossScale: growth_interval must be an int >= 1, got {self.growth_interval!r}")

    def init(self, device: torch.device | str | None = None) -> LossScaleState:
        """Return the initial state, on ``device`` (the CPU by default; :meth:`update` moves it to
        its verdict's device, once, so that a GPU step never waits for the host's state).

        Example:
            >>> fddp.DynamicLossScale().init().scale
            tensor(65536.)
        """
        return LossScaleState(
            torch.tensor(self.init_scale, dtype=torch.float32, device=device),
            torch.zeros((), dtype=torch.int32, device=device),
        )

    def scale_loss(self, state: LossScaleState, loss: torch.Tensor, /) -> torch.Tensor:
        """Return ``loss * scale``, in ``loss``'s dtype.

        Example:
            >>> loss_scale.scale_loss(ls, torch.tensor(0.5))
            tensor(32768.)
        """
        return loss * _on(state.scale, loss.device)

    def unscale_grads(self, state: LossScaleState, grads: Any, /) -> Any:
        """Return ``grads`` divided by the scale, as GradScaler does: times ``float32(1 / scale)``.

        Each leaf keeps its dtype; ``None`` leaves stay ``None``.

        Example:
            >>> grads = loss_scale.unscale_grads(ls, grads)
        """
        inv_scale = state.scale.double().reciprocal().float()
        return optree.tree_map(lambda g: g * _on(inv_scale, g.device), grads)

    def update(self, state: LossScaleState, finite: torch.Tensor | bool, /) -> LossScaleState:
        """Return the state after a step whose gradients were finite (``finite`` true) or not.

        Non-finite: scale times ``backoff_factor``, tracker reset. Finite: the tracker counts up,
        and when it reaches ``growth_interval`` the scale grows by ``growth_factor`` (kept as is if
        that is not finite in float32) and the tracker resets.

        Example:
            >>> ls = loss_scale.update(ls, info.finite)
        """
        scale, tracker = state.scale, state.growth_tracker
        if isinstance(finite, torch.Tensor) and finite.device != scale.device:
            # The state follows the verdict to its device (once: it stays there), instead of the
            # verdict coming to the host's state, a sync at every step on a GPU.
            scale, tracker = scale.to(finite.device), tracker.to(finite.device)
        finite = torch.as_tensor(finite, device=scale.device).reshape(())
        if finite.dtype != torch.bool:
            raise TypeError(f"DynamicLossScale.update: finite must be a bool tensor (info.finite), got {finite.dtype}")
        counted = tracker + 1
        grow = finite & (counted >= self.growth_interval)
        # float32 scale, float64 factor, rounded to float32: GradScaler's _amp_update_scale_.
        grown = (scale.double() * self.growth_factor).float()
        backed_off = (scale.double() * self.backoff_factor).float()
        new_scale = torch.where(finite, torch.where(grow & torch.isfinite(grown), grown, scale), backed_off)
        new_tracker = torch.where(finite & ~grow, counted, torch.zeros_like(counted))
        return LossScaleState(new_scale, new_tracker)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a 0-dim scale) for an op with tensors on ``device``: a CPU one as it is (an op reads
    a CPU scalar tensor on the host, where a copy to the GPU would wait for it), else moved."""
    return t if t.device == device or (t.is_cpu and t.dim() == 0) else t.to(device)
