"""The reducer: copy values into a plan's buckets, hand each full bucket to the comm hook, collect.

It only moves buckets; what a bucket becomes (a mean, a weighted mean, a compressed mean) is the
hook's business. Two ways in: :meth:`Reducer.push` takes every leaf at once (``ddp_step``), and
:meth:`Reducer.arrive` takes one leaf at a time, as backward produces it (``fddp.grad``'s hooks),
launching each bucket as soon as it is full. Either way buckets are launched in plan order on every
rank, so ranks whose backward passes visit leaves in different orders still issue the same sequence
of collectives.
"""

from __future__ import annotations

import functools
import time
from typing import Any, NamedTuple, Sequence

import torch

from fddp import _layout
from fddp._layout import BucketPlan
from fddp.sync._comm import Comm
from fddp.sync.hooks import CommHook, GradBucket

__all__ = ["Reducer", "SyncInfo"]


class Timeline(NamedTuple):
    """When one synchronisation's work happened, in seconds since the reducer started.

    ``fddp.grad_and_value`` starts its reducer before ``fn`` runs, so ``backward`` is the length of
    the forward pass, and ``ready`` says when backward produced each leaf's gradient; for
    ``ddp_step`` every leaf is ready at once. This is what the scaling model
    (:func:`fddp.scaling.predict_step`) and :func:`fddp.scaling.choose_bucket_cap` read.

    Attributes:
        backward: when backward started (``fddp.grad_and_value``), or when the values were handed over.
        ready: per leaf (tree-flatten order), when its value reached its bucket.
        launched: per bucket, when its collectives started.
        done: per bucket, when its reduced buffer came back.
        nbytes: per bucket, its size in bytes.
        end: when the synchronisation finished.
    """

    backward: float
    ready: tuple[float, ...]
    launched: tuple[float, ...]
    done: tuple[float, ...]
    nbytes: tuple[int, ...]
    end: float


class SyncInfo(NamedTuple):
    """What one synchronisation did, returned with ``return_info=True``.

    Attributes:
        finite: with ``check_finite=True``, a bool tensor, True when every reduced gradient is
            finite. The reduced buffers are bitwise identical on all ranks, so every rank reaches
            the same verdict without another collective (a sharding hook's ranks each hold their
            own shards, and one small all-reduce shares the verdict). ``None`` otherwise.
        weight: with ``weight=``, the sum of the weights over the ranks (a float64 tensor).
        bytes_sent: bytes this rank handed to collectives (the payload, before the backend's own
            ring or tree traffic).
        collectives: the number of collectives issued.
        compression_state: with a stateful comm hook (:class:`fddp.PowerSGD`), its state after
            this step, to pass as ``compression_state=`` next time; ``None`` otherwise.
        timeline: when each leaf arrived and each bucket went out and came back
            (:class:`fddp.sync.Timeline`); ``None`` where nothing was timed (torch.compile).

    Example:
        >>> grads, info = fddp.ddp_step(params, grads, check_finite=True, return_info=True)
        >>> skip = not info.finite  # the same verdict on every rank
    """

    finite: torch.Tensor | None
    weight: torch.Tensor | None
    bytes_sent: int
    collectives: int
    compression_state: Any = None
    timeline: Timeline | None = None


class Reducer:
    """Move one tree's values through a bucket plan and a comm hook.

    Args:
        plan: the bucket plan the values follow.
        hook: the comm hook that reduces each bucket.
        state: the hook's state (``None`` for a stateless hook).
        comm: the synchronisation's process group, plan and weight.
        check_finite: compute :attr:`SyncInfo.finite` from the reduced buffers.
    """

    def __init__(self, plan: BucketPlan, hook: CommHook, state: Any, comm: Comm, check_finite: bool = False) -> None:
        self.plan, self.hook, self.comm, self.check_finite = plan, hook, comm, check_finite
        # Dynamo cannot trace the clock: a compiled step reads zeros and reports no timeline.
        self.clock = _zero if torch.compiler.is_compiling() else time.perf_counter
        self.t0 = self.clock()
        self.t_backward = 0.0
        self.ready = [0.0] * plan.num_leaves
        self.launched = [0.0] * len(plan.buckets)
        self.done = [0.0] * len(plan.buckets)
        # Scaling factors the hook wants applied while values are copied in (1/n for a mean over a
        # power-of-two group): one pass fewer than scaling the bucket afterwards.
        self.scales = [_no_unit(hook.scale_in(comm, b)) for b in plan.buckets]
        # The dtype each bucket is filled in, where the hook casts first (Cast): the copy casts.
        self.fill = [_no_same(hook.fill_dtype(comm, b), b.dtype) for b in plan.buckets]
        self.working = hook.begin(state, comm)
        self.buckets: list[GradBucket | None] = [None] * len(plan.buckets)
        self.pending: list[Any] = [None] * len(plan.buckets)
        # fddp.grad's path: buffers made on first use, leaves still missing, the next to launch.
        self.flats: list[torch.Tensor | None] = [None] * len(plan.buckets)
        self.views: list[Sequence[torch.Tensor] | None] = [None] * len(plan.buckets)
        self.missing = [set(b.indices) for b in plan.buckets]
        self.where = _slots(plan)  # leaf -> (bucket, position): looked up once, not per leaf
        self.next = 0

    def launch(self, i: int, flat: torch.Tensor) -> None:
        """Hand bucket ``i`` (``flat``, already scaled by ``scales[i]``) to the hook."""
        bucket = GradBucket(i, flat, self.plan.buckets[i], self.comm)
        self.launched[i] = self.clock() - self.t0
        self.pending[i], self.working = self.hook.launch(self.working, bucket)
        self.buckets[i] = bucket

    def mark_backward(self) -> None:
        """Note that backward starts now (for :class:`Timeline`)."""
        self.t_backward = self.clock() - self.t0

    def push(self, leaves: Sequence[torch.Tensor | None]) -> None:
        """Copy every leaf (``None``: zeros) into its bucket and launch all buckets in order."""
        self.t_backward = now = self.clock() - self.t0
        self.ready = [now] * self.plan.num_leaves
        for i, flat in enumerate(_layout.flatten(self.plan, leaves, dtypes=self.fill)):
            if self.scales[i] is not None:
                flat.mul_(self.scales[i])
            self.launch(i, flat)

    def arrive(self, leaf: int, g: torch.Tensor) -> None:
        """Copy one leaf's value into its bucket; launch every bucket that is now complete, in order."""
        # Called once per leaf per step from a backward hook: kept to a few attribute lookups.
        b, k = self.where[leaf]
        views = self.views[b]
        if views is None:
            views = self._leaf_views(b)
        scale = self.scales[b]
        if scale is None:
            views[k].copy_(g)
        else:
            torch.mul(g, scale, out=views[k])  # the copy, scaled on the way
        self.ready[leaf] = self.clock() - self.t0
        missing = self.missing[b]
        missing.discard(leaf)
        if not missing and b == self.next:
            self._launch_ready()

    def flush(self) -> None:
        """Complete with zeros the leaves that never arrived (unused this step), then launch."""
        for b in range(self.next, len(self.flats)):
            for leaf in self.missing[b]:
                self._leaf_views(b)[self.where[leaf][1]].zero_()
            self.missing[b].clear()
        self._launch_ready()

    def _leaf_views(self, b: int) -> Sequence[torch.Tensor]:
        views = self.views[b]
        if views is None:
            self.flats[b] = flat = _layout.new_flat(self.plan.buckets[b], self.fill[b])
            self.views[b] = views = _layout.views(flat, self.plan.buckets[b])
        return views

    def _launch_ready(self) -> None:
        while self.next < len(self.flats) and not self.missing[self.next]:
            self.launch(self.next, self.flats[self.next])
            # The hook holds the buffer now; its leaf views stay, for made_views.
            self.flats[self.next] = None
            self.next += 1

    def made_views(self, flats: Sequence[torch.Tensor]) -> list[Sequence[torch.Tensor] | None]:
        """Per reduced buffer, the leaf views :meth:`arrive` made of it, where the hook reduced in
        place (the buffer came back as it went out): the caller's views need not be made again."""
        return [v if b is not None and b.buffer is f else None for v, b, f in zip(self.views, self.buckets, flats)]

    def finish(self) -> tuple[list[torch.Tensor], SyncInfo]:
        """Wait for every bucket, in rounds (a hook may need several round trips); return the
        reduced buffers and what the synchronisation did."""
        for i, bucket in enumerate(self.buckets):
            if bucket is None:
                raise RuntimeError(f"fddp.{self.comm.what}: bucket {i} of {len(self.buckets)} was never launched")
        out: list[Any] = [None] * len(self.buckets)
        todo = list(range(len(self.buckets)))
        while todo:
            again = []
            for i in todo:
                result, self.working = self.hook.finish(self.working, self.buckets[i], self.pending[i])
                if isinstance(result, torch.Tensor):
                    numel = self.comm.cut(i).size if self.hook.shards else self.plan.buckets[i].numel
                    out[i] = _checked(result, self.plan.buckets[i], numel, self.hook, i)
                    self.done[i] = self.clock() - self.t0
                else:
                    self.pending[i] = result
                    again.append(i)
            todo = again
        new_state = self.hook.end(self.working)
        finite = _all_finite(out) if self.check_finite else None
        comm = self.comm
        if finite is not None and self.hook.shards and comm.world_size > 1:
            # Each rank holds its own shards: one small all-reduce makes the verdict everyone's.
            bad = (~finite).to(device=comm.device, dtype=torch.int32).reshape(1)
            comm.wait(comm.all_reduce(bad, "max"), "the all-reduce of the finite checks")
            finite = (bad[0] == 0).to(finite.device)
        timeline = None if torch.compiler.is_compiling() else Timeline(
            self.t_backward, tuple(self.ready), tuple(self.launched), tuple(self.done),
            tuple(b.nbytes for b in self.plan.buckets), self.clock() - self.t0,
        )  # fmt: skip
        return out, SyncInfo(finite, comm.weight_sum, comm.bytes_sent, comm.collectives, new_state, timeline)


def _zero() -> float:
    return 0.0


def _no_unit(scale: float | None) -> float | None:
    return None if scale == 1.0 else scale


def _no_same(dtype: torch.dtype | None, own: torch.dtype) -> torch.dtype | None:
    return None if dtype == own else dtype


def _checked(result: torch.Tensor, bucket: _layout.Bucket, numel: int, hook: CommHook, i: int) -> torch.Tensor:
    if result.dtype != bucket.dtype or result.numel() != numel or result.dim() != 1:
        what = "this rank's shard of " if hook.shards else ""
        raise ValueError(
            f"comm hook {hook!r} returned a tensor of shape {tuple(result.shape)} and dtype {result.dtype} "
            f"for {what}bucket {i}; expected a 1-D tensor of {numel} elements of dtype {bucket.dtype}"
        )
    return result


@functools.lru_cache(maxsize=64)
def _slots(plan: BucketPlan) -> dict[int, tuple[int, int]]:
    """Map each leaf to (bucket, position in the bucket)."""
    return {leaf: (b, k) for b, bucket in enumerate(plan.buckets) for k, leaf in enumerate(bucket.indices)}


def _all_finite(flats: list[torch.Tensor]) -> torch.Tensor:
    """Return a bool tensor: True when no buffer holds a NaN or an Inf.

    Each buffer's min and max come from one pass without a temporary (``aminmax`` propagates NaN,
    and an Inf is the min or the max); ``isfinite(f).all()`` writes a bool per element first and
    is ~15x slower on a 25 MB bucket on the CPU.
    """
    ends = [torch.stack(torch.aminmax(torch.view_as_real(f) if f.is_complex() else f)) for f in flats if f.numel()]
    if not ends:
        return torch.tensor(True)
    return torch.isfinite(torch.cat([e.to(ends[0].device) for e in ends])).all()
