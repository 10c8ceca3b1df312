"""A model of a data-parallel step: when gradients become ready, how long buckets take on the wire.

A step's time is the backward pass and the bucketed all-reduces, overlapped: bucket ``b`` can start
once its last gradient exists (:class:`fddp.sync.Timeline`, recorded by fddp itself) and once bucket
``b - 1`` is off the wire, and takes the link's all-reduce time for its bytes (:class:`Link`, an
alpha-beta model of a ring or tree all-reduce). The step ends when both the backward pass and the
last bucket are done, plus whatever follows (the optimizer). That is enough to predict how a step
scales to more ranks and faster or slower links, and to choose the bucket size:

    link = fddp.scaling.measure_link()                              # every rank calls it
    timeline = fddp.scaling.measure_timeline(loss_fn, params, x, y)  # gradients ready when?
    choice = fddp.scaling.choose_bucket_cap(params, timeline, link, world=fddp.world_size())
    print(choice.explain())
    step = fddp.grad_and_value(loss_fn, bucket_cap_mb=choice.bucket_cap_mb, first_bucket_mb=choice.first_bucket_mb)

or all three at once, ``choice = fddp.scaling.auto_bucket_cap(loss_fn, params, x, y)``. With
``compression=`` the timeline includes the comm hook's own work (casts, PowerSGD's products) and
the wire carries what the hook sends (:func:`wire_rounds`). The control plane is counted too: every
fddp call's head (a 4 KiB all-reduce the host waits for), the step's own and ``calls=`` more
(:func:`predict_step`; ``Prediction.collectives``, ``host_waits``, ``control``).

The model leaves out what a shared CPU adds (the all-reduce's own compute competing with the
backward pass) and what a real fabric adds (congestion, stragglers); the docs' Scaling page shows
how close it comes on the test bed.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from fddp import _caches, _dist
from fddp._dist import _header
from fddp._layout import BUCKET_CAP_MB, FIRST_BUCKET_MB, Bucket
from fddp.sync import Cast, PowerSGD, Timeline, grad_and_value, plan_of
from fddp.sync._setup import as_hook
from fddp.sync.hooks import CommHook, Mean

__all__ = [
    "Link",
    "Prediction",
    "BucketChoice",
    "predict_step",
    "choose_bucket_cap",
    "auto_bucket_cap",
    "wire_rounds",
    "measure_link",
    "fit_alpha_beta",
    "measure_timeline",
    "measure_bucket_cost",
    "verify_bucket_cap",
]

CANDIDATE_CAPS_MB = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 64.0)
_MARGIN = 0.005  # predictions closer than this are a tie, which the larger cap wins


@dataclasses.dataclass(frozen=True)
class Link:
    """An alpha-beta model of one all-reduce: ``latency`` per message step, ``bandwidth`` per rank.

    Ring (gloo's and NCCL's default for large messages): ``2 (n - 1)`` steps, each sending
    ``b / n`` bytes, so ``2 (n - 1) latency + 2 (n - 1) / n * b / bandwidth``. Tree: ``2 log2(n)``
    steps that each forward the whole message, pipelined: ``2 log2(n) latency + 2 b / bandwidth``.

    Attributes:
        latency: seconds per message step (alpha).
        bandwidth: bytes per second a rank sends and receives at once (1 / beta).
        algorithm: ``"ring"`` or ``"tree"``.

    Example:
        >>> link = Link.gbit(10, latency_us=25)
        >>> round(link.all_reduce_time(25 * 2**20, world=8) * 1e3, 1)  # ms for a 25 MiB bucket
        37.1
    """

    latency: float
    bandwidth: float
    algorithm: str = "ring"

    def __post_init__(self) -> None:
        if not (self.latency >= 0 and self.bandwidth > 0):
            raise ValueError(f"Link: latency must be >= 0 and bandwidth > 0, got {self.latency!r} and {self.bandwidth!r}")
        if self.algorithm not in ("ring", "tree"):
            raise ValueError(f"Link: algorithm must be 'ring' or 'tree', got {self.algorithm!r}")

    @staticmethod
    def gbit(rate: float, latency_us: float = 25.0, algorithm: str = "ring") -> "Link":
        """A link of ``rate`` Gbit/s per rank with ``latency_us`` microseconds per message step.

        Example:
            >>> Link.gbit(1).bandwidth
            125000000.0
        """
        return Link(latency_us * 1e-6, rate * 1e9 / 8, algorithm)

    def all_reduce_time(self, nbytes: float, world: int) -> float:
        """Seconds one all-reduce of ``nbytes`` takes over ``world`` ranks (0 for one rank).

        Example:
            >>> Link.gbit(1).all_reduce_time(8 * 2**20, world=2) > 0.06
            True
        """
        if world <= 1:
            return 0.0
        if self.algorithm == "ring":
            steps = 2 * (world - 1)
            return steps * self.latency + steps / world * nbytes / self.bandwidth
        depth = math.ceil(math.log2(world))
        return 2 * depth * self.latency + 2 * nbytes / self.bandwidth


class Prediction(NamedTuple):
    """A predicted step.

    Attributes:
        step: seconds per step.
        compute: the same step without communication (one rank).
        exposed: communication not hidden behind the backward pass (``step - compute``).
        efficiency: ``compute / step``, the scaling efficiency (1 is linear scaling).
        buckets: per bucket, ``(start, end)`` of its all-reduce, in seconds from the step's start.
        collectives: collectives per step: every call's head, and the buckets' rounds (none where
            the step's only bucket rides in its head).
        host_waits: heads per step the host waits for before it goes on (one per call; with
            ``control_link``, NCCL's, none: one head a step, read at the next step).
        head: seconds one head takes on the control link.
        control: seconds the heads add to the step (the step less the same step without heads).
    """

    step: float
    compute: float
    exposed: float
    efficiency: float
    buckets: tuple[tuple[float, float], ...]
    collectives: int = 0
    host_waits: int = 0
    head: float = 0.0
    control: float = 0.0


def wire_rounds(compression: Any, bucket: Bucket) -> tuple[int, ...]:
    """Bytes one bucket puts on the wire per round trip, for a ``compression=`` value.

    A mean (``None``) sends the bucket in one all-reduce; a cast (``"bf16"``, ``"fp16"``,
    :class:`fddp.Cast`) sends it at two bytes per element; :class:`fddp.PowerSGD` (compressing)
    sends its uncompressed leaves and every compressed leaf's ``P`` (``n r`` elements) in a first
    round, and ``Q`` (``m r``) in a second. Other hooks are taken to send the bucket once.

    Example:
        >>> plan = fddp.sync.plan_of({"w": torch.zeros(512, 512)})
        >>> wire_rounds(fddp.PowerSGD(rank=1), plan.buckets[0])
        (2048, 2048)
    """
    hook = as_hook(compression, False, "scaling")
    if isinstance(hook, Cast):
        return (bucket.numel * torch.empty((), dtype=hook.dtype).element_size(),)
    if isinstance(hook, PowerSGD):
        item = bucket.nbytes // max(bucket.numel, 1)
        first = second = 0
        for shape, numel in zip(bucket.shapes, bucket.numels):
            nmr = hook.compressed_shape(shape)
            if nmr is None:
                first += numel * item
            else:
                n, m, r = nmr
                first, second = first + n * r * item, second + m * r * item
        return (first, second) if second else (first,)
    return (bucket.nbytes,)


def predict_step(
    params: Any,
    timeline: Timeline,
    link: Link,
    world: int,
    *,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    first_bucket_mb: float = FIRST_BUCKET_MB,
    after: float = 0.0,
    bytes_scale: float = 1.0,
    compression: Any = None,
    per_bucket: float = 0.0,
    calls: int = 0,
    control_link: Link | None = None,
    per_call: float = 0.0,
) -> Prediction:
    """Predict one overlapped step (``fddp.grad_and_value``) of ``params`` on ``world`` ranks.

    Bucket ``b``'s first round goes on the wire once its last gradient is in, its predecessor has
    launched, and the wire is free (one collective at a time, in plan order, as fddp launches
    them); a second round (PowerSGD's ``Q``) follows after the backward pass, as the reducer
    issues it. The step ends when the backward pass and every round are done, plus the work the
    timeline shows after the backward pass (``timeline.end - last gradient``: waiting, casting
    back, decompressing) and ``after``.

    The control plane is counted too: every fddp call that communicates sends one head (a
    ``HEAD_BYTES`` (4 KiB) all-reduce on ``control_link``) and the host waits for it. The step's own
    call sends its head when the backward pass starts, and its first bucket cannot launch before
    the head is back (the backward pass stalls for whatever of the round trip it did not hide);
    with ``control_link`` (NCCL, where known calls are checked in a batch) no call sends a head:
    the step boundary sends one, read at the next boundary, which costs the step nothing unless
    its round trip outlasts the step;
    where the call's only bucket is a plain mean of at most 470 float32/float64 values on the CPU,
    and the head travels on the data's own link, the bucket rides in the head instead. Each of
    ``calls`` further calls (a global batch norm's ``fddp.pmean`` per layer, a metric's
    ``fddp.psum``) is one head, carrying its tiny values, waited for before the step goes on: they
    run one after another, before the backward pass.

    Args:
        params: the parameter tree (its leaves' sizes and definition order make the buckets).
        timeline: when each gradient became ready, from a step without communication
            (:func:`measure_timeline`, with the same ``compression``); times are seconds from
            the start of the step.
        link: the all-reduce model.
        world: the number of ranks.
        bucket_cap_mb: the buckets' cap, in MiB.
        first_bucket_mb: the first bucket's cap, in MiB.
        after: seconds of work after the synchronisation (the optimizer step).
        bytes_scale: multiplies the bytes on the wire (to project another dtype, say).
        compression: what ``grad_and_value``'s ``compression=`` is (:func:`wire_rounds`).
        per_bucket: seconds of the computing thread each bucket costs (launching and collecting
            it; :func:`measure_bucket_cost`): bucket ``k``'s gradients are ready ``k`` such costs
            later, and the backward pass ends ``len(buckets)`` later.
        calls: fddp calls per step besides the step's own (0: the step's one call), each a head
            whose values ride in it (at most 470 float32/float64 values on the CPU; a larger
            call also sends its buckets, which this does not count).
        control_link: the link the heads travel (``None``: ``link``). Under NCCL the head goes
            on a gloo side group over TCP, so pass that link's model; no data rides in it there,
            and the calls send none: each of ``calls`` is its values' all-reduce on ``link``
            (counted at ``link``'s latency), and the step boundary sends the step's one head.
        per_call: seconds of the host each head costs beyond its time on the wire (building,
            sending and reading it).

    Returns:
        The :class:`Prediction`; its ``compute`` is the step without communication, one bucket
        and no per-bucket cost, so that ``efficiency`` counts that cost as a loss. Its
        ``collectives``, ``host_waits``, ``head`` and ``control`` count the control plane.

    Example:
        >>> p = predict_step(params, timeline, Link.gbit(10), world=64, calls=8)
        >>> p.efficiency, p.collectives, p.control
    """
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
        raise ValueError(f"predict_step: calls must be an int >= 0 (fddp calls per step besides the step's own), got {calls!r}")
    if not per_call >= 0:
        raise ValueError(f"predict_step: per_call must be seconds >= 0, got {per_call!r}")
    plan = plan_of(params, bucket_cap_mb, first_bucket_mb)
    if len(timeline.ready) != plan.num_leaves:
        raise ValueError(f"predict_step: the timeline has {len(timeline.ready)} leaves, params have {plan.num_leaves}")
    rounds = [wire_rounds(compression, b) for b in plan.buckets]
    bare = _schedule(plan, rounds, timeline, link, world, after, bytes_scale, per_bucket, None)
    if world <= 1:  # a one-rank group sends no head
        return bare
    # The head is 512 float64 slots whatever the data's dtype: bytes_scale leaves it alone.
    head = (control_link if control_link is not None else link).all_reduce_time(HEAD_BYTES, world)
    carried = control_link is None and _carries(plan, compression)
    # A call's few values ride in its head on the data's own link; on a side link (NCCL's gloo
    # group) they follow it as one more all-reduce on link, as long as its latency.
    values = 0.0 if control_link is None else link.all_reduce_time(0, world)
    heads = _Heads(head, calls, per_call, carried, values, batched=control_link is not None)
    full = _schedule(plan, rounds, timeline, link, world, after, bytes_scale, per_bucket, heads)
    # Under NCCL (a side link) the known calls send no head: their values only, and one head a
    # step (the boundary's), read at the next boundary.
    collectives = calls + (1 if carried else 1 + sum(len(r) for r in rounds))
    host_waits = 0 if heads.batched else calls + 1
    return full._replace(collectives=collectives, host_waits=host_waits, head=head, control=full.step - bare.step)


HEAD_BYTES = _header.HEAD * 8  # every fddp call's head: 512 float64 slots, 4 KiB


class _Heads(NamedTuple):
    seconds: float  # one head's round trip on the control link
    calls: int  # heads before the backward pass, one after another
    per_call: float  # the host's own seconds per head
    carried: bool  # the step's only bucket rides in its head
    values: float  # each other call's values, where they cannot ride in its head
    batched: bool = False  # NCCL: the calls send no head; one head a step, read at the next step


def _carries(plan: Any, compression: Any) -> bool:
    """Whether the step's data rides in its head (``fddp.sync.Sync._carries``, from the plan alone)."""
    if type(as_hook(compression, False, "scaling")) is not Mean or len(plan.buckets) != 1:
        return False
    b = plan.buckets[0]
    return b.numel <= _header.HEAD - _header.DATA and b.dtype in (torch.float32, torch.float64) and b.device.type == "cpu"


def _schedule(
    plan: Any,
    rounds: list[tuple[int, ...]],
    timeline: Timeline,
    link: Link,
    world: int,
    after: float,
    bytes_scale: float,
    per_bucket: float,
    heads: _Heads | None,
) -> Prediction:
    """The step's schedule (:func:`predict_step`), with the heads or (``None``) without them."""
    backward_end = max(timeline.ready, default=timeline.backward)
    tail = max(0.0, timeline.end - backward_end) if timeline.end else 0.0
    compute = backward_end + tail + after
    ready_at = list(timeline.ready)
    head_back, shift = 0.0, 0.0
    if heads is not None:
        # The other calls' heads come first, one round trip after another; then this call's
        # head leaves as the backward pass starts (its host cost delays the backward pass).
        # Batched (NCCL), the calls send no head: each is its values' all-reduce alone.
        pace = heads.values if heads.batched else heads.seconds + heads.values
        shift = heads.calls * (pace + heads.per_call) + heads.per_call
        ready_at = [t + shift for t in ready_at]
        head_back = timeline.backward + shift + heads.seconds
    prev_ready = wire_free = 0.0
    spans = []
    for k, b in enumerate(plan.buckets):
        # Buckets launch in plan order, each once its last gradient is in and its predecessor has.
        ready = max([prev_ready, *(ready_at[i] + k * per_bucket for i in b.indices)])
        if k == 0 and heads is not None and not (heads.carried or heads.batched) and head_back > ready:
            # The host waits for the head before the first bucket: the backward pass stalls.
            stall = head_back - ready
            ready_at = [t + stall if t > ready else t for t in ready_at]
            shift, ready = shift + stall, head_back
        start = max(ready, wire_free)
        if heads is not None and heads.carried:
            wire_free = start + heads.seconds  # the bucket is the head's DATA
        else:
            wire_free = start + link.all_reduce_time(rounds[k][0] * bytes_scale, world)
        spans.append((start, wire_free))
        prev_ready = ready
    backward_end += shift
    for i, more in enumerate(rounds):  # second rounds: issued once backward is over, in order
        for nbytes in more[1:]:
            wire_free = max(wire_free, backward_end) + link.all_reduce_time(nbytes * bytes_scale, world)
            spans[i] = (spans[i][0], wire_free)
    synced = max(backward_end + len(plan.buckets) * per_bucket, wire_free) + tail
    step = synced + after
    if heads is not None and heads.batched:
        # The step boundary's head, sent as the step ends, is read at the next boundary: it costs
        # the step nothing unless its round trip outlasts the step.
        step = max(step, heads.seconds + heads.per_call)
    return Prediction(step, compute, step - compute, compute / step if step > 0 else 1.0, tuple(spans))


class BucketChoice(NamedTuple):
    """The bucket cap the model predicts fastest, and the prediction for every candidate.

    Attributes:
        bucket_cap_mb: the chosen cap, in MiB (pass it as ``bucket_cap_mb=``).
        first_bucket_mb: the first bucket's cap that goes with it.
        predictions: per candidate cap, its :class:`Prediction`.
    """

    bucket_cap_mb: float
    first_bucket_mb: float
    predictions: dict
    measured: dict | None = None

    def explain(self) -> str:
        """A table of the candidates: predicted step, exposed communication, buckets.

        Example:
            >>> print(choice.explain())
        """
        lines = [f"{'cap MiB':>8} {'step ms':>9} {'exposed ms':>11} {'buckets':>8}"]
        for cap, p in self.predictions.items():
            mark = "  <- chosen" if cap == self.bucket_cap_mb else ""
            lines.append(f"{cap:8g} {p.step * 1e3:9.2f} {p.exposed * 1e3:11.2f} {len(p.buckets):8d}{mark}")
        if self.measured:
            timed = ", ".join(f"{cap:g} MiB {t * 1e3:.2f} ms" for cap, t in self.measured.items())
            lines.append(f"measured gradient steps (median, slowest rank): {timed}; kept {self.bucket_cap_mb:g} MiB")
        return "\n".join(lines)


def choose_bucket_cap(
    params: Any,
    timeline: Timeline,
    link: Link,
    world: int,
    *,
    candidates: Sequence[float] = CANDIDATE_CAPS_MB,
    after: float = 0.0,
    bytes_scale: float = 1.0,
    compression: Any = None,
    per_bucket: float = 0.0,
    calls: int = 0,
    control_link: Link | None = None,
    per_call: float = 0.0,
) -> BucketChoice:
    """Choose the bucket cap that the model predicts fastest for this tree, timeline and link.

    Small buckets start communicating early but pay the link's latency once each; large ones pay
    it rarely but wait for their last gradient. Every candidate is predicted with the first
    bucket capped at ``min(1, cap)`` MiB, as torch DDP does. Each bucket's CPU cost is
    ``per_bucket`` (:func:`measure_bucket_cost`); walking from the largest cap down, a smaller one
    is chosen only if its step is more than 0.5% shorter than the best so far (a tie goes to fewer
    collectives). ``calls``, ``control_link`` and ``per_call`` are :func:`predict_step`'s (the
    control plane: the same for every cap, unless the first bucket waits for its head). Pure:
    every rank that passes the same arguments gets the same answer.

    Example:
        >>> choice = choose_bucket_cap(params, timeline, Link.gbit(1), world=2)
        >>> grads, loss = fddp.grad_and_value(loss_fn, bucket_cap_mb=choice.bucket_cap_mb)(params, x, y)
    """
    if not candidates:
        raise ValueError("choose_bucket_cap: no candidate caps")
    preds = {}
    for cap in sorted(candidates):
        preds[cap] = predict_step(
            params, timeline, link, world, bucket_cap_mb=cap, first_bucket_mb=min(1.0, cap), after=after,
            bytes_scale=bytes_scale, compression=compression, per_bucket=per_bucket, calls=calls, control_link=control_link,
            per_call=per_call,
        )  # fmt: skip
    best = max(preds)
    for cap in sorted(preds, reverse=True):
        if preds[cap].step < preds[best].step * (1 - _MARGIN):
            best = cap
    return BucketChoice(best, min(1.0, best), preds)


@_dist.entry("scaling.auto_bucket_cap")
def auto_bucket_cap(
    fn: Callable[..., torch.Tensor],
    params: Any,
    *args: Any,
    compression: Any = None,
    link: Link | None = None,
    group: dist.ProcessGroup | None = None,
    verify_steps: int = 5,
    **kwargs: Any,
) -> BucketChoice:
    """Measure the link and ``fn``'s backward timeline, and choose the bucket cap (every rank calls it).

    :func:`measure_link` (unless ``link`` is given), :func:`measure_timeline` and
    :func:`measure_bucket_cost` (agreed over the ranks), then :func:`choose_bucket_cap`, then
    :func:`verify_bucket_cap` with ``verify_steps`` (0: trust the model): every rank gets the same
    choice. Call it once, before training, with a representative batch.

    Example:
        >>> choice = fddp.scaling.auto_bucket_cap(loss_fn, params, x, y)
        >>> print(choice.explain())
        >>> step = fddp.grad_and_value(loss_fn, bucket_cap_mb=choice.bucket_cap_mb, first_bucket_mb=choice.first_bucket_mb)
    """
    link = link if link is not None else measure_link(group=group)
    timeline = measure_timeline(fn, params, *args, compression=compression, group=group, **kwargs)
    cost = measure_bucket_cost(fn, params, *args, compression=compression, group=group, **kwargs)
    choice = choose_bucket_cap(params, timeline, link, dist.get_world_size(group), compression=compression, per_bucket=cost)
    if verify_steps <= 0:
        return choice
    return verify_bucket_cap(choice, fn, params, *args, steps=verify_steps, compression=compression, group=group, **kwargs)


@_dist.entry("scaling.verify_bucket_cap")
def verify_bucket_cap(
    choice: BucketChoice,
    fn: Callable[..., torch.Tensor],
    params: Any,
    *args: Any,
    steps: int = 5,
    rounds: int = 3,
    compression: Any = None,
    group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> BucketChoice:
    """Time the model's choice against torch DDP's default (25 MiB, first bucket 1 MiB); keep the faster.

    The model does not count what communication takes from computation on a shared CPU (on the
    10 Gbit/s test bed its choice of 1 MiB buckets made the MLP's step 13% slower than 25 MiB
    buckets). So the two caps are timed on ``group`` itself: ``rounds`` interleaved blocks of
    ``steps`` calls of ``fddp.grad_and_value(fn)`` each (after one warm-up call), the slowest
    rank's time per block, the median per cap. The default is kept unless the choice is faster.
    Every rank gets the same answer. Nothing is timed when the choice is the default.

    Example:
        >>> choice = fddp.scaling.verify_bucket_cap(choice, loss_fn, params, x, y)
        >>> choice.measured  # {cap: seconds per gradient step}
    """
    default = (BUCKET_CAP_MB, FIRST_BUCKET_MB)
    chosen = (choice.bucket_cap_mb, choice.first_bucket_mb)
    _agree_on(group, "verify_bucket_cap", chosen=chosen, steps=steps, rounds=rounds)
    if chosen == default:
        return choice
    runs = [
        (_stepper("verify_bucket_cap", fn, params, args, kwargs, compression, group, cap, first), [])
        for cap, first in (chosen, default)
    ]
    for once, _ in runs:
        once()  # warm up: the first call checks signatures and plans
    for r in range(rounds):
        for once, times in runs if r % 2 == 0 else runs[::-1]:
            _reduce(None, group, "verify_bucket_cap", "the barrier before a timed block")
            t0 = time.perf_counter()
            for _ in range(steps):
                once()
            times.append((time.perf_counter() - t0) / steps)
    times = torch.tensor([t for _, ts in runs for t in ts], dtype=torch.float64)
    _reduce(times, group, "verify_bucket_cap", "the times' all-reduce", dist.ReduceOp.MAX)  # the slowest rank's, everywhere
    fast, slow = statistics.median(times[:rounds].tolist()), statistics.median(times[rounds:].tolist())
    keep = chosen if fast < slow else default
    return choice._replace(bucket_cap_mb=keep[0], first_bucket_mb=keep[1], measured={chosen[0]: fast, default[0]: slow})


@_dist.entry("scaling.measure_link")
def measure_link(
    *, group: dist.ProcessGroup | None = None, sizes: Sequence[int] = (2**12, 2**16, 2**20, 2**22, 2**23), repeats: int = 5
) -> Link:
    """Fit a ring :class:`Link` to timed all-reduces on ``group`` (every rank must call this).

    Each size is all-reduced ``repeats`` times; the fastest time per size (the least disturbed) is
    taken over all ranks (the slowest rank's), and ``t = a + c * bytes`` is fitted by
    :func:`fit_alpha_beta`: the bandwidth from the largest sizes, the latency from the smallest.
    Every rank gets the same link.

    Example:
        >>> link = fddp.scaling.measure_link()
    """
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError("measure_link: a one-rank group has no link to measure")
    if len(sizes) < 2 or any(isinstance(n, bool) or not isinstance(n, int) or n < 4 for n in sizes):
        raise ValueError(f"measure_link: sizes must be at least 2 sizes in bytes (ints >= 4), got {tuple(sizes)!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"measure_link: repeats must be an int >= 1, got {repeats!r}")
    _agree_on(group, "measure_link", sizes=tuple(int(n) for n in sizes), repeats=repeats)
    best = []
    for n in sizes:
        t = torch.zeros(max(1, n // 4), dtype=torch.float32)
        _reduce(t, group, "measure_link", "a warm-up all-reduce")
        times = []
        for _ in range(repeats):
            _reduce(None, group, "measure_link", "the barrier before a timed all-reduce")
            t0 = time.perf_counter()
            dist.all_reduce(t, group=group)  # timed as torch issues it: a plain, blocking all-reduce
            times.append(time.perf_counter() - t0)
        best.append(min(times))
    slowest = torch.tensor(best, dtype=torch.float64)
    _reduce(slowest, group, "measure_link", "the times' all-reduce", dist.ReduceOp.MAX)
    intercept, slope = fit_alpha_beta([float(max(1, n // 4) * 4) for n in sizes], slowest.tolist())
    steps = 2 * (world - 1)
    return Link(latency=intercept / steps, bandwidth=steps / world / max(slope, 1e-15))


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit ``seconds = a + c * sizes`` to timed all-reduces; return ``(a, c)``.

    Each parameter comes from the sizes that show it: the bandwidth ``c`` from the two largest
    (the slope between them, where the latency cancels and a rate limiter's burst allowance is
    negligible), the latency ``a`` from the smallest (its time less its bytes at that rate).
    Least squares over all sizes went wrong both ways on the 1 Gbit/s test bed: a plain fit let
    the largest points' jitter set ``a`` to 0 (25 buckets looked as cheap as 2), a fit in relative
    error let the burst-shortened middle sizes lower ``c`` (8 MiB looked 25% faster than it was).
    ``a`` is clamped at 0; a non-positive slope falls back to the largest size's time per byte.

    Example:
        >>> a, c = fit_alpha_beta([1e3, 1e5, 1e6], [1e-4 + 1e-6, 1e-4 + 1e-4, 1e-4 + 1e-3])
        >>> round(a * 1e6), round(c * 1e9)
        (100, 1)
    """
    points = sorted(zip(sizes, seconds))
    if len(sizes) != len(seconds) or len({x for x, _ in points}) < 2:
        raise ValueError(f"fit_alpha_beta needs times of at least 2 different sizes; got sizes {list(sizes)}")
    (x0, y0), (x1, y1), (x2, y2) = points[0], points[-2], points[-1]
    slope = (y2 - y1) / (x2 - x1) if x2 > x1 else 0.0
    if slope <= 0:  # jitter larger than the difference: the largest size's average rate
        slope = y2 / x2
    return max(0.0, y0 - slope * x0), slope


@_dist.entry("scaling.measure_timeline")
def measure_timeline(
    fn: Callable[..., torch.Tensor],
    params: Any,
    *args: Any,
    repeats: int = 5,
    compression: Any = None,
    group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> Timeline:
    """Time when each gradient of ``fn`` becomes ready, without communication (median of ``repeats``).

    Runs ``fddp.grad_and_value(fn, compression=compression)`` over a group of this rank alone
    (every rank of the default group must call this, since making the groups is collective), so
    the timeline is the compute alone, the comm hook's own work included: what
    :func:`predict_step` overlaps the all-reduces with. The ranks then agree on the slowest
    rank's times (an all-reduce over ``group``), so that every rank predicts and chooses alike.

    Example:
        >>> timeline = fddp.scaling.measure_timeline(loss_fn, params, x, y)
    """
    once = _stepper("measure_timeline", fn, params, args, kwargs, compression, _own_group(), 1e9, 1e9)
    once()  # warm up
    runs = [once().timeline for _ in range(repeats)]
    ready = [statistics.median(r.ready[i] for r in runs) for i in range(len(runs[0].ready))]
    head = [statistics.median(r.backward for r in runs), statistics.median(r.end for r in runs)]
    if dist.get_world_size(group) > 1:
        t = torch.tensor(head + ready, dtype=torch.float64)
        _agree_on(group, "measure_timeline", values=t.numel())
        _reduce(t, group, "measure_timeline", "the timeline's all-reduce", dist.ReduceOp.MAX)
        head, ready = t[:2].tolist(), t[2:].tolist()
    return Timeline(head[0], tuple(ready), (), (), (), head[1])


@_dist.entry("scaling.measure_bucket_cost")
def measure_bucket_cost(
    fn: Callable[..., torch.Tensor],
    params: Any,
    *args: Any,
    repeats: int = 9,
    compression: Any = None,
    group: dist.ProcessGroup | None = None,
    **kwargs: Any,
) -> float:
    """Seconds one more bucket costs a step of ``fn`` on this machine (every rank must call this).

    Times ``fddp.grad_and_value(fn)`` over a group of this rank alone with one bucket and with one
    bucket per leaf (medians of ``repeats``) and divides the difference by the extra buckets: the
    hook calls, the copies into smaller buffers, launching and collecting each collective. The ranks
    agree on the mean.

    Example:
        >>> cost = fddp.scaling.measure_bucket_cost(loss_fn, params, x, y)
    """
    alone = _own_group()
    tiny = 1e-9  # every leaf closes its own bucket
    runs = [(_stepper("measure_bucket_cost", fn, params, args, kwargs, compression, alone, cap, cap), []) for cap in (1e9, tiny)]
    for i in range(repeats + 1):
        for once, times in runs if i % 2 else runs[::-1]:  # interleaved, so that both see the same noise
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    seconds = [statistics.median(times[1:]) for _, times in runs]
    extra = len(plan_of(params, tiny, tiny).buckets) - 1
    cost = torch.tensor([max(0.0, (seconds[1] - seconds[0]) / extra) if extra > 0 else 0.0], dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        _agree_on(group, "measure_bucket_cost")
        _reduce(cost, group, "measure_bucket_cost", "the cost's all-reduce")
        cost /= dist.get_world_size(group)
    return float(cost)


def _agree_on(group: dist.ProcessGroup | None, what: str, **arguments: Any) -> None:
    """Agree across ``group`` that every rank measures the same way (the arguments that fix the
    collectives' number and sizes), before the first timed collective."""
    _dist.agree(group, f"scaling.{what}", [(f"option {k}", repr(v), None) for k, v in sorted(arguments.items())])


def _reduce(t: torch.Tensor | None, group: dist.ProcessGroup | None, what: str, doing: str, op: Any = dist.ReduceOp.SUM) -> None:
    """All-reduce ``t`` in place (``None``: a barrier), in a wait that watches for a peer's failure."""
    work = dist.barrier(group=group, async_op=True) if t is None else dist.all_reduce(t, op=op, group=group, async_op=True)
    _dist.wait(work, group, f"scaling.{what}", doing, host=t is None or t.is_cpu)


def _stepper(
    what: str,
    fn: Callable[..., torch.Tensor],
    params: Any,
    args: tuple,
    kwargs: dict,
    compression: Any,
    group: dist.ProcessGroup | None,
    bucket_cap_mb: float,
    first_bucket_mb: float,
) -> Callable[[], Any]:
    """A function making one ``fddp.grad_and_value(fn)`` step per call and returning its
    :class:`SyncInfo`; a stateful comm hook's state (PowerSGD's) goes from each call to the next."""
    hook = as_hook(compression, False, f"scaling.{what}")
    stateful = type(hook).init is not CommHook.init
    step = grad_and_value(
        fn, group=group, return_info=True, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, compression=compression
    )
    state = hook.init(params) if stateful else None

    def once() -> Any:
        nonlocal state
        *_, info = step(params, *args, compression_state=state, **kwargs) if stateful else step(params, *args, **kwargs)
        state = info.compression_state
        return info

    return once


_alone: "weakref.WeakKeyDictionary[Any, dist.ProcessGroup]" = weakref.WeakKeyDictionary()
_caches.register("fddp.scaling._alone", _alone.clear)


def _own_group() -> dist.ProcessGroup:
    """A process group of this rank alone, made once per default group (every rank must call
    this together the first time: making groups is collective)."""
    world = dist.group.WORLD
    if world not in _alone:
        _alone[world], _ = dist.new_subgroups(group_size=1)
    return _alone[world]
