"""torch's fused optimizer kernels (``_fused_sgd_``, ``_fused_adam_``, ``_fused_adamw_``) on fddp's trees.

``apply_gradients`` hands them one tensor per leaf, as ``torch.optim.*(fused=True)`` does, so that
its results equal torch's to the bit. A split tree (``fddp.zero``'s shards) holds pieces of leaves
instead; :func:`kernel_lists` cuts them so that every element takes the kernel path it takes in
the per-leaf call, and a sharded step equals the replicated one to the bit too.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch

from fddp import _caches
from fddp._layout import Piece, Split, SplitTree, has_split

from ._flat import Group, Step

__all__ = ["FUSED_DTYPES", "kernels_take", "kernel_lists", "kernel_pieces"]

FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_BLOCK = 64  # the fused kernels' vector width divides this (see kernel_pieces)


def kernel_lr(lr: Any) -> Any:
    """A learning rate for torch's fused kernels: a Python float as it is; a tensor (a schedule's,
    float64 on the count's device) in float32 on a GPU, whose kernels read it as float (a float64
    one raises there), and as it is on the CPU, whose kernels read it as double."""
    return lr.float() if isinstance(lr, torch.Tensor) and not lr.is_cpu else lr


def kernels_take(step: Step | None, params: Any, treedef: optree.PyTreeSpec) -> bool:
    """Whether torch's fused kernels can run this step: flat groups of a float dtype on the CPU or
    CUDA, and a plain tree or a split tree at the root (split trees deeper down take the pure path,
    which is position-independent)."""
    if step is None or not all(g.dtype in FUSED_DTYPES and g.device.type in ("cpu", "cuda") for g in step.groups):
        return False
    return isinstance(params, SplitTree) or not has_split(treedef)


def kernel_lists(
    params: Any, group: Group, lists: Sequence[Sequence[torch.Tensor]], read_only: Sequence[int] = ()
) -> tuple[Sequence[Sequence[torch.Tensor]], Callable[[], None]]:
    """The tensor lists to hand torch's fused kernels for one flat group, and what to run after.

    For a plain tree, the lists themselves (one tensor per leaf, as ``torch.optim``'s fused=True).
    For a split tree, the leaves' pieces cut as :func:`kernel_pieces` says; the returned function
    copies the pieces that went through temporaries back (except for the lists in ``read_only``).
    """
    if isinstance(params, SplitTree):
        return kernel_pieces(params.split, group.indices, lists, read_only)
    return lists, _nothing


def _nothing() -> None:
    return None


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


Item = tuple[str, int, int, int, int]  # (kind, start, stop, temporary length, offset in it)


@_caches.cached(maxsize=256)
def _kernel_items(pieces: tuple[Piece, ...]) -> tuple[Item, ...]:
    """For one tensor of a split tree, its kernel items: every piece's, in the tensor's coordinates."""
    return tuple(item for p in pieces for item in _piece_items(p))


def _piece_items(p: Piece) -> list[Item]:
    n, a, e = p.numel, p.start, p.stop  # this rank's piece of the leaf: [a, e)
    last = n - n % _BLOCK  # the start of the leaf's last partial block
    items = []
    body_end = min(e, last)
    if a < body_end:
        first_full, end_full = -(-a // _BLOCK) * _BLOCK, body_end // _BLOCK * _BLOCK
        if end_full < first_full:  # inside one block
            items.append(("temp", a, body_end, _BLOCK, a % _BLOCK))
        else:
            if a < first_full:
                items.append(("temp", a, first_full, _BLOCK, a % _BLOCK))
            if first_full < end_full:
                items.append(("view", first_full, end_full, 0, 0))
            if end_full < body_end:
                items.append(("temp", end_full, body_end, _BLOCK, 0))
    if e > last:
        s = max(a, last)
        if s == last and e == n:
            items.append(("view", s, e, 0, 0))
        else:
            items.append(("temp", s, e, n - last, s - last))
    shift = p.at - p.start  # leaf coordinates to the tensor's
    return [(kind, x + shift, y + shift, tl, to) for kind, x, y, tl, to in items]


def kernel_pieces(
    split: Split, members: Sequence[int], lists: Sequence[Sequence[torch.Tensor]], read_only: Sequence[int] = ()
) -> tuple[list[list[torch.Tensor]], Callable[[], None]]:
    """The per-shard tensor lists of a fused kernel call, as leaf-aligned pieces (see above).

    Args:
        split: the split of the shards' tree.
        members: the index of each shard in the lists, within the split tree (one flat group's shards).
        lists: parallel lists of shards (params, grads, state...), one tensor per bucket.
        read_only: indices of lists the kernel only reads (no copy back).

    Returns:
        The kernel's lists, and a function that copies the temporaries' results back into the
        shards; call it after the kernel.
    """
    out: list[list[torch.Tensor]] = [[] for _ in lists]
    fixes: list[tuple[int, int, int, int, list[torch.Tensor]]] = []
    for j, k in enumerate(members):
        for kind, s, f, tl, to in _kernel_items(split.pieces[k]):
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


