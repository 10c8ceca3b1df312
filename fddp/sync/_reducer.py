"""The reducer: copy values into a plan's buckets, hand each full bucket to the comm hook, collect.

It only moves buckets; what a bucket becomes (a mean, a weighted mean, a compressed mean) is the
hook's business. Two ways in: :meth:`Reducer.push` takes every leaf at once (``ddp_step``), and
:meth:`Reducer.arrive` takes one leaf at a time, as backward produces it (``fddp.grad``'s hooks),
launching each bucket as soon as it is full. Either way buckets are launched in plan order on every
rank, so ranks whose backward passes visit leaves in different orders still issue the same sequence
of collectives.
"""

from __future__ import annotations

import itertools
import operator
import time
from typing import Any, NamedTuple, Sequence

import torch

from fddp import _caches, _layout
from fddp._layout import Bucket, BucketPlan
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
        weight: with ``weight=``, the sum of the weights over the ranks: a float64 scalar tensor on
            the device of the collective that carried it (a GPU's, on NCCL: reading it on the host,
            ``float(info.weight)``, waits for the GPU). ``None`` otherwise.
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


class _Slot:
    """One bucket's way through a synchronisation: its buffer, leaf views, what is missing, its collectives."""

    __slots__ = ("layout", "scale", "fill", "flat", "views", "missing", "held", "bucket", "pending", "launched", "done")

    def __init__(self, layout: Bucket, scale: float | None, fill: torch.dtype | None) -> None:
        self.layout, self.scale, self.fill = layout, scale, fill
        self.flat: torch.Tensor | None = None  # the buffer, until it is handed to the hook
        self.views: Sequence[torch.Tensor] | None = None  # its leaf views, made on first use
        self.missing = set(layout.index_set)  # fddp.grad's path: leaves still to arrive
        self.held: list[tuple[int, torch.Tensor]] = []  # small leaves' values, copied in at launch
        self.bucket: GradBucket | None = None  # as handed to the hook
        self.pending: Any = None
        self.launched = self.done = 0.0

    def open(self) -> Sequence[torch.Tensor]:
        """Make the buffer (in the fill dtype) and its leaf views."""
        self.flat = flat = _layout.new_flat(self.layout, self.fill)
        self.views = views = _layout.views(flat, self.layout)
        return views

    def concatenate(self, values: list[torch.Tensor]) -> bool:
        """Make the buffer from every leaf's value in one copy, where every leaf is 1-D (the
        concatenation is the bucket, ~3x cheaper a leaf than copies into views); return whether
        it did. Its leaf views are made after the launch (:meth:`Reducer.view_launched`), while
        the collective is under way, instead of before it."""
        if not _flat_leaves(self.layout):
            return False
        self.flat = flat = _layout.new_flat(self.layout, self.fill)
        torch.cat(values, out=flat)
        return True


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
        # Per bucket: a factor the hook wants applied while values are copied in (1/n for a mean
        # over a power-of-two group: one pass fewer than scaling the bucket afterwards), and the
        # dtype it is filled in where the hook casts first (Cast: the copy casts).
        self.slots = [
            _Slot(b, _no_unit(hook.scale_in(comm, b)), _no_same(hook.fill_dtype(comm, b), b.dtype)) for b in plan.buckets
        ]
        self.working = hook.begin(state, comm)
        self.where = _where(plan)  # leaf -> (bucket, position): looked up once, not per leaf
        self.next = 0
        # An agreement still under way (fddp._setup.PendingAgreement): no bucket goes out before
        # it is finished, since the agreement is what makes the ranks' buckets match.
        self.gate: Any = None

    def launch(self, i: int, flat: torch.Tensor) -> None:
        """Hand bucket ``i`` (``flat``, already scaled) to the hook."""
        s = self.slots[i]
        s.bucket = bucket = GradBucket(i, flat, s.layout, self.comm)
        s.launched = self.clock() - self.t0
        s.pending, self.working = self.hook.launch(self.working, bucket)
        s.flat = None  # the hook holds the buffer now; its leaf views stay, for made_views

    def mark_backward(self) -> None:
        """Note that backward starts now (for :class:`Timeline`)."""
        self.t_backward = self.clock() - self.t0

    def push(self, leaves: Sequence[torch.Tensor | None]) -> None:
        """Copy every leaf (``None``: zeros) into its bucket and launch all buckets in order."""
        self.t_backward = now = self.clock() - self.t0
        self.ready = [now] * self.plan.num_leaves
        if torch.compiler.is_compiling():
            # Dynamo traces a concatenation into the bucket more simply than foreach copies.
            for i, flat in enumerate(_layout.flatten(self.plan, leaves, dtypes=[s.fill for s in self.slots])):
                if self.slots[i].scale is not None:
                    flat.mul_(self.slots[i].scale)
                self.launch(i, flat)
            self.next = len(self.slots)
            return
        for i, s in enumerate(self.slots):
            values = [leaves[k] for k in s.layout.indices]
            if any(map(operator.is_, values, itertools.repeat(None))):
                for view, v in zip(s.open(), values):
                    view.zero_() if v is None else view.copy_(v)
            elif not s.concatenate(values):
                torch._foreach_copy_(s.open(), values)
            if s.scale is not None:
                s.flat.mul_(s.scale)
            self.launch(i, s.flat)
        self.next = len(self.slots)
        self.view_launched()

    def view_launched(self) -> None:
        """Make the leaf views of launched buckets that have none yet (their collectives run
        meanwhile): :meth:`made_views` hands them out."""
        for s in self.slots[: self.next]:
            if s.views is None and s.bucket is not None:
                s.views = _layout.views(s.bucket.buffer, s.layout)

    def arrive(self, leaf: int, g: torch.Tensor) -> None:
        """Take one leaf's value for its bucket; launch every bucket that is now complete, in order.

        A large value is copied into the bucket at once, while it is still in cache; a small one
        is kept and copied with the rest of its bucket's small ones in one call at launch, where
        the copy costs less than calling it.
        """
        # Called once per leaf per step from a backward hook: kept to a few attribute lookups.
        b, k, small = self.where[leaf]
        s = self.slots[b]
        if small:
            s.held.append((k, g))
        else:
            views = s.views
            if views is None:
                views = s.open()
            if s.scale is None:
                views[k].copy_(g)
            else:
                torch.mul(g, s.scale, out=views[k])  # the copy, scaled on the way
        self.ready[leaf] = self.clock() - self.t0
        missing = s.missing
        missing.discard(leaf)
        if not missing and b == self.next:
            self._launch_ready()

    def unarrived(self) -> list[int]:
        """The leaves whose values have not arrived yet (in buckets not yet launched)."""
        return [leaf for s in self.slots[self.next :] for leaf in s.missing]

    def flush(self) -> None:
        """Complete with zeros the leaves that never arrived (unused this step), then launch
        (finishing the agreement first if it is still under way: it may raise)."""
        for s in self.slots[self.next :]:
            if s.missing:
                views = s.views if s.views is not None else s.open()
                for leaf in s.missing:
                    views[self.where[leaf][1]].zero_()
                s.missing.clear()
        self._launch_ready()

    def _launch_ready(self) -> None:
        gate = self.gate
        if gate is not None:
            # The first bucket is ready (or backward is over): the header has flown while backward
            # made it (waiting here, not for its return before backward, hides its round trip).
            self.gate = None
            gate.finish()
        slots = self.slots
        while self.next < len(slots) and not slots[self.next].missing:
            s = slots[self.next]
            held = s.held
            if held and len(held) == len(s.layout.indices):  # every leaf of the bucket was small: one copy
                values: list[Any] = [None] * len(held)
                for k, g in held:
                    values[k] = g
                if s.views is not None:
                    _fill(s, s.views, values)
                elif not s.concatenate(values):  # no views yet: made after the launch (view_launched)
                    torch._foreach_copy_(s.open(), values)
                if s.scale is not None:
                    s.flat.mul_(s.scale)
                s.held = []
            else:
                views = s.views if s.views is not None else s.open()
                if held:
                    targets = [views[k] for k, _ in held]
                    torch._foreach_copy_(targets, [g for _, g in held])
                    if s.scale is not None:
                        torch._foreach_mul_(targets, s.scale)
                    s.held = []
            self.launch(self.next, s.flat)
            self.next += 1
        self.view_launched()

    def made_views(self, flats: Sequence[torch.Tensor]) -> list[Sequence[torch.Tensor] | None]:
        """Per reduced buffer, the leaf views made of it on the way in, where the hook reduced in
        place (the buffer came back as it went out): the caller's views need not be made again."""
        return [s.views if s.bucket is not None and s.bucket.buffer is f else None for s, f in zip(self.slots, flats)]

    def finish(self) -> tuple[list[torch.Tensor], SyncInfo]:
        """Wait for every bucket, in rounds (a hook may need several round trips); return the
        reduced buffers and what the synchronisation did."""
        slots, hook, comm = self.slots, self.hook, self.comm
        for i, s in enumerate(slots):
            if s.bucket is None:
                raise RuntimeError(f"fddp.{comm.what}: bucket {i} of {len(slots)} was never launched")
        out: list[Any] = [None] * len(slots)
        todo = list(range(len(slots)))
        while todo:
            again = []
            for i in todo:
                s = slots[i]
                result, self.working = hook.finish(self.working, s.bucket, s.pending)
                if isinstance(result, torch.Tensor):
                    out[i] = _checked(result, s.layout, hook.result_numel(comm, i), hook, i)
                    s.done = self.clock() - self.t0
                else:
                    s.pending = result
                    again.append(i)
            todo = again
        new_state = hook.end(self.working)
        comm.poison(out)  # NaN where the call's stamp shows its ranks ran different calls (an NCCL group's batch)
        finite = hook.finite(out, comm) if self.check_finite else None
        timeline = None if torch.compiler.is_compiling() else Timeline(
            self.t_backward, tuple(self.ready), tuple(map(_launched, slots)), tuple(map(_done, slots)),
            _nbytes(self.plan), self.clock() - self.t0,
        )  # fmt: skip
        return out, SyncInfo(finite, comm.weight_sum, comm.bytes_sent, comm.collectives, new_state, timeline)


def _fill(s: _Slot, views: Sequence[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Copy every leaf's value into the bucket (casting to a fill dtype): one call for the bucket."""
    if _flat_leaves(s.layout):
        torch.cat(values, out=s.flat)  # 1-D leaves: the concatenation is the bucket (~3x cheaper a leaf)
    else:
        torch._foreach_copy_(views, values)


@_caches.cached(maxsize=256)
def _flat_leaves(layout: Bucket) -> bool:
    return all(len(shape) == 1 for shape in layout.shapes)


_launched, _done = operator.attrgetter("launched"), operator.attrgetter("done")


@_caches.cached(maxsize=64)
def _nbytes(plan: BucketPlan) -> tuple[int, ...]:
    return tuple(b.nbytes for b in plan.buckets)


def _zero() -> float:
    return 0.0


def _no_unit(scale: float | None) -> float | None:
    return None if scale == 1.0 else scale


def _no_same(dtype: torch.dtype | None, own: torch.dtype) -> torch.dtype | None:
    return None if dtype == own else dtype


def _checked(result: torch.Tensor, bucket: Bucket, numel: int, hook: CommHook, i: int) -> torch.Tensor:
    if result.dtype != bucket.dtype or result.numel() != numel or result.dim() != 1:
        what = "this rank's shard of " if hook.shards else ""
        raise ValueError(
            f"comm hook {hook!r} returned a tensor of shape {tuple(result.shape)} and dtype {result.dtype} "
            f"for {what}bucket {i}; expected a 1-D tensor of {numel} elements of dtype {bucket.dtype} "
            "(its result_numel)"
        )
    return result


_SMALL = 1 << 14  # elements: a leaf this small is copied into its bucket at launch, with the others


@_caches.cached(maxsize=64)
def _where(plan: BucketPlan) -> list[tuple[int, int, bool]]:
    """Per leaf: its bucket, its position there, and whether it is small."""
    where: list = [None] * plan.num_leaves
    for b, bucket in enumerate(plan.buckets):
        for k, (leaf, n) in enumerate(zip(bucket.indices, bucket.numels)):
            where[leaf] = (b, k, n <= _SMALL)
    return where
