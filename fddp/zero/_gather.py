"""The pipeline of a fully sharded call: its gathers ahead of the compute and its reductions behind.

A :class:`Pipeline` (one per call of a fully sharded forward) makes the collectives asynchronous:
it starts the gathers of the next ``depth`` buckets before the current one computes (and of the
previous ones in backward), and lets up to ``depth`` reductions run behind the backward pass
(``_autograd``'s ``_Boundary`` on the shards waits for the last of them before their gradients
leave backward). The reductions use ``fddp.ddp_step``'s mean: scaled by ``1/n`` before the sum
for a power-of-two ``n``, else summed, then divided; with a replica group (hybrid sharding) the
shard is then all-reduced across the replicas. What is differentiable about the gathers lives in
``_autograd``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from fddp import _dist
from fddp.sync._comm import Comm
from fddp.sync._differentiable import transform_levels
from fddp.zero import _layout as shard_layout

__all__ = ["Counters", "Pipeline", "Precision", "check_groups", "constants", "plain"]

_functorch = torch._C._functorch
LOW_PRECISION = (torch.float16, torch.bfloat16)  # divided before the sum, as fddp.hooks.Mean does


def _eager(method: Any) -> Any:
    """Run ``method`` below every torch.func level and outside autograd: the pipeline's buffers are
    plain tensors that it and the backend fill in place (a grad transform would refuse writes into
    tensors it did not make, and autograd views made by a collective in one grad mode and written
    by its wait in another)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with temporarily_clear_interpreter_stack(), torch.no_grad():
            return method(*args, **kwargs)

    return wrapper


def constants(tensors: Sequence[Any]) -> bool:
    """Whether a backward may compute on ``tensors`` (``None`` allowed) eagerly, outside autograd and
    torch.func: none is wrapped by a transform, and nothing will differentiate the backward itself.

    Autograd runs a backward in grad mode only for ``create_graph=True``: a plain
    ``.backward(create_graph=True)`` keeps the graph (and double backward then raises). A
    torch.func transform's backward always runs that way, below its own level, for no one: a
    transform outside it would have wrapped the tensors.
    """
    if any(t is not None and _functorch.is_functorch_wrapped_tensor(t) for t in tensors):
        return False
    return torch._C._are_functorch_transforms_active() or not torch.is_grad_enabled()


def plain(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every torch.func wrapper of ``t`` (batch dimensions where they lie)."""
    while _functorch.is_functorch_wrapped_tensor(t):
        t = _functorch.get_unwrapped(t)
    return t


@dataclasses.dataclass(frozen=True)
class Precision:
    """Stage 3's mixed precision (FSDP2's ``MixedPrecisionPolicy``): the dtype floating-point buckets
    are gathered and computed in (``param``), and the dtype their gradients are reduced in
    (``reduce``: by default the gather's, as FSDP2's). The shards, their gradients and the
    optimizer keep the parameters' own dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def param(self, dtype: torch.dtype) -> torch.dtype:
        return self.param_dtype if self.param_dtype is not None and dtype.is_floating_point else dtype

    def reduce(self, dtype: torch.dtype) -> torch.dtype:
        if not dtype.is_floating_point:
            return dtype
        return self.reduce_dtype if self.reduce_dtype is not None else self.param(dtype)

    def cast(self, t: Any) -> Any:
        """A forward input in the compute dtype (floating-point tensors only, as FSDP2's ``cast_forward_inputs``)."""
        if self.param_dtype is not None and isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != self.param_dtype:
            return t.to(self.param_dtype)
        return t

    def rows(self) -> list[tuple]:
        """Signature rows: ranks must gather and reduce in the same dtypes."""
        if self.param_dtype is None and self.reduce_dtype is None:
            return []
        return [("mixed precision", f"param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}", None)]


FULL_PRECISION = Precision()  # no policy: every bucket gathered, computed and reduced in its own dtype


@dataclasses.dataclass
class Counters:
    """What a fully sharded tree's collectives moved, and the most memory its full buckets held.

    Attributes:
        gathers: all-gathers of parameter (or tangent) shards.
        gathered_bytes: bytes this rank sent into them (its shards).
        reduces: reductions of cotangents (one per bucket and backward pass).
        reduced_bytes: bytes this rank handed to them within the shard group.
        replica_bytes: bytes handed to the all-reduces across the replica group (hybrid sharding).
        prefetch_hits: gathers found already in flight when their bucket was needed.
        prefetch_misses: gathers started only when needed (the first bucket, an unpredicted order).
        live_bytes: bytes of gathered buckets and reduction buffers alive now.
        peak_bytes: the most ``live_bytes`` has been (reset it to measure a step).

    Example:
        >>> apply_fn.counters.peak_bytes = 0
        >>> loss = loss_fn(shards, x, y)
        >>> apply_fn.counters.peak_bytes  # the full buckets' bytes at the fullest moment
    """

    gathers: int = 0
    gathered_bytes: int = 0
    reduces: int = 0
    reduced_bytes: int = 0
    replica_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    live_bytes: int = 0
    peak_bytes: int = 0

    def hold(self, t: torch.Tensor) -> "_Held":
        """Count ``t``'s bytes as live until it is freed or released."""
        held = _Held(self, t.untyped_storage().nbytes())
        self.live_bytes += held.n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(t, held.release)
        return held


@dataclasses.dataclass(eq=False)
class _Held:
    """One buffer's bytes in :attr:`Counters.live_bytes`: dropped when it is freed or released."""

    counters: Counters
    n: int
    live: bool = True

    def release(self) -> None:
        if self.live:
            self.counters.live_bytes -= self.n
            self.live = False

    def again(self) -> None:
        if not self.live:
            c = self.counters
            c.live_bytes += self.n
            c.peak_bytes = max(c.peak_bytes, c.live_bytes)
            self.live = True


@dataclasses.dataclass(eq=False)
class _Pending:
    """A collective in flight: its work handle and the buffers it reads or writes."""

    key: Any
    buf: torch.Tensor
    work: Any
    batch: tuple[int, ...]
    out: torch.Tensor | None = None
    phase: int = 1  # reductions: 1 = within the shard group, 2 = across the replicas, 3 = done
    wire: torch.Tensor | None = None  # across the replicas: the shard in the reduction's dtype, if not out's
    held: "_Held | None" = None  # the gathered buffer's bytes in the counters
    refill: "_Released | None" = None  # a gather back into a released bucket's own memory


@dataclasses.dataclass(eq=False)
class _Released:
    """A bucket whose full buffer's memory was given back after the forward (``remat="params"``):
    autograd still holds views of it, and backward gathers the bucket into it again."""

    full: torch.Tensor  # the plain full buffer autograd's saved views look into
    base: torch.Tensor | None  # the all-gather buffer it is a view of, or None (a copy of one)
    nbytes: int
    shard: torch.Tensor
    held: "_Held | None"
    version: int = 0  # the version counter autograd saw, restored after each gather into it

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        if self.held is not None:
            self.held.release()

    def restore(self) -> None:
        self.full.untyped_storage().resize_(self.nbytes)
        if self.held is not None:
            self.held.again()


class _Comms:
    """A layout's groups as fddp ``Comm`` handles (counted, waited with errors that name the call)."""

    def __init__(self, lay: shard_layout.ShardLayout, what: str) -> None:
        self.lay = lay
        self.shard = Comm(lay.group, what, lay.plan) if lay.world > 1 else None
        replica_group = getattr(lay, "replica_group", None)
        self.replicas = getattr(lay, "replicas", 1)
        self.replica = Comm(replica_group, what, lay.plan) if self.replicas > 1 else None
        self.n = lay.world * self.replicas
        self.pow2 = self.n & (self.n - 1) == 0
        # Two ranks reduce-scatter by exchanging halves (Comm.swap): the peer's rank in the group.
        self.pair = 1 - lay.rank if lay.world == 2 else None


class _Debt:
    """What a call still owes its layout's groups: the collectives of a backward still to run
    (``fddp._dist.owe``: a failure meanwhile is fatal), and the end of its agreed sequences
    (``fddp._dist.Segment``: the shard group's and, with hybrid sharding, the replica group's)."""

    __slots__ = ("groups", "segments", "owing")

    def __init__(self, lay: shard_layout.ShardLayout, segments: Sequence[Any]) -> None:
        replica_group = getattr(lay, "replica_group", None)
        self.groups = [lay.group] + ([replica_group] if replica_group is not None else [])
        self.segments = [s for s in segments if s is not None]
        self.owing = False

    def owe(self) -> None:
        if not self.owing and dist.is_initialized():
            self.owing = True
            for g in self.groups:
                _dist.owe(g, 1)

    def settle(self, dropped: bool = False) -> None:
        """The call's collectives are over: its backward ran (or it has none); or, ``dropped``,
        the pipeline died without it (its graph was freed): the peers may be waiting in them."""
        try:
            owed = self.owing
            if owed:
                self.owing = False
                for g in self.groups:
                    _dist.owe(g, -1)
            for seg in self.segments:
                seg.drop(owed) if dropped else seg.close()
        except _dist.MismatchError:
            if not dropped:
                raise
        except Exception:  # noqa: BLE001 - a finalizer at interpreter exit: the group may be gone
            if not dropped:
                raise


class Pipeline:
    """The collectives of one call of a fully sharded forward (and of its backward): asynchronous.

    Gathers: :meth:`gather` returns bucket ``k``'s full buffer, from a gather already in flight when
    one was started for this very shard tensor, and then starts the next ``depth`` of ``order``
    (forward) or of the reversed forward sequence (backward). Reductions: :meth:`reduce` starts one
    and returns this rank's shard buffer, which its wait fills; at most ``depth`` more stay in
    flight, and :meth:`finish_reduces` (the shards' boundary in backward) waits for them all.
    A bucket gathered twice in one forward is reduced synchronously: autograd adds its two
    gradients as soon as both exist, before the boundary.
    """

    def __init__(
        self, lay: shard_layout.ShardLayout, what: str, shards: Sequence[torch.Tensor], depth: int,
        order: Sequence[int], counters: Counters, remat: frozenset[int] = frozenset(), release: bool = False,
        precision: "Precision | None" = None, segments: Sequence[Any] = (), window: Any = None, levels: tuple = (),
    ) -> None:  # fmt: skip
        self.lay, self.what, self.depth, self.counters = lay, what, depth, counters
        # An accumulation window (fddp.zero._window.Window): its open backwards reduce nothing, its
        # closing one reduces its sums; with keep_gathered its buckets are gathered once.
        self.window = window
        # Mixed precision: per bucket, the dtype its gathers (and the compute) use, and its reductions'.
        p = precision or FULL_PRECISION
        self.gather_dtypes = [p.param(b.dtype) for b in lay.plan.buckets]
        self.reduce_dtypes = [p.reduce(b.dtype) for b in lay.plan.buckets]
        # remat="params": the buckets' memory is given back after their unit's forward and gathered
        # into again in backward.
        self.release_after_forward = release
        self.released: dict[int, _Released] = {}
        self.done: dict[int, _Released] = {}  # gathered into again, until their gradient is reduced
        self.last: dict[int, _Pending] = {}  # each bucket's latest forward gather
        self.comms = _Comms(lay, what)
        # The header's agreed sequences: every gather and reduction is checked against them.
        if segments and self.comms.shard is not None:
            self.comms.shard.segment = segments[0]
        if len(segments) > 1 and self.comms.replica is not None:
            self.comms.replica.segment = segments[1]
        self.plains = [plain(s) for s in shards]
        self.order = list(order)  # the predicted forward sequence of buckets
        self.remat = remat  # buckets gathered again in backward
        self.gathers: dict[int, _Pending] = {}
        self.reduces: collections.deque[_Pending] = collections.deque()
        self.seq: list[int] = []  # the forward sequence, as it happened
        self.repeated: set[int] = set()  # buckets gathered more than once in it
        self.uses: dict[int, int] = {}  # per bucket, the gathers of the forward sequence
        self.left: dict[int, int] = {}  # per gathered-again bucket, its gathers' backwards still to come
        self.cursor = 0
        self.back: list[int] | None = None  # the backward sequence, once backward starts
        self.bcursor = 0
        # The backward this forward leaves to run owes its collectives to the groups: a failure
        # before it has run is fatal for them. Settled by the backward (or at the forward's end
        # when there is none), or when the pipeline is dropped without one (the finalizer).
        self.debt = _Debt(lay, segments)
        weakref.finalize(self, self.debt.settle, True)
        # The forward's torch.func levels (fddp.sync._differentiable.transform_levels, which the
        # caller walked): a backward under others branches its sequences (enter_backward).
        self.levels = frozenset(levels)
        self.entered = False

    def tag(self, k: int) -> str:
        """What bucket ``k``'s collectives carry, in words (the sequence agreement names it)."""
        units = getattr(self.lay, "unit_of", None)
        name = units(k) if units is not None else None
        return f"bucket {k}" + (f" of unit {name!r}" if name is not None else "")

    def enter_backward(self) -> None:
        """The call's backward starts: the first of its rules that may issue a collective runs.

        Called with the backward's torch.func levels still active (not under :func:`_eager`).
        Where the backward runs under levels its forward did not (``jacrev`` and ``hessian`` map
        the vjp over the outputs with a ``vmap`` of their own, so every reduction carries every
        member), its collectives are not those the call's kind fixed: each agreed sequence
        branches to that context's own (``fddp._dist.Segment.branch``). The usual backward, under
        the forward's own levels or none, branches nothing and costs nothing.
        """
        if self.entered:
            return
        self.entered = True
        if not self.debt.segments or not torch._C._are_functorch_transforms_active():
            return
        extra = [word for level, word in transform_levels() if (level, word) not in self.levels]
        if extra:
            for seg in self.debt.segments:
                seg.branch(f"{', '.join(extra)} (levels its forward did not run under)")

    # -- gathers --------------------------------------------------------------------------------

    def _start_gather(self, k: int, shard: torch.Tensor) -> _Pending:
        lay, comms = self.lay, self.comms
        batch = tuple(shard.shape[:-1])
        src = self._wire(k, shard)
        if comms.shard is None:
            return _Pending(_key(shard), src, None, batch)
        # A buffer of its own, not the pool's: autograd's views of it keep it (and so its count in
        # the counters) alive exactly as long as they need it, and remat="params" resizes it.
        buf = torch.empty(lay.world * src.numel(), dtype=src.dtype, device=src.device)
        held = self.counters.hold(buf)
        work = comms.shard.all_gather_into(buf, src.reshape(-1), tag=self.tag(k))
        self.counters.gathers += 1
        self.counters.gathered_bytes += src.numel() * src.element_size()
        return _Pending(_key(shard), buf, work, batch, held=held)

    def _finish_gather(self, k: int, p: _Pending) -> torch.Tensor:
        lay = self.lay
        b, c = lay.plan.buckets[k], lay.cuts[k]
        if p.work is not None:
            self.comms.shard.wait(p.work, f"the all-gather of bucket {k} (of {len(lay.cuts)})")
        m = 1
        for d in p.batch:
            m *= d
        if p.work is None:  # one rank: the shard is the bucket, padded
            return p.buf.view(*p.batch, c.size)[..., : b.numel]
        if m == 1:
            return p.buf[: b.numel].view(*p.batch, b.numel)
        # Rank-major (world, members, shard) -> members, world * shard: one copy.
        full = p.buf.view(lay.world, m, c.size).transpose(0, 1).reshape(m, lay.world * c.size)[:, : b.numel]
        return full.reshape(*p.batch, b.numel)

    def _wire(self, k: int, shard: torch.Tensor) -> torch.Tensor:
        """What bucket ``k``'s gathers send: the shard, contiguous, in the bucket's gather dtype."""
        dtype = self.gather_dtypes[k]
        return shard.contiguous() if shard.dtype == dtype else shard.to(dtype, memory_format=torch.contiguous_format)

    @_eager
    def gather(self, k: int, shard: torch.Tensor, backward: bool) -> torch.Tensor:
        """Bucket ``k``'s full flat buffer, gathered from ``shard`` (plain, ``(*batch, size)``)."""
        window = self.window
        if window is not None and window.keep_gathered:
            full = window.kept_full(k, _key(shard), shard._version)
            if full is not None:  # gathered by an earlier micro-batch of the window: no collective
                self.counters.prefetch_hits += 1
                if not backward:
                    self.seq.append(k)
                    self._prefetch_forward(k)
                return full
        p = self.gathers.pop(k, None)
        if p is not None and p.key == _key(shard):
            self.counters.prefetch_hits += 1
        else:
            if p is not None:  # started for another tensor: let it land, unused
                self._finish_gather(k, p)
            self.counters.prefetch_misses += 1
            p = self._start_gather(k, shard)
        if backward:
            self._prefetch_backward(k)
        else:
            self.seq.append(k)
            if self.release_after_forward and k in self.remat:  # for release() after the unit's forward
                self.last[k] = p
            self._prefetch_forward(k)
        full = self._finish_gather(k, p)
        if window is not None and p.key == _key(shard):
            window.keep(k, p.key, shard._version, full)
        return full

    @_eager
    def release(self, k: int, full: torch.Tensor) -> None:
        """Give back bucket ``k``'s full buffer's memory (``full``, plain) after its unit's forward."""
        p = self.last.pop(k, None)
        if p is None or p.work is None and self.comms.shard is None:
            return  # one rank: the full buffer is the shard itself
        if self.order and k == self.order[-1] and self.cursor == len(self.order):
            return  # the forward's last bucket, as predicted: backward starts with it (no gather back)
        if k in self.released:
            # A unit called again in this forward (a block applied twice): the earlier call's
            # memory is gathered back once in backward, for every use; this call's buffer stays
            # alive, held by autograd's views until its backward (one unit's bytes more).
            return
        base = p.buf if full.untyped_storage().data_ptr() == p.buf.untyped_storage().data_ptr() else None
        # A detached alias: the same storage and version counter, but no grad_fn. Under autograd
        # ``full`` is the gather's output, whose grad_fn holds this pipeline: kept here, it would
        # close a cycle through autograd's C++ graph that gc cannot see, and every step would
        # leave its pipeline and shards behind.
        alias = full.detach()
        r = _Released(alias, base, alias.untyped_storage().nbytes(), self.plains[k], p.held if base is not None else None, full._version)
        r.free()
        self.released[k] = r

    def _start_refill(self, k: int, r: _Released) -> _Pending:
        r.restore()
        if r.base is not None:  # gather straight into the memory autograd's views look into
            src = self._wire(k, r.shard).reshape(-1)
            work = self.comms.shard.all_gather_into(r.base, src, tag=self.tag(k))
            self.counters.gathers += 1
            self.counters.gathered_bytes += src.numel() * src.element_size()
            p = _Pending(None, r.base, work, tuple(r.shard.shape[:-1]))
        else:
            p = self._start_gather(k, r.shard)
        p.refill = r
        return p

    @_eager
    def refill(self, ks: Sequence[int]) -> None:
        """Before these buckets' unit runs backward: their released memory, gathered into again."""
        for k in ks:
            r = self.released.pop(k, None)
            if r is None:
                continue
            p = self.gathers.pop(k, None)
            if p is None or p.refill is not r:
                self.counters.prefetch_misses += 1
                p = self._start_refill(k, r)
            else:
                self.counters.prefetch_hits += 1
            full = self._finish_gather(k, p)
            if r.base is None:
                r.full.copy_(full)
            # The values autograd saved its views of, back: give them back the version counter it
            # checks, as FSDP does for its unsharded parameters. (Not at the launch: gloo's thread
            # copies into the buffer, bumping the counter, until the wait.)
            torch._C._autograd._unsafe_set_version_counter((r.full,), (r.version,))
            self.done[k] = r
            self._prefetch_backward(k)

    @_eager
    def release_again(self, k: int) -> None:
        """Bucket ``k``'s unit has run backward: give its memory back again (a second backward gathers again)."""
        r = self.done.get(k)
        if r is None:
            return
        left = self.left.get(k, 1) - 1
        if left > 0:  # a unit used several times: the other uses' backwards still read it
            self.left[k] = left
            return
        del self.done[k]
        self.left[k] = self.uses.get(k, 1)
        r.free()
        self.released[k] = r

    @_eager
    def gather_now(self, k: int, shard: torch.Tensor) -> torch.Tensor:
        """Bucket ``k``'s full buffer from ``shard``, gathered now, outside the prefetch order."""
        return self._finish_gather(k, self._start_gather(k, shard))

    def _prefetch(self, ks: Sequence[int]) -> None:
        kept = self.window.kept if self.window is not None else {}
        for j in ks:
            if j not in self.gathers and j not in kept:
                r = self.released.get(j)
                self.gathers[j] = self._start_gather(j, self.plains[j]) if r is None else self._start_refill(j, r)

    def _prefetch_forward(self, k: int) -> None:
        order, at = self.order, self.cursor
        while at < len(order) and order[at] != k:
            at += 1
        if at == len(order):  # not where predicted: prefetch nothing until the sequence is back
            return
        self.cursor = at + 1
        self._prefetch(order[self.cursor : self.cursor + self.depth])

    @_eager
    def end_forward(self, will_backward: bool) -> None:
        """The forward is over: let unused gathers land; start backward's first gathers."""
        for k in list(self.gathers):
            self._finish_gather(k, self.gathers.pop(k))
        self.last.clear()
        self.back = [k for k in reversed(self.seq) if k in self.remat]
        if self.window is not None and self.window.keep_gathered:
            self.back = []  # backward finds every bucket still gathered
        elif self.release_after_forward:  # each released bucket is gathered back once, for all its uses
            self.back = [k for k in dict.fromkeys(self.back) if k in self.released]
        self.uses = dict(collections.Counter(self.seq))
        self.left = dict(self.uses)
        self.repeated = {k for k, n in self.uses.items() if n > 1}
        if will_backward:
            self.debt.owe()
            self._prefetch(self.back[: self.depth])
        else:
            self.debt.settle()  # an evaluation forward: its collectives are over

    def _prefetch_backward(self, k: int) -> None:
        back = self.back if self.back is not None else []
        at = self.bcursor
        while at < len(back) and back[at] != k:
            at += 1
        if at == len(back):
            return
        self.bcursor = at + 1
        self._prefetch(back[self.bcursor : self.bcursor + self.depth])

    # -- reductions -----------------------------------------------------------------------------

    @_eager
    def reduce(self, k: int, ct: torch.Tensor, invariant: bool) -> torch.Tensor:
        """Start reducing ``ct`` (plain, ``(*batch, B)``); return this rank's shard buffer for it."""
        lay, comms, counters = self.lay, self.comms, self.counters
        b, c = lay.plan.buckets[k], lay.cuts[k]
        batch = tuple(ct.shape[:-1])
        # The gradient shard has the shard's dtype; the reduction runs in the bucket's reduce dtype
        # (mixed precision: the cotangent arrives in the gather's dtype).
        dtype = self.reduce_dtypes[k]
        window = self.window
        if window is not None and window.open:  # a micro-batch of an accumulation window: kept local
            window.add(k, ct, dtype)
            return torch.zeros(*batch, c.size, dtype=b.dtype, device=ct.device)
        if window is not None:
            ct = window.take(k, ct)
        out = torch.empty(*batch, c.size, dtype=b.dtype, device=ct.device)
        out[..., c.held :].zero_()  # the padding; the reduction writes the rest
        if invariant:
            out[..., : c.held].copy_(ct[..., c.lo : c.hi])
            return out
        # One full-size reduction in flight (it overlaps the next unit's backward): the one before
        # this lands first, keeping its shard; across replicas, `depth` shards stay in flight.
        for older in self.reduces:
            if older.phase == 1:
                self._advance(older)
        while len(self.reduces) > self.depth:
            self._finish(self.reduces.popleft())
        m = 1
        for d in batch:
            m *= d
        # Not the pool's: after its wait, its memory is given back at once (below), however long
        # gloo's worker thread keeps its reference to the finished work.
        buf = torch.empty(*batch, b.numel, dtype=dtype, device=ct.device)
        held = counters.hold(buf)
        if comms.pow2:
            torch.mul(ct, 1.0 / comms.n, out=buf)  # 2**-k commutes with rounding: ddp_step's mean
        elif dtype in LOW_PRECISION:
            torch.div(ct, comms.n, out=buf)  # a half-precision sum could overflow where the mean would not
        else:
            buf.copy_(ct)
        counters.reduces += 1
        work: Any = None
        if comms.pair is not None:
            work = self._exchange(k, buf)
        elif comms.shard is not None:
            counters.reduced_bytes += buf.numel() * buf.element_size()
            work = comms.shard.all_reduce(buf, tag=self.tag(k))
        p = _Pending(k, buf, work, batch, out, held=held)
        self.reduces.append(p)
        return out

    def _exchange(self, k: int, buf: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Two ranks: a reduce-scatter as one exchange, each rank sending the other its half.

        Gloo's reduce-scatter is an all-reduce inside, which sends the whole bucket; this sends
        half of it. The sum of two values does not depend on their order: the all-reduce's bits.
        """
        lay, comms = self.lay, self.comms
        numel = lay.plan.buckets[k].numel
        theirs = shard_layout.cut(numel, 2, 1 - lay.rank)
        c = lay.cuts[k]
        send = buf[..., theirs.lo : theirs.hi].contiguous()
        got = torch.empty(*buf.shape[:-1], c.held, dtype=buf.dtype, device=buf.device)
        self.counters.reduced_bytes += send.numel() * send.element_size()
        return comms.shard.swap(send, got, comms.pair, tag=self.tag(k)), got

    def _advance(self, p: _Pending) -> None:
        """Phase 1 done: keep this rank's slice; start the all-reduce across the replicas."""
        lay, comms = self.lay, self.comms
        c = lay.cuts[p.key]
        doing = f"the reduction of bucket {p.key}'s gradients (of {len(lay.cuts)})"
        if comms.pair is not None:
            swapped, got = p.work
            comms.shard.wait(swapped, doing)
            torch.add(p.buf[..., c.lo : c.hi], got, out=p.out[..., : c.held])
        else:
            if p.work is not None:
                comms.shard.wait(p.work, doing)
            p.out[..., : c.held].copy_(p.buf[..., c.lo : c.hi])
        p.buf.untyped_storage().resize_(0)
        if p.held is not None:
            p.held.release()
        p.buf, p.work, p.phase = None, None, 2
        if comms.replica is not None:
            dtype = self.reduce_dtypes[p.key]
            p.wire = p.out if p.out.dtype == dtype else p.out.to(dtype)
            self.counters.replica_bytes += p.wire.numel() * p.wire.element_size()
            p.work = comms.replica.all_reduce(p.wire, tag=self.tag(p.key))

    def _finish(self, p: _Pending) -> None:
        comms = self.comms
        if p.phase == 1:
            self._advance(p)
        if p.work is not None:
            comms.replica.wait(p.work, f"the all-reduce of bucket {p.key}'s gradient shard across the replicas")
        if p.wire is not None and p.wire is not p.out:
            p.out.copy_(p.wire)
        if not comms.pow2 and self.reduce_dtypes[p.key] not in LOW_PRECISION:
            p.out.div_(comms.n)
        p.work, p.phase, p.wire = None, 3, None

    @_eager
    def finish_reduces(self) -> None:
        """Wait for every reduction in flight: the gradient shards are complete after this."""
        while self.reduces:
            self._finish(self.reduces.popleft())

    def end_backward(self) -> None:
        """The backward has run (the shards' boundary): nothing of this call is owed any more."""
        self.finish_reduces()
        if self.window is not None and not self.window.open:
            self.window.finish()  # the closing backward: the window's buffers go
        self.debt.settle()

    @_eager
    def reduce_now(self, k: int, ct: torch.Tensor, invariant: bool) -> torch.Tensor:
        """:meth:`reduce`, waited for before it returns."""
        out = self.reduce(k, ct, invariant)
        self.finish_reduces()
        return out


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)  # fddp.zero._window.key's


def check_groups(group: dist.ProcessGroup | None, replica_group: dist.ProcessGroup | None, what: str) -> tuple[int, int, int]:
    """Validate hybrid sharding's groups; return ``(world, rank, replicas)``.

    Every rank must be in both groups; the replica group must not be the shard group, and the two
    groups' sizes must multiply to at most the default group's (each rank one shard of one replica).
    """
    for name, g in (("group", group), ("replica_group", replica_group)):
        if g is not None and not isinstance(g, dist.ProcessGroup):
            raise TypeError(f"fddp.{what}: {name} must be a torch.distributed.ProcessGroup or None, got {type(g).__name__}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world < 0 or rank < 0:
        raise ValueError(f"fddp.{what}: this rank (global rank {dist.get_rank()}) is not in `group`")
    if replica_group is None:
        return world, rank, 1
    if replica_group is group or (group is None and replica_group is dist.group.WORLD):
        raise ValueError(
            f"fddp.{what}: replica_group is the shard group; pass two different groups (shard within one, replicate across the other)"
        )
    replicas, r = dist.get_world_size(replica_group), dist.get_rank(replica_group)
    if replicas < 0 or r < 0:
        raise ValueError(f"fddp.{what}: this rank (global rank {dist.get_rank()}) is not in `replica_group`")
    total = dist.get_world_size()
    if world * replicas > total:
        raise ValueError(
            f"fddp.{what}: a shard group of {world} ranks times a replica group of {replicas} is "
            f"{world * replicas} ranks, more than the {total} there are; each rank holds one shard of one replica "
            "(e.g. shard within a host, replicate across hosts: groups of ranks_per_host and of hosts)"
        )
    return world, rank, replicas
