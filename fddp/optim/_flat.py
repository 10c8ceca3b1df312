"""Flat buffers for optimizer updates: one contiguous tensor per dtype and device, not one per leaf.

An optimizer step outside ``vmap`` is bound by memory traffic, and a pure one must write its
results to new tensors every step. On the host that is what made it slow: torch's CPU allocator
hands large freed blocks back to the OS, so every new result paid page faults on first touch and a
pure AdamW took twice the time of ``torch.optim.AdamW``'s in-place one. Here each operation runs
once over a flat buffer laid out by ``fddp._layout`` (one buffer per dtype and device, leaves in
tree order) and taken from fddp's pool of host buffers (``fddp._pool``), which hands a buffer out
again only when nothing refers to it any more, so recycling is never observable.

Results go back to the caller as views of the flat buffers (``_layout.views``). When they come back
as the next step's inputs (state, parameters, updates), ``as_flat`` recognises them
(``_layout.tiled``) and reads the buffer in place instead of copying; other leaves (fresh gradients, a user's own tensors) are copied in
once. The same per-tensor functions run on flat buffers and, under ``vmap``, ``torch.compile`` or
autograd, on each leaf with ``out=None``: the same kernels in the same order, so both paths give
bit-identical results.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
from torch import Tensor

from fddp import _layout, _shard
from fddp._layout import tiled, views
from fddp._tree import LeafSpec

_functorch = torch._C._functorch


Group = _layout.Bucket  # one flat buffer: leaf indices, shapes, offsets, dtype and device


def new(group: Group) -> Tensor:
    """An uninitialised buffer for this group, recycled from the host pool when possible."""
    return _layout.new_flat(group)


def multi_tensor_ok(tensors: Sequence[Tensor]) -> bool:
    """Whether multi-tensor work (flat buffers, ``torch._foreach_*`` ops) may be used on ``tensors``.

    Inside any torch.func transform (vmap, grad, jacrev, ...) we work leaf by leaf: foreach ops have
    no batching rule and ``out=`` cannot take batched tensors. The interpreter stack is the robust
    signal: it is non-empty whenever a transform is active, even if a particular leaf is not batched.
    """
    if not tensors:
        return False
    if _functorch.peek_interpreter_stack() is not None:
        return False
    return not _functorch.is_functorch_wrapped_tensor(tensors[0])


def groups_for(
    *leaf_lists: Sequence[Tensor],
    names: Callable[[], Sequence[str]] | None = None,
    labels: Sequence[str] | None = None,
) -> tuple[Group, ...] | None:
    """The flat layout for updating these parallel leaf lists together, or ``None`` for leaf by leaf.

    The first list that already tiles flat buffers (gradients from ``ddp_step``, the results of an
    earlier step) sets the layout; otherwise one buffer per dtype and device, in tree order. Flat
    buffers are used only when every leaf is a plain
    contiguous tensor with the first list's dtype and device, when no torch.func transform or
    ``torch.compile`` tracing is active (``out=`` and the buffer pool are eager-only), and when
    autograd does not need to see the arithmetic.

    Args:
        *leaf_lists: parallel lists of tensors (params, grads, state...), the same length.
        names: returns the leaves' paths, for error messages (called only on error).
        labels: what each list is (``"params"``, ``"grads"``...), for error messages.

    Raises:
        ValueError: a leaf's shape differs from the first list's, on any path (elementwise ops
            would otherwise broadcast it silently).
    """
    ref = leaf_lists[0]
    for k, leaves in enumerate(leaf_lists[1:], 1):
        for i, (t, r) in enumerate(zip(leaves, ref)):
            if t.shape != r.shape:
                where = f"leaf {names()[i]!r}" if names is not None else f"leaf {i}"
                what = f"{labels[k]} has" if labels else f"input {k} has"
                ref_name = labels[0] if labels else "input 0"
                raise ValueError(
                    f"shapes differ at {where}: {what} {tuple(t.shape)}, {ref_name} has {tuple(r.shape)}"
                )
    if not multi_tensor_ok(ref) or torch.compiler.is_compiling():
        return None
    grad_mode = torch.is_grad_enabled()
    specs = []
    for t in ref:
        if t.layout is not torch.strided or not t.is_contiguous() or (grad_mode and t.requires_grad):
            return None
        specs.append(LeafSpec(tuple(t.shape), t.dtype, t.device))
    for leaves in leaf_lists[1:]:
        for t, spec in zip(leaves, specs):
            dtype, device = spec.dtype, spec.device
            if (
                t.dtype != dtype
                or t.device != device
                or t.layout is not torch.strided
                or not t.is_contiguous()
                or (grad_mode and t.requires_grad)
            ):
                return None
    for leaves in leaf_lists:
        # A list that already tiles flat buffers (gradients in their buckets, or this optimizer's
        # own results) sets the layout: read in place, and the results keep that layout.
        adopted = _layout.tiling(leaves)
        if adopted is not None:
            return adopted
    return _layout.optim_plan(tuple(specs)).buckets


def as_flat(leaves: Sequence[Tensor], group: Group) -> Tensor:
    """The group's leaves as one flat tensor: the buffer they tile if any, else a copy."""
    base = tiled(leaves, group)
    return base if base is not None else copy(leaves, group)


def copy(leaves: Sequence[Tensor], group: Group) -> Tensor:
    """A new flat buffer holding a copy of the group's leaves."""
    return copy_with_views(leaves, group)[0]


def copy_with_views(leaves: Sequence[Tensor], group: Group) -> tuple[Tensor, list[Tensor]]:
    """A new flat buffer holding a copy of the group's leaves, and its views shaped like them."""
    out = new(group)
    out_views = views(out, group)
    torch._foreach_copy_(out_views, [leaves[i] for i in group.indices])
    return out, out_views


def scatter(out: list, group_views: Sequence[Tensor], group: Group) -> None:
    """Put a group's views (from ``views``) into ``out`` at the group's leaf positions."""
    for i, v in zip(group.indices, group_views):
        out[i] = v


def disjoint(*leaf_lists: Sequence[Tensor]) -> bool:
    """Whether no two of these contiguous leaves share a byte of memory.

    An in-place update of tied leaves (one tensor twice in a tree, or overlapping views) would
    apply the step twice to the shared memory; with this check, such trees stay on the pure path.
    """
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for leaves in leaf_lists
        for t in leaves
        if t.numel()
    )
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def run(
    unit: Callable[..., tuple],
    groups: tuple[Group, ...] | None,
    inputs: Sequence[Sequence[Tensor] | None],
    like: Sequence[Tensor],
    num_outputs: int,
) -> list[list]:
    """Apply ``unit`` to each flat group, or to each leaf when ``groups`` is ``None``.

    ``unit(*tensors, new)`` receives one tensor per input list (``None`` for an absent input) and a
    ``new()`` that returns an output buffer (a pooled flat buffer, or ``None`` meaning "allocate",
    leaf by leaf); it returns ``num_outputs`` tensors or ``None``s.

    Returns:
        ``num_outputs`` leaf lists (``None`` where the unit returned ``None``).
    """
    n = len(like)
    outs: list[list] = [[None] * n for _ in range(num_outputs)]
    if groups is None:
        for i in range(n):
            res = unit(*(None if xs is None else xs[i] for xs in inputs), _no_buffer)
            for k in range(num_outputs):
                outs[k][i] = res[k]
        return outs
    for group in groups:
        flats = [None if xs is None else as_flat(xs, group) for xs in inputs]
        res = unit(*flats, functools.partial(new, group))
        del flats  # drop our references so a copied-in input buffer is free again right away
        for k in range(num_outputs):
            if res[k] is not None:
                scatter(outs[k], views(res[k], group), group)
    return outs


def _no_buffer() -> None:
    return None


def kernels_take(params: object, treedef: object) -> bool:
    """Whether :func:`kernel_lists` can cut this tree for torch's fused kernels: a plain tree, or a
    :class:`fddp.zero.Sharded` at the root (shards deeper down take the pure path, which is
    position-independent)."""
    return isinstance(params, _shard.Sharded) or not _shard.spec_has_sharded(treedef)


def kernel_lists(
    params: object, group: Group, lists: Sequence[Sequence[Tensor]], read_only: Sequence[int] = ()
) -> tuple[Sequence[Sequence[Tensor]], Callable[[], None]]:
    """The tensor lists to hand torch's fused kernels for one flat group, and what to run after.

    For a plain tree, the lists themselves (one tensor per leaf, as ``torch.optim``'s fused=True).
    For a :class:`fddp.zero.Sharded` tree, the leaves' pieces cut so that every element takes the
    kernel's code path of the per-leaf call (``fddp._shard.kernel_pieces``), so that sharded steps
    equal replicated ones to the bit; the returned function copies the pieces that went through
    temporaries back (except for the lists in ``read_only``).
    """
    if isinstance(params, _shard.Sharded):
        return _shard.kernel_pieces(params.layout, group.indices, lists, read_only)
    return lists, _nothing


def _nothing() -> None:
    return None
