"""Bucket plans: which leaves travel together in one flat buffer, and the copies in and out of it.

A plan is plain, deterministic data computed from the leaves' shapes, dtypes and devices only, so
every rank that holds the same tree computes the same plan without talking to the others.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import optree
import torch

__all__ = ["Bucket", "BucketPlan", "LeafSpec", "definition_order", "make_plan", "plan_for", "new_buffer", "release_buffers", "flatten", "unflatten", "MB"]

MB = 1024 * 1024  # bucket caps are in MiB, as in torch DDP's bucket_cap_mb


@dataclass(frozen=True)
class LeafSpec:
    """What the planner needs to know of a leaf: its shape, dtype and device."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> "LeafSpec":
        return LeafSpec(tuple(t.shape), t.dtype, t.device)

    @property
    def numel(self) -> int:
        return functools.reduce(lambda a, b: a * b, self.shape, 1)


@dataclass(frozen=True)
class Bucket:
    """One flat buffer: the leaves it holds (by index in the flattened tree) and their layout.

    Attributes:
        indices: leaf indices, in the order they are laid out in the buffer.
        shapes: each leaf's shape.
        numels: each leaf's number of elements; the buffer is their concatenation.
        dtype: the buffer's dtype (all its leaves share it).
        device: the buffer's device (all its leaves share it).
    """

    indices: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class BucketPlan:
    """The buckets of a tree, in the order their all-reduces are launched.

    Attributes:
        buckets: the buckets; bucket 0 holds the last leaves of the tree, which backward
            produces first.
        num_leaves: the number of leaves in the tree the plan was made for.
    """

    buckets: tuple[Bucket, ...]
    num_leaves: int

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _plan(
    specs: tuple[LeafSpec, ...],
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    order: tuple[int, ...] | None = None,
) -> BucketPlan:
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number of MiB, got {value!r}")
    open_buckets: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    open_bytes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed_count: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[list[int]] = []
    if order is not None and sorted(order) != list(range(len(specs))):
        raise ValueError(f"order must be a permutation of range({len(specs)}), got {order!r}")
    for i in reversed(range(len(specs)) if order is None else order):
        key = (specs[i].dtype, specs[i].device)
        open_buckets.setdefault(key, []).append(i)
        open_bytes[key] = open_bytes.get(key, 0) + specs[i].numel * _itemsize(specs[i].dtype)
        cap = first_bucket_mb if closed_count.get(key, 0) == 0 else bucket_cap_mb
        if open_bytes[key] >= cap * MB:
            closed.append(open_buckets.pop(key))
            open_bytes.pop(key)
            closed_count[key] = closed_count.get(key, 0) + 1
    closed.extend(open_buckets.values())
    buckets = tuple(
        Bucket(
            indices=tuple(idx),
            shapes=tuple(specs[i].shape for i in idx),
            numels=tuple(specs[i].numel for i in idx),
            dtype=specs[idx[0]].dtype,
            device=specs[idx[0]].device,
        )
        for idx in closed
    )
    return BucketPlan(buckets=buckets, num_leaves=len(specs))


_plan_cached = functools.lru_cache(maxsize=256)(_plan)


def make_plan(
    specs: tuple[LeafSpec, ...],
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    order: tuple[int, ...] | None = None,
) -> BucketPlan:
    """Group leaves into buckets the way torch DDP does.

    Leaves are taken in reverse ``order`` (the order backward produces gradients). Each (dtype, device)
    pair fills its own bucket; a bucket closes once it reaches its cap, which is
    ``first_bucket_mb`` for the first bucket of each pair (so the first all-reduce starts early)
    and ``bucket_cap_mb`` after that. Buckets are listed in the order they close. Cached: the same
    specs give the same plan object.

    Args:
        specs: one :class:`LeafSpec` per leaf, in tree-flatten order.
        bucket_cap_mb: the cap of every bucket but the first, in MiB.
        first_bucket_mb: the cap of the first bucket of each (dtype, device), in MiB.
        order: the leaf indices in the order the model defines (and forward uses) them; see
            :func:`definition_order`. ``None`` means tree-flatten order.

    Returns:
        The plan.

    Example:
        >>> specs = tuple(LeafSpec((1000,), torch.float32, torch.device("cpu")) for _ in range(3))
        >>> [b.indices for b in make_plan(specs, bucket_cap_mb=0.005, first_bucket_mb=0.001).buckets]
        [(2,), (1, 0)]
    """
    # torch.compile traces the planner (its result is a constant of the graph), and dynamo ignores
    # lru_cache wrappers with a warning: call the plain function there.
    if torch.compiler.is_compiling():
        return _plan(specs, bucket_cap_mb, first_bucket_mb, order)
    return _plan_cached(specs, bucket_cap_mb, first_bucket_mb, order)


def _insertion_paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """optree-style leaf paths with dicts walked in insertion order (plain Python, so it traces)."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _insertion_paths(v, prefix + (k,))]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in _insertion_paths(v, prefix + (i,))]
    return [prefix]


def definition_order(tree: Any) -> tuple[int, ...] | None:
    """Return the leaf indices (into ``optree``'s flatten order) in the order the tree was built.

    optree flattens a dict in sorted key order, so ``'layers.10'`` comes before ``'layers.2'`` and
    ``'bias'`` before ``'weight'``. A dict of parameters is built in module registration order,
    the order forward uses them and the reverse of the order backward produces their gradients,
    which is the order buckets should fill. ``None`` when the two orders agree, or when the tree
    holds node types other than dicts, lists and tuples (their flatten order is kept).
    """
    ins = _insertion_paths(tree)
    index = {p: i for i, p in enumerate(optree.tree_paths(tree, none_is_leaf=True))}
    if len(index) != len(ins) or any(p not in index for p in ins):
        return None
    order = tuple(index[p] for p in ins)
    return None if order == tuple(range(len(order))) else order


def plan_for(tree: Any, /, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0) -> BucketPlan:
    """Return the plan ``ddp_step`` and ``grad_and_value`` use for ``tree``: its leaves' specs in
    optree's flatten order, filled in the tree's definition order.

    Example:
        >>> plan = plan_for({"w": torch.zeros(3), "b": torch.zeros(2)})
        >>> [b.indices for b in plan.buckets]
        [(0, 1)]
    """
    specs = tuple(LeafSpec.of(t) for t in optree.tree_leaves(tree, none_is_leaf=True))
    return make_plan(specs, bucket_cap_mb, first_bucket_mb, definition_order(tree))


class _HostBuffers:
    """Reuse host bucket buffers that nothing references any more.

    Fresh host memory is expensive: glibc hands large freed blocks back to the OS and every page of
    a new buffer then faults on first touch, which made copying a gradient into a new bucket cost
    several times the copy itself. A buffer handed out by fddp is kept here and handed out again
    only once its storage has no other user: no view (the gradients returned to the caller), no
    alias (``detach()``, numpy) and no in-flight collective. So reuse is never observable, and the
    functions stay pure. GPU memory has torch's caching allocator and is not pooled.
    """

    def __init__(self, per_key: int = 16) -> None:
        # Per (size, dtype): a step's buckets and the previous step's, or an optimizer's params,
        # state, their successors and its temporaries (fddp.optim's flat buffers share sizes).
        self.per_key = per_key
        self.free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.lock = threading.Lock()  # the check and the hand-out must not interleave across threads

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type != "cpu" or _storage_users is None or torch.compiler.is_compiling():
            return torch.empty(numel, dtype=dtype, device=device)
        with self.lock:
            return self._take(numel, dtype, device)

    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        kept = self.free.setdefault((numel, dtype), [])
        for t in kept:
            # 2: the kept tensor itself and the temporary storage object made to ask.
            if _storage_users(t.untyped_storage()._cdata) == 2:
                # Hand out a view: it holds its own reference to the storage, so the buffer counts
                # as in use from now on, even before anything else refers to it.
                return t.view(numel)
        t = torch.empty(numel, dtype=dtype, device=device)
        if len(kept) >= self.per_key:
            # All in use (other models' parameters, say, held for long): forget the oldest, which
            # stays valid for its users, so that the buffers of the loop running now are kept.
            kept.pop(0)
        kept.append(t)
        return t.view(numel)


_storage_users = getattr(torch._C, "_storage_Use_Count", None)
_host_buffers = _HostBuffers()


def new_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Return an uninitialised 1-D buffer for a bucket, reusing an unreferenced host one if any.

    Example:
        >>> new_buffer(4, torch.float32, torch.device("cpu")).shape
        torch.Size([4])
    """
    return _host_buffers.take(numel, dtype, device)


def release_buffers() -> None:
    """Forget the host buffers kept for reuse, so that memory can go back to the OS.

    fddp keeps the host buffers it makes (gradient buckets, ``fddp.optim``'s flat parameters and
    state) and reuses the ones nothing refers to any more: like torch's CUDA caching allocator, it
    holds on to a step's peak working set. Buffers still in use stay valid; they are simply not
    reused. Call this after training, or between phases that use different models.

    Example:
        >>> fddp.buckets.release_buffers()
    """
    with _host_buffers.lock:
        _host_buffers.free.clear()


def flatten(plan: BucketPlan, leaves: Sequence[torch.Tensor | None], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Copy each bucket's leaves into one new flat buffer (one copy per element).

    ``None`` leaves become zeros. The inputs are never aliased, so the buffers can be reduced in place.

    Args:
        plan: the plan the leaves follow.
        leaves: the leaves in tree-flatten order.
        dtype: cast every buffer to this dtype in the same copy (for compressed communication);
            ``None`` keeps each bucket's dtype.

    Returns:
        One 1-D tensor per bucket.

    Example:
        >>> specs = (LeafSpec((2,), torch.float32, torch.device("cpu")),) * 2
        >>> flatten(make_plan(specs), [torch.ones(2), None])
        [tensor([0., 0., 1., 1.])]
    """
    flats = []
    for b in plan.buckets:
        out_dtype = b.dtype if dtype is None else dtype
        parts = [
            torch.zeros(n, dtype=out_dtype, device=b.device) if leaves[i] is None else leaves[i].reshape(-1)
            for i, n in zip(b.indices, b.numels)
        ]
        flat = new_buffer(b.numel, out_dtype, b.device)
        torch.cat(parts, out=flat)  # casts, when asked to, inside the one copy
        flats.append(flat)
    return flats


def unflatten(plan: BucketPlan, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Return the leaves as views into the bucket buffers (no copy), in tree-flatten order.

    Example:
        >>> specs = (LeafSpec((2,), torch.float32, torch.device("cpu")),) * 2
        >>> plan = make_plan(specs)
        >>> unflatten(plan, [torch.arange(4.0)])
        [tensor([2., 3.]), tensor([0., 1.])]
    """
    leaves: list[torch.Tensor | None] = [None] * plan.num_leaves
    if torch.compiler.is_compiling():
        for b, flat in zip(plan.buckets, flats):
            for i, piece, shape in zip(b.indices, flat.split(b.numels), b.shapes):
                leaves[i] = piece.view(shape)
        return leaves  # type: ignore[return-value]
    # Eagerly, one C++ call per bucket makes all its views (~5 us per leaf less than Python's).
    for b, flat, templates in zip(plan.buckets, flats, _shape_templates(plan)):
        for i, view in zip(b.indices, torch._C._nn.unflatten_dense_tensors(flat, templates)):
            leaves[i] = view
    return leaves  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def _shape_templates(plan: BucketPlan) -> list[list[torch.Tensor]]:
    """Per bucket, storage-less tensors of its leaves' shapes, for ``unflatten_dense_tensors``."""
    return [[torch.empty(shape, device="meta") for shape in b.shapes] for b in plan.buckets]
