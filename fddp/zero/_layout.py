"""ZeRO's shard layout: how a bucket plan is cut across ranks, and the pytree node that holds one rank's cut.

ZeRO (``fddp.zero``) keeps, on each rank, only its slice of every gradient bucket, of the
parameters laid out the same way, and of the optimizer state made from them. The cut is plain,
deterministic data computed from the bucket plan, the world size and the rank, so every rank
knows every other rank's slice without talking to it:

- bucket ``k`` of ``B`` elements gets a shard size ``s = ceil(B / (N * align)) * align``, the same
  on every rank (``align = 64`` elements keeps each shard 256-byte aligned in fp32);
- rank ``r`` holds elements ``[r * s, min((r + 1) * s, B))`` of the bucket, zero-padded to ``s``
  (FSDP's rule, rounded up; a rank may hold nothing of a small bucket);
- a rank's shards of one dtype and device lie back to back in one flat buffer, in bucket order,
  laid out (``fddp._layout.lay_out``) so that ``fddp.optim`` reads them in place.

:class:`Sharded` is the pytree node for one rank's shards: its children are the shards (1-D
tensors, one per bucket), its metadata is the :class:`ShardLayout`. Gradients, parameters and every
optimizer state tree made from them by ``opt.init`` have the same treedef, so fddp.optim's
elementwise transformations work on them unchanged, and a replicated tree mixed with a sharded one
(or two different layouts) fails the treedef comparison. ``Sharded`` is a
:class:`fddp._layout.SplitTree`: the optimizer reads its :class:`~fddp._layout.Split` (the group,
and where each shard's elements sit in the whole leaves) without importing this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import optree
import optree.registry
import torch
import torch.distributed as dist

from fddp import _caches, _layout
from fddp._layout import BucketPlan, Piece, Split, SplitTree
from fddp._pool import new_buffer
from fddp._tree import LeafSpec

__all__ = ["ALIGN", "Cut", "ShardLayout", "Sharded", "cut", "layout", "new_shards", "leaf_pieces"]

ALIGN = 64  # elements: every shard size is a multiple of it


@dataclass(frozen=True)
class Cut:
    """One bucket's cut for one rank.

    Attributes:
        numel: the bucket's elements, ``B``.
        size: every rank's shard length ``s`` (padding included).
        lo: the first element of the bucket this rank holds.
        hi: one past the last (``hi - lo <= size``; ``lo == hi`` when the rank holds nothing).
        offset: where the shard starts in this rank's flat buffer of the bucket's dtype and device.
    """

    numel: int
    size: int
    lo: int
    hi: int
    offset: int = 0

    @property
    def held(self) -> int:
        return self.hi - self.lo


def cut(numel: int, world: int, rank: int, align: int = ALIGN) -> Cut:
    """Cut a bucket of ``numel`` elements for ``rank`` of ``world`` (offset 0).

    Example:
        >>> cut(1000, 4, 3)
        Cut(numel=1000, size=256, lo=768, hi=1000, offset=0)
    """
    size = -(-numel // (world * align)) * align
    return Cut(numel, size, min(rank * size, numel), min((rank + 1) * size, numel))


@dataclass(frozen=True)
class ShardLayout:
    """How one rank's shards cut a tree's bucket plan.

    Two layouts are equal when everything that decides the cut is: the plan, the tree's structure,
    the world size, the rank, the process group and the alignment. Trees sharded with different
    layouts do not mix.

    Attributes:
        plan: the bucket plan of the full tree (the one ``ddp_step`` and ``grad_and_value`` use).
        spec: the full tree's structure, to rebuild it from gathered buckets.
        world: the number of ranks the tree is sharded over.
        rank: this rank, within ``group``.
        group: the process group (``None``: the default group).
        align: shard sizes are multiples of this many elements.
        cuts: per bucket, this rank's :class:`Cut`.
        buffers: per flat buffer, ``(dtype, device, numel)``: one per dtype and device.
        shard_plan: the shards' own flat layout (a :class:`fddp._layout.BucketPlan` whose leaves are
            the shards and whose buckets are the flat buffers): how :func:`new_shards` lays them out.
        split: the :class:`fddp._layout.Split` every tree of this layout carries.

    Example:
        >>> layout = fddp.zero.shard(params).layout
        >>> [(c.lo, c.hi, c.size) for c in layout.cuts]  # this rank's slice of every bucket
    """

    plan: BucketPlan
    spec: optree.PyTreeSpec
    world: int
    rank: int
    group: Any = None
    align: int = ALIGN
    cuts: tuple[Cut, ...] = field(init=False, compare=False, hash=False, repr=False)
    buffers: tuple[tuple[torch.dtype, torch.device, int], ...] = field(init=False, compare=False, hash=False, repr=False)
    shard_plan: BucketPlan = field(init=False, compare=False, hash=False, repr=False)
    split: Split = field(init=False, compare=False, hash=False, repr=False)

    # The ZeRO stage whose trees use this layout: 2 (buckets cut for the gradients' sync); stage 3's
    # layout, fddp.zero.UnitLayout, is a subclass that records its units.
    stage: ClassVar[int] = 2

    def __post_init__(self) -> None:
        at: dict[tuple[torch.dtype, torch.device], int] = {}
        members: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        cuts = []
        for k, b in enumerate(self.plan.buckets):
            c = cut(b.numel, self.world, self.rank, self.align)
            key = (b.dtype, b.device)
            cuts.append(Cut(c.numel, c.size, c.lo, c.hi, at.get(key, 0)))
            at[key] = at.get(key, 0) + c.size
            members.setdefault(key, []).append(k)
        set_ = object.__setattr__
        set_(self, "cuts", tuple(cuts))
        set_(self, "buffers", tuple((d, dev, n) for (d, dev), n in at.items()))
        groups = []
        for (d, dev), ks in members.items():
            sizes = tuple(cuts[k].size for k in ks)
            groups.append(_layout.Bucket(tuple(ks), tuple((n,) for n in sizes), sizes, tuple(cuts[k].offset for k in ks), d, dev))
        set_(self, "shard_plan", BucketPlan(tuple(groups), len(cuts)))
        pieces = []
        leaves: list[Any] = [None] * self.plan.num_leaves
        places: list[Any] = [None] * self.plan.num_leaves
        for b, c in zip(self.plan.buckets, cuts):
            held = []
            for i, shape, off, n in zip(b.indices, b.shapes, b.offsets, b.numels):
                leaves[i] = LeafSpec(shape, b.dtype, b.device)
                places[i] = (off, c.size)
                lo, hi = max(c.lo, off), min(c.hi, off + n)
                if lo < hi:
                    held.append(Piece(lo - c.lo, lo - off, hi - off, n, i))
            pieces.append(tuple(held))
        # The whole tree's structure and leaf specs, for per-leaf optimizer choices (masks, labels).
        whole = tuple(leaves) if None not in leaves else ()
        known = tuple(places) if whole else ()  # where every rank's cut falls in each leaf (Split.held)
        set_(self, "split", Split(self.group, self.world, self.rank, tuple(pieces), self.spec, whole, known))

    def __repr__(self) -> str:
        return (
            f"ShardLayout(world={self.world}, rank={self.rank}, buckets={len(self.plan.buckets)}, "
            f"leaves={self.plan.num_leaves}, elements={self.numel})"
        )

    @property
    def numel(self) -> int:
        """Elements this rank holds, padding included."""
        return sum(c.size for c in self.cuts)

    def describe(self) -> list[tuple]:
        """The layout as signature rows (``fddp._tree`` rows; the rank is deliberately left out)."""
        rows: list[tuple] = [("shard layout", f"world={self.world} align={self.align}", None)]
        for k, (b, c) in enumerate(zip(self.plan.buckets, self.cuts)):
            rows.append((f"shard layout bucket {k}", f"{b.numel} elements of {b.dtype}, shards of {c.size}", None))
        return rows

    def check_group(self, what: str) -> None:
        """Raise unless this process is rank ``rank`` of a group of ``world`` ranks: say how to reshard."""
        if not dist.is_initialized():
            n, r = 1, 0
        else:
            n, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (n, r) != (self.world, self.rank):
            raise RuntimeError(
                f"fddp.{what}: this sharded tree was made for rank {self.rank} of {self.world} ranks, but this "
                f"process is rank {r} of {n}. Shards move between world sizes only through a checkpoint: "
                "fddp.checkpoint.save_sharded(directory, tree) on the old ranks, then, on the new ones, "
                "fddp.checkpoint.load_sharded(directory, like) with `like` made by fddp.zero.shard(params) "
                "and opt.init of it, which reshards."
            )


@_caches.cached(maxsize=64)
def layout(plan: BucketPlan, spec: optree.PyTreeSpec, world: int, rank: int, group: Any = None, align: int = ALIGN) -> ShardLayout:
    """The (cached, so shared) layout of ``plan`` for ``rank`` of ``world``."""
    return ShardLayout(plan, spec, world, rank, group, align)


class Sharded(SplitTree):
    """One rank's shards of a tree: one 1-D tensor per bucket of its plan, and their layout.

    A pytree node (optree): its leaves are the shards, its layout is part of the treedef. Made by
    ``fddp.zero.shard(params)`` (parameters), by a sharding comm hook (``fddp.zero.ReduceScatter``:
    gradients), and by ``opt.init`` / ``opt.update`` on those (optimizer state, updates).

    Attributes:
        shards: one 1-D tensor of ``layout.cuts[k].size`` elements per bucket ``k``; elements past
            ``cuts[k].held`` are padding (zero in parameters, gradients and state).
        layout: the :class:`ShardLayout`.

    Example:
        >>> shards = fddp.zero.shard(params)
        >>> shards.layout.world, [s.numel() for s in shards.shards]
    """

    __slots__ = ("shards", "layout")

    def __init__(self, shards: Sequence[Any], layout: ShardLayout) -> None:
        if not isinstance(layout, ShardLayout):
            raise TypeError(f"Sharded: layout must be a ShardLayout, got {type(layout).__name__}")
        if len(shards) != len(layout.cuts):
            raise ValueError(f"Sharded: the layout has {len(layout.cuts)} buckets, got {len(shards)} shards")
        self.shards = tuple(shards)
        self.layout = layout

    def __repr__(self) -> str:
        return f"Sharded({self.layout!r})"

    @property
    def split(self) -> Split:
        """Over which ranks the whole tree is spread, and where each shard's elements sit in its leaves."""
        return self.layout.split

    def check_group(self, what: str) -> None:
        """Raise unless this process is the rank, in a group of the size, the shards were made for."""
        self.layout.check_group(what)

    @property
    def stage(self) -> int:
        """2 for ``fddp.zero.shard``'s layout, 3 for ``fully_shard``'s (:class:`fddp.zero.UnitLayout`)."""
        return self.layout.stage


optree.register_pytree_node(
    Sharded,
    lambda s: (s.shards, s.layout, tuple(f"shard{k}" for k in range(len(s.shards)))),
    lambda layout_, shards: Sharded(tuple(shards), layout_),
    namespace=vars(optree.registry)["__GLOBAL_NAMESPACE"],  # fddp flattens in optree's global namespace
)


def new_shards(lay: ShardLayout) -> list[torch.Tensor]:
    """One flat buffer per dtype and device (from the host pool), as per-bucket views laid out for
    ``fddp.optim`` (:func:`fddp._layout.lay_out`), padding zeroed."""
    bufs = [new_buffer(g.numel, g.dtype, g.device) for g in lay.shard_plan.buckets]
    out = _layout.lay_out(lay.shard_plan, bufs)
    for view, c in zip(out, lay.cuts):
        view[c.held :].zero_()
    return out


@_caches.cached(maxsize=64)
def leaf_pieces(lay: ShardLayout) -> tuple[tuple[tuple[int, int, int, int], ...], ...]:
    """Per leaf (tree-flatten order): ``(bucket, start in the leaf, start in the shard, length)`` of
    every piece of it this rank holds (at most one per leaf)."""
    out: list[list] = [[] for _ in range(lay.plan.num_leaves)]
    for k, (b, c) in enumerate(zip(lay.plan.buckets, lay.cuts)):
        for i, off, n in zip(b.indices, b.offsets, b.numels):
            lo, hi = max(c.lo, off), min(c.hi, off + n)
            if lo < hi:
                out[i].append((k, lo - off, lo - c.lo, hi - lo))
    return tuple(tuple(p) for p in out)


