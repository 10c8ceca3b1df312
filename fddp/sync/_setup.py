"""One setup for every synchronisation: options in, an agreed plan and a reducer out.

``ddp_step``, ``grad``/``grad_and_value``, ``broadcast``, ``sync_buffers``, ``verify_replicas``
and ``fddp.zero`` all start here. Their keyword options become one frozen :class:`SyncOptions`
(checked once and cached: a loop passes the same options every step); :func:`setup` turns a tree
and the options into a :class:`Sync` (the tree's leaves, structure and bucket plan), agreeing with
the other ranks on the call first (``fddp._dist.agree``), and :meth:`Sync.reducer` moves values
through the comm hook. Per-step values (this rank's ``weight``, a comm hook's state) are given to
the call, not to the options. :func:`plan_of` is the planner the setup calls, for anyone who needs
a tree's plan without communicating (the tests, the benchmarks).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import operator
from typing import Any, Callable, Hashable, NamedTuple

import optree
import torch
import torch.distributed as dist

from fddp import _caches, _dist, _layout
from fddp._layout import BUCKET_CAP_MB, FIRST_BUCKET_MB, BucketPlan, module_aliases
from fddp._tree import LeafSpec, definition_order, flatten, paths, specs_of, structure_rows, tensor_leaves
from fddp.runtime import require_initialized
from fddp.sync._checksum import check_replicas
from fddp.sync._comm import Comm, on_host
from fddp.sync._reducer import Reducer
from fddp.sync.hooks import Cast, CommHook, Mean, WeightedMean

__all__ = [
    "KEYWORDS",
    "SyncOptions",
    "Sync",
    "make_options",
    "setup",
    "plan_of",
    "as_hook",
    "as_weight",
    "nan_where_invalid",
    "check_state",
    "check_dtypes",
    "dtype_error",
]

_CAST_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_MEAN, _WEIGHTED_MEAN = Mean(), WeightedMean()


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    """How one synchronisation runs: all of it shapes the collectives, so ranks must agree on it
    (it is part of the call's signature).

    Attributes:
        group: the process group (``None``: the default one).
        bucket_cap_mb: the cap of every bucket but the first, in MiB.
        first_bucket_mb: the cap of the first bucket, in MiB.
        hook: the comm hook that reduces each bucket.
        weighted: a weight rides along (the call's ``weight=``).
        check_finite: compute ``SyncInfo.finite``.
    """

    group: dist.ProcessGroup | None = None
    bucket_cap_mb: float = BUCKET_CAP_MB
    first_bucket_mb: float = FIRST_BUCKET_MB
    hook: CommHook = _MEAN
    weighted: bool = False
    check_finite: bool = False

    def signature_rows(self, state: Any) -> tuple[tuple, ...]:
        """The options as signature rows: any per-rank difference names the option and both values.

        Without a hook state and with a frozen hook (fddp's own), the rows are made once per
        options object (a training loop's options come from :func:`make_options`' cache)."""
        if state is None and not torch.compiler.is_compiling():  # dynamo traces the rows, not the memo
            rows = self.__dict__.get("_rows")
            if rows is None:
                rows = self._signature_rows(None)
                if dataclasses.is_dataclass(self.hook) and self.hook.__dataclass_params__.frozen:
                    object.__setattr__(self, "_rows", rows)
            return rows
        return self._signature_rows(state)

    def _signature_rows(self, state: Any) -> tuple[tuple, ...]:
        return (
            ("option weight", "a weight" if self.weighted else "no weight", None),
            ("option bucket_cap_mb", repr(float(self.bucket_cap_mb)), None),
            ("option first_bucket_mb", repr(float(self.first_bucket_mb)), None),
            ("option compression", self.hook.signature(state), None),
            # A sharding hook adds an all-reduce for the finite check: one rank asking and one not
            # would pair it with the next call's collectives.
            ("option check_finite", repr(self.check_finite), None),
        )


def as_hook(compression: Any, weighted: bool, what: str) -> CommHook:
    """Normalise ``compression=`` to a comm hook; ``None`` is the (weighted, with ``weight=``) mean."""
    if compression is None or compression == "none":
        return _WEIGHTED_MEAN if weighted else _MEAN
    if isinstance(compression, str) and compression in _CAST_NAMES:
        return Cast(_CAST_NAMES[compression])
    if isinstance(compression, CommHook):
        if isinstance(compression, Mean) and weighted:
            return _WEIGHTED_MEAN
        return compression
    raise ValueError(
        f"fddp.{what}: compression must be None, 'bf16', 'fp16', fddp.Cast, fddp.PowerSGD or another "
        f"fddp.hooks.CommHook; got {compression!r}"
    )


# The keyword options every synchronising front end takes, with their defaults.
KEYWORDS: dict[str, Any] = dict(
    group=None, bucket_cap_mb=BUCKET_CAP_MB, first_bucket_mb=FIRST_BUCKET_MB, compression=None, check_finite=False, return_info=True
)


def make_options(what: str, /, *, weighted: bool = False, **options: Any) -> SyncOptions:
    """Check the keyword options of ``fddp.<what>`` (:data:`KEYWORDS`) and return one :class:`SyncOptions`.

    The same options (hashable, as fddp's hooks and plain values are) give the same object from
    a cache, so a training loop checks them once.
    """
    if not options.keys() <= KEYWORDS.keys():
        unknown = sorted(set(options) - set(KEYWORDS))
        raise TypeError(f"fddp.{what}: unexpected keyword {unknown[0]!r}; the options are {', '.join(KEYWORDS)}")
    o = {**KEYWORDS, **options}
    args = (what, o["group"], o["bucket_cap_mb"], o["first_bucket_mb"], o["compression"], o["check_finite"], o["return_info"], weighted)
    try:
        return _options(*args)
    except TypeError as e:
        if "unhashable" not in str(e):
            raise
        return _make(*args)  # a user's hook that cannot be hashed: checked on every call


def _make(
    what: str, group: Any, bucket_cap_mb: Any, first_bucket_mb: Any, compression: Any, check_finite: Any, return_info: Any, weighted: bool
) -> SyncOptions:
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"fddp.{what}: {name} must be a positive number of MiB, got {value!r}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"fddp.{what}: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    hook = as_hook(compression, weighted, what)
    if weighted and not hook.weighted:
        raise ValueError(f"fddp.{what}: weight= cannot be combined with compression={hook!r}, which does not implement weighted means")
    if hook.stateful and not return_info:
        raise ValueError(f"fddp.{what}: {hook!r} returns its next state in info.compression_state; pass return_info=True")
    if check_finite and not return_info:
        raise ValueError(f"fddp.{what}: check_finite=True computes info.finite, which only return_info=True returns; pass both")
    # Floats: 25 and 25.0 are one option (equal, and equal keys of the options cache).
    return SyncOptions(group, float(bucket_cap_mb), float(first_bucket_mb), hook, weighted, bool(check_finite))


_options = _caches.cached(maxsize=128, name="fddp.sync._setup._options")(_make)


def as_weight(weight: Any, what: str) -> torch.Tensor:
    """This rank's weight as a float64 scalar tensor, or raise naming what arrived.

    Outside torch.compile a number, or a CPU tensor, is checked on the host (a finite number
    >= 0) and comes back on the CPU. A tensor on a GPU stays there, and under torch.compile any
    weight is a tensor of the graph; their type and shape are checked, but not their value:
    reading it would make the host wait for the GPU (or cannot be traced). A value that is
    negative or not finite becomes NaN instead (:func:`nan_where_invalid`), which makes every rank's mean
    NaN (``info.finite`` false, ``info.weight`` NaN).
    """
    if isinstance(weight, torch.Tensor):
        if weight.requires_grad:
            raise ValueError(f"fddp.{what}: weight must not require grad (the weighted mean is differentiated in the gradients only)")
        if weight.numel() != 1:
            raise ValueError(f"fddp.{what}: weight must be a scalar (this rank's sample count), got shape {tuple(weight.shape)}")
        if weight.is_complex() or weight.dtype == torch.bool:
            raise TypeError(f"fddp.{what}: weight must be a real number (this rank's sample count), got a {weight.dtype} tensor")
        if not on_host(weight):
            return nan_where_invalid(weight.detach().to(torch.float64).reshape(()))
        w = weight.detach().to("cpu", torch.float64).reshape(())
        value = float(w)
    elif isinstance(weight, (int, float)) and not isinstance(weight, bool):
        if torch.compiler.is_compiling():  # dynamo traces a number as a symbol, whose value it cannot test
            return nan_where_invalid(torch.scalar_tensor(weight, dtype=torch.float64))
        w = torch.tensor(float(weight), dtype=torch.float64)
        value = float(w)
    else:
        raise TypeError(
            f"fddp.{what}: weight must be a number or a one-element tensor (this rank's sample count), got "
            f"{type(weight).__name__} {weight!r}"
        )
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"fddp.{what}: weight must be a finite number >= 0 (this rank's sample count), got {value!r}")
    return w


def nan_where_invalid(w: torch.Tensor) -> torch.Tensor:
    """``w``, or NaN where it is negative or not finite: the check of a weight the host cannot read
    (``ddp_step``'s, and ``fddp.diloco``'s GPU weights).

    Not ``torch._assert_async``: a failed device assert leaves the CUDA context unusable (nothing
    more runs in the process, not even a checkpoint) and strands the peers inside the collective,
    where NaN reaches every rank through the weight sum, as a NaN gradient would.
    """
    return w.masked_fill(~(w.isfinite() & (w >= 0)), math.nan)  # a fill: no scalar tensor to copy to the GPU


def check_state(options: SyncOptions, state: Any, what: str, compression: Any = None) -> None:
    """Raise unless ``compression_state`` fits the hook: given exactly when the hook is stateful.

    ``compression`` is what the caller passed, for the message (``'bf16'`` rather than its hook).
    """
    hook = options.hook
    if hook.stateful and state is None:
        raise ValueError(
            f"fddp.{what}: compression={hook!r} needs compression_state= (from its init(params), then each "
            f"step's info.compression_state), got NoneType"
        )
    if not hook.stateful and state is not None:
        raise ValueError(
            f"fddp.{what}: compression_state is only used by a stateful comm hook such as fddp.PowerSGD, "
            f"got compression={compression if compression is not None else hook!r}"
        )


def check_dtypes(sync: "Sync", what: str, compression: Any = None) -> None:
    """Raise a TypeError naming the first gradient the call cannot average (see :func:`dtype_error`).

    Per bucket, not per leaf: a bucket holds one dtype, and a plan has a handful of buckets.
    """
    hook = sync.options.hook
    bad = {b.dtype for b in sync.plan.buckets if not (b.dtype.is_floating_point or b.dtype.is_complex) or hook.cannot_carry(b.dtype)}
    if bad:
        first = next(t.dtype for t in sync.leaves if t.dtype in bad)  # the first in the tree, not in the plan
        raise TypeError(dtype_error(first, sync.leaves, sync.spec, hook, what, compression))


def dtype_error(
    dtype: torch.dtype, leaves: list[torch.Tensor], spec: optree.PyTreeSpec, hook: CommHook, what: str, compression: Any = None
) -> str:
    """Words for a gradient dtype that ``hook`` cannot average: not floating point or complex (a
    mean of integers is no integer; torch's gradients are floating point or complex), or one the
    hook cannot send (a complex leaf in half precision). Names the first leaf of that dtype."""
    i = next(i for i, t in enumerate(leaves) if t.dtype == dtype)
    where = f"grad {paths(spec)[i]!r}"
    if not (dtype.is_floating_point or dtype.is_complex):
        return (
            f"fddp.{what}: gradients must be floating point or complex, but {where} is {dtype} (its parameter's "
            "dtype); keep integer and bool tensors (step counters, masks) out of the tree you synchronise, or "
            "make them identical on every rank with fddp.broadcast or fddp.sync_buffers(..., 'mean'), which "
            "takes an integer's maximum"
        )
    shown = compression if compression is not None else hook
    return (
        f"fddp.{what}: compression={shown!r} cannot carry {where}, a {dtype} leaf: {hook.cannot_carry(dtype)}. "
        "Synchronise complex gradients without compression (compression=None), in a call of their own if "
        "the rest should stay compressed"
    )


class Sync:
    """One synchronisation of a tree, from open to close: its leaves, structure, bucket plan and
    the call's values, and the life every front end gives it.

    Every synchronising front end (``ddp_step``, ``grad``/``grad_and_value``, ``broadcast``,
    ``sync_buffers``, the differentiable mean, ``fddp.diloco``'s in-flight sync) goes through the
    same four steps, in this order::

        sync = setup(tree, options, what, agree=False)   # open: plan, number the call
        sync.announce(...)                               # the head: carrying the data, gated or waited
        reducer = sync.reducer(state); reducer.push(leaves)   # or reducer.arrive(i, g) from backward
        flats, info = sync.close(reducer)                # check, wait, record the call


    Attributes:
        leaves: the tree's leaves (flatten order).
        spec: the tree's structure.
        plan: the bucket plan.
        options: the synchronisation's options.
        what: the public function's name, for messages.
        weight: this rank's weight (a float64 scalar tensor, from :func:`as_weight`), or ``None``.
        digest: the digest of the call's signature (what the ranks agree on).
        rows: builds the signature's rows (to name a difference between ranks).
        new: once agreed, whether some rank met this signature for the first time (the same
            answer on every rank).
    """

    __slots__ = ("leaves", "spec", "plan", "options", "what", "weight", "digest", "rows", "new", "_comm", "_pending")

    def __init__(
        self,
        leaves: list[torch.Tensor],
        spec: optree.PyTreeSpec,
        plan: BucketPlan,
        options: SyncOptions,
        what: str,
        weight: torch.Tensor | None,
        digest: int,
        rows: Callable[[], list[tuple]],
    ) -> None:
        self.leaves, self.spec, self.plan, self.options, self.what = leaves, spec, plan, options, what
        self.weight, self.digest, self.rows = weight, digest, rows
        self.new = False  # after agree(): whether some rank met this signature for the first time
        self._comm: Comm | None = None
        self._pending: PendingAgreement | None = None  # a head that carries the data, read in close()

    @property
    def comm(self) -> Comm:
        """The synchronisation's handle on the process group (one per call: it counts the bytes)."""
        if self._comm is None:
            o = self.options
            self._comm = Comm(o.group, self.what, self.plan, self.weight)
        return self._comm

    def agree(self, *, replicas: bool = False, drift: bool = False) -> bool:
        """Agree with the other ranks on this call now (:meth:`announce`, waited for at once);
        return whether the replicas were compared.

        With ``replicas`` (the leaves are parameters of replicas), the first call on a tree that
        some rank holds straight from ``fddp.functionalize`` (its module's own tensors: no
        ``fddp.broadcast`` since) also compares the leaves' checksums across the ranks, unless
        ``fddp.set_checks(replicas=False)``.
        """
        return self._start(replicas, drift).finish()

    def announce(self, *, replicas: bool = False, drift: bool = False, gate: Reducer | None = None) -> None:
        """Start this call's agreement: the one place a synchronisation starts it and decides when
        it is waited for.

        - where the call's only collective is a plain mean's bucket that fits in the head
          (``fddp._dist.can_carry``: decided from the signature, alike on every rank), the bucket
          rides in the head, and :meth:`close` reads the head before anything is returned;
        - otherwise, with a ``gate``: its reducer waits for the head before its first bucket
          goes out (``grad_and_value``: the round trip overlaps the backward that fills it);
        - otherwise: waited for here, before any bucket.

        ``replicas`` and ``drift`` (the leaves are the replicas' parameters: the head also
        carries a fingerprint of them, and replicas that drifted apart are compared leaf by leaf
        and named) are :meth:`agree`'s.
        """
        pending = self._start(replicas, drift, self._carries, defer=True)
        self.comm.stamp(pending.agreement.stamp)  # a batched call's: its first all-reduce carries it
        if pending.agreement.open:
            self.comm.carry(pending.agreement)
            self._pending = pending
        elif gate is not None:
            gate.gate = pending
        else:
            pending.finish()

    def _start(self, replicas: bool, drift: bool, carry: bool = False, defer: bool = False) -> PendingAgreement:
        replicas = replicas and _dist.checks().replicas
        leaves = self.leaves
        ask = (lambda: module_aliases(leaves)) if replicas else False  # asked only of a tree new to this rank
        group = self.options.group
        send = replicas and drift and _dist.size(group) > 1  # a one-rank group sends no head: no fingerprint
        values = _dist.replica_digest(self.leaves, "sampled") if send else 0
        agreement = _dist.start_agreement(
            group, self.what, self.rows, signature=self.digest, ask=ask, values=values, carry=carry, defer=defer
        )  # fmt: skip
        return PendingAgreement(self, agreement)

    def close(self, reducer: Reducer) -> tuple[list[torch.Tensor], Any]:
        """Finish the call: read a head still under way (the one its data rode in: before
        anything is returned, so a mismatch raises here, on every rank), then wait for every
        bucket. Returns ``(reduced buffers, info)``.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()
        return reducer.finish()

    @property
    def _carries(self) -> bool:
        """Whether the call's data can ride in its head: a plain mean of one bucket that fits."""
        buckets = self.plan.buckets
        if type(self.options.hook) is not Mean or len(buckets) != 1 or _dist.size(self.options.group) == 1:
            return False
        b = buckets[0]
        return _dist.can_carry(self.options.group, b.numel, b.dtype, b.device)

    def reducer(self, state: Any = None) -> Reducer:
        """A reducer for one synchronisation of this tree, with the hook's ``state``."""
        return Reducer(self.plan, self.options.hook, state, self.comm, self.options.check_finite)

    def tree(self, results: list[torch.Tensor], made: list[Any] | None = None) -> Any:
        """The synchronised tree from the reduced buffers (the hook's ``tree``: views laid out for
        ``fddp.optim``, or a sharding hook's shards)."""
        return self.options.hook.tree(self.spec, self.comm, results, made)


class PendingAgreement:
    """A :class:`Sync`'s agreement under way (:meth:`Sync.announce`): finished by the reducer's
    gate, by :meth:`Sync.close`, or at once.

    Example:
        >>> pending = sync._start(replicas=True, drift=False)
        >>> ...  # work that issues no collective on the group
        >>> pending.finish()  # before the call's first bucket
    """

    __slots__ = ("sync", "agreement")

    def __init__(self, sync: Sync, agreement: _dist.Agreement) -> None:
        self.sync, self.agreement = sync, agreement

    def finish(self) -> bool:
        """Wait for the agreement (and, on a tree fresh from ``fddp.functionalize``, compare the
        replicas); return whether the replicas were compared."""
        sync = self.sync
        agreed = self.agreement.finish()
        sync.new = agreed.new
        if agreed.asked:
            check_replicas(sync.leaves, sync.spec, sync.options.group, sync.what)
        elif agreed.drifted:
            check_replicas(sync.leaves, sync.spec, sync.options.group, sync.what, drifted=True)
        return agreed.asked or agreed.drifted


class _Record(NamedTuple):
    """What a call signature always gives: its digest and its bucket plan."""

    digest: int
    plan: BucketPlan


_KEYS = 1024  # distinct call signatures remembered (a training loop needs a handful)
_records: "collections.OrderedDict[Hashable, _Record]" = collections.OrderedDict()
_caches.register("fddp.sync._setup._records", _records.clear)


def setup(
    tree: Any,
    options: SyncOptions,
    what: str,
    state: Any = None,
    *,
    weight: torch.Tensor | None = None,
    members: tuple[LeafSpec, ...] | None = None,
    flat: tuple[list[torch.Tensor], optree.PyTreeSpec] | None = None,
    specs: tuple | None = None,
    agree: bool = True,
    replicas: bool = False,
) -> Sync:
    """Plan ``tree``'s buckets and agree with the other ranks on the call; return it as a :class:`Sync`.

    Every synchronising call starts here, so this also numbers the calls to ``fddp.<what>``, for
    the error a failed collective raises ("call 1234 to fddp.ddp_step"). The call's signature is
    looked up by a cheap local key (the treedef, the leaf specs, the definition order, the options'
    rows); only a new key walks the tree for its rows, digests them and plans the buckets.

    Args:
        tree: the pytree of tensors that fixes the buckets (the parameters, for gradients).
        options: the synchronisation's options.
        what: the public function's name, for messages.
        state: the comm hook's state (part of the signature: PowerSGD's switch to compressing).
        weight: this rank's weight (from :func:`as_weight`), with ``options.weighted``.
        members: under ``vmap``, the leaf specs of one member: buckets are planned for those and
            hold every member's copy of their leaves (``fddp._layout.respec``).
        flat: ``tree``'s leaves and structure, where the caller has flattened it already.
        specs: the leaves' ``(shape, dtype, device)`` (``fddp._tree.specs_of``), where the caller has them.
        agree: agree now; ``False`` leaves it to the caller (:meth:`Sync.agree`, which
            ``grad_and_value`` calls once the forward pass has run).
        replicas: the leaves are the parameters of replicas (see :meth:`Sync.agree`).
    """
    require_initialized(what)
    leaves, spec = flat if flat is not None else tensor_leaves(tree, what)
    if _layout.has_split(spec):
        if any(s.stage == 3 for s in _layout.split_nodes(spec)):
            raise TypeError(
                f"fddp.{what}: got fully sharded parameters (ZeRO stage 3, fddp.zero.fully_shard); their "
                "gradients need no sync: differentiate a loss that calls fully_shard's apply_fn with "
                "fddp.grad_and_value or torch.func.grad, and the gradient shards come out averaged"
            )
        raise TypeError(
            f"fddp.{what}: got a sharded tree (fddp.zero.Sharded: this rank's slices of the buckets, which "
            "differ between ranks by design); synchronise the full tree instead, e.g. the parameters from "
            "fddp.zero.gather(shards).wait()"
        )
    if specs is None:
        specs = specs_of(leaves)
    order = definition_order(tree, spec)
    option_rows = options.signature_rows(state)

    def rows() -> list[tuple]:
        return [*option_rows, *structure_rows(tree)]

    key = (spec, specs, order, option_rows, members, options.bucket_cap_mb, options.first_bucket_mb)
    if torch.compiler.is_compiling():  # dynamo traces neither the cache nor hashlib: the digest is taken at trace time
        # Sizes traced as symbols (automatic dynamic shapes, after recompiles for other models) are
        # made concrete (operator.index specializes them: the graph is guarded on these sizes), so
        # that the digest and the bucket plan are of one tree's sizes.
        specs = [(tuple(operator.index(d) for d in shape), dtype, device) for shape, dtype, device in specs]
        record = _Record(_dist.traced_digest((option_rows, tuple((s[0], str(s[1]), str(s[2])) for s in specs), order)),
                         _plan(specs, members, order, options))
    else:
        record = _records.get(key)
    if record is None:
        record = _records[key] = _Record(_dist.digest(rows()), _plan(specs, members, order, options))
        if len(_records) > _KEYS:
            _records.popitem(last=False)
    _dist.count_call(options.group, what)
    sync = Sync(leaves, spec, record.plan, options, what, weight, record.digest, rows)
    if agree:
        sync.agree(replicas=replicas, drift=replicas)
    return sync


def _plan(specs: tuple, members: tuple[LeafSpec, ...] | None, order: tuple[int, ...] | None, options: SyncOptions) -> BucketPlan:
    base = _layout.plan(specs if members is None else members, options.bucket_cap_mb, options.first_bucket_mb, order)
    if members is not None and members != specs:
        base = _layout.respec(base, tuple(LeafSpec(tuple(s[0]), s[1], s[2]) for s in specs))
    # One object per plan: the caches keyed by plans (the reducer's, the views') then match it by
    # identity, where an equal plan of another call (broadcast's, say) would be compared field by
    # field, every shape, at every lookup.
    plan = _plans.setdefault(base, base)
    if len(_plans) > _KEYS:
        _plans.pop(next(iter(_plans)))
    return plan


_plans: dict[BucketPlan, BucketPlan] = {}
_caches.register("fddp.sync._setup._plans", _plans.clear)


def plan_of(tree: Any, /, bucket_cap_mb: float = BUCKET_CAP_MB, first_bucket_mb: float = FIRST_BUCKET_MB) -> BucketPlan:
    """Return the bucket plan :func:`setup` makes for ``tree``: leaves in optree's flatten order,
    filled in the tree's definition order, reversed. No communication.

    Example:
        >>> plan = plan_of({"w": torch.zeros(3), "b": torch.zeros(2)})
        >>> [b.indices for b in plan.buckets]
        [(0, 1)]
    """
    leaves, _ = flatten(tree)
    return _layout.plan(specs_of(leaves), bucket_cap_mb, first_bucket_mb, definition_order(tree))
