"""Parameter groups on split trees (ZeRO's shards): a per-leaf choice made per slice.

A shard of ``fddp.zero`` holds pieces of several leaves, back to back, and its
:class:`~fddp._layout.Split` says which leaf each piece is of (``Piece.leaf``) and what the whole
tree looks like (``Split.spec``, ``Split.leaves``). So a mask, a label or a param group, chosen per
leaf of the whole tree, is a choice per slice of the shards: a group's tree is a
:class:`GroupSlices`, the views of the runs of its leaves' pieces in this rank's shards, itself a
split tree whose pieces keep their place in their leaves. Every transformation sees it as it sees
shards: elementwise steps are position-independent, torch's fused kernels are cut leaf-aligned
(``_kernels``), a global norm is summed over the ranks. The groups' results are written back into
new shards of the whole tree's layout (:meth:`SplitPartition.merge`).

Every rank runs every group of the whole tree, in the same order, even one it holds nothing of:
a group's transformation may take a collective (``masked(clip_by_global_norm(...))``).
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, NamedTuple, Sequence

import optree
import optree.registry
import torch
import torch.distributed as dist
from torch import Tensor

from fddp import _caches
from fddp._layout import Piece, Split, SplitTree, lay_out, new_flat, optim_plan
from fddp._tree import LeafSpec, paths, specs_of

__all__ = ["GroupSlices", "SplitPartition", "broadcast_labels", "members_of", "whole_tree"]


class _Meta(NamedTuple):
    """What a :class:`GroupSlices` tree's structure records: its split, the stage, the group's
    label and its whole leaves (indices in the whole tree, the same on every rank)."""

    split: Split
    stage: int
    label: Any
    members: tuple[int, ...] = ()


class GroupSlices(SplitTree):
    """One group's elements of a split tree: the runs of this rank's shards that hold the group's leaves.

    A pytree node: its children are 1-D tensors (views of the shards where the partition made them,
    the group's own results after a step), its metadata the :class:`~fddp._layout.Split` of those
    runs (each run's pieces, at their places in the whole leaves), so that a transformation treats
    it as shards. Ranks hold different runs (a rank may hold none).

    Example:
        >>> part = SplitPartition(labels, shards, where="adamw.update")
        >>> part.tree(optree.tree_leaves(shards), True)  # the decayed leaves' slices
    """

    __slots__ = ("runs", "meta")

    def __init__(self, runs: Sequence[Any], meta: _Meta) -> None:
        self.runs = tuple(runs)
        self.meta = meta

    def __repr__(self) -> str:
        held = sum(p.stop - p.start for r in self.meta.split.pieces for p in r)
        return f"GroupSlices(label={self.meta.label!r}, runs={len(self.runs)}, elements={held})"

    @property
    def split(self) -> Split:
        return self.meta.split

    @property
    def stage(self) -> int:
        return self.meta.stage

    @property
    def members(self) -> tuple[int, ...]:
        """The group's whole leaves (their indices in the whole tree), every rank's alike, held here or not."""
        return self.meta.members

    def check_group(self, what: str) -> None:
        """Raise unless this process is the rank, in a group of the size, the slices were cut for."""
        split = self.meta.split
        n, r = (dist.get_world_size(split.group), dist.get_rank(split.group)) if dist.is_initialized() else (1, 0)
        if (n, r) != (split.world, split.rank):
            raise RuntimeError(
                f"fddp.{what}: these shards' group slices were cut for rank {split.rank} of {split.world} ranks, but this "
                f"process is rank {r} of {n}; shards move between world sizes only through fddp.checkpoint.load_sharded"
            )


optree.register_pytree_node(
    GroupSlices,
    lambda s: (s.runs, s.meta, tuple(f"run{k}" for k in range(len(s.runs)))),
    lambda meta, runs: GroupSlices(tuple(runs), meta),
    namespace=vars(optree.registry)["__GLOBAL_NAMESPACE"],  # fddp flattens in optree's global namespace
)


class _Run(NamedTuple):
    """A stretch of one tensor of the split tree whose pieces all belong to one group."""

    tensor: int
    at: int
    length: int
    pieces: tuple[Piece, ...]  # at their places in the run


def members_of(tree: SplitTree) -> tuple[int, ...]:
    """The whole leaves a split tree covers: a group's (:attr:`GroupSlices.members`), else every leaf."""
    if isinstance(tree, GroupSlices):
        return tree.members
    return tuple(range(len(tree.split.leaves)))


def whole_tree(split: Split, where: str) -> Any:
    """The whole tree as meta tensors (shapes and dtypes, no values): what a labels function of the
    parameters is called on, for shards."""
    if split.spec is None or len(split.leaves) != split.spec.num_leaves:
        raise TypeError(
            f"{where}: labels and masks choose leaves of the whole tree, but these shards do not record its "
            "structure; make them with fddp.zero.shard, fddp.zero.ReduceScatter or fddp.zero.fully_shard"
        )
    return optree.tree_unflatten(split.spec, list(_meta_leaves(split.leaves)))


@_caches.cached(maxsize=64)
def _meta_leaves(leaves: tuple[LeafSpec, ...]) -> tuple[Tensor, ...]:
    return tuple(torch.empty(s.shape, dtype=s.dtype, device="meta") for s in leaves)


@_caches.cached(maxsize=64)
def _runs(split: Split, labels: tuple) -> tuple[dict, dict]:
    """Each label's runs in this rank's tensors, and each label's whole-leaf indices, labels in
    the whole tree's order (the same on every rank)."""
    members: dict[Any, list[int]] = {}
    for i, label in enumerate(labels):
        members.setdefault(label, []).append(i)
    runs: dict[Any, list[_Run]] = {label: [] for label in members}
    for k, pieces in enumerate(split.pieces):
        open_: tuple[Any, int, list[Piece]] | None = None  # (label, where the run starts, its pieces)
        for p in pieces:
            label = labels[p.leaf]
            if open_ is not None and open_[0] == label and open_[1] + sum(q.stop - q.start for q in open_[2]) == p.at:
                open_[2].append(p)
                continue
            if open_ is not None:
                runs[open_[0]].append(_close(k, open_))
            open_ = (label, p.at, [p])
        if open_ is not None:
            runs[open_[0]].append(_close(k, open_))
    return {label: tuple(r) for label, r in runs.items()}, {label: tuple(ix) for label, ix in members.items()}


def _close(k: int, open_: tuple[Any, int, list[Piece]]) -> _Run:
    _, at, pieces = open_
    rebased = tuple(p._replace(at=p.at - at) for p in pieces)
    return _Run(k, at, sum(p.stop - p.start for p in pieces), rebased)


class SplitPartition:
    """Each whole leaf's label, and each label's slices of a split tree (the split counterpart of
    ``_groups._Partition``).

    Attributes:
        treedef: the split tree's structure.
        labels: every whole leaf's label (flatten order of the whole tree).
        groups: per label (every label of the whole tree, in its order, the same on every rank),
            the indices of its whole leaves.
    """

    def __init__(self, tree: SplitTree, treedef: optree.PyTreeSpec, labels: list, where: str) -> None:
        split = tree.split
        self.treedef = treedef
        self.split = split
        self.labels = labels
        self.names = paths(split.spec)
        self.runs, self.groups = _runs(split, tuple(labels))
        self.metas = {
            label: _Meta(
                split._replace(pieces=tuple(r.pieces for r in runs)), tree.stage, label, self.groups[label]
            )
            for label, runs in self.runs.items()
        }  # fmt: skip

    def name(self, i: int) -> str:
        return self.names[i]

    def tree(self, leaves: Sequence[Tensor], label: Hashable) -> GroupSlices:
        """The label's slices of these leaves (one tensor per tensor of the split tree): views, no copy."""
        runs = self.runs.get(label, ())
        return GroupSlices([leaves[r.tensor][r.at : r.at + r.length] for r in runs], self.metas.get(label, _empty_meta(self, label)))

    def merge(self, parts: Mapping[Any, Any], like: Sequence[Tensor], into: Sequence[Tensor] | None = None) -> Any:
        """One split tree from each label's slices (a :class:`GroupSlices` or its leaves).

        Without ``into``: new tensors laid out for ``fddp.optim``, shaped and typed like ``like``
        (the split tree's tensors), every element no part covers (padding, or the labels missing
        from ``parts``) zero. With ``into``: written into those tensors, skipping the slices that
        already lie there (a group stepped in place on its views of them).
        """
        if into is None:
            plan = optim_plan(specs_of(like))
            out = lay_out(plan, [new_flat(b).zero_() for b in plan.buckets])
        else:
            out = list(into)
        dst, src = [], []
        for label, part in parts.items():
            xs = part.runs if isinstance(part, GroupSlices) else optree.tree_leaves(part, none_is_leaf=True)
            for r, x in zip(self.runs[label], xs):
                if not r.length:
                    continue
                d = out[r.tensor][r.at : r.at + r.length]
                if into is not None and x.data_ptr() == d.data_ptr() and x.dtype == d.dtype:
                    continue  # stepped in place
                dst.append(d)
                src.append(x)
        if dst:
            torch._foreach_copy_(dst, src)
        return optree.tree_unflatten(self.treedef, out)

    def cut(self, state: Any, label: Hashable) -> Any:
        """``state`` with every subtree shaped like the split tree replaced by the label's slices of it."""
        return _map_shaped(state, self.treedef, lambda node: self.tree(optree.tree_leaves(node), label))

    def join(self, states: Mapping[Any, Any], old: Any, *, in_place: bool = False) -> Any:
        """One state from the labels' states (:meth:`cut` shapes, each label's step): their slices
        merged into split trees laid out like ``old``'s (``in_place``: written into ``old``'s), their
        other values taken from the first label's."""
        first = next(iter(states.values()))
        old_nodes = _shaped_nodes(old, self.treedef)
        if not old_nodes:
            return first
        flat = {label: optree.tree_flatten(s, is_leaf=_is_slices, none_is_leaf=True)[0] for label, s in states.items()}
        leaves, spec = optree.tree_flatten(first, is_leaf=_is_slices, none_is_leaf=True)
        at = iter(old_nodes)
        out = []
        for j, x in enumerate(leaves):
            if isinstance(x, GroupSlices):
                like = optree.tree_leaves(next(at))
                out.append(self.merge({label: f[j] for label, f in flat.items()}, like, like if in_place else None))
            else:
                out.append(x)
        return optree.tree_unflatten(spec, out)

    def fresh(self, tree: Any) -> Any:
        """``tree`` with every subtree shaped like the split tree copied into new buffers laid out
        for ``fddp.optim`` (one copy per buffer), for the groups to step in place."""

        def copy(node: Any) -> Any:
            leaves = optree.tree_leaves(node)
            plan = optim_plan(specs_of(leaves))
            bufs = [new_flat(b) for b in plan.buckets]
            out = lay_out(plan, bufs)
            torch._foreach_copy_(out, leaves)
            return optree.tree_unflatten(self.treedef, out)

        return _map_shaped(tree, self.treedef, copy)


def _empty_meta(part: SplitPartition, label: Any) -> _Meta:
    return _Meta(part.split._replace(pieces=()), 2, label, part.groups.get(label, ()))


def _is_slices(x: Any) -> bool:
    return isinstance(x, GroupSlices)


def _map_shaped(state: Any, treedef: optree.PyTreeSpec, fn: Callable[[Any], Any]) -> Any:
    """Apply ``fn`` to every split-tree node of ``state`` whose structure is ``treedef``."""
    split_type = treedef.type

    def shaped(x: Any) -> bool:
        return isinstance(x, SplitTree) and type(x) is split_type and optree.tree_structure(x, none_is_leaf=True) == treedef

    return optree.tree_map(lambda x: fn(x) if shaped(x) else x, state, is_leaf=shaped, none_is_leaf=True)


def _shaped_nodes(state: Any, treedef: optree.PyTreeSpec) -> list:
    found = []
    _map_shaped(state, treedef, lambda node: found.append(node) or node)
    return found


def labels_of(labels: Any, by_path: Callable[[list, optree.PyTreeSpec], list] | None, tree: SplitTree, where: str) -> list:
    """Every whole leaf's label: from a ``by_path`` function's leaves and paths, or a labels tree /
    function of the whole tree (meta tensors: shapes and dtypes, no values)."""
    split = tree.split
    whole = whole_tree(split, where)
    if by_path is not None:
        return by_path(list(_meta_leaves(split.leaves)), split.spec)
    expected = (
        "on fddp.zero's shards the labels are those of the whole parameters: a tree shaped like them (or a "
        "prefix of it), or a function of them (called on meta tensors of their shapes)"
    )
    return broadcast_labels(labels, whole, where, expected)


def broadcast_labels(labels: Any, tree: Any, where: str, expected: str) -> list:
    """Every leaf of ``tree``'s label, from ``labels``: a tree shaped like ``tree`` or a prefix of it
    (one label for a whole subtree), or a function of ``tree`` returning one; ``expected`` says what
    was expected, in the error.

    Example:
        >>> broadcast_labels({"a": "x", "b": "y"}, {"a": torch.ones(1), "b": {"c": torch.ones(1)}}, "masked", "...")
        ['x', 'y']
    """
    given = labels(tree) if callable(labels) else labels
    try:
        full = optree.tree_broadcast_prefix(given, tree, none_is_leaf=True)
    except ValueError as e:
        raise ValueError(f"{where}: {expected}: {e}") from None
    return optree.tree_leaves(full, none_is_leaf=True)
