"""Comm hooks: what happens to each bucket between "this rank's gradients" and "the mean".

A synchronisation copies the gradients into flat buckets (the reducer's job) and hands each
bucket to a *comm hook*, which issues its collectives and, once they land, returns the reduced
buffer. The built-in hooks are the plain mean (:class:`Mean`), the weighted mean
(:class:`WeightedMean`), half-precision casts (:class:`Cast`) and :class:`fddp.PowerSGD`; users
write their own by subclassing :class:`CommHook`, in the spirit of torch's
``ddp_comm_hooks/default_hooks.py`` but pure: a hook's state goes in and comes out.

The protocol, per synchronisation of a tree whose buckets are ``b_0 .. b_k``::

    state = hook.init(params)                   # once, before the first step (None: stateless)
    ws = hook.begin(state, comm)                # per call: a working state (default: state itself)
    p_i, ws = hook.launch(ws, b_i)              # for each bucket, as it fills: start collectives
    r_i, ws = hook.finish(ws, b_i, p_i)         # for each bucket, in order: wait, return the mean
    new_state = hook.end(ws)                    # -> SyncInfo.compression_state

Optionally, ``scale_in(comm, layout)`` returns a factor for the reducer to apply while it copies
values into a bucket (the mean's ``1/n`` for a power-of-two group), which saves a pass, and
``fill_dtype(comm, layout)`` a dtype for the reducer to fill the bucket in, casting as it copies
(:class:`Cast`'s half precision): ``bucket.buffer`` then has that dtype, not ``layout.dtype``.
``finish`` may return something that is not a tensor: a further pending value, and the reducer
calls ``finish`` again with it after every other bucket has had its turn (PowerSGD's second round
trip). The buffer it finally returns must have the bucket's dtype and number of elements; it may be
``bucket.buffer`` itself, written in place. ``signature(state)`` describes what the hook sends, so
that ranks configured differently raise :class:`fddp.MismatchError` instead of exchanging buffers of
different sizes.

A hook that returns something else than the whole mean bucket says so with three more methods:
``result_numel(comm, index)`` (how many elements ``finish`` returns), ``finite(results, comm)``
(``SyncInfo.finite``, the same verdict on every rank) and ``tree(spec, comm, results, made)`` (what
the front ends return, by default the tree of views into the results). ``fddp.zero.ReduceScatter``
returns each rank's shard of every bucket that way, and a ``fddp.zero.Sharded`` tree.

Example (a user-written hook: int8 quantisation with one scale per bucket and rank):

    >>> class Int8(fddp.hooks.CommHook):
    ...     def launch(self, state, bucket):
    ...         x = bucket.buffer
    ...         scale = x.abs().max().clamp_min(1e-30) / 127
    ...         q = torch.round(x / scale).to(torch.int8)
    ...         (qs, w1), (scales, w2) = bucket.comm.all_gather(q), bucket.comm.all_gather(scale)
    ...         return (qs, scales, w1, w2), state
    ...     def finish(self, state, bucket, pending):
    ...         qs, scales, w1, w2 = pending
    ...         bucket.comm.wait(w1, "the gather of the values")
    ...         bucket.comm.wait(w2, "the gather of the scales")
    ...         mean = (qs.to(scales.dtype) * scales[:, None]).mean(0)
    ...         return bucket.buffer.copy_(mean), state
    >>> grads = fddp.ddp_step(params, grads, compression=Int8())
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import optree
import torch

from fddp import _layout
from fddp._layout import Bucket, new_flat
from fddp.sync._comm import Comm, on_host

__all__ = ["CommHook", "GradBucket", "Mean", "WeightedMean", "Cast", "Broadcast", "describe"]

LOW_PRECISION = (torch.float16, torch.bfloat16)
_TINY = torch.finfo(torch.float64).tiny


@dataclasses.dataclass(frozen=True)
class GradBucket:
    """One bucket as a comm hook sees it.

    Attributes:
        index: the bucket's position in the plan (and in the launch order).
        buffer: this rank's values, a flat 1-D tensor the hook may overwrite.
        layout: which leaves the buffer holds, their shapes and offsets.
        comm: the process group, through which the hook issues its collectives.
    """

    index: int
    buffer: torch.Tensor
    layout: Bucket
    comm: Comm


def describe(value: Any) -> str:
    """``repr(value)``, by value where ``repr`` would show an address (a plain class's default).

    Example:
        >>> class Hook:
        ...     def __init__(self):
        ...         self.bits = 8
        >>> describe(Hook())
        "Hook(bits=8)"
    """
    text = repr(value)
    if type(value).__repr__ is not object.__repr__:
        return text
    fields = getattr(value, "__dict__", None) or {n: getattr(value, n) for n in getattr(type(value), "__slots__", ()) if hasattr(value, n)}
    inner = ", ".join(f"{k}={describe(v)}" for k, v in sorted(fields.items()) if not k.startswith("__"))
    return f"{type(value).__module__}.{type(value).__qualname__}({inner})"


class CommHook:
    """Base class of comm hooks (see the module docstring for the protocol).

    Subclasses implement :meth:`launch` and :meth:`finish`; the rest has defaults for a stateless
    hook. Hooks are configuration, best written as frozen dataclasses, so that ``repr`` (the
    default :meth:`signature`) shows the settings ranks must agree on.

    Attributes:
        batchable: the hook treats every element alike, so ``vmap`` may run it once on a bucket
            that holds all members of an ensemble. Off by default.
        weighted: the hook implements ``weight=`` (reads ``comm.weight``, sets ``comm.weight_sum``).
        shards: :meth:`finish` returns this rank's part of the reduced bucket, not all of it, so
            the result has no derivative and cannot feed another hook (``fddp.zero.ReduceScatter``).
    """

    batchable: ClassVar[bool] = False
    weighted: ClassVar[bool] = False
    shards: ClassVar[bool] = False

    @property
    def stateful(self) -> bool:
        """Whether the hook keeps state between steps (by default: whether it defines ``init``)."""
        return type(self).init is not CommHook.init

    def init(self, params: Any, /) -> Any:
        """Return the state before the first step (``None`` for a stateless hook)."""
        return None

    def signature(self, state: Any) -> str:
        """Describe what this hook sends with ``state``: ranks must produce the same string.

        By default its ``repr``, or, where that is ``object``'s (``<Int8 object at 0x...>``: an
        address, different in every process), the class and its attributes by value.
        """
        return describe(self)

    def scale_in(self, comm: Comm, layout: Bucket) -> float | None:
        """A factor for the reducer to apply while it copies values into this bucket, or ``None``."""
        return None

    def cannot_carry(self, dtype: torch.dtype) -> str | None:
        """Why this hook cannot reduce buckets of ``dtype`` (for the error the front end raises), or
        ``None`` when it can (the default)."""
        return None

    def fill_dtype(self, comm: Comm, layout: Bucket) -> torch.dtype | None:
        """A dtype for the reducer to fill this bucket in (casting in the copy), or ``None`` for
        ``layout.dtype``. The buffer ``finish`` returns still has ``layout.dtype``."""
        return None

    def begin(self, state: Any, comm: Comm) -> Any:
        """Return the working state for one synchronisation (default: ``state`` itself)."""
        return state

    def launch(self, state: Any, bucket: GradBucket) -> tuple[Any, Any]:
        """Start the bucket's collectives; return ``(pending, state)``."""
        raise NotImplementedError(f"{type(self).__name__}.launch")

    def finish(self, state: Any, bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        """Wait for ``pending``; return ``(reduced buffer, state)``, or a new pending value for another round."""
        raise NotImplementedError(f"{type(self).__name__}.finish")

    def end(self, state: Any) -> Any:
        """Return the state after this synchronisation (default: the working state)."""
        return state

    def result_numel(self, comm: Comm, index: int) -> int:
        """How many elements :meth:`finish` returns for bucket ``index`` (default: all of them)."""
        return comm.plan.buckets[index].numel

    def finite(self, results: list[torch.Tensor], comm: Comm) -> torch.Tensor:
        """``SyncInfo.finite``: True when no reduced value is NaN or Inf, the same on every rank.

        By default the results are the whole reduced buckets, bitwise identical on every rank, so
        each rank reaches the same verdict alone.
        """
        return all_finite(results)

    def tree(self, spec: optree.PyTreeSpec, comm: Comm, results: list[torch.Tensor], made: list[Any] | None) -> Any:
        """What the front end returns: by default the tree of views into the results, laid out
        (``fddp._layout.lay_out``) so that ``fddp.optim`` reads them in place. ``made[k]``, where
        given, are result ``k``'s views already made."""
        return optree.tree_unflatten(spec, _layout.lay_out(comm.plan, results, made))


def all_finite(flats: list[torch.Tensor]) -> torch.Tensor:
    """Return a bool tensor: True when no buffer holds a NaN or an Inf.

    Each buffer's min and max come from one pass without a temporary (``aminmax`` propagates NaN,
    and an Inf is the min or the max); ``isfinite(f).all()`` writes a bool per element first and
    is ~15x slower on a 25 MB bucket on the CPU.
    """
    ends = [torch.stack(torch.aminmax(torch.view_as_real(f) if f.is_complex() else f)) for f in flats if f.numel()]
    if not ends:
        return torch.tensor(True)
    return torch.isfinite(torch.cat([e.to(ends[0].device) for e in ends])).all()


def nth(collective: str, bucket: GradBucket) -> str:
    return f"{collective} {bucket.index + 1} of {len(bucket.comm.plan.buckets)}"


def power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class Mean(CommHook):
    """Average each bucket over the ranks: the sum divided by the group size, to the bit.

    For a power-of-two group the gradients are scaled by ``1/n`` as they are copied into the
    bucket, before the sum, as torch DDP does: ``2**-k`` commutes with rounding, so ``sum(g_r / n)``
    is exactly ``sum(g_r) / n`` (short of subnormals), and the scaling rides on a copy made anyway.
    Otherwise the bucket is summed, then divided; half-precision buckets are divided first, so that
    the sum cannot overflow where the mean would not (torch's ``fp16_compress_hook``).

    Example:
        >>> grads = fddp.ddp_step(params, grads, compression=fddp.hooks.Mean())  # the default
    """

    batchable: ClassVar[bool] = True

    def signature(self, state: Any) -> str:
        return "mean"

    def scale_in(self, comm: Comm, layout: Bucket) -> float | None:
        return 1.0 / comm.world_size if power_of_two(comm.world_size) else None

    def launch(self, state: Any, bucket: GradBucket) -> tuple[Any, Any]:
        flat, comm = bucket.buffer, bucket.comm
        if not power_of_two(comm.world_size) and flat.dtype in LOW_PRECISION:
            flat.div_(comm.world_size)
        return comm.all_reduce(flat), state

    def finish(self, state: Any, bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        flat, comm = bucket.buffer, bucket.comm
        comm.wait(pending, nth("all-reduce", bucket))
        if not power_of_two(comm.world_size) and flat.dtype not in LOW_PRECISION:
            flat.div_(comm.world_size)
        return flat, state


class WeightSum:
    """Learn ``W = sum_r w_r`` once per synchronisation: from bucket 0's all-reduce, where the
    weight rides as one extra element, or, when it is needed before that lands (a half-precision
    bucket must send ``w_r / W * g_r``), from an all-reduce of its own, in float64."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.buf: torch.Tensor | None = None  # the buffer the weight travels in, weight last
        self.work: Any = None

    def ride(self, flat: torch.Tensor) -> torch.Tensor:
        """Return ``[w_r * flat, w_r]``, to be all-reduced in place of ``flat``."""
        w = self.comm.weight
        buf = torch.empty(flat.numel() + 1, dtype=flat.dtype, device=flat.device)
        torch.mul(flat, w.to(flat.dtype), out=buf[:-1])
        # A CPU weight is the host's: a fill, since a CPU tensor's copy into a GPU buffer is a
        # synced copy. Any other (a GPU's, or one traced by torch.compile) is copied on its device.
        buf[-1] = float(w) if on_host(w) else w
        self.buf = buf
        return buf

    def launched(self, work: Any) -> None:
        self.work = work

    def total(self, device: torch.device) -> torch.Tensor:
        """``W`` as a float64 scalar on the collective's device, waiting for (or starting) the
        collective that carries it. It stays there: a GPU's copy to the host would make the host
        wait for the GPU."""
        comm = self.comm
        if comm.weight_sum is None:
            if self.buf is None:
                w = comm.weight
                if on_host(w):  # a fill: a CPU tensor's copy to a GPU is a synced copy
                    self.buf = torch.full((1,), float(w), dtype=torch.float64, device=device)
                else:  # a copy: reshape/to alias the weight (the caller's tensor, even) on the same device
                    self.buf = w.reshape(1).to(device, copy=True)
                self.work = comm.all_reduce(self.buf)
            comm.wait(self.work, "the all-reduce of the weights")
            comm.weight_sum = self.buf[-1].real.to(torch.float64)  # .real: a complex bucket's weight
        return comm.weight_sum


def normalise_weight(flat: torch.Tensor, sums: WeightSum) -> None:
    """Scale this rank's buffer to ``w_r / W * g_r`` before a half-precision all-reduce.

    ``w_r * g_r / n`` overflows fp16 where the mean does not (``w_r`` is a sample count, often in
    the thousands); ``w_r / W`` is at most 1. One rounding: the host's scale is read in the kernel's
    float math; a GPU's would be cast to the bucket's half-precision dtype first, so a half-precision
    bucket is then multiplied in float32 (the same arithmetic) and rounded once.
    """
    scale = sums.comm.weight / sums.total(flat.device).clamp_min(_TINY)
    if on_host(scale) or flat.dtype not in LOW_PRECISION:
        flat.mul_(scale)
    else:
        flat.copy_(flat.float().mul_(scale))


def weight_divisor(weight_sum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W`` as the divisor of a bucket of ``dtype``, at least that dtype's smallest normal number.

    ``W = 0`` (no rank had data) comes with an all-zero numerator (every rank zeroed its
    contribution), and the mean over no samples is taken as zero: ``0 / tiny`` is 0, where ``0 / 0``
    is NaN. The floor must be the bucket dtype's: float64's smallest normal rounds to 0 in float32.
    """
    return weight_sum.clamp_min(torch.finfo(dtype).tiny).to(dtype)


def zero_if_weightless(flat: torch.Tensor, weight: torch.Tensor) -> None:
    # A rank with no data: its gradients may be NaN (a mean over nothing), and 0 * NaN is NaN.
    if on_host(weight):
        if weight == 0:
            flat.zero_()
    else:  # the same zeros, decided on the device: no host read, nothing for dynamo to guard on
        flat.masked_fill_(weight == 0, 0)


@dataclasses.dataclass(frozen=True)
class WeightedMean(CommHook):
    """The weighted mean ``sum_r w_r g_r / sum_r w_r``, with ``w_r`` this rank's ``weight=``.

    The weight sum rides in bucket 0's all-reduce as one extra element (no extra collective) and
    comes back as ``SyncInfo.weight``; a rank with weight 0 contributes nothing, even NaN.
    Half-precision buckets send ``w_r / W * g_r``, which cannot overflow, and so need ``W`` first:
    it then travels alone, in float64, once per call. ``weight=`` selects this hook.
    """

    batchable: ClassVar[bool] = True
    weighted: ClassVar[bool] = True

    def signature(self, state: Any) -> str:
        return "weighted mean"

    def begin(self, state: Any, comm: Comm) -> Any:
        return WeightSum(comm)

    def launch(self, sums: Any, bucket: GradBucket) -> tuple[Any, Any]:
        flat, comm = bucket.buffer, bucket.comm
        if flat.dtype in LOW_PRECISION:
            normalise_weight(flat, sums)
            zero_if_weightless(flat, comm.weight)
            return comm.all_reduce(flat), sums
        if bucket.index == 0:
            buf = sums.ride(flat)
            zero_if_weightless(buf[:-1], comm.weight)
            work = comm.all_reduce(buf)
            sums.launched(work)
            return work, sums
        flat.mul_(comm.weight.to(flat.dtype))
        zero_if_weightless(flat, comm.weight)
        return comm.all_reduce(flat), sums

    def finish(self, sums: Any, bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        flat, comm = bucket.buffer, bucket.comm
        comm.wait(pending, nth("all-reduce", bucket))
        if flat.dtype in LOW_PRECISION:
            return flat, sums  # sent as w_r / W * g_r: the sum is the mean
        if bucket.index == 0:
            comm.weight_sum = sums.buf[-1].real.to(torch.float64)  # .real: a complex bucket's weight
            flat = sums.buf[:-1]
        return flat.div_(weight_divisor(comm.weight_sum, flat.dtype)), sums

    def end(self, sums: Any) -> Any:
        if sums.comm.weight_sum is None:  # no buckets (an empty tree): the weight still travels
            sums.total(sums.comm.device)
        return None


@dataclasses.dataclass(frozen=True)
class Cast(CommHook):
    """Send buckets in a half-precision dtype, divided by the world size before the sum.

    The same arithmetic as torch's ``bf16_compress_hook`` / ``fp16_compress_hook``: cast down,
    divide (so the fp16 sum cannot overflow where the mean would not), all-reduce, cast back.
    ``compression="bf16"`` is ``Cast(torch.bfloat16)`` and ``"fp16"`` is ``Cast(torch.float16)``.
    With ``weight=`` each rank sends ``w_r / W * g_r`` (``W``, the weight sum, travels first, alone).

    Args:
        dtype: ``torch.bfloat16`` or ``torch.float16``.

    Example:
        >>> grads = fddp.ddp_step(params, grads, compression=fddp.Cast(torch.bfloat16))
    """

    dtype: torch.dtype
    batchable: ClassVar[bool] = True
    weighted: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.dtype not in LOW_PRECISION:
            raise ValueError(f"fddp.Cast: dtype must be torch.bfloat16 or torch.float16, got {self.dtype!r}")

    def signature(self, state: Any) -> str:
        return f"cast to {self.dtype}"

    def cannot_carry(self, dtype: torch.dtype) -> str | None:
        if dtype.is_complex:
            return f"it sends each bucket as {self.dtype}, which has no imaginary part"
        return None

    def begin(self, state: Any, comm: Comm) -> Any:
        return WeightSum(comm) if comm.weight is not None else None

    def fill_dtype(self, comm: Comm, layout: Bucket) -> torch.dtype | None:
        # Unweighted, the cast is the first thing done to the values: the reducer's copy into the
        # bucket makes it, and the full-precision bucket is never written (a weighted bucket is
        # scaled by w_r / W first, in full precision).
        return self.dtype if comm.weight is None and layout.dtype != self.dtype else None

    def launch(self, sums: Any, bucket: GradBucket) -> tuple[Any, Any]:
        flat, comm = bucket.buffer, bucket.comm
        if sums is not None:
            normalise_weight(flat, sums)
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        if sums is None:
            flat.div_(comm.world_size)
        else:
            zero_if_weightless(flat, comm.weight)
        return (flat, comm.all_reduce(flat)), sums

    def finish(self, sums: Any, bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        sent, work = pending
        bucket.comm.wait(work, nth("all-reduce", bucket))
        if sent.dtype == bucket.layout.dtype:
            return sent, sums
        out = new_flat(bucket.layout)  # from the host pool: fresh memory faults on first touch
        return out.copy_(sent), sums

    def end(self, sums: Any) -> Any:
        if sums is not None and sums.comm.weight_sum is None:
            sums.total(sums.comm.device)
        return None


@dataclasses.dataclass(frozen=True)
class Broadcast(CommHook):
    """Give every rank rank ``src``'s buckets (``fddp.broadcast``'s hook).

    Args:
        src: the rank, within the group, whose values everyone receives.
    """

    src: int = 0

    def launch(self, state: Any, bucket: GradBucket) -> tuple[Any, Any]:
        return bucket.comm.broadcast(bucket.buffer, self.src), state

    def finish(self, state: Any, bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        bucket.comm.wait(pending, nth("broadcast", bucket))
        return bucket.buffer, state


@dataclasses.dataclass(frozen=True)
class BufferMean(Mean):
    """``fddp.sync_buffers``' ``"mean"``: floating-point buckets averaged, integer and bool ones
    (counters such as ``num_batches_tracked``) take their maximum over the ranks."""

    def signature(self, state: Any) -> str:
        return "buffer mean"

    def launch(self, state: Any, bucket: GradBucket) -> tuple[Any, Any]:
        flat = bucket.buffer
        if flat.is_floating_point() or flat.is_complex():
            return super().launch(state, bucket)
        # gloo has no MAX for bool; as uint8 the maximum is the logical or.
        return bucket.comm.all_reduce(flat.view(torch.uint8) if flat.dtype == torch.bool else flat, "max"), state

    def finish(self, state: Any, bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        flat = bucket.buffer
        if flat.is_floating_point() or flat.is_complex():
            return super().finish(state, bucket, pending)
        bucket.comm.wait(pending, nth("max all-reduce", bucket))
        return flat, state

    def scale_in(self, comm: Comm, layout: Bucket) -> float | None:
        if layout.dtype.is_floating_point or layout.dtype.is_complex:
            return super().scale_in(comm, layout)
        return None  # counters are not scaled
