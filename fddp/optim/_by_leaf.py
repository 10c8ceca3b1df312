"""Per-leaf quantities on replicated trees and on ``fddp.zero``'s shards alike.

LAMB and LARS scale each parameter's update by a trust ratio, ``|param| / |update|``, which needs
each parameter's whole norm; masks (``mask=``) choose per leaf. On a replicated tree a leaf is a
tensor. On shards (a :class:`~fddp._layout.SplitTree`) a tensor holds pieces of several leaves
(``Split.pieces``), and a leaf may lie across ranks: here each rank sums its pieces' squares in
float64, per whole leaf, and one all-reduce of that vector (every rank's, the same length: the
whole tree's leaf count) gives every rank every leaf's sum. A leaf's replicated norm is the same
float64 sum of the same squares over one piece, so the two agree to float64 rounding (about 1e-16
relative); the ratio is then rounded to the parameter's dtype, where such a difference shows with
a probability of about 1e-8 per leaf and step in float32.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from fddp import _dist
from fddp._layout import SplitTree, has_split

from ._checks import paths_of
from ._clip import summed_over_shards
from ._groups import _partition  # the one reading of masks and labels, for trees and shards

__all__ = ["Layout", "layout_of", "sums_of_squares", "by_leaf", "leaf_flags"]


class Layout(NamedTuple):
    """Where the whole leaves lie in a tree's tensors.

    Attributes:
        split: the split tree (``None``: a replicated tree, tensor ``i`` is whole leaf ``i``).
        pieces: per tensor, ``(whole leaf, at, length)`` of each piece, in order (split trees only).
        count: the number of whole leaves.
    """

    split: SplitTree | None
    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    count: int


def layout_of(tree: Any, leaves: Sequence[Tensor], treedef: Any, where: str) -> Layout:
    """The layout of ``tree`` (whose flattened tensors are ``leaves``)."""
    if isinstance(tree, SplitTree):
        split = tree.split
        pieces = tuple(tuple((p.leaf, p.at, p.stop - p.start) for p in ps) for ps in split.pieces)
        if any(leaf < 0 for ps in pieces for leaf, _, _ in ps) or not split.leaves:
            raise TypeError(
                f"{where}: these shards do not record which leaf each piece is of; make them with fddp.zero.shard, "
                "fddp.zero.ReduceScatter or fddp.zero.fully_shard"
            )
        return Layout(tree, pieces, len(split.leaves))
    if has_split(treedef):
        raise TypeError(
            f"{where}: the tree holds fddp.zero's shards below its root; give the optimizer the sharded tree itself "
            "(the fddp.zero.Sharded), whose per-leaf norms are summed over the ranks"
        )
    return Layout(None, (), len(leaves))


def sums_of_squares(layout: Layout, *trees: Sequence[Tensor]) -> Tensor:
    """Each whole leaf's sum of squares, per tree: a float64 tensor ``[len(trees), count]``, the
    same on every rank (on shards, one all-reduce: a collective every rank of the group joins)."""
    if layout.split is None:
        rows = [torch.stack([_sumsq(x) for x in xs]) if xs else torch.zeros(0, dtype=torch.float64) for xs in trees]
        return torch.stack(rows) if rows else torch.zeros((0, 0), dtype=torch.float64)
    return _split_sums(layout.split, layout, trees)


def _sumsq(x: Tensor) -> Tensor:
    return torch.linalg.vector_norm(x, dtype=torch.float64).square()


def _split_group(tree: SplitTree, *_: Any, **__: Any) -> Any:
    return tree.split.group


@_dist.entry("optim.trust_ratio", _split_group, headerless=True)
def _split_sums(tree: SplitTree, layout: Layout, trees: Sequence[Sequence[Tensor]]) -> Tensor:
    what = "optim.trust_ratio"
    tree.check_group(what)
    device = next((x.device for xs in trees for x in xs), torch.device("cpu"))
    total = torch.zeros((len(trees), layout.count), dtype=torch.float64, device=device)
    for j, xs in enumerate(trees):
        for x, pieces in zip(xs, layout.pieces):
            for leaf, at, n in pieces:
                if n:
                    total[j, leaf] += _sumsq(x[at : at + n])
    return summed_over_shards(total, tree.split, what, "the all-reduce of the shards' per-leaf sums of squares")


def by_leaf(layout: Layout, fn: Callable[..., Tensor], *trees: Sequence[Tensor]) -> list[Tensor]:
    """``fn(leaf, *xs)`` on each whole leaf's elements of the trees' tensors, as new tensors.

    On a replicated tree ``fn`` gets whole leaves; on shards, each piece (a slice), and the
    padding between pieces is kept as the first tree's (zeros).
    """
    if layout.split is None:
        return [fn(i, *xs) for i, xs in enumerate(zip(*trees))]
    out = []
    for k, pieces in enumerate(layout.pieces):
        xs = [t[k] for t in trees]
        segments, pos = [], 0
        for leaf, at, n in pieces:
            if at > pos:
                segments.append(xs[0][pos:at])
            segments.append(fn(leaf, *(x[at : at + n] for x in xs)))
            pos = at + n
        if pos < xs[0].numel() or not segments:
            segments.append(xs[0][pos:])
        out.append(torch.cat(segments) if len(segments) > 1 else segments[0].clone())
    return out


def leaf_flags(mask: Any, tree: Any, leaves: list, treedef: Any, where: str) -> list[bool]:
    """Each whole leaf's mask value (``None``: every leaf True), as ``mask=`` elsewhere in fddp.optim
    reads it: a tree of bools shaped like the parameters (or a prefix), a function of them, or
    :func:`fddp.optim.by_path`; on shards, those of the whole parameters."""
    if mask is None:
        count = len(tree.split.leaves) if isinstance(tree, SplitTree) else len(leaves)
        return [True] * count
    labels = _partition(mask, tree, leaves, treedef, where).labels
    for i, label in enumerate(labels):
        if not isinstance(label, bool):
            names = paths_of(treedef) if not isinstance(tree, SplitTree) else [str(j) for j in range(len(labels))]
            raise TypeError(f"{where}: a mask's values are Python bools, but leaf {names[i]!r} has {label!r}")
    return list(labels)
