"""Sharded trees: how a bucket plan is cut across ranks, and the pytree node that holds one rank's cut.

ZeRO (``fddp.zero``) keeps, on each rank, only its slice of every gradient bucket, of the
parameters laid out the same way, and of the optimizer state made from them. The cut is plain,
deterministic data computed from the bucket plan, the world size and the rank, so every rank
knows every other rank's slice without talking to it:

- bucket ``k`` of ``B`` elements gets a shard size ``s = ceil(B / (N * align)) * align``, the same
  on every rank (``align = 64`` elements keeps each shard 256-byte aligned in fp32);
- rank ``r`` holds elements ``[r * s, min((r + 1) * s, B))`` of the bucket, zero-padded to ``s``
  (FSDP's rule, rounded up; a rank may hold nothing of a small bucket);
- a rank's shards of one dtype and device lie back to back in one flat buffer, in bucket order,
  which is exactly the flat layout ``fddp.optim`` uses for a tree of those shards: its flat fast
  path reads them in place.

:class:`Sharded` is the pytree node for one rank's shards: its children are the shards (1-D
tensors, one per bucket), its metadata is the :class:`ShardLayout`. Gradients, parameters and every
optimizer state tree made from them by ``opt.init`` have the same treedef, so fddp.optim's
elementwise transformations work on them unchanged, and a replicated tree mixed with a sharded one
(or two different layouts) fails the treedef comparison; :func:`explain` words that failure.

This module depends only on the tree and layout modules and the pool; ``fddp.sync``, ``fddp.optim``
and ``fddp.zero`` build on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import optree
import optree.registry
import torch
import torch.distributed as dist

from fddp._layout import BucketPlan
from fddp._pool import new_buffer

__all__ = ["ALIGN", "Cut", "ShardLayout", "Sharded", "cut", "layout", "new_shards", "leaf_pieces", "kernel_pieces"]

ALIGN = 64  # elements: every shard size is a multiple of it
_BLOCK = 64  # the fused kernels' vector width divides this (see kernel_pieces)


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

    # The ZeRO stage whose trees use this layout: 2 (buckets cut for the gradients' sync); stage 3's
    # layout, fddp.zero.UnitLayout, is a subclass that records its units.
    stage: ClassVar[int] = 2

    def __post_init__(self) -> None:
        at: dict[tuple[torch.dtype, torch.device], int] = {}
        cuts = []
        for b in self.plan.buckets:
            c = cut(b.numel, self.world, self.rank, self.align)
            key = (b.dtype, b.device)
            cuts.append(Cut(c.numel, c.size, c.lo, c.hi, at.get(key, 0)))
            at[key] = at.get(key, 0) + c.size
        object.__setattr__(self, "cuts", tuple(cuts))
        object.__setattr__(self, "buffers", tuple((d, dev, n) for (d, dev), n in at.items()))

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


@functools.lru_cache(maxsize=64)
def layout(plan: BucketPlan, spec: optree.PyTreeSpec, world: int, rank: int, group: Any = None, align: int = ALIGN) -> ShardLayout:
    """The (cached, so shared) layout of ``plan`` for ``rank`` of ``world``."""
    return ShardLayout(plan, spec, world, rank, group, align)


class Sharded:
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


optree.register_pytree_node(
    Sharded,
    lambda s: (s.shards, s.layout, tuple(f"shard{k}" for k in range(len(s.shards)))),
    lambda layout_, shards: Sharded(tuple(shards), layout_),
    namespace=vars(optree.registry)["__GLOBAL_NAMESPACE"],  # fddp flattens in optree's global namespace
)


def new_shards(lay: ShardLayout) -> list[torch.Tensor]:
    """One flat buffer per dtype and device (from the host pool), as per-bucket views, padding zeroed."""
    bufs = {(d, dev): new_buffer(n, d, dev) for d, dev, n in lay.buffers}
    out = []
    for b, c in zip(lay.plan.buckets, lay.cuts):
        view = bufs[(b.dtype, b.device)][c.offset : c.offset + c.size]
        view[c.held :].zero_()
        out.append(view)
    return out


@functools.lru_cache(maxsize=64)
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


def sharded_roots(tree: Any) -> list[Sharded]:
    """The :class:`Sharded` nodes of ``tree`` (outermost first; a Sharded holds none)."""
    found: list[Sharded] = []

    def walk(node: Any) -> None:
        if isinstance(node, Sharded):
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


def spec_has_sharded(spec: optree.PyTreeSpec) -> bool:
    """Whether a tree of this structure holds a :class:`Sharded` node."""
    # torch.compile traces this (every sync checks it) and warns about lru_cache wrappers: the
    # plain function there, the cached one in eager mode.
    return _has_sharded(spec) if torch.compiler.is_compiling() else _has_sharded_cached(spec)


def _has_sharded(spec: optree.PyTreeSpec) -> bool:
    return spec.type is Sharded or any(_has_sharded(c) for c in spec.children())


_has_sharded_cached = functools.lru_cache(maxsize=256)(_has_sharded)


def explain(want: optree.PyTreeSpec, got: optree.PyTreeSpec, want_name: str = "the reference", got_name: str = "this tree") -> str | None:
    """Words for two treedefs that differ because of sharding, or ``None`` if sharding is not why."""
    a, b = spec_has_sharded(want), spec_has_sharded(got)
    if not (a or b):
        return None
    la = sharded_roots(optree.tree_unflatten(want, [None] * want.num_leaves))
    lb = sharded_roots(optree.tree_unflatten(got, [None] * got.num_leaves))
    if a != b:
        which, other = (want_name, got_name) if a else (got_name, want_name)
        return (
            f"{which} is sharded (fddp.zero: one rank's slices of the buckets) but {other} is a replicated "
            "tree: the sharded and replicated paths do not mix. Give a sharded optimizer state sharded "
            "gradients (compression=fddp.zero.ReduceScatter() in fddp.grad_and_value or fddp.ddp_step) "
            "and sharded parameters (fddp.zero.shard(params)), or keep everything replicated"
        )
    for x, y in zip(la, lb):
        if x.layout != y.layout:
            lx, ly = x.layout, y.layout
            if lx.stage != ly.stage:
                return (
                    f"{want_name} is sharded for ZeRO stage {lx.stage} and {got_name} for stage {ly.stage}: stage 3's "
                    "trees (fddp.zero.fully_shard: one bucket per unit) and stage 2's (fddp.zero.shard, "
                    "ReduceScatter: the gradients' buckets) do not mix; take the gradients of fully_shard's "
                    "apply_fn with torch.func.grad for its shards, or keep to stage 2 throughout"
                )
            if (lx.world, lx.rank) != (ly.world, ly.rank):
                return (
                    f"the trees are sharded for different world sizes or ranks ({lx!r} and {ly!r}); shards move "
                    "between world sizes only through fddp.checkpoint.save_sharded / load_sharded, which reshard"
                )
            return (
                f"the trees are sharded with different layouts ({lx!r} and {ly!r}): make the parameter shards "
                "and the gradients with the same bucket_cap_mb, first_bucket_mb and group, and for the same tree"
            )
    return None


def check_world(tree: Any, what: str) -> None:
    """Raise (saying how to reshard) if a Sharded node of ``tree`` was made for another group."""
    for s in sharded_roots(tree):
        s.layout.check_group(what)


def all_reduce_sum(lay: ShardLayout, value: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` summed over the layout's ranks (one small all-reduce; a copy, the input is kept)."""
    lay.check_group(what)
    out = value.detach().clone()
    if lay.world > 1:
        from fddp.sync._signature import collective_device, wait

        device = collective_device(lay.group)
        moved = out.to(device)
        wait(dist.all_reduce(moved, group=lay.group, async_op=True), lay.group, what, "the all-reduce of a sharded sum")
        out = moved.to(value.device)
    return out


# ---------------------------------------------------------------------------------------------
# torch's fused optimizer kernels on shards, element for element as on whole leaves.
#
# The CPU kernels (_fused_adam_, _fused_adamw_, _fused_sgd_) run each tensor of their lists through
# a vector loop and its last numel % W elements (W lanes) through a scalar loop that rounds
# differently. fddp's replicated apply_gradients, like torch.optim's fused=True, hands them one
# tensor per leaf. To give shards the same numbers, the kernel gets the leaves' pieces, cut so that
# every element takes the path it takes in the per-leaf call, whatever W (a divisor of 64):
#   - whole 64-element blocks of a leaf (counted from the leaf's start): views of the shard;
#   - the leaf's last partial block (n % 64 elements, which holds the scalar tail): at its full
#     length, a view when this rank holds all of it, else a zeroed temporary with this rank's
#     elements at their offsets (the rest computed on zeros and thrown away);
#   - body elements that a shard boundary cuts from their block: inside a zeroed 64-element
#     temporary, at their offsets.


@functools.lru_cache(maxsize=64)
def _kernel_items(lay: ShardLayout) -> tuple[tuple[tuple[str, int, int, int, int], ...], ...]:
    """Per bucket: ``(kind, shard start, shard stop, temporary length, offset in it)`` items."""
    out = []
    for b, c in zip(lay.plan.buckets, lay.cuts):
        items = []
        for off, n in zip(b.offsets, b.numels):
            lo, hi = max(c.lo, off), min(c.hi, off + n)
            if lo >= hi:
                continue
            a, e = lo - off, hi - off  # this rank's piece of the leaf: [a, e)
            last = n - n % _BLOCK  # the start of the leaf's last partial block
            piece = []
            body_end = min(e, last)
            if a < body_end:
                first_full, end_full = -(-a // _BLOCK) * _BLOCK, body_end // _BLOCK * _BLOCK
                if end_full < first_full:  # inside one block
                    piece.append(("temp", a, body_end, _BLOCK, a % _BLOCK))
                else:
                    if a < first_full:
                        piece.append(("temp", a, first_full, _BLOCK, a % _BLOCK))
                    if first_full < end_full:
                        piece.append(("view", first_full, end_full, 0, 0))
                    if end_full < body_end:
                        piece.append(("temp", end_full, body_end, _BLOCK, 0))
            if e > last:
                s = max(a, last)
                if s == last and e == n:
                    piece.append(("view", s, e, 0, 0))
                else:
                    piece.append(("temp", s, e, n - last, s - last))
            shift = off - c.lo
            items += [(kind, x + shift, y + shift, tl, to) for kind, x, y, tl, to in piece]
        out.append(tuple(items))
    return tuple(out)


def kernel_pieces(
    lay: ShardLayout, buckets: Sequence[int], lists: Sequence[Sequence[torch.Tensor]], read_only: Sequence[int] = ()
) -> tuple[list[list[torch.Tensor]], Callable[[], None]]:
    """The per-shard tensor lists of a fused kernel call, as leaf-aligned pieces (see above).

    Args:
        lay: the layout of the shards.
        buckets: the bucket of each shard in the lists (one flat group's shards).
        lists: parallel lists of shards (params, grads, state...), one tensor per bucket.
        read_only: indices of lists the kernel only reads (no copy back).

    Returns:
        The kernel's lists, and a function that copies the temporaries' results back into the
        shards; call it after the kernel.
    """
    items = _kernel_items(lay)
    out: list[list[torch.Tensor]] = [[] for _ in lists]
    fixes: list[tuple[int, int, int, int, list[torch.Tensor]]] = []
    for j, k in enumerate(buckets):
        for kind, s, f, tl, to in items[k]:
            if kind == "view":
                for o, xs in zip(out, lists):
                    o.append(xs[j][s:f])
                continue
            temps = []
            for o, xs in zip(out, lists):
                t = torch.zeros(tl, dtype=xs[j].dtype, device=xs[j].device)
                t[to : to + f - s].copy_(xs[j][s:f])
                o.append(t)
                temps.append(t)
            fixes.append((j, s, f, to, temps))
    skip = set(read_only)

    def copy_back() -> None:
        for j, s, f, to, temps in fixes:
            for i, (xs, t) in enumerate(zip(lists, temps)):
                if i not in skip:
                    xs[j][s:f].copy_(t[to : to + f - s])

    return out, copy_back


def clear() -> None:
    """Forget the cached layouts and pieces (``fddp.clear_caches``)."""
    layout.cache_clear()
    leaf_pieces.cache_clear()
    _kernel_items.cache_clear()
    _has_sharded_cached.cache_clear()
