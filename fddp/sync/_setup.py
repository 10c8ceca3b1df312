"""One setup for every synchronisation: options in, a checked plan and a reducer out.

``ddp_step``, ``grad``/``grad_and_value``, ``broadcast``, ``sync_buffers`` and ``verify_replicas``
all start here: their keyword options become one frozen :class:`SyncOptions`, and :func:`setup`
turns a tree and the options into a :class:`Sync` (the tree's leaves and bucket plan, after the
cross-rank signature check), whose :meth:`Sync.reducer` moves values through the comm hook.
:func:`plan_of` is the planner the setup calls, for anyone who needs a tree's plan without
communicating (the tests, the benchmarks).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist

from fddp import _layout, _shard
from fddp._layout import BucketPlan
from fddp._tree import LeafSpec, definition_order, structure_rows, tensor_leaves
from fddp.runtime import require_initialized
from fddp.sync._comm import Comm
from fddp.sync._reducer import Reducer
from fddp.sync._signature import check_signature, count_call
from fddp.sync.hooks import Cast, CommHook, Mean, WeightedMean

__all__ = ["KEYWORDS", "SyncOptions", "Sync", "make_options", "setup", "plan_of", "as_hook"]

_CAST_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_MEAN, _WEIGHTED_MEAN = Mean(), WeightedMean()


@dataclasses.dataclass(frozen=True)
class SyncOptions:
    """How one synchronisation runs; everything in it but ``weight`` and ``check_finite`` shapes
    the collectives, so ranks must agree on it (checked with the tree's signature).

    Attributes:
        group: the process group (``None``: the default one).
        bucket_cap_mb: the cap of every bucket but the first, in MiB.
        first_bucket_mb: the cap of the first bucket, in MiB.
        hook: the comm hook that reduces each bucket.
        weight: this rank's weight (a float64 CPU scalar), or ``None``; a per-call value.
        check_finite: compute ``SyncInfo.finite``.
    """

    group: dist.ProcessGroup | None = None
    bucket_cap_mb: float = 25.0
    first_bucket_mb: float = 1.0
    hook: CommHook = _MEAN
    weight: torch.Tensor | None = None
    check_finite: bool = False

    def signature_rows(self, state: Any) -> list[tuple]:
        """The options as signature rows: any per-rank difference names the option and both values."""
        return [
            ("option weight", "a weight" if self.weight is not None else "no weight", None),
            ("option bucket_cap_mb", repr(self.bucket_cap_mb), None),
            ("option first_bucket_mb", repr(self.first_bucket_mb), None),
            ("option compression", self.hook.signature(state), None),
        ]


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


def stateful(hook: CommHook) -> bool:
    """Whether the hook keeps state between steps (it defines its own ``init``)."""
    return hook.stateful


# The keyword options every synchronising front end takes, with their defaults.
KEYWORDS: dict[str, Any] = dict(
    group=None, bucket_cap_mb=25.0, first_bucket_mb=1.0, weight=None, compression=None, check_finite=False, return_info=True
)


def make_options(what: str, **options: Any) -> SyncOptions:
    """Check the keyword options of ``fddp.<what>`` (:data:`KEYWORDS`) and return one :class:`SyncOptions`."""
    unknown = sorted(set(options) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"fddp.{what}: unexpected keyword {unknown[0]!r}; the options are {', '.join(KEYWORDS)}")
    o = {**KEYWORDS, **options}
    group, bucket_cap_mb, first_bucket_mb, weight = o["group"], o["bucket_cap_mb"], o["first_bucket_mb"], o["weight"]
    compression, check_finite, return_info = o["compression"], o["check_finite"], o["return_info"]
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"fddp.{what}: {name} must be a positive number of MiB, got {value!r}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"fddp.{what}: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    hook = as_hook(compression, weight is not None, what)
    if weight is not None and not hook.weighted:
        raise ValueError(f"fddp.{what}: weight= cannot be combined with compression={hook!r}, which does not implement weighted means")
    if stateful(hook) and not return_info:
        raise ValueError(f"fddp.{what}: {hook!r} returns its next state in info.compression_state; pass return_info=True")
    if check_finite and not return_info:
        raise ValueError(f"fddp.{what}: check_finite=True computes info.finite, which only return_info=True returns; pass both")
    return SyncOptions(group, bucket_cap_mb, first_bucket_mb, hook, None if weight is None else as_weight(weight, what), bool(check_finite))


def as_weight(weight: Any, what: str) -> torch.Tensor:
    """This rank's weight as a float64 CPU scalar tensor, or raise naming what arrived."""
    if isinstance(weight, torch.Tensor) and weight.requires_grad:
        raise ValueError(f"fddp.{what}: weight must not require grad (the weighted mean is differentiated in the gradients only)")
    w = torch.as_tensor(weight, dtype=torch.float64).detach().cpu()
    if w.numel() != 1:
        raise ValueError(f"fddp.{what}: weight must be a scalar (this rank's sample count), got shape {tuple(w.shape)}")
    return w.reshape(())


def check_state(options: SyncOptions, state: Any, what: str, compression: Any = None) -> None:
    """Raise unless ``compression_state`` fits the hook: given exactly when the hook is stateful.

    ``compression`` is what the caller passed, for the message (``'bf16'`` rather than its hook).
    """
    hook = options.hook
    if stateful(hook) and state is None:
        raise ValueError(
            f"fddp.{what}: compression={hook!r} needs compression_state= (from its init(params), then each "
            f"step's info.compression_state), got NoneType"
        )
    if not stateful(hook) and state is not None:
        raise ValueError(
            f"fddp.{what}: compression_state is only used by a stateful comm hook such as fddp.PowerSGD, "
            f"got compression={compression if compression is not None else hook!r}"
        )


class Sync(NamedTuple):
    """A tree ready to synchronise: its leaves, structure and checked bucket plan."""

    leaves: list[torch.Tensor]
    spec: optree.PyTreeSpec
    plan: BucketPlan
    options: SyncOptions
    what: str

    def reducer(self, state: Any = None) -> Reducer:
        """A reducer for one synchronisation of this tree, with the hook's ``state``."""
        o = self.options
        return Reducer(self.plan, o.hook, state, Comm(o.group, self.what, self.plan, o.weight), o.check_finite)

    def unflatten(self, flats: list[torch.Tensor], made: list[Any] | None = None) -> Any:
        """The tree rebuilt from reduced buffers (its leaves are views into them); a sharding
        hook's shards as a :class:`fddp.zero.Sharded` of the tree instead. ``made``: views of
        some buffers already made (:meth:`fddp.sync._reducer.Reducer.made_views`)."""
        o = self.options
        if o.hook.shards:
            world, rank = dist.get_world_size(o.group), dist.get_rank(o.group)
            return _shard.Sharded(flats, _shard.layout(self.plan, self.spec, world, rank, o.group))
        return optree.tree_unflatten(self.spec, _layout.unflatten(self.plan, flats, made))


def setup(tree: Any, options: SyncOptions, what: str, state: Any = None, *, members: tuple[LeafSpec, ...] | None = None) -> Sync:
    """Check ``tree``'s signature (with the options) across the group; return it with its plan.

    Every synchronising call starts here, so this also numbers the calls to ``fddp.<what>``, for
    the error a failed collective raises ("call 1234 to fddp.ddp_step").

    Args:
        tree: the pytree of tensors that fixes the buckets (the parameters, for gradients).
        options: the synchronisation's options.
        what: the public function's name, for messages.
        state: the comm hook's state (part of the signature: PowerSGD's switch to compressing).
        members: under ``vmap``, the leaf specs of one member: buckets are planned for those and
            hold every member's copy of their leaves (``fddp._layout.respec``).
    """
    require_initialized(what)
    leaves, spec = tensor_leaves(tree, what)
    if _shard.spec_has_sharded(spec):
        if any(s.layout.stage == 3 for s in _shard.sharded_roots(tree)):
            raise TypeError(
                f"fddp.{what}: got fully sharded parameters (ZeRO stage 3, fddp.zero.fully_shard); their "
                "gradients need no sync: differentiate a loss that calls fully_shard's apply_fn with "
                "fddp.grad_and_value or torch.func.grad, and the gradient shards come out averaged"
            )
        raise TypeError(
            f"fddp.{what}: got a sharded tree (fddp.zero.Sharded: this rank's slices of the buckets, which "
            "differ between ranks by design); synchronise the full tree instead, e.g. the parameters "
            "from fddp.zero.gather(shards).wait()"
        )
    specs = tuple(LeafSpec.of(t) for t in leaves)
    order = definition_order(tree)
    rows = options.signature_rows(state)
    count_call(options.group, what)
    check_signature((spec, specs, order, tuple(rows)), lambda: rows + structure_rows(tree), options.group, what)
    plan = _plan(specs if members is None else members, order, options.bucket_cap_mb, options.first_bucket_mb)
    if members is not None and members != specs:
        plan = _layout.respec(plan, specs)
    return Sync(leaves, spec, plan, options, what)


def _plan(specs: tuple[LeafSpec, ...], order: tuple[int, ...] | None, bucket_cap_mb: float, first_bucket_mb: float) -> BucketPlan:
    return _layout.plan(specs, bucket_cap_mb, first_bucket_mb, order)


def plan_of(tree: Any, /, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0) -> BucketPlan:
    """Return the bucket plan :func:`setup` makes for ``tree``: leaves in optree's flatten order,
    filled in the tree's definition order, reversed. No communication.

    Example:
        >>> plan = plan_of({"w": torch.zeros(3), "b": torch.zeros(2)})
        >>> [b.indices for b in plan.buckets]
        [(0, 1)]
    """
    specs = tuple(LeafSpec.of(t) for t in optree.tree_leaves(tree, none_is_leaf=True))
    return _plan(specs, definition_order(tree), bucket_cap_mb, first_bucket_mb)
