"""``ReduceScatter``: the comm hook that gives each rank only its shard of every mean bucket.

ZeRO's gradients: the reducer fills the buckets as for ``ddp_step``, this hook reduces them and
keeps this rank's cut (``fddp.zero._layout``), and the front ends return a
:class:`fddp.zero.Sharded` tree, through the hook protocol's ``result_numel``, ``finite`` and
``tree`` (``fddp.sync.hooks``): the replicated path knows nothing of shards.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import optree
import torch

from fddp import _dist
from fddp._layout import Bucket
from fddp._pool import new_buffer
from fddp.sync._comm import Comm
from fddp.sync.hooks import (
    LOW_PRECISION,
    CommHook,
    GradBucket,
    Mean,
    WeightedMean,
    WeightSum,
    all_finite,
    nth,
    power_of_two,
    weight_divisor,
    zero_if_weightless,
)
from fddp.zero import _layout as shard_layout
from fddp.zero._layout import Sharded, ShardLayout

__all__ = ["ReduceScatter"]

_TINY = torch.finfo(torch.float64).tiny


def _layout_of(comm: Comm, spec: optree.PyTreeSpec | None = None) -> ShardLayout:
    """How this rank's shards cut the synchronisation's buckets."""
    return shard_layout.layout(comm.plan, spec, comm.world_size, comm.rank, comm.group)


_STRATEGIES = ("auto", "all_reduce", "reduce_scatter")


class _Shards:
    """``ReduceScatter``'s working state: the inner hook's, this call's shard buffers, the weight sum."""

    def __init__(self, inner: CommHook, inner_state: Any, comm: Comm) -> None:
        self.inner, self.inner_state, self.comm = inner, inner_state, comm
        self.cuts = _layout_of(comm).cuts
        self.out = shard_layout.new_shards(_layout_of(comm))
        self.sums = WeightSum(comm) if comm.weight is not None else None
        self.scattered = False  # some bucket went through reduce_scatter (and its weight sum through sums)


@dataclasses.dataclass(frozen=True)
class ReduceScatter(CommHook):
    """Give each rank only its shard of every mean bucket: ZeRO's gradients (``fddp.zero``).

    The gradients come back as a :class:`fddp.zero.Sharded`: on rank ``r`` of ``N``, the mean of
    elements ``[r * s, (r + 1) * s)`` of each bucket (``s``, the shard size, is the bucket's size
    over ``N``, rounded up to a multiple of 64 elements; the tail is zero padding). The full buckets
    exist only while they are reduced; the returned tree holds ``1/N`` of the gradients.

    Two ways to get there, with the same result up to the order of the sums:

    - ``"all_reduce"``: all-reduce the bucket with the inner hook (the mean, the weighted mean,
      a cast, PowerSGD: whatever ``inner`` is), then keep this rank's slice. The sums are those of
      ``ddp_step``, bit for bit, and on gloo it is the fastest way: gloo's reduce-scatter is
      itself a copy, an all-reduce and a slice.
    - ``"reduce_scatter"``: pad the bucket to ``N * s`` and reduce-scatter it, sending half the
      bytes of an all-reduce on NCCL. Only with the plain or weighted mean (``inner=None``). The
      padding moves the backend's chunk boundaries, so sums over 3 or more ranks may differ from
      ``ddp_step``'s in the last bit.

    ``"auto"`` picks ``"reduce_scatter"`` for CUDA buckets when ``inner`` is ``None``, and
    ``"all_reduce"`` otherwise. ``weight=`` works with either: the weighted mean of the inner hook,
    or ``sum_r w_r g_r / sum_r w_r`` with the weight sum all-reduced alongside in float64.

    Args:
        inner: the comm hook that averages each full bucket (``"all_reduce"`` only); ``None`` for
            the mean, or with ``weight=`` the weighted mean.
        strategy: ``"auto"``, ``"all_reduce"`` or ``"reduce_scatter"``.

    Example:
        >>> shards = fddp.zero.shard(params)
        >>> step = fddp.grad_and_value(loss_fn, compression=fddp.zero.ReduceScatter())
        >>> grads, loss = step(params, x, y)  # a Sharded tree: this rank's shard of the mean
        >>> shards, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, shards)
    """

    inner: CommHook | None = None
    strategy: str = "auto"
    shards: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"fddp.zero.ReduceScatter: strategy must be one of {_STRATEGIES}, got {self.strategy!r}")
        if self.inner is not None:
            if not isinstance(self.inner, CommHook) or self.inner.shards:
                raise TypeError(
                    f"fddp.zero.ReduceScatter: inner must be a comm hook that returns whole buckets, got {self.inner!r}"
                )
            if self.strategy == "reduce_scatter":
                raise ValueError(
                    "fddp.zero.ReduceScatter: strategy='reduce_scatter' sends the plain or weighted mean only; "
                    f"inner={self.inner!r} needs strategy='all_reduce'"
                )

    @property
    def weighted(self) -> bool:  # type: ignore[override]
        return self.inner is None or self.inner.weighted

    @property
    def stateful(self) -> bool:
        return self.inner is not None and self.inner.stateful

    def init(self, params: Any, /) -> Any:
        return None if self.inner is None else self.inner.init(params)

    def signature(self, state: Any) -> str:
        inner = "mean" if self.inner is None else self.inner.signature(state)
        return f"shards ({self.strategy}) of {inner}"

    def cannot_carry(self, dtype: torch.dtype) -> str | None:
        return None if self.inner is None else self.inner.cannot_carry(dtype)

    def _inner(self, comm: Comm) -> CommHook:
        if self.inner is not None:
            return self.inner
        return WeightedMean() if comm.weight is not None else Mean()

    def _scatters(self, layout: Bucket) -> bool:
        if self.strategy == "auto":
            return self.inner is None and layout.device.type == "cuda"
        return self.strategy == "reduce_scatter"

    def scale_in(self, comm: Comm, layout: Bucket) -> float | None:
        if self._scatters(layout):
            return 1.0 / comm.world_size if comm.weight is None and power_of_two(comm.world_size) else None
        return self._inner(comm).scale_in(comm, layout)

    def begin(self, state: Any, comm: Comm) -> Any:
        if torch.compiler.is_compiling():
            raise NotImplementedError("fddp.zero.ReduceScatter cannot be traced by torch.compile; synchronise eagerly")
        inner = self._inner(comm)
        return _Shards(inner, inner.begin(state, comm), comm)

    def launch(self, ws: Any, bucket: GradBucket) -> tuple[Any, Any]:
        if not self._scatters(bucket.layout):
            pending, ws.inner_state = ws.inner.launch(ws.inner_state, bucket)
            return pending, ws
        flat, comm = bucket.buffer, bucket.comm
        c = ws.cuts[bucket.index]
        padded = new_buffer(comm.world_size * c.size, flat.dtype, flat.device)
        body = padded[: c.numel]
        if ws.sums is not None:
            if flat.dtype in LOW_PRECISION:  # w_r / W * g_r: cannot overflow
                torch.mul(flat, (comm.weight / ws.sums.total(flat.device).clamp_min(_TINY)).to(flat.dtype), out=body)
            else:
                torch.mul(flat, comm.weight.to(flat.dtype), out=body)
            zero_if_weightless(body, comm.weight)
        else:
            body.copy_(flat)
            if not power_of_two(comm.world_size) and flat.dtype in LOW_PRECISION:
                body.div_(comm.world_size)
        padded[c.numel :].zero_()
        ws.scattered = True
        return (padded, comm.reduce_scatter(ws.out[bucket.index], padded)), ws

    def finish(self, ws: Any, bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        comm, out = bucket.comm, ws.out[bucket.index]
        c = ws.cuts[bucket.index]
        if not self._scatters(bucket.layout):
            result, ws.inner_state = ws.inner.finish(ws.inner_state, bucket, pending)
            if not isinstance(result, torch.Tensor):
                return result, ws  # another round trip of the inner hook
            out[: c.held].copy_(result[c.lo : c.hi])
            return out, ws
        _, work = pending
        comm.wait(work, nth("reduce-scatter", bucket))
        out[c.held :].zero_()  # the padding's sum is zero already; keep it exactly so
        if ws.sums is not None:
            if out.dtype not in LOW_PRECISION:
                out.div_(weight_divisor(ws.sums.total(out.device), out.dtype))
        elif not power_of_two(comm.world_size) and out.dtype not in LOW_PRECISION:
            out.div_(comm.world_size)
        return out, ws

    def result_numel(self, comm: Comm, index: int) -> int:
        return _layout_of(comm).cuts[index].size

    def finite(self, results: list[torch.Tensor], comm: Comm) -> torch.Tensor:
        finite = all_finite(results)
        if comm.world_size > 1:
            # Each rank holds its own shards: one small all-reduce makes the verdict everyone's.
            bad = (~finite).to(device=_dist.data_device(comm.group, like=finite.device), dtype=torch.int32).reshape(1)
            comm.wait(comm.all_reduce(bad, "max"), "the all-reduce of the finite checks")
            finite = (bad[0] == 0).to(finite.device)
        return finite

    def tree(self, spec: optree.PyTreeSpec, comm: Comm, results: list[torch.Tensor], made: list[Any] | None) -> Any:
        return Sharded(results, _layout_of(comm, spec))

    def end(self, ws: Any) -> Any:
        if ws.sums is not None and (ws.scattered or not ws.out) and ws.comm.weight_sum is None:
            ws.sums.total(ws.comm.device)  # SyncInfo.weight, even for a tree with no buckets
        return ws.inner.end(ws.inner_state)
