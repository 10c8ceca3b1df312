"""Flat layouts: which leaves share one flat buffer, the copies in and out of it, and the record
that lets a tree of views say which buffers it is.

One planner serves the gradient buckets of the sync path, the flat buffers of ``fddp.optim`` and
the shards of ``fddp.zero``. A plan (:class:`BucketPlan`) is plain, deterministic data computed
from the leaves' shapes, dtypes and devices only, so every rank that holds the same tree computes
the same plan without talking to the others.

**The layout travels with the values.** Whoever hands out a tree of views into flat buffers (the
sync's reduced buckets, the optimizer's new parameters and state, ZeRO's shards) makes them with
:func:`lay_out`, which registers the plan and tags each view with its place. The next consumer
asks :func:`flat_of` for the buffers and their plan and reads them in place: the plan is looked
up, not rebuilt from storage offsets. The user sees a plain tree of tensors; a tree rebuilt from
other tensors (a ``tree_map``, a copy) is not recognised and is read leaf by leaf, and
:func:`why_not_flat` says which leaf broke it.

**Split trees.** A :class:`SplitTree` node holds this rank's part of a larger tree (``fddp.zero``'s
shards): its :class:`Split` says over which ranks the whole is spread and where each of its tensors
sits in the whole's leaves, which is all the optimizer needs (global norms, fused kernels cut as on
whole leaves) without depending on ``fddp.zero``.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import optree
import torch

from fddp import _caches
from fddp._pool import new_buffer
from fddp._tree import LeafSpec

# The bucket caps every synchronising function defaults to, in MiB: torch DDP's (25 MiB, and a
# first bucket of 1 MiB, so that the first collective starts early in backward). The one place
# they are written; every signature takes its default from here.
BUCKET_CAP_MB = 25.0
FIRST_BUCKET_MB = 1.0

__all__ = [
    "BUCKET_CAP_MB",
    "FIRST_BUCKET_MB",
    "MB",
    "MODULE_ALIAS",
    "module_aliases",
    "Bucket",
    "BucketPlan",
    "plan",
    "respec",
    "optim_plan",
    "new_flat",
    "flatten",
    "views",
    "unflatten",
    "Flat",
    "lay_out",
    "flat_of",
    "why_not_flat",
    "Piece",
    "Split",
    "SplitTree",
    "has_split",
    "split_nodes",
    "explain_split",
]

MB = 1024 * 1024  # caps are in MiB, as torch DDP's bucket_cap_mb
_functorch = torch._C._functorch

# The attribute fddp.functionalize sets on the aliases of a module's own parameters that it hands
# out: memory fddp must never write in place (apply_gradients(..., donate=True) copies such
# leaves instead of updating them, and so the module), and values no rank has synchronised yet.
MODULE_ALIAS = "_fddp_module_alias"


def module_aliases(leaves: Sequence[Any]) -> bool:
    """Whether any leaf is an alias of a module's own parameter, as ``fddp.functionalize`` hands them out."""
    return any(map(getattr, leaves, itertools.repeat(MODULE_ALIAS), itertools.repeat(False)))


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: the leaves it holds (by index in the flattened tree) and where.

    Attributes:
        indices: leaf indices, in the order they are laid out in the buffer.
        shapes: each leaf's shape.
        numels: each leaf's number of elements.
        offsets: where each leaf starts in the buffer (elements).
        dtype: the buffer's dtype (all its leaves share it).
        device: the buffer's device (all its leaves share it).
    """

    indices: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    # Plans are made once and looked up (caches of views, slots) on every step: hash them once.
    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.indices, self.shapes, self.dtype, self.device)))
        object.__setattr__(self, "_numel", sum(self.numels))  # asked several times a call
        object.__setattr__(self, "_index_set", frozenset(self.indices))  # copied by every call's reducer

    def __hash__(self) -> int:
        return self._hash

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def index_set(self) -> frozenset[int]:
        """The leaf indices as a set (a copy of it costs less than building one from ``indices``)."""
        return self._index_set

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class BucketPlan:
    """A tree's buckets, in the order their collectives are launched.

    Attributes:
        buckets: the buckets; with the sync path's reverse order, bucket 0 holds the last leaves
            of the tree, which backward produces first.
        num_leaves: the number of leaves in the tree the plan was made for.
    """

    buckets: tuple[Bucket, ...]
    num_leaves: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.buckets, self.num_leaves)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def _plan(
    specs: tuple[LeafSpec, ...], bucket_cap_mb: float, first_bucket_mb: float, order: tuple[int, ...] | None, reverse: bool
) -> BucketPlan:
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number of MiB, got {value!r}")
    # Callers may key the cache with plain (shape, dtype, device) tuples, which hash and compare
    # as LeafSpecs do; the planner reads LeafSpecs.
    specs = tuple(s if isinstance(s, LeafSpec) else LeafSpec(tuple(s[0]), s[1], s[2]) for s in specs)
    if order is not None and sorted(order) != list(range(len(specs))):
        raise ValueError(f"order must be a permutation of range({len(specs)}), got {order!r}")
    walk = list(range(len(specs)) if order is None else order)
    if reverse:
        walk.reverse()
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[list[int]] = []
    for i in walk:
        key = (specs[i].dtype, specs[i].device)
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + specs[i].numel * specs[i].dtype.itemsize
        cap = first_bucket_mb if closed_count.get(key, 0) == 0 else bucket_cap_mb
        if open_bytes[key] >= cap * MB:
            closed.append(open_buckets.pop(key))
            open_bytes.pop(key)
            closed_count[key] = closed_count.get(key, 0) + 1
    closed.extend(open_buckets.values())
    buckets = []
    for idx in closed:
        numels = tuple(specs[i].numel for i in idx)
        offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
        buckets.append(
            Bucket(tuple(idx), tuple(specs[i].shape for i in idx), numels, offsets, specs[idx[0]].dtype, specs[idx[0]].device)
        )
    return BucketPlan(tuple(buckets), len(specs))


_plan_cached = _caches.cached(maxsize=256)(_plan)


def plan(
    specs: tuple[LeafSpec, ...],
    bucket_cap_mb: float = BUCKET_CAP_MB,
    first_bucket_mb: float = FIRST_BUCKET_MB,
    order: tuple[int, ...] | None = None,
    *,
    reverse: bool = True,
) -> BucketPlan:
    """Group leaves into flat buckets the way torch DDP does.

    Leaves are taken in ``order`` (reversed when ``reverse``: the order backward produces
    gradients). Each (dtype, device) pair fills its own buckets; a bucket closes once it reaches
    its cap, which is ``first_bucket_mb`` for the first bucket of each pair (so the first
    all-reduce starts early) and ``bucket_cap_mb`` after that. Buckets are listed in the order
    they close. With infinite caps and ``reverse=False`` this is one buffer per (dtype, device) in
    tree order: ``fddp.optim``'s layout. Cached: the same arguments give the same plan object.

    Args:
        specs: one :class:`~fddp._tree.LeafSpec` per leaf, in tree-flatten order.
        bucket_cap_mb: the cap of every bucket but the first, in MiB.
        first_bucket_mb: the cap of the first bucket of each (dtype, device), in MiB.
        order: the leaf indices in definition order (see :func:`fddp._tree.definition_order`);
            ``None`` means tree-flatten order.
        reverse: walk ``order`` backwards.

    Returns:
        The plan.

    Example:
        >>> specs = tuple(LeafSpec((1000,), torch.float32, torch.device("cpu")) for _ in range(3))
        >>> [b.indices for b in plan(specs, bucket_cap_mb=0.005, first_bucket_mb=0.001).buckets]
        [(2,), (1, 0)]
    """
    return _plan_cached(specs, bucket_cap_mb, first_bucket_mb, order, reverse)


def respec(plan: BucketPlan, specs: tuple[LeafSpec, ...]) -> BucketPlan:
    """The same buckets (which leaves travel together, in which order) for leaves of other shapes.

    Under ``vmap`` every member of an ensemble is synchronised at once: each bucket holds the same
    leaves as a single member's plan, with the members stacked, so there is one collective per
    bucket for all of them.
    """
    buckets = []
    for b in plan.buckets:
        numels = tuple(specs[i].numel for i in b.indices)
        offsets = tuple(sum(numels[:k]) for k in range(len(numels)))
        buckets.append(Bucket(b.indices, tuple(specs[i].shape for i in b.indices), numels, offsets, b.dtype, b.device))
    return BucketPlan(tuple(buckets), plan.num_leaves)


def optim_plan(specs: tuple[LeafSpec, ...]) -> BucketPlan:
    """One buffer per (dtype, device), leaves in tree order: the layout of ``fddp.optim``'s buffers."""
    return plan(specs, math.inf, math.inf, reverse=False)


def new_flat(bucket: Bucket, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised buffer for ``bucket`` (in ``dtype``, default the bucket's), from the host pool."""
    return new_buffer(bucket.numel, bucket.dtype if dtype is None else dtype, bucket.device)


def flatten(
    plan: BucketPlan,
    leaves: Sequence[torch.Tensor | None],
    dtype: torch.dtype | None = None,
    *,
    dtypes: Sequence[torch.dtype | None] | None = None,
) -> list[torch.Tensor]:
    """Copy each bucket's leaves into one new flat buffer (one copy per element).

    ``None`` leaves become zeros. The inputs are never aliased, so the buffers can be reduced in place.

    Args:
        plan: the plan the leaves follow.
        leaves: the leaves in tree-flatten order.
        dtype: cast every buffer to this dtype in the same copy; ``None`` keeps each bucket's.
        dtypes: per bucket, the dtype to cast to (``None``: ``dtype`` or the bucket's own).

    Returns:
        One 1-D tensor per bucket.

    Example:
        >>> specs = (LeafSpec((2,), torch.float32, torch.device("cpu")),) * 2
        >>> flatten(plan(specs), [torch.ones(2), None])
        [tensor([0., 0., 1., 1.])]
    """
    flats = []
    for k, b in enumerate(plan.buckets):
        out_dtype = dtypes[k] if dtypes is not None and dtypes[k] is not None else b.dtype if dtype is None else dtype
        parts = [
            torch.zeros(n, dtype=out_dtype, device=b.device) if leaves[i] is None else leaves[i].reshape(-1)
            for i, n in zip(b.indices, b.numels)
        ]
        flat = new_flat(b, out_dtype)
        torch.cat(parts, out=flat)  # casts, when asked to, inside the one copy
        flats.append(flat)
    return flats


def views(flat: torch.Tensor, bucket: Bucket) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like the bucket's leaves, in bucket order (no copy).

    Eagerly, one view per leaf made in C++: ``split`` when every leaf is 1-D (~5k instructions a
    view), else ``as_strided`` mapped over the leaves (~9k); ``unflatten_dense_tensors`` makes two
    per leaf (~10k). A ``flat`` that autograd differentiates takes ``split`` and ``view``: the
    backward of each ``as_strided`` view is a zero tensor the size of the whole buffer with the
    view's gradient copied in, so a bucket of ``L`` leaves cost ``L`` buffers' worth of writes
    and additions (20 times split's one ``cat`` on a transformer layer of 12 leaves).
    """
    if torch.compiler.is_compiling() or _functorch.is_functorch_wrapped_tensor(flat) or flat.requires_grad:
        return [piece.view(shape) for piece, shape in zip(flat.split(bucket.numels), bucket.shapes)]
    flat_1d, shapes, strides, offsets = _view_args(bucket)
    if flat_1d:
        return list(flat.split(bucket.numels))
    start = flat.storage_offset()
    if start:
        offsets = [start + o for o in offsets]
    return list(map(flat.as_strided, shapes, strides, offsets))


@_caches.cached(maxsize=512)
def _view_args(bucket: Bucket) -> tuple[bool, tuple, tuple, tuple]:
    """Whether every leaf is 1-D, and each leaf's shape, contiguous strides and offset."""
    strides = []
    for shape in bucket.shapes:
        stride, at = [], 1
        for n in reversed(shape):
            stride.append(at)
            at *= max(n, 1)
        strides.append(tuple(reversed(stride)))
    return all(len(s) == 1 for s in bucket.shapes), bucket.shapes, tuple(strides), bucket.offsets


def unflatten(
    plan: BucketPlan, flats: Sequence[torch.Tensor], made: Sequence[Sequence[torch.Tensor] | None] | None = None
) -> list[torch.Tensor]:
    """Return the leaves as views into the bucket buffers (no copy), in tree-flatten order.

    ``made[b]``, where given, are bucket ``b``'s views already made (by :func:`views` of ``flats[b]``).

    Example:
        >>> specs = (LeafSpec((2,), torch.float32, torch.device("cpu")),) * 2
        >>> unflatten(plan(specs), [torch.arange(4.0)])
        [tensor([2., 3.]), tensor([0., 1.])]
    """
    every: list[torch.Tensor] = []  # all buckets' views, bucket after bucket
    for k, (b, flat) in enumerate(zip(plan.buckets, flats)):
        known = made[k] if made is not None else None
        every.extend(known if known is not None else views(flat, b))
    if len(every) != plan.num_leaves:
        raise ValueError(f"unflatten: the plan has {plan.num_leaves} leaves, the buffers' views {len(every)}")
    return list(map(every.__getitem__, _inverse(plan)))


@_caches.cached(maxsize=256)
def _inverse(plan: BucketPlan) -> tuple[int, ...]:
    """Per leaf, its position among the buckets' views taken bucket after bucket."""
    where = [0] * plan.num_leaves
    at = 0
    for b in plan.buckets:
        for i in b.indices:
            where[i] = at
            at += 1
    return tuple(where)


# ---------------------------------------------------------------------------------------------
# The record a tree of views carries: which buffers it is, and their plan.

_TAG = "_fddp_flat"  # on each view: serial * _SPAN + its leaf index (an int: pickles as plain data)
_SPAN = 1 << 32
_KEPT = 4096  # plans of recently laid-out trees; an older tree is simply read leaf by leaf
_laid: "collections.OrderedDict[int, BucketPlan]" = collections.OrderedDict()
_serials = itertools.count(1)
_caches.register("fddp._layout._laid", _laid.clear)
_base_of = operator.attrgetter("_base")


class Flat(NamedTuple):
    """A tree's leaves as views of flat buffers: the plan (which leaves each buffer holds, where)
    and the buffers, one per bucket of the plan.

    Example:
        >>> flat = flat_of(optree.tree_leaves(grads))
        >>> [b.numel() for b in flat.buffers]  # the sync's buckets, read in place
    """

    plan: BucketPlan
    buffers: tuple[torch.Tensor, ...]


def _taggable(t: torch.Tensor) -> bool:
    return not torch.compiler.is_compiling() and not _functorch.is_functorch_wrapped_tensor(t)


def lay_out(
    plan: BucketPlan, flats: Sequence[torch.Tensor], made: Sequence[Sequence[torch.Tensor] | None] | None = None
) -> list[torch.Tensor]:
    """Return the leaves as views of ``flats`` (tree-flatten order), recorded for :func:`flat_of`.

    Args:
        plan: which leaves each buffer holds.
        flats: one 1-D buffer per bucket of ``plan``.
        made: per buffer, its views already made (by :func:`views`), or ``None``.

    Example:
        >>> leaves = lay_out(p, [torch.zeros(p.buckets[0].numel)])
        >>> flat_of(leaves).plan is p
        True
    """
    leaves = unflatten(plan, flats, made)
    if leaves and _taggable(flats[0]):
        serial = next(_serials)
        base = serial * _SPAN
        collections.deque(map(setattr, leaves, itertools.repeat(_TAG), range(base, base + len(leaves))), maxlen=0)
        _laid[serial] = plan
        if len(_laid) > _KEPT:
            _laid.popitem(last=False)
    return leaves


def _tag(t: Any) -> int | None:
    return getattr(t, _TAG, None) if isinstance(t, torch.Tensor) else None


def flat_of(leaves: Sequence[Any]) -> Flat | None:
    """The buffers ``leaves`` are views of, with their plan, if :func:`lay_out` made exactly these
    leaves (every one, in this order, untouched in shape); else ``None``.

    The check costs a few attribute reads per leaf, in C where it can: no storage offsets.
    """
    if not leaves:
        return None
    first = _tag(leaves[0])
    if first is None or first % _SPAN:
        return None
    p = _laid.get(first // _SPAN)
    if p is None or p.num_leaves != len(leaves):
        return None
    try:
        tags = list(map(getattr, leaves, itertools.repeat(_TAG), itertools.repeat(None)))
    except TypeError:  # a leaf that is no tensor
        return None
    if tags != list(range(first, first + len(leaves))):
        return None
    bases = list(map(_base_of, leaves))
    buffers = []
    for b in p.buckets:
        base = bases[b.indices[0]]
        if base is None or base.dim() != 1 or base.numel() != b.numel or base.dtype != b.dtype:
            return None
        if not all(bases[i] is base for i in b.indices):
            return None
        buffers.append(base)
    if not all(map(torch.Tensor.is_contiguous, leaves)):
        return None  # a view reshaped in place (t_(), as_strided_()) no longer lies where the plan says
    return Flat(p, tuple(buffers))


def why_not_flat(leaves: Sequence[Any], names: Sequence[str]) -> str | None:
    """Why :func:`flat_of` does not recognise ``leaves`` (naming the first leaf at fault), or ``None``.

    Example:
        >>> why_not_flat(optree.tree_leaves(optree.tree_map(torch.clone, grads)), paths)
        "leaf 'w' is not a view fddp handed out (a tree_map or a copy makes new tensors) ..."
    """
    if flat_of(leaves) is not None:
        return None
    if not leaves:
        return "the tree has no leaves"
    tags = list(map(_tag, leaves))
    first = tags[0]
    for i, t in enumerate(tags):
        if t is None or first is None or t != first + i:
            return (
                f"leaf {names[i]!r} is not a view fddp handed out in this place (a tree_map, a copy or a tree "
                "put together from several results makes other tensors): its values are copied into flat "
                "buffers first"
            )
    if first % _SPAN or _laid.get(first // _SPAN) is None:
        return "the tree was laid out too long ago (fddp remembers the most recent layouts): it is copied once"
    return (
        "the leaves no longer lie in their buffers as laid out (a view reshaped or re-strided in place, or "
        "a leaf replaced by a copy of itself): their values are copied into flat buffers first"
    )


# ---------------------------------------------------------------------------------------------
# Split trees: this rank's part of a larger tree.


class Piece(NamedTuple):
    """A slice of a whole leaf held inside one tensor of a split tree.

    Attributes:
        at: where the slice starts in the split tree's tensor (elements).
        start: where it starts in the whole leaf (flattened).
        stop: one past where it ends in the whole leaf.
        numel: the whole leaf's number of elements.
        leaf: the whole leaf's index (tree-flatten order of the whole tree), which tells a per-leaf
            choice (a mask, a label, a param group) which leaf each element belongs to; -1 unknown.
    """

    at: int
    start: int
    stop: int
    numel: int
    leaf: int = -1


class Split(NamedTuple):
    """How a split tree's tensors relate to the whole tree.

    Attributes:
        group: the process group the whole is spread over (``None``: the default group).
        world: the number of ranks it is spread over.
        rank: this rank, within ``group``.
        pieces: per tensor of the split tree (flatten order), the :class:`Piece` s of whole leaves
            it holds, in order; elements outside every piece are padding (zero).
        spec: the whole tree's structure (``None``: unknown), whose leaves the pieces' ``leaf``
            indices count; with ``leaves``, what a labels function sees of the whole tree.
        leaves: the whole tree's :class:`~fddp._tree.LeafSpec` s, in flatten order (``()``: unknown).
        places: per whole leaf, ``(where it starts in its bucket, that bucket's shard size)``: the
            cut every rank makes alike, from which :meth:`held` tells what any rank holds of any
            leaf without asking it (``()``: unknown). What an operation on whole leaves needs
            (``fddp.optim.muon`` sends each matrix's pieces to one rank).
    """

    group: Any
    world: int
    rank: int
    pieces: tuple[tuple[Piece, ...], ...]
    spec: Any = None
    leaves: tuple[LeafSpec, ...] = ()
    places: tuple[tuple[int, int], ...] = ()

    def held(self, leaf: int, rank: int) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of whole leaf ``leaf`` (flattened) that ``rank`` holds; ``lo == hi``: none.

        Every bucket is cut into equal shards of ``size`` elements, rank ``r`` holding
        ``[r * size, (r + 1) * size)`` of it (``fddp.zero``'s cut), so a leaf that starts at ``at``
        in its bucket has ``[r * size - at, (r + 1) * size - at)`` of it on rank ``r``, clipped.

        Example:
            >>> Split(None, 2, 0, (), leaves=(LeafSpec((4, 8), torch.float32, cpu),), places=((0, 64),)).held(0, 1)
            (32, 32)
        """
        at, size = self.places[leaf]
        n = math.prod(self.leaves[leaf].shape)
        lo = min(max(rank * size - at, 0), n)
        return lo, max(lo, min(max((rank + 1) * size - at, 0), n))


class SplitTree:
    """Base class of pytree nodes that hold one rank's part of a larger tree (see :class:`Split`).

    Subclasses provide :attr:`split` and :meth:`check_group`; the sync refuses them, and the
    optimizer reads them through this interface only.
    """

    __slots__ = ()

    @property
    def split(self) -> Split:
        raise NotImplementedError

    @property
    def stage(self) -> int:
        """ZeRO's stage of the tree: 3 when a forward pass gathers it (``fddp.zero.fully_shard``: the
        gathers' backward reduces the gradients, so no sync may), else 2."""
        return 2

    def check_group(self, what: str) -> None:
        """Raise unless this process holds the part the tree was made for."""
        raise NotImplementedError


def has_split(spec: optree.PyTreeSpec) -> bool:
    """Whether a tree of this structure holds a :class:`SplitTree` node."""
    return _has_split(spec)


@_caches.cached(maxsize=256)
def _has_split(spec: optree.PyTreeSpec) -> bool:
    t = spec.type
    return (t is not None and issubclass(t, SplitTree)) or any(_has_split(c) for c in spec.children())


def split_nodes(tree: Any) -> list[SplitTree]:
    """The :class:`SplitTree` nodes of ``tree`` (outermost first; one holds none), or of a tree
    structure (a ``PyTreeSpec``: its nodes rebuilt with ``None`` leaves)."""
    if isinstance(tree, optree.PyTreeSpec):
        if not has_split(tree):
            return []
        tree = optree.tree_unflatten(tree, [None] * tree.num_leaves)
    found: list[SplitTree] = []

    def walk(node: Any) -> None:
        if isinstance(node, SplitTree):
            found.append(node)
            return
        if isinstance(node, torch.Tensor) or node is None:
            return
        if optree.treespec_is_leaf(optree.tree_structure(node, none_is_leaf=True)):
            return
        for child in optree.tree_flatten_one_level(node, none_is_leaf=True).children:
            walk(child)

    walk(tree)
    return found


def explain_split(
    want: optree.PyTreeSpec, got: optree.PyTreeSpec, want_name: str = "the reference", got_name: str = "this tree"
) -> str | None:
    """Words for two tree structures that differ because of split trees, or ``None`` if that is not why."""
    a, b = has_split(want), has_split(got)
    if not (a or b):
        return None
    if a != b:
        which, other = (want_name, got_name) if a else (got_name, want_name)
        if any(n.stage == 3 for n in split_nodes(want if a else got)):
            return (
                f"{which} is fully sharded (ZeRO stage 3, fddp.zero.fully_shard's shards) but {other} is a whole, "
                "replicated tree: under stage 3 the optimizer state is sharded like the parameters. Make it from the "
                "shards, `state = opt.init(shards)` (not from the gathered tree of fddp.zero.unshard or gather), and "
                "step with the shards and their gradients (torch.func.grad or fddp.grad_and_value of a loss that calls "
                "fully_shard's apply_fn)"
            )
        return (
            f"{which} is sharded (fddp.zero: one rank's slices of the buckets) but {other} is a replicated "
            "tree: the sharded and replicated paths do not mix. Give a sharded optimizer state sharded "
            "gradients (compression=fddp.zero.ReduceScatter() in fddp.grad_and_value or fddp.ddp_step) "
            "and sharded parameters (fddp.zero.shard(params)), or keep everything replicated"
        )
    for x, y in zip(split_nodes(want), split_nodes(got)):
        if x.stage != y.stage:
            return (
                f"{want_name} is sharded for ZeRO stage {x.stage} and {got_name} for stage {y.stage}: stage 3's "
                "trees (fddp.zero.fully_shard: one bucket per unit) and stage 2's (fddp.zero.shard, "
                "ReduceScatter: the gradients' buckets) do not mix; take the gradients of fully_shard's "
                "apply_fn with torch.func.grad for its shards, or keep to stage 2 throughout"
            )
        sx, sy = x.split, y.split
        if (sx.world, sx.rank) != (sy.world, sy.rank):
            return (
                f"the trees are sharded for different world sizes or ranks ({x!r} and {y!r}); shards move "
                "between world sizes only through fddp.checkpoint.save_sharded / load_sharded, which reshard"
            )
        if sx != sy or x != y:
            return (
                f"the trees are sharded with different layouts ({x!r} and {y!r}): make the parameter shards "
                "and the gradients with the same bucket_cap_mb, first_bucket_mb and group, and for the same tree"
            )
    return None
