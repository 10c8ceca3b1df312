"""Flat layouts: which leaves share one flat buffer, and the copies in and out of it.

One planner serves both the gradient buckets of the sync path and the flat buffers of
``fddp.optim``. A plan is plain, deterministic data computed from the leaves' shapes, dtypes and
devices only, so every rank that holds the same tree computes the same plan without talking to
the others.

The contract between the two users: :func:`views` hands a buffer out as leaf-shaped views, and
:func:`tiled` recognises leaves that are exactly those views (same base, right offsets), so a
buffer that comes back as an input is read in place instead of copied.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fddp._pool import new_buffer
from fddp._tree import LeafSpec

__all__ = ["MB", "Bucket", "BucketPlan", "plan", "flatten", "unflatten", "views", "tiled", "tiling", "new_flat"]

MB = 1024 * 1024  # caps are in MiB, as torch DDP's bucket_cap_mb

# The attribute fddp.functionalize sets on the aliases of a module's own parameters that it hands
# out: memory fddp must never write in place (apply_gradients(..., donate=True) copies such
# leaves instead of updating them, and so the module).
MODULE_ALIAS = "_fddp_module_alias"


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

    def __hash__(self) -> int:
        return self._hash

    @property
    def numel(self) -> int:
        return sum(self.numels)

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


_plan_cached = functools.lru_cache(maxsize=256)(_plan)


def plan(
    specs: tuple[LeafSpec, ...],
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
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
    # torch.compile traces the planner (its result is a constant of the graph), and dynamo ignores
    # lru_cache wrappers with a warning: call the plain function there.
    if torch.compiler.is_compiling():
        return _plan(specs, bucket_cap_mb, first_bucket_mb, order, reverse)
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

    Eagerly, one C++ call makes all of them (~5 us per leaf less than Python's ``split``/``view``).
    """
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(flat):
        return [piece.view(shape) for piece, shape in zip(flat.split(bucket.numels), bucket.shapes)]
    return torch._C._nn.unflatten_dense_tensors(flat, _templates(bucket))


@functools.lru_cache(maxsize=512)
def _templates(bucket: Bucket) -> list[torch.Tensor]:
    """Storage-less tensors of the bucket's leaf shapes, for ``unflatten_dense_tensors``."""
    return [torch.empty(shape, device="meta") for shape in bucket.shapes]


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
    leaves: list[torch.Tensor | None] = [None] * plan.num_leaves
    for k, (b, flat) in enumerate(zip(plan.buckets, flats)):
        known = made[k] if made is not None else None
        for i, view in zip(b.indices, known if known is not None else views(flat, b)):
            leaves[i] = view
    return leaves  # type: ignore[return-value]


def tiling(leaves: Sequence[torch.Tensor]) -> tuple[Bucket, ...] | None:
    """The buckets these leaves already tile, if every leaf is a view that :func:`views` made.

    Gradients from ``ddp_step`` and ``grad_and_value`` are views of their bucket buffers; an
    optimizer that adopts that layout for its own buffers reads the gradients in place, one flat
    operation per bucket instead of one per leaf, and its results (parameters, state) come out in
    the same layout, so the next step recognises them too. ``None`` unless every base is a 1-D
    contiguous buffer exactly tiled by its leaves, back to back.
    """
    groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for i, t in enumerate(leaves):
        base = t._base
        if base is None:
            return None
        entry = groups.get(id(base))
        if entry is None:
            groups[id(base)] = entry = (base, [])
        entry[1].append(i)
    buckets = []
    for base, idx in groups.values():
        if base.dim() != 1 or not base.is_contiguous():
            return None
        start = base.storage_offset()
        idx.sort(key=lambda i: leaves[i].storage_offset())
        shapes, numels, offsets, at = [], [], [], 0
        for i in idx:
            t = leaves[i]
            if t.storage_offset() - start != at or t.dtype != base.dtype or not t.is_contiguous():
                return None
            shapes.append(tuple(t.shape))
            numels.append(t.numel())
            offsets.append(at)
            at += t.numel()
        if at != base.numel():
            return None
        buckets.append(Bucket(tuple(idx), tuple(shapes), tuple(numels), tuple(offsets), base.dtype, base.device))
    return tuple(buckets)


def tiled(leaves: Sequence[torch.Tensor], bucket: Bucket) -> torch.Tensor | None:
    """The 1-D buffer the bucket's leaves tile, back to back at the bucket's offsets, if there is one.

    That is how :func:`views` hands results out; reading the buffer is then reading the leaves.
    """
    base = leaves[bucket.indices[0]]._base
    if base is None or base.dim() != 1 or base.numel() != bucket.numel or base.dtype != bucket.dtype or not base.is_contiguous():
        return None
    start = base.storage_offset()
    for i, off in zip(bucket.indices, bucket.offsets):
        leaf = leaves[i]
        if leaf._base is not base or leaf.storage_offset() - start != off:
            return None
    return base
