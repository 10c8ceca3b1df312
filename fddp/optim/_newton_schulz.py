"""Muon's arithmetic, as ``torch.optim.Muon`` writes it: the momentum, Newton-Schulz, the step.

Shared by the replicated step (``_muon``) and the step on shards (``_muon_shards``), which apply
the same lines to the same values, so that the two agree to the bit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ._checks import ScalarOrSchedule, Updates, lr_at
from ._flat import multi_tensor_ok

__all__ = [
    "ADJUST", "MuonConfig", "MuonState", "NS_COEFFICIENTS", "check_matrices", "decayed", "decays", "descend", "lr_now", "momentum_step",
    "orthogonalize", "step_by",
]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic Newton-Schulz coefficients (``torch.optim.Muon``'s and optax's default)."""

ADJUST = ("original", "match_rms_adamw", "none")


class MuonState(NamedTuple):
    """State of the Muon part of :func:`muon` (the matrices).

    Attributes:
        count: the number of updates so far (an int64 scalar tensor).
        momentum_buffer: a tree shaped like the matrices: torch's ``state["momentum_buffer"]``.
    """

    count: Tensor
    momentum_buffer: Updates


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """One Muon's hyperparameters (``fddp.optim.muon``'s arguments, checked)."""

    lr: ScalarOrSchedule
    momentum: float
    weight_decay: float
    nesterov: bool
    coefficients: tuple[float, float, float]
    steps: int
    eps: float
    adjust: str
    ns_dtype: torch.dtype | None
    where: str = "muon.update"

    def ratio(self, shape: tuple[int, ...]) -> float:
        """torch's ``_adjust_lr`` factor for a matrix of this shape (a Python float, as torch's)."""
        rows, cols = shape[:2]
        if self.adjust == "original":
            return math.sqrt(max(1, rows / cols))
        if self.adjust == "match_rms_adamw":
            return 0.2 * math.sqrt(max(rows, cols))
        return 1.0


def orthogonalize(
    x: Tensor, /, coefficients: tuple[float, float, float] = NS_COEFFICIENTS, steps: int = 5, eps: float = 1e-7,
    dtype: torch.dtype | None = torch.bfloat16,
) -> Tensor:
    """The quintic Newton-Schulz iteration of ``torch.optim.Muon``: ``x`` made nearly orthogonal.

    torch's ``_zeropower_via_newtonschulz``, op for op (so its results to the bit): cast to
    ``dtype``, transposed if taller than wide, divided by its Frobenius norm (at least ``eps``),
    then ``steps`` times ``X = a X + (b A + c A A) X`` with ``A = X X^T``. Out of place: ``x`` is
    not modified (torch's divides a bfloat16 input in place).

    Args:
        x: a matrix.
        coefficients: ``(a, b, c)``.
        steps: the number of iterations.
        eps: the smallest norm divided by.
        dtype: the dtype it runs in; ``None``: ``x``'s.

    Returns:
        A matrix of ``x``'s shape, in ``dtype``.

    Example:
        >>> o = fddp.optim.orthogonalize(torch.randn(64, 32))
        >>> torch.linalg.svdvals(o.float())  # all near 1 (between about 0.7 and 1.2)
    """
    if x.ndim != 2:
        raise ValueError(f"orthogonalize: expected a matrix (2-D), got shape {tuple(x.shape)}")
    a, b, c = coefficients
    o = x.to(dtype) if dtype is not None else x
    tall = x.size(0) > x.size(1)
    if tall:
        o = o.T
    o = o.div(o.norm().clamp(min=eps))
    for _ in range(steps):
        gram = o @ o.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        o = torch.addmm(o, poly, o, beta=a)
    return o.T if tall else o


def momentum_step(cfg: MuonConfig, g: Tensor, m: Tensor, *, in_place: bool = False) -> tuple[Tensor, Tensor]:
    """torch's two elementwise lines: the new buffer, and what Newton-Schulz gets."""
    m = m.lerp_(g, 1 - cfg.momentum) if in_place else torch.lerp(m, g, 1 - cfg.momentum)
    return m, (torch.lerp(g, m, cfg.momentum) if cfg.nesterov else m)


def lr_now(cfg: MuonConfig, count: Tensor) -> float | Tensor:
    """The learning rate at ``count``: a schedule's value read as a Python float where that costs
    no device sync (a CPU tensor, eagerly, outside torch.func transforms), so that the step is
    torch's arithmetic on torch's Python floats; a tensor elsewhere (one more rounding a step)."""
    lr = lr_at(cfg.lr, count)
    if isinstance(lr, Tensor) and lr.device.type == "cpu" and not torch.compiler.is_compiling() and multi_tensor_ok([lr]):
        return float(lr)
    return lr


def decays(cfg: MuonConfig, lr: float | Tensor) -> float | Tensor:
    """torch's decay factor ``1 - lr * weight_decay`` (a Python float for a constant lr)."""
    return 1 - lr * cfg.weight_decay


def decayed(p: Tensor, decay: float | Tensor, *, in_place: bool = False) -> Tensor:
    """``p * decay``, as torch's ``param.mul_(decay)`` (a schedule's tensor in ``p``'s dtype)."""
    if isinstance(decay, Tensor):
        decay = decay.to(p.dtype)
    return p.mul_(decay) if in_place else torch.mul(p, decay)


def descend(p: Tensor, o: Tensor, decay: float | Tensor, step: float | Tensor, *, in_place: bool = False) -> Tensor:
    """``p * decay - step * o``, as torch's ``param.mul_(decay); param.add_(o, alpha=-step)``."""
    return step_by(decayed(p, decay, in_place=in_place), o, step)


def step_by(q: Tensor, o: Tensor, step: float | Tensor) -> Tensor:
    """``q -= step * o`` in place: for a Python ``step`` torch's own ``add_`` with ``alpha`` (one
    rounding, to the bit); a tensor one (a schedule's) multiplies first, which rounds once more."""
    if isinstance(step, Tensor):
        return q.sub_(o.to(q.dtype) * step.to(q.dtype))
    return q.add_(o, alpha=-step)


def check_matrices(shapes: list[tuple[int, ...]], names: Callable[[], list[str]], where: str) -> None:
    """Raise a ValueError naming the first leaf that is no matrix."""
    for i, shape in enumerate(shapes):
        if len(shape) != 2:
            raise ValueError(
                f"{where}: leaf {names()[i]!r} has shape {tuple(shape)}, but Muon orthogonalises matrices (2-D) only; "
                "leave it to the fallback (muon's mask= picks the leaves Muon steps; the default picks every 2-D "
                "leaf) or reshape it into a matrix"
            )


