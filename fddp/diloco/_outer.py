"""The outer step of local SGD and (streaming) DiLoCo: ``(params, state) -> (params, state)``."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import weakref
from typing import Any, NamedTuple, Sequence

import optree
import torch
import torch.distributed as dist

from fddp import _caches, _dist, _layout, _tree, optim, zero
from fddp._layout import BUCKET_CAP_MB, FIRST_BUCKET_MB
from fddp.diloco import _checks
from fddp.diloco._compress import Quantize
from fddp.diloco._plan import Fragment, describe, launches, split, split_by, warm
from fddp.optim import GradientTransformation
from fddp.sync import Cast, SyncInfo, hooks
from fddp.sync._inflight import InFlight, start

__all__ = ["DiLoCo", "DiLoCoState", "Flight", "OuterInfo", "diloco", "local_sgd"]

_WHAT = "diloco.step"
_CASTS = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Compressions by name (compression="e3m0"): each with error feedback, its residual in the outer state.
_NAMED = {"e3m0": Quantize(bits=4, format="e3m0"), "int4": Quantize(bits=4, format="int"), "int2": Quantize(bits=2)}


class Flight(NamedTuple):
    """One fragment's synchronisation between its launch and its merge.

    Attributes:
        launched_at: int64 scalar, the inner step it was launched at; -1 when none is in flight.
        merge_at: int64 scalar, the inner step it merges at; -1 when none is in flight.
        pending: the all-reduce on its way (``fddp.sync._inflight.InFlight``, not a tensor); ``None``
            when none is in flight or once :meth:`DiLoCo.settle` has received it and applied the
            outer step to the snapshot (only the merge into the local parameters waits then).

    Example:
        >>> in_flight = [f.pending is not None for f in state.flights]  # [False] * fragments once settled
    """

    launched_at: torch.Tensor
    merge_at: torch.Tensor
    pending: InFlight | None = None


class DiLoCoState(NamedTuple):
    """The outer state: a pytree of tensors that :mod:`fddp.checkpoint` saves and loads as it is
    (after :meth:`DiLoCo.settle`, when a fragment is in flight).

    Attributes:
        count: int64 scalar, the inner steps taken so far.
        snapshot: a tree shaped like the parameters: the global parameters, each fragment's as of
            its last synchronisation (what to evaluate; the same on every rank).
        outer_state: per fragment, the outer optimizer's state (over the fragment's tree, a dict
            from leaf path to leaf; with ``shard=True``, over this rank's shards of it).
        compression_state: per fragment, the comm hook's state (``None`` for a stateless hook).
            Residuals differ between ranks: every rank saves its own to resume exactly.
        weight: per fragment, this rank's ``weight=`` summed since the fragment's last launch
            (float64 scalars; zeros when no weights are given).
        flights: per fragment, its :class:`Flight`.
        origin: with ``eager=True``, per fragment, where this rank's current round started (the
            fragment's tree: the snapshot stepped with this rank's own share of its last
            pseudo-gradient), or ``None`` before its first round; ``None`` per fragment otherwise.
            Per rank, like the residuals: every rank saves its own.
    """

    count: torch.Tensor
    snapshot: Any
    outer_state: tuple
    compression_state: tuple
    weight: tuple
    flights: tuple
    origin: tuple = ()


class OuterInfo(NamedTuple):
    """What one outer step did, returned with ``return_info=True``.

    Attributes:
        launched: the fragments whose synchronisation started at this step.
        merged: the fragments merged into the parameters at this step.
        syncs: the :class:`fddp.SyncInfo` of every synchronisation received at this step (bytes,
            collectives, weight sum); those received by :meth:`DiLoCo.settle` are not repeated.
        bytes_sent: the payload bytes of those synchronisations (with ``shard=True``, and the
            all-gathers of the new shards).
        wait_s: seconds this step spent waiting for synchronisations to arrive (0 when each had
            landed during the inner steps it overlapped).
        gains: with ``extrapolate=True``, the factor each received mean pseudo-gradient was scaled by
            before the outer step (1 without).

    Example:
        >>> params, state, info = outer.step(params, state, return_info=True)
        >>> sent_per_step = info.bytes_sent  # 0 between synchronisations
    """

    launched: tuple[int, ...]
    merged: tuple[int, ...]
    syncs: tuple[SyncInfo, ...]
    bytes_sent: int
    wait_s: float
    gains: tuple[float, ...] = ()


class _Extrapolating:
    """A synchronisation in flight with, beside it, the all-reduce of the ranks' squared norms of
    their pseudo-gradients (float64, one value: what ``extrapolate=True`` needs)."""

    __slots__ = ("mean", "norms")

    def __init__(self, mean: InFlight, pseudo: dict, group: Any) -> None:
        # On the data's device: a CPU accumulator cannot take a GPU sum in place (and a pure NCCL
        # group could not reduce it).
        sq = torch.zeros(1, dtype=torch.float64, device=next((v.device for v in pseudo.values()), None))
        for v in pseudo.values():
            sq += v.detach().double().square().sum()
        self.mean = mean
        self.norms = start({"norm": sq}, {"norm": sq}, what=_WHAT, group=group)  # the mean of the squared norms

    def wait(self) -> tuple[Any, SyncInfo]:
        return self.mean.wait()


def _extrapolated(mean: Any, pending: Any) -> tuple[Any, float]:
    """The mean pseudo-gradient times FedExP's gain (Jhunjhunwala et al. 2023), and the gain:
    ``max(1, mean_r |delta_r|^2 / (2 |mean|^2 + eps))``; the same on every rank (every rank holds
    the same mean and the same all-reduced norms). The mean itself where nothing was measured."""
    if not isinstance(pending, _Extrapolating):
        return mean, 1.0
    ranks_sq = float(pending.norms.wait()[0]["norm"][0])
    # Read in one copy (a GPU's would sync once per leaf), then summed in order on the host as before.
    mean_sq = sum(torch.stack([v.detach().double().square().sum() for v in mean.values()]).tolist()) if mean else 0.0
    gain = max(1.0, ranks_sq / (2.0 * mean_sq + 1e-30))
    if not math.isfinite(gain):
        gain = 1.0
    return {k: v * gain for k, v in mean.items()} if gain != 1.0 else mean, gain


def _no_flight() -> Flight:
    return Flight(torch.tensor(-1, dtype=torch.int64), torch.tensor(-1, dtype=torch.int64), None)


@dataclasses.dataclass(frozen=True, eq=False)
class DiLoCo:
    """Local SGD and (streaming) DiLoCo as a pure outer step; make one with :func:`diloco` or
    :func:`local_sgd`.

    Every rank trains its own copy of the parameters with its own inner optimizer and no
    communication; :meth:`step`, called after every inner step, synchronises every ``every``
    steps. At a synchronisation the *pseudo-gradient* ``snapshot - params`` (the ground this rank
    covered since the last one) is averaged over the ranks with fddp's bucketed all-reduce and
    comm hooks (as :func:`fddp.ddp_step`), the outer optimizer steps the snapshot with it, and the
    result becomes both the new snapshot and the parameters on every rank.

    Streaming (``fragments > 1``): the leaves are cut into ``fragments`` contiguous groups of about
    equal bytes, synchronised at staggered steps (fragment ``p`` every ``every`` steps, offset by
    ``(p + 1) * every // fragments``), so the link carries ``1 / fragments`` of the bytes at a
    time. With ``delay = tau > 0`` a fragment's all-reduce is started ``tau`` steps before its
    merge and runs while those inner steps do; on arrival the outer step gives the fragment's new
    global values ``g`` and the local ones become ``mixing * local + (1 - mixing) * g``.

    Attributes:
        every: ``H``, inner steps between two synchronisations of a fragment.
        optimizer: the outer optimizer, any ``fddp.optim`` transformation.
        compression: how pseudo-gradients travel: ``None``, ``"bf16"``, ``"fp16"``, or any
            :class:`fddp.hooks.CommHook` (:class:`fddp.Int8`, :class:`fddp.PowerSGD`, yours).
        fragments: ``F``, the number of fragments, or the fragments themselves: per fragment, the
            prefixes of its leaves (``(("embed", "blocks.0"), ("blocks.1",), ("head",))``).
        delay: ``tau``, inner steps a fragment's all-reduce overlaps, ``0 <= tau < every``.
        mixing: the weight of the local values at a merge (``alpha``); 0 replaces them.
        eager: never wait (eager updates, Kale et al. 2025): a fragment's all-reduce overlaps the
            whole next round; meanwhile this rank goes on from the snapshot stepped with its own
            share of its pseudo-gradient (``delta / N`` through the outer optimizer), and the mean
            steps the snapshot one round late.
        extrapolate: scale each mean pseudo-gradient by FedExP's gain (see :func:`diloco`).
        shard: keep the outer optimizer's state sharded over the ranks (reduce-scatter the
            pseudo-gradients, step this rank's shard, all-gather: ``fddp.zero``'s cut).
        group: the process group to average over (``None``: the default group).
        bucket_cap_mb: bucket cap of the synchronisations, in MiB.
        first_bucket_mb: cap of their first bucket, in MiB.
        warmup: the first inner steps, synchronous: after each of them the ranks average their
            parameters (every fragment at once, no outer optimizer); the rounds of ``every`` steps
            start after them.

    Example:
        >>> outer = fddp.diloco.diloco(every=40, fragments=4, delay=5, mixing=0.5, compression=fddp.Int8())
        >>> state = outer.init(params)
        >>> params, state = outer.step(params, state)  # after each inner step
    """

    every: int
    optimizer: GradientTransformation
    compression: Any = None
    fragments: int | tuple[tuple[str, ...], ...] = 1
    delay: int = 0
    mixing: float = 0.0
    shard: bool = False
    group: dist.ProcessGroup | None = None
    bucket_cap_mb: float = BUCKET_CAP_MB
    first_bucket_mb: float = FIRST_BUCKET_MB
    warmup: int = 0
    eager: bool = False
    extrapolate: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.fragments, int):
            object.__setattr__(self, "fragments", _prefixes(self.fragments))
        for name, low in (("every", 1), ("delay", 0), ("warmup", 0)) + ((("fragments", 1),) if isinstance(self.fragments, int) else ()):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"fddp.diloco: {name} must be an int >= {low}, got {v!r}")
        if self.count > self.every:
            raise ValueError(
                f"fddp.diloco: fragments={self.count} > every={self.every}: each fragment needs its own step "
                "within every round; use at most every fragments"
            )
        if self.delay >= self.every:
            raise ValueError(
                f"fddp.diloco: delay={self.delay} must be < every={self.every}: a fragment must merge before its "
                "next synchronisation starts"
            )
        if not 0.0 <= self.mixing <= 1.0:
            raise ValueError(f"fddp.diloco: mixing must be in [0, 1], got {self.mixing!r}")
        if not isinstance(self.eager, bool):
            raise ValueError(f"fddp.diloco: eager must be a bool, got {self.eager!r}")
        if not isinstance(self.extrapolate, bool):
            raise ValueError(f"fddp.diloco: extrapolate must be a bool, got {self.extrapolate!r}")
        if self.extrapolate and self.shard:
            raise ValueError(
                "fddp.diloco: extrapolate=True reads the whole mean pseudo-gradient's norm on every rank; with shard=True "
                "each rank holds a shard of it. Drop one of them"
            )
        if self.eager and (self.delay or self.mixing or self.shard):
            raise ValueError(
                f"fddp.diloco: eager=True overlaps each synchronisation with the whole next round and applies this "
                f"rank's own share at once; it takes no delay= (got {self.delay}), mixing= (got {self.mixing}) or "
                f"shard=True (got {self.shard}): drop them"
            )
        if not isinstance(self.optimizer, GradientTransformation):
            raise TypeError(f"fddp.diloco: optimizer must be an fddp.optim transformation, got {type(self.optimizer).__name__}")
        _hook(self.compression, False)  # raise now for a compression the sync would refuse

    def __repr__(self) -> str:
        return (
            f"DiLoCo(every={self.every}, fragments={self.fragments}, delay={self.delay}, mixing={self.mixing}, "
            f"compression={self.compression!r}, shard={self.shard}, warmup={self.warmup}, eager={self.eager}, "
            f"extrapolate={self.extrapolate})"
        )

    @property
    def count(self) -> int:
        """``F``, the number of fragments."""
        return self._n

    @functools.cached_property
    def _n(self) -> int:
        return self.fragments if isinstance(self.fragments, int) else len(self.fragments)

    # --- the pure functions ------------------------------------------------------------------

    def init(self, params: Any, /) -> DiLoCoState:
        """Return the state before the first inner step: the snapshot is a copy of ``params``.

        Call it on every rank with the same parameters (after :func:`fddp.broadcast`); with
        ``shard=True`` it communicates (``fddp.zero.shard``'s check).

        Example:
            >>> outer = fddp.diloco.diloco(every=50)
            >>> state = outer.init(params)
        """
        leaves, spec = _checks.leaves_of(params, "diloco.init")
        self._refuse_split(spec, "diloco.init")
        frags = self._fragments(params)
        snapshot = [t.detach().clone() for t in leaves]
        trees = [_fragment_tree(f, snapshot) for f in frags]
        hook = _hook(self.compression, self.shard)
        outer = []
        for tree in trees:
            if self.shard:
                tree = zero.shard(tree, group=self.group, bucket_cap_mb=self.bucket_cap_mb, first_bucket_mb=self.first_bucket_mb)
            outer.append(self.optimizer.init(tree))
        comp = tuple(hook.init(tree) if _stateful(hook) else None for tree in trees)
        weights = tuple(torch.zeros((), dtype=torch.float64) for _ in frags)
        return DiLoCoState(
            torch.tensor(0, dtype=torch.int64), optree.tree_unflatten(spec, snapshot), tuple(outer), comp, weights,
            tuple(_no_flight() for _ in frags), tuple(tree if self.eager else None for tree in trees),
        )  # fmt: skip

    @_dist.entry(_WHAT, lambda self, *args, **kwargs: self.group)
    def step(self, params: Any, state: DiLoCoState, /, *, weight: float | torch.Tensor | None = None,
             return_info: bool = False) -> Any:  # fmt: skip
        """Count one inner step; synchronise the fragments that are due. Pure: nothing is modified.

        Between synchronisations this counts and checks ``params`` against the state's shapes and
        dtypes (tens of microseconds; a ``ValueError`` naming the leaf at once for a resized
        model). At the first step of this configuration in the process, and before every
        synchronisation, the ranks agree on the configuration (the outer optimizer by value), the
        step count, the tree and the checksums of the snapshot's leaves about to be synchronised
        (all of them at the first step): another step (a rank resumed from an older file),
        another start (no :func:`fddp.broadcast`) or another tree on one rank is a
        :class:`fddp.MismatchError` on every rank, naming the difference. When a fragment is due:
        its pseudo-gradient ``snapshot - params`` is averaged over the ranks (the weighted mean
        with ``weight=``), the outer optimizer steps the snapshot with it, and the fragment's
        parameters become the new global values (mixed with the local ones by ``mixing``). Every
        rank must call ``step`` once per inner step. If a synchronisation fails (a peer lost, a
        timeout, a hook's error) the error propagates and ``params`` and ``state`` are as they
        were: nothing was written in place. Such a failure is fatal to the process group (its
        peers may be inside the synchronisation's collectives): every rank's next fddp call
        raises :class:`fddp.PeerError`, and the run restarts from its last checkpoint.

        Args:
            params: this rank's parameters after its inner step.
            state: the outer state (from :meth:`init`, the previous step or a checkpoint).
            weight: this inner step's weight on this rank, usually its number of samples (0 once
                out of data). Pass it at every step or at none: a fragment's pseudo-gradients are
                then averaged with the weights summed since its last launch. A number or a CPU
                tensor must be >= 0; a GPU tensor is summed on the GPU (``state.weight`` then
                lives there) and, negative or not finite, makes the fragment's mean NaN (see
                :func:`fddp.ddp_step`'s ``weight=``).
            return_info: also return an :class:`OuterInfo`.

        Returns:
            ``(params, state)``, or ``(params, state, info)`` with ``return_info``.

        Example:
            >>> for x, y in batches:
            ...     grads = torch.func.grad(loss_fn)(params, x, y)  # local: no communication
            ...     params, opt_state = fddp.optim.apply_gradients(inner, grads, opt_state, params)
            ...     params, state = outer.step(params, state)
        """
        self._check_state(state)
        if self.eager and weight is not None:
            with _dist.call(self.group, _WHAT):  # announced: the peers raise at their next synchronisation
                raise ValueError(
                    f"fddp.{_WHAT}: eager=True applies this rank's own share of its pseudo-gradient before the others' "
                    "arrive, 1/N of it; with weight= that share is unknown until then. Drop weight= or eager=True"
                )
        leaves, spec, snap_leaves, snap_spec, problem = _checks.against(params, state.snapshot)
        t = int(state.count) + 1
        weights = state.weight
        if weight is not None:
            w = _checks.as_weight(weight)
            weights = tuple(a + w for a in weights)
        n = self._n
        due_merge = [p for p, f in enumerate(state.flights) if int(f.merge_at) == t]
        warming = warm(t, self.warmup)
        due_launch = list(range(n)) if warming else [p for p in range(n) if launches(t, p, n, self.every, self.delay, self.warmup)]
        first = self._first_step()
        count = torch.tensor(t, dtype=torch.int64)
        if not due_merge and not due_launch and not first:
            if problem is not None:
                with _dist.call(self.group, _WHAT):  # announced: the peers raise at their next synchronisation
                    raise ValueError(f"fddp.{_WHAT}: {problem}")
            new_state = state._replace(count=count, weight=weights)
            return (params, new_state, OuterInfo((), (), (), 0, 0.0)) if return_info else (params, new_state)

        with _dist.call(self.group, _WHAT):  # a refusal here is announced in place of this call's header
            leaves, spec = _checks.leaves_of(params, _WHAT)
            self._refuse_split(spec, _WHAT)
        frags = self._fragments(params) if problem is None else ()
        if first or due_launch:
            # Before anything moves, the ranks agree on the configuration, the step, the tree, and
            # the checksums of the snapshot's leaves that are about to be synchronised (all of them
            # at the first step of this process): a rank resumed from another checkpoint, or that
            # started from other parameters, is an error on every rank, not a silent divergence.
            checked = range(len(snap_leaves)) if first or problem is not None else [i for p in due_launch for i in frags[p].indices]
            self._agree(t, state.snapshot, snap_leaves, snap_spec, sorted(checked), problem)
        if problem is not None:
            raise ValueError(f"fddp.{_WHAT}: {problem}")  # on every rank: the agreement passed
        # From here on the peers are inside this synchronisation's collectives: a failure on this
        # rank is fatal to the group (posted on its error channel, which their waits read).
        with _dist.call(self.group, _WHAT, headerless=True):
            return self._sync(params, state, leaves, spec, snap_leaves, frags, due_merge, due_launch, warming,
                              count, weights, weight is not None, return_info)  # fmt: skip

    def _sync(self, params: Any, state: DiLoCoState, leaves: list, spec: Any, snap_leaves: list, frags: tuple,
              due_merge: list, due_launch: list, warming: bool, count: torch.Tensor, weights: tuple, weighted: bool,
              return_info: bool) -> Any:  # fmt: skip
        """The synchronisations due at step ``count``: receive, merge, launch (see :meth:`step`)."""
        t = int(count)
        out = list(leaves)
        snap = list(snap_leaves)
        outer, comp, flights = list(state.outer_state), list(state.compression_state), list(state.flights)
        origin = list(state.origin)
        weights = list(weights)
        syncs: list[SyncInfo] = []
        gains: list[float] = []
        wait_s, gathered = 0.0, 0

        def receive(p: int, pending: Any, average: bool = False) -> None:
            nonlocal wait_s, gathered
            t0 = time.perf_counter()
            mean, info = pending.wait()
            wait_s += time.perf_counter() - t0
            syncs.append(info)
            if not average:
                mean, gain = _extrapolated(mean, pending)
                gains.append(gain)
            gathered += self._apply(p, frags[p], mean, info, snap, outer, comp, average)

        def merge(p: int) -> None:
            for i in frags[p].indices:
                out[i] = snap[i].clone() if self.mixing == 0 else torch.lerp(snap[i], leaves[i].detach(), self.mixing)
            flights[p] = _no_flight()

        for p in due_merge:
            if self.eager:
                continue  # received at its next launch, this very step (below)
            if flights[p].pending is not None:
                receive(p, flights[p].pending)
            merge(p)
        for p in due_launch:
            eager = self.eager and not warming
            if eager and flights[p].pending is not None:
                receive(p, flights[p].pending)  # last round's mean steps the snapshot, one round late
            tree = _fragment_tree(frags[p], snap)
            # The pseudo-gradient: where this rank started the round minus where it is. Eager
            # rounds start from this rank's own origin, the others' from the snapshot.
            base = origin[p] if eager else tree
            pseudo = {path: torch.sub(base[path], out[i].detach()) for path, i in zip(frags[p].paths, frags[p].indices)}
            pending = start(
                tree, pseudo, what=_WHAT, group=self.group, bucket_cap_mb=self.bucket_cap_mb,
                first_bucket_mb=self.first_bucket_mb, weight=weights[p] if weighted else None,
                compression=_hook(self.compression, self.shard), compression_state=comp[p],
            )  # fmt: skip
            if self.extrapolate and not warming:
                pending = _Extrapolating(pending, pseudo, self.group)
            weights[p] = torch.zeros((), dtype=torch.float64)
            if warming:  # the local values become the ranks' mean, whatever the mixing
                receive(p, pending, average=True)
                for i in frags[p].indices:
                    out[i] = snap[i].clone()
                if self.eager:
                    origin[p] = _fragment_tree(frags[p], snap)
            elif eager:
                # This rank's own share, delta / N, through the outer optimizer from its committed
                # state (which stays as it is: the mean steps it when it lands); the round goes on
                # from there while the all-reduce travels.
                share = {path: torch.div(d, _dist.size(self.group)) for path, d in pseudo.items()}
                start_tree, _ = optim.apply_gradients(self.optimizer, share, outer[p], tree)
                for path, i in zip(frags[p].paths, frags[p].indices):
                    out[i] = start_tree[path].clone()  # the caller may donate its params: not the origin's
                origin[p] = dict(start_tree)
                flights[p] = Flight(count, torch.tensor(t + self.every, dtype=torch.int64), pending)
            elif self.delay == 0:
                receive(p, pending)
                merge(p)
            else:
                flights[p] = Flight(count, torch.tensor(t + self.delay, dtype=torch.int64), pending)
        new_state = DiLoCoState(
            count, optree.tree_unflatten(spec, snap), tuple(outer), tuple(comp), tuple(weights), tuple(flights), tuple(origin)
        )
        new_params = optree.tree_unflatten(spec, out)
        if not return_info:
            return new_params, new_state
        merged = () if self.eager and not warming else tuple(due_merge)
        info = OuterInfo(tuple(due_launch), merged + (tuple(due_launch) if (self.delay == 0 and not self.eager) or warming else ()),
                         tuple(syncs), sum(s.bytes_sent for s in syncs) + gathered, wait_s, tuple(gains))  # fmt: skip
        return new_params, new_state, info

    def settle(self, state: DiLoCoState, /) -> DiLoCoState:
        """Receive every fragment in flight and apply its outer step: a state of tensors only.

        A state with a fragment in flight holds its all-reduce, which cannot be saved.
        ``settle`` waits for it and steps the snapshot and the outer state with it as the merge
        would; only the merge into the local parameters still waits for its step. Resuming from
        the settled state gives bitwise the parameters an uninterrupted run gives. Every rank must
        call it at the same step (the received values are the same everywhere). A state with
        nothing in flight comes back as it is.

        Example:
            >>> state = outer.settle(state)
            >>> fddp.checkpoint.save(path, {"params": params, "outer": state})
        """
        self._check_state(state)
        if all(f.pending is None for f in state.flights):
            return state
        snap_leaves, spec = optree.tree_flatten(state.snapshot, none_is_leaf=True)
        frags = self._fragments(state.snapshot)
        snap = list(snap_leaves)
        outer, comp, flights = list(state.outer_state), list(state.compression_state), list(state.flights)
        # The peers wait for the same synchronisations: a failure here is fatal to the group, so
        # that they raise instead of waiting for this rank's next call.
        with _dist.call(self.group, "diloco.settle", headerless=True):
            for p, f in enumerate(flights):
                if f.pending is not None:
                    mean, info = f.pending.wait()
                    mean, _ = _extrapolated(mean, f.pending)
                    self._apply(p, frags[p], mean, info, snap, outer, comp)
                    flights[p] = f._replace(pending=None)
        return state._replace(snapshot=optree.tree_unflatten(spec, snap), outer_state=tuple(outer),
                              compression_state=tuple(comp), flights=tuple(flights))  # fmt: skip

    # --- the pieces ----------------------------------------------------------------------------

    def _apply(self, p: int, frag: Fragment, mean: Any, info: SyncInfo, snap: list, outer: list, comp: list,
               average: bool = False) -> int:  # fmt: skip
        """Step fragment ``p`` of the snapshot with its mean pseudo-gradient (into ``snap``, ``outer``,
        ``comp``); with ``average`` (a warm-up step) subtract it instead, leaving the outer state as
        it is. Return the bytes this sent (the all-gather of the new shards, with ``shard``)."""
        if _stateful(_hook(self.compression, self.shard)):
            comp[p] = info.compression_state
        if info.weight is not None:
            # One host read a merge (a GPU weight's sum is on the GPU): it decides both cases, alike on every rank.
            total = float(info.weight)
            if total == 0:
                return 0  # no rank had data since the last launch: nothing to step (momentum would move)
            if not math.isfinite(total):  # a GPU weight that was negative or not finite became NaN (as_weight)
                raise ValueError(
                    f"fddp.{_WHAT}: the weights summed over the ranks since the last synchronisation are {total}: a rank "
                    "passed a weight that is negative or not finite (a GPU tensor's is not read on the host when it is "
                    "given). Pass each inner step's sample count, a finite number >= 0; the snapshot and the outer state "
                    "are left as they were."
                )
        tree = _fragment_tree(frag, snap)
        sent = 0
        if self.shard:
            shards = zero.shard(tree, group=self.group, bucket_cap_mb=self.bucket_cap_mb, first_bucket_mb=self.first_bucket_mb)
            if average:
                shards = optree.tree_map(torch.sub, shards, mean)
            else:
                shards, outer[p] = optim.apply_gradients(self.optimizer, mean, outer[p], shards)
            new = zero.gather(shards).wait()
            sent = sum(s.numel() * s.element_size() for s in shards.shards)
        elif average:
            new = {path: torch.sub(tree[path], mean[path]) for path in tree}
        else:
            new, outer[p] = optim.apply_gradients(self.optimizer, mean, outer[p], tree)
        for path, i in zip(frag.paths, frag.indices):
            snap[i] = new[path]
        return sent

    def _fragments(self, params: Any) -> tuple[Fragment, ...]:
        return _split_of(optree.tree_structure(params, none_is_leaf=True), _checks.specs(params), self.fragments)

    @functools.cached_property
    def _rows(self) -> list[tuple[str, str, None]]:
        """The configuration as the ranks compare it (at the first step and at every launch)."""
        return [
            ("option diloco every", str(self.every), None),
            ("option diloco fragments", str(self.fragments), None),
            ("option diloco delay", str(self.delay), None),
            ("option diloco mixing", repr(float(self.mixing)), None),
            ("option diloco shard", str(self.shard), None),
            ("option diloco compression", describe(self.compression), None),
            ("option diloco warmup", str(self.warmup), None),
            ("option diloco eager", str(self.eager), None),
            ("option diloco extrapolate", str(self.extrapolate), None),
            ("option diloco optimizer", describe(self.optimizer), None),
        ]

    @functools.cached_property
    def _digest(self) -> int:
        return _dist.digest(self._rows)

    def _first_step(self) -> bool:
        """Whether this is the first step of this configuration on its group in this process
        (every rank's is the same call: the loops start together)."""
        if self.__dict__.get("_agreed_in") == _generation[0]:  # this object's first step is behind it (a fast path)
            return False
        return self._digest not in _started.get(self.group if self.group is not None else dist.group.WORLD, ())

    def _note_started(self) -> None:
        _started.setdefault(self.group if self.group is not None else dist.group.WORLD, set()).add(self._digest)
        self.__dict__["_agreed_in"] = _generation[0]  # forgotten with fddp.clear_caches(), which starts a new generation

    def _agree(self, t: int, snapshot: Any, leaves: list, spec: Any, checked: Sequence[int], problem: str | None) -> None:
        """Agree across the group on the configuration, the step ``t``, the tree, whether the params
        match the state, and the checksums of the snapshot's leaves ``checked``; raise
        :class:`fddp.MismatchError` on every rank, naming the difference, unless all ranks do.

        With the agreement off (``fddp.set_checks(agreement=False)``) only the configuration and the
        tree are compared, once, as every fddp call's signature is.
        """
        key = ("diloco.tree", spec, _checks.specs_of(leaves))
        tree = _dist.signature_digest(key, lambda: _tree.structure_rows(snapshot))
        paths = _tree.paths(spec)
        if not _dist.checks().agreement:
            self._agree_on(_dist.digest((self._digest, tree)), lambda: [*self._rows, *_tree.structure_rows(snapshot)])
            self._note_started()
            return
        sums = _dist.replica_digest([leaves[i] for i in checked], "full")
        state = problem or "match the state's shapes"

        def rows() -> list[tuple]:
            return [
                *self._rows,
                ("option diloco step", str(t), None),
                ("option diloco params", state, None),
                *_tree.structure_rows(snapshot),
                *[(f"snapshot {paths[i]}", f"checksum {s}", None) for i, s in zip(checked, sums)],
            ]

        self._agree_on(_dist.digest((self._digest, tree, t, state, tuple(checked), tuple(sums))), rows)
        self._note_started()  # once the ranks agreed: a first step that failed is a first step again next time

    def _agree_on(self, signature: int, rows: Any) -> None:
        with _dist.call(self.group, _WHAT):
            _dist.count_call(self.group, _WHAT)
            _dist.agree(self.group, _WHAT, rows, signature=signature, names=_checks.name_difference)

    def _refuse_split(self, spec: Any, what: str) -> None:
        """Raise unless every rank of the group holds the same slices: ZeRO's shards on the group
        DiLoCo averages over (``fddp.zero.shard``, ``fully_shard``) differ between ranks by design."""
        if not _layout.has_split(spec):
            return
        mine = set(dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD))
        for node in _layout.split_nodes(spec):
            g = node.split.group
            theirs = set(dist.get_process_group_ranks(g if g is not None else dist.group.WORLD))
            if len(mine & theirs) > 1:
                kind = "fully sharded parameters (ZeRO stage 3, fddp.zero.fully_shard)" if node.stage == 3 else (
                    "sharded parameters (fddp.zero.shard)")  # fmt: skip
                raise TypeError(
                    f"fddp.{what}: got {kind} sharded over ranks {sorted(mine & theirs)}, which this outer step "
                    "also averages over: each of them holds other slices of the buckets, and averaging them mixes "
                    "unrelated values. Average across replicas instead: shard within each worker and give DiLoCo "
                    "a group of ranks that hold the same slices (fully_shard(model, group=shard_group) and "
                    "fddp.diloco.diloco(..., group=replica_group)), or give it the gathered tree"
                )

    def _check_state(self, state: Any) -> None:
        if type(state) is DiLoCoState and len(state.flights) == self._n == len(state.outer_state) == len(state.origin):
            if not self.eager or all(o is not None for o in state.origin):
                return
        if not isinstance(state, tuple) or getattr(type(state), "_fields", None) != DiLoCoState._fields:
            raise TypeError(f"fddp.{_WHAT}: state must be the DiLoCoState from outer.init(params), got {type(state).__name__}")
        if len(state.flights) != self.count or len(state.outer_state) != self.count or len(state.origin) != self.count:
            raise ValueError(
                f"fddp.{_WHAT}: the state has {len(state.flights)} fragments, this outer step {self.count}; "
                "make the state with the same outer step's init(params)"
            )
        if self.eager and any(o is None for o in state.origin):
            raise ValueError(
                f"fddp.{_WHAT}: this outer step is eager but the state was made without eager=True (it holds no "
                "round origins); make the state with this outer step's init(params)"
            )


@_caches.cached(maxsize=64)
def _split_of(spec: Any, specs: tuple, fragments: int | tuple) -> tuple[Fragment, ...]:
    """The fragments of trees of this structure and these leaf shapes and dtypes (cached)."""
    like = optree.tree_unflatten(spec, [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in specs])
    return split(like, fragments, _WHAT) if isinstance(fragments, int) else split_by(like, fragments, _WHAT)


def _prefixes(fragments: Any) -> tuple[tuple[str, ...], ...]:
    """``fragments=`` as the user's groups of leaf prefixes: a sequence of prefixes or of lists of them."""
    bad = ValueError(
        "fddp.diloco: fragments must be an int or a sequence of fragments, each a leaf prefix ('blocks.0') or a "
        f"list of them (['embed', 'blocks.0']), got {fragments!r}"
    )
    if isinstance(fragments, (str, bytes)) or not isinstance(fragments, Sequence) or not fragments:
        raise bad
    out = []
    for f in fragments:
        group = (f,) if isinstance(f, str) else tuple(f) if isinstance(f, Sequence) else None
        if not group or not all(isinstance(x, str) for x in group):
            raise bad
        out.append(group)
    return tuple(out)


_started: "weakref.WeakKeyDictionary[Any, set[int]]" = weakref.WeakKeyDictionary()
_generation = [0]


def _forget_started() -> None:
    _started.clear()
    _generation[0] += 1


_caches.register("fddp.diloco._outer._started", _forget_started)


def _fragment_tree(frag: Fragment, leaves: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fragment as a tree: its leaves by path, in definition order (the order buckets fill)."""
    return {path: leaves[i] for path, i in zip(frag.paths, frag.indices)}


def _hook(compression: Any, shard: bool) -> Any:
    """The comm hook the synchronisations use; with ``shard``, wrapped to return this rank's shards."""
    if isinstance(compression, str) and compression in _CASTS:
        compression = Cast(_CASTS[compression])
    elif isinstance(compression, str) and compression in _NAMED:
        compression = _NAMED[compression]
    elif compression is not None and not isinstance(compression, hooks.CommHook):
        raise ValueError(
            f"fddp.diloco: compression must be None, 'bf16', 'fp16', 'e3m0', 'int4', 'int2' or an fddp.hooks.CommHook (fddp.Int8, "
            f"fddp.PowerSGD, ...), got {compression!r}"
        )
    if compression is not None and compression.shards:
        raise ValueError(f"fddp.diloco: compression={compression!r} already shards; use shard=True with an unsharded hook")
    return zero.ReduceScatter(inner=compression) if shard else compression


def _stateful(hook: Any) -> bool:
    return hook is not None and hook.stateful


def diloco(
    every: int,
    optimizer: GradientTransformation | None = None,
    *,
    compression: Any = None,
    fragments: int = 1,
    delay: int = 0,
    mixing: float = 0.0,
    shard: bool = False,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    first_bucket_mb: float = FIRST_BUCKET_MB,
    warmup: int = 0,
    eager: bool = False,
    extrapolate: bool = False,
) -> DiLoCo:
    """DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025): an outer optimizer on averaged
    pseudo-gradients every ``every`` inner steps.

    Args:
        every: ``H``, inner steps between synchronisations (of each fragment).
        optimizer: the outer optimizer; default SGD at learning rate 1 without momentum
            (``fddp.optim.sgd(1.0)``: the new global parameters are the ranks' mean), which
            reached DDP's loss best on runs of 15 to 30 outer steps in ``benchmarks/lowcomm.py``'s
            tuning (docs/lowcomm.md). The paper's Nesterov SGD (``fddp.optim.sgd(0.7,
            momentum=0.9, nesterov=True)``) is for runs of hundreds of outer steps: in runs of
            15 to 30 it ended 9% (a language model) and 93% (non-iid shards) above DDP's loss.
        compression: ``None``, ``"bf16"``, ``"fp16"`` or a comm hook (:class:`fddp.Int8`,
            :class:`fddp.PowerSGD`, any :class:`fddp.hooks.CommHook`).
        fragments: ``F`` for streaming: groups of leaves synchronised at staggered steps; an int
            (contiguous runs of leaves of about equal bytes) or the fragments themselves, each a
            leaf prefix or a list of them, as torchft takes module lists
            (``[["embed", "blocks.0"], "blocks.1", ["blocks.2", "head"]]``).
        delay: ``tau``, inner steps each fragment's all-reduce overlaps before it merges.
        mixing: ``alpha``, the weight of the local values when a fragment merges.
        shard: keep the outer optimizer's state sharded (``fddp.zero``'s cut).
        group: the process group (``None``: the default group).
        bucket_cap_mb: the synchronisations' bucket cap, in MiB.
        first_bucket_mb: their first bucket's cap, in MiB.
        warmup: synchronous inner steps at the start: after each, the ranks average their
            parameters (post-local SGD's warm start; ``PeriodicModelAverager``'s ``warmup_steps``,
            with averaging instead of a separate DDP phase); the rounds start after them.
        eager: never wait for a synchronisation (eager updates, Kale, Douillard and Donchev 2025):
            each fragment's all-reduce runs during the whole next round; at its launch this rank
            steps the snapshot with its own share of its pseudo-gradient (``delta / N``, through
            the outer optimizer, whose state is left as it is) and trains on from there; when the
            mean lands, at the fragment's next launch, it steps the snapshot and the outer state.
            The snapshot is then one round behind the ranks (``settle`` applies the last round).
            Not with ``delay``, ``mixing``, ``shard`` or ``weight=``.
        extrapolate: scale each mean pseudo-gradient by FedExP's gain before the outer step
            (Jhunjhunwala, Wang and Joshi 2023): ``max(1, mean_r |delta_r|^2 / (2 |mean|^2))``,
            1 while the ranks' pseudo-gradients agree, more as they cancel out (up to ``N / 2``
            for orthogonal ones on ``N`` ranks). One more all-reduce of one float64 per
            synchronisation, beside it. Not with ``shard``.

    Returns:
        A :class:`DiLoCo`: ``init(params)``, ``step(params, state)``, ``settle(state)``.

    Example:
        >>> outer = fddp.diloco.diloco(every=50)
        >>> state = outer.init(params)
        >>> params, state = outer.step(params, state)  # after each inner step
    """
    if optimizer is None:
        optimizer = optim.sgd(1.0)
    return DiLoCo(every, optimizer, compression, fragments, delay, mixing, shard, group, bucket_cap_mb, first_bucket_mb, warmup, eager,
                  extrapolate)  # fmt: skip


def local_sgd(
    every: int,
    *,
    compression: Any = None,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    first_bucket_mb: float = FIRST_BUCKET_MB,
    warmup: int = 0,
) -> DiLoCo:
    """Local SGD: average the parameters over the ranks every ``every`` inner steps.

    DiLoCo with outer SGD at learning rate 1 and no momentum: the new parameters are
    ``snapshot - mean(snapshot - params_r)``, the mean of every rank's parameters up to rounding
    (torch's ``PeriodicModelAverager``, which, unlike this, skips every parameter whose ``.grad``
    is ``None``).

    Args:
        every: inner steps between two averagings.
        compression: how the differences travel (see :func:`diloco`).
        group: the process group (``None``: the default group).
        bucket_cap_mb: the synchronisations' bucket cap, in MiB.
        first_bucket_mb: their first bucket's cap, in MiB.
        warmup: synchronous inner steps at the start (see :func:`diloco`).

    Returns:
        A :class:`DiLoCo`.

    Example:
        >>> outer = fddp.diloco.local_sgd(every=8)
        >>> state = outer.init(params)
        >>> params, state = outer.step(params, state)  # after each inner step
    """
    return diloco(every, optim.sgd(1.0), compression=compression, group=group, bucket_cap_mb=bucket_cap_mb,
                  first_bucket_mb=first_bucket_mb, warmup=warmup)  # fmt: skip
