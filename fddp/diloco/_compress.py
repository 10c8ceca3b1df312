"""Pseudo-gradients in 4 and 2 bits, or their top k, with error feedback: comm hooks for the outer step.

Below 8 bits the integer sum :class:`fddp.Int8` relies on overflows, so these hooks *gather*: every
rank sends its own compressed bucket (codes packed into bytes, plus one scale per block, or the
indices and values of its top ``k``), every rank decodes every rank's and sums them in rank order,
in the bucket's dtype. The mean is then bitwise the same on every rank, from one all-gather per
bucket (two with the scales or the indices), with no second quantisation. What a rank did not send
(its input minus what it sent) is kept in the hook's state and added to its next input (error
feedback): a pure function of the state, which is a :class:`ResidualState` of tensors that
:mod:`fddp.checkpoint` saves.

The formats:

- ``Quantize(bits=4, format="e3m0")``: Streaming DiLoCo's 4-bit float, a sign and three exponent
  bits, no mantissa: each value over its block's largest ``|x|`` rounds to the nearest of 0 and
  ``2**-6 .. 2**0`` (nearest in value: ``frexp``, a mantissa of 0.75 rounds up).
- ``Quantize(bits=b, format="int")``: symmetric integers, ``L = 2**(b - 1) - 1`` levels each side
  of 0 times the block's ``max |x| / L`` (``b = 4``: -7 .. 7; ``b = 2``: -1, 0, 1).
- ``TopK(fraction)``: the ``ceil(fraction * n)`` entries of largest ``|x|`` of each bucket, sent as
  int32 indices and values of the bucket's dtype.

Bytes per element sent by each rank, against float32's 4: ``bits / 8 + scale_bytes / block``
(4 bits, block 128, float32 scales: 0.53, 7.5x fewer; 2 bits: 0.28, 14x fewer) and ``8 * fraction``
for top k (1%: 0.08, 50x fewer). A gather sends each rank's bytes to every other rank: on ``N``
ranks in a ring each rank forwards ``N - 1`` of them, where an all-reduce moves ``2 (N - 1) / N``
times its buffer; the counts in ``SyncInfo.bytes_sent`` are the payload each rank hands over.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import optree
import torch

from fddp import _caches
from fddp.sync._int8 import residual_leaves
from fddp.sync.hooks import CommHook, GradBucket, nth

__all__ = ["Quantize", "TopK", "ResidualState", "encode", "decode", "pack", "unpack", "FORMATS", "SCALES"]

FORMATS = ("e3m0", "int")
_E3M0_LEVELS = 7  # nonzero magnitudes 2**-6 .. 2**0; code 0 is zero
# Ternary codes (2 bits) at 1.5 times the block's mean |x|: half the error of the largest |x| on
# Gaussian values (0.43 against 0.77 of the norm, blocks of 128), which sends all but the largest as 0.
_MEAN_SCALE = 1.5
SCALES = ("max", "mean")


class ResidualState(NamedTuple):
    """The error-feedback state of :class:`Quantize` and :class:`TopK`: what this rank has not sent yet.

    Attributes:
        error: a tree shaped like the synchronised tree: this rank's input at its last
            synchronisation minus what it sent. Residuals differ between ranks by design: every
            rank saves its own (``fddp.checkpoint.PerRank``) to resume exactly.
    """

    error: Any


# --- the arithmetic: pure functions of tensors ------------------------------------------------------


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (1-D) zero-padded to whole blocks, as a ``(blocks, block)`` grid."""
    n = x.numel()
    grid = torch.zeros(-(-n // block) * block, dtype=x.dtype, device=x.device)
    grid[:n].copy_(x)
    return grid.view(-1, block)


def encode(x: torch.Tensor, bits: int, format: str, block: int, scale: str = "max") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a 1-D tensor: ``(codes, scales)``, codes as uint8 in ``[0, 2**bits)`` (one per element,
    zero-padded to whole blocks), scales of ``x``'s dtype, one per block: its largest ``|x|``
    (``scale="max"``) or 1.5 times its mean ``|x|`` (``"mean"``: larger values are clipped to it).

    Example:
        >>> codes, scales = encode(torch.tensor([0.5, -1.0, 0.2]), 4, "e3m0", 4)
        >>> decode(codes, scales, 4, "e3m0")[:3]
        tensor([ 0.5000, -1.0000,  0.2500])
    """
    grid = _blocks(x, block)
    scales = grid.abs().amax(1) if scale == "max" else grid.abs().mean(1) * _MEAN_SCALE
    u = grid / scales.clamp_min(torch.finfo(x.dtype).tiny)[:, None]
    if format == "int":
        levels = 2 ** (bits - 1) - 1
        q = torch.round(u * levels).clamp_(-levels, levels)
        return (q + levels).to(torch.uint8).reshape(-1), scales
    # e3m0: the nearest of 0 and 2**-6 .. 2**0 in value, ties to the larger: the level is the
    # number of midpoints at or below |u| (2**-7 between 0 and 2**-6, then 0.75 * 2**k between
    # 2**(k-1) and 2**k; exact comparisons), counted in uint8 (faster than frexp or bucketize).
    magnitude = u.abs()
    level = torch.zeros(magnitude.shape, dtype=torch.uint8, device=u.device)
    for midpoint in _e3m0_midpoints(u.dtype, u.device):
        level += magnitude >= midpoint
    sign = (u < 0).to(torch.uint8) << 3
    return (sign | level).reshape(-1), scales


def decode(codes: torch.Tensor, scales: torch.Tensor, bits: int, format: str) -> torch.Tensor:
    """The values ``codes`` and ``scales`` stand for (:func:`encode`'s inverse, up to its rounding), 1-D,
    of the scales' dtype, padded to whole blocks."""
    grid = codes.view(scales.numel(), -1)
    if format == "int":
        levels = 2 ** (bits - 1) - 1
        step = scales / levels
        return ((grid.to(scales.dtype) - levels) * step[:, None]).reshape(-1)
    values = torch.take(_e3m0_values(scales.dtype, scales.device), grid.long())  # one gather from the 16 codes' values
    return (values * scales[:, None]).reshape(-1)


@_caches.cached(maxsize=16)
def _e3m0_midpoints(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 7 boundaries between E3M0's magnitudes 0, 2**-6, ..., 2**0 (exact in any float dtype)."""
    return torch.tensor([2.0**-7] + [0.75 * 2.0**k for k in range(-5, 1)], dtype=dtype, device=device)


@_caches.cached(maxsize=16)
def _e3m0_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """What each of the 16 codes stands for: level ``l`` (the low 3 bits) is 0 or ``2**(l - 7)``; bit 3 the sign."""
    magnitudes = [0.0] + [2.0 ** (level - _E3M0_LEVELS) for level in range(1, _E3M0_LEVELS + 1)]
    return torch.tensor(magnitudes + [-m for m in magnitudes], dtype=dtype, device=device)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes of ``bits`` bits (1, 2, 4 or 8) into bytes, the first code in the low bits."""
    per = 8 // bits
    padded = torch.zeros(-(-codes.numel() // per) * per, dtype=torch.uint8, device=codes.device)
    padded[: codes.numel()].copy_(codes)
    grid = padded.view(-1, per)
    out = grid[:, 0].clone()
    for j in range(1, per):
        out |= grid[:, j] << (bits * j)
    return out


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """:func:`pack`'s inverse: the first ``numel`` codes."""
    per, mask = 8 // bits, (1 << bits) - 1
    grid = torch.stack([(packed >> (bits * j)) & mask for j in range(per)], 1)
    return grid.reshape(-1)[:numel]


# --- the hooks --------------------------------------------------------------------------------------


class _Call:
    """One synchronisation's working state: the residual leaves in, the new residual leaves out."""

    def __init__(self, hook: Any, state: Any, comm: Any) -> None:
        self.comm, self.hook, self.state = comm, hook, state
        self.finite: bool | torch.Tensor = True  # every bucket's values finite, on the device
        self.error, self.spec = residual_leaves(hook, state, ResidualState, comm)
        self.new_error: list[Any] = [None] * comm.plan.num_leaves

    def add_residual(self, bucket: GradBucket) -> torch.Tensor:
        x, layout = bucket.buffer, bucket.layout
        if self.error is not None:
            for v, leaf in zip(x.split(layout.numels), layout.indices):
                e = self.error[leaf]
                if not isinstance(e, torch.Tensor) or e.numel() != v.numel() or e.dtype != v.dtype:
                    raise ValueError(
                        f"fddp.{self.comm.what}: compression_state.error leaf {leaf} does not match its parameter "
                        f"({tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__} against {v.numel()} "
                        f"values of {v.dtype}); make the state with init(params) of the same tree"
                    )
                v.add_(e.reshape(-1))
        return x

    def keep_residual(self, bucket: GradBucket, residual: torch.Tensor) -> None:
        if self.error is None:
            return
        layout = bucket.layout
        for leaf, v, shape in zip(layout.indices, residual.split(layout.numels), layout.shapes):
            self.new_error[leaf] = v.view(shape)

    def new_state(self) -> Any:
        if self.error is None:
            return None
        if not bool(self.finite):
            # A synchronisation that is not finite gets skipped: its residuals must not carry the
            # NaN on, so the state it was given is the state it returns (fddp.Int8's rule).
            return self.state
        return ResidualState(optree.tree_unflatten(self.spec, self.new_error))


class _Gathering(CommHook):
    """What :class:`Quantize` and :class:`TopK` share: the residual, the state, the checks."""

    error_feedback: bool

    @property
    def stateful(self) -> bool:
        return self.error_feedback

    def init(self, params: Any, /) -> ResidualState | None:
        """Return the state before the first synchronisation: zero residuals shaped like ``params``.

        Example:
            >>> state = fddp.diloco.Quantize(bits=4).init(params)
        """
        if not self.error_feedback:
            return None
        return ResidualState(optree.tree_map(torch.zeros_like, params))

    def signature(self, state: Any) -> str:
        return repr(self)

    def cannot_carry(self, dtype: torch.dtype) -> str | None:
        return None if dtype.is_floating_point else f"{type(self).__name__} sends floating-point values only"

    def begin(self, state: Any, comm: Any) -> _Call:
        return _Call(self, state, comm)

    def end(self, call: Any) -> Any:
        return call.new_state()


@dataclasses.dataclass(frozen=True)
class Quantize(_Gathering):
    """Send buckets in ``bits`` bits per value, one scale per ``block`` values, with error feedback.

    Per bucket: this rank's residual is added; each block is divided by its largest ``|x|`` (its
    scale) and rounded to a code of ``bits`` bits (``format``: ``"e3m0"``, Streaming DiLoCo's 4-bit
    float, or ``"int"``, symmetric integers); the codes, packed into bytes, and the scales are
    gathered from every rank; every rank decodes every rank's and sums them in rank order, then
    divides by the number of ranks: the same mean, to the bit, everywhere. The residual, this rank's
    input minus what it sent, goes into the state for the next synchronisation.

    Args:
        bits: 4 or 2 (``"int"``; ``"e3m0"`` is 4 bits by definition).
        format: ``"e3m0"`` (a sign and 3 exponent bits: 0 and ``2**-6 .. 1`` times the scale) or
            ``"int"`` (``-L .. L`` with ``L = 2**(bits - 1) - 1``, times the scale over ``L``).
            Default: ``"e3m0"`` for 4 bits, ``"int"`` (ternary) for 2.
        block: values per scale.
        scale: each block's scale: ``"max"``, its largest ``|x|`` (nothing clipped), or ``"mean"``,
            1.5 times its mean ``|x|`` (larger values clipped to it; what is clipped stays in the
            residual). Default: ``"max"`` for 4 bits, ``"mean"`` for 2 (ternary codes at the largest
            ``|x|`` send all but the largest values as 0).
        error_feedback: keep the residual; without, the hook is stateless.

    Example:
        >>> outer = fddp.diloco.diloco(every=30, compression=fddp.diloco.Quantize(bits=4))
        >>> q2 = fddp.diloco.Quantize(bits=2)   # ternary: -1, 0, 1 times 1.5 x the block's mean |x|
    """

    bits: int = 4
    format: str | None = None
    block: int = 128
    scale: str | None = None
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if self.format is None:
            object.__setattr__(self, "format", "e3m0" if self.bits == 4 else "int")
        if self.scale is None:
            object.__setattr__(self, "scale", "max" if self.bits == 4 else "mean")
        if self.scale not in SCALES:
            raise ValueError(f"fddp.diloco.Quantize: scale must be one of {SCALES}, got {self.scale!r}")
        if self.format not in FORMATS:
            raise ValueError(f"fddp.diloco.Quantize: format must be one of {FORMATS}, got {self.format!r}")
        allowed = (4,) if self.format == "e3m0" else (2, 4)
        if not isinstance(self.bits, int) or isinstance(self.bits, bool) or self.bits not in allowed:
            raise ValueError(f"fddp.diloco.Quantize: format={self.format!r} takes bits in {allowed}, got {self.bits!r}")
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"fddp.diloco.Quantize: block must be a positive int, got {self.block!r}")

    def launch(self, call: Any, bucket: GradBucket) -> tuple[Any, Any]:
        x = call.add_residual(bucket)
        codes, scales = encode(x, self.bits, self.format, self.block, self.scale)
        if call.error is not None:
            call.keep_residual(bucket, x.sub_(decode(codes, scales, self.bits, self.format)[: x.numel()]))
        comm = bucket.comm
        packed = pack(codes, self.bits)
        all_codes, w1 = comm.all_gather(packed)
        all_scales, w2 = comm.all_gather(scales)
        return (all_codes, w1, all_scales, w2), call

    def finish(self, call: Any, bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        all_codes, w1, all_scales, w2 = pending
        comm, n = bucket.comm, bucket.layout.numel
        comm.wait(w1, nth("gather of the codes", bucket))
        comm.wait(w2, nth("gather of the scales", bucket))
        blocks = all_scales.shape[1]
        total = None
        for r in range(comm.world_size):  # rank order: the same sum on every rank
            codes = unpack(all_codes[r], self.bits, blocks * self.block)
            values = decode(codes, all_scales[r], self.bits, self.format)[:n]
            total = values if total is None else total.add_(values)
        call.finite = call.finite & torch.isfinite(all_scales).all()  # read once, in new_state (a GPU's: one sync a call, not one a bucket)
        # A new tensor: the bucket's buffer now holds this rank's residual (the state's leaves view it).
        return total.div_(comm.world_size), call


@dataclasses.dataclass(frozen=True)
class TopK(_Gathering):
    """Send each bucket's ``fraction`` of entries of largest ``|x|`` (indices and values), with error feedback.

    Per bucket of ``n`` values: this rank's residual is added; its ``k = ceil(fraction * n)``
    entries of largest magnitude (``torch.topk``) are gathered from every rank as int32 indices and
    values; every rank adds every rank's into zeros in rank order and divides by the number of
    ranks. The entries not sent stay in the residual. Each rank sends ``k * (4 + itemsize)`` bytes
    per bucket: with 1%, 50x fewer than float32's ``4 n``.

    Args:
        fraction: the share of each bucket's entries sent, in ``(0, 1]``.
        error_feedback: keep the residual; without, the hook is stateless.

    Example:
        >>> outer = fddp.diloco.diloco(every=30, compression=fddp.diloco.TopK(0.01))
    """

    fraction: float = 0.01
    error_feedback: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) or not 0 < self.fraction <= 1:
            raise ValueError(f"fddp.diloco.TopK: fraction must be in (0, 1], got {self.fraction!r}")

    def k(self, n: int) -> int:
        """How many of ``n`` entries are sent."""
        return min(n, max(1, math.ceil(self.fraction * n)))

    def launch(self, call: Any, bucket: GradBucket) -> tuple[Any, Any]:
        x = call.add_residual(bucket)
        _, index = torch.topk(x.abs(), self.k(x.numel()), sorted=False)
        values = x[index]
        if call.error is not None:
            call.keep_residual(bucket, x.index_fill_(0, index, 0.0))
        comm = bucket.comm
        all_index, w1 = comm.all_gather(index.to(torch.int32))
        all_values, w2 = comm.all_gather(values)
        return (all_index, w1, all_values, w2), call

    def finish(self, call: Any, bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        all_index, w1, all_values, w2 = pending
        comm = bucket.comm
        comm.wait(w1, nth("gather of the indices", bucket))
        comm.wait(w2, nth("gather of the values", bucket))
        total = torch.zeros_like(bucket.buffer)
        for r in range(comm.world_size):  # rank order: the same sum on every rank
            total.index_add_(0, all_index[r].long(), all_values[r])
        call.finite = call.finite & torch.isfinite(all_values).all()
        # A new tensor: the bucket's buffer now holds this rank's residual (the state's leaves view it).
        return total.div_(comm.world_size), call
