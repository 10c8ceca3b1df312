"""Flat buffers for optimizer updates: one contiguous tensor per bucket, not one per leaf.

An optimizer step outside ``vmap`` is bound by memory traffic, and a pure one must write its
results to new tensors every step. On the host that is what made it slow: torch's CPU allocator
hands large freed blocks back to the OS, so every new result paid page faults on first touch and a
pure AdamW took twice the time of ``torch.optim.AdamW``'s in-place one. Here each operation runs
once over a flat buffer and takes its outputs from fddp's pool of host buffers (``fddp._pool``),
which hands a buffer out again only when nothing refers to it any more, so recycling is never
observable.

The layout comes with the values (``fddp._layout``): gradients from ``ddp_step`` or
``grad_and_value`` are views of the sync's buckets, and this optimizer's own results (parameters,
state) are views of its buffers, each laid out with its plan. The first input that carries a plan
sets the step's (:func:`step_plan`); inputs laid out in it are read in place, others (fresh
gradients from ``torch.func.grad``, a user's own tensors) are copied in once; results are laid out
in it, so the next step reads them in place too. The same per-tensor functions run on flat buffers
and, under ``vmap``, ``torch.compile`` or autograd, on each leaf with ``out=None``: the same kernels
in the same order, so both paths give bit-identical results.
"""

from __future__ import annotations

import functools
import operator
from typing import Callable, Sequence

import torch
from torch import Tensor

from fddp import _layout
from fddp._layout import Bucket, BucketPlan, Flat, flat_of, lay_out, views
from fddp._tree import specs_of

__all__ = ["Group", "Step", "Why", "new", "note", "views", "multi_tensor_ok", "step_plan", "copy", "copy_with_views", "disjoint", "run"]

_functorch = torch._C._functorch
_layout_of = operator.attrgetter("layout")

Group = Bucket  # one flat buffer: leaf indices, shapes, offsets, dtype and device


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


class Why(list):
    """Notes on the path a step took (``fddp.optim.fast_path`` collects them); a list of strings."""


class Step:
    """One optimizer step's flat layout: the plan, and each input's buffers where it lies in it.

    Attributes:
        plan: the step's plan; its buckets are the groups every flat operation runs over.
    """

    def __init__(self, plan: BucketPlan, known: dict[int, Flat | None]) -> None:
        self.plan = plan
        self._known = known  # id(leaf list) -> what flat_of said about it

    @property
    def groups(self) -> tuple[Group, ...]:
        return self.plan.buckets

    def _flat(self, leaves: Sequence[Tensor]) -> Flat | None:
        key = id(leaves)
        if key not in self._known:
            self._known[key] = flat_of(leaves)
        f = self._known[key]
        return f if f is not None and (f.plan is self.plan or f.plan == self.plan) else None

    def lies_in(self, leaves: Sequence[Tensor]) -> bool:
        """Whether ``leaves`` are views of buffers laid out in this step's plan (read in place)."""
        return self._flat(leaves) is not None

    def read(self, leaves: Sequence[Tensor], k: int) -> Tensor:
        """Group ``k`` of ``leaves`` as one flat tensor: the buffer they lie in, or a copy."""
        f = self._flat(leaves)
        return f.buffers[k] if f is not None else copy(leaves, self.plan.buckets[k])

    def buffer(self, leaves: Sequence[Tensor], k: int) -> Tensor | None:
        """Group ``k``'s buffer if ``leaves`` lie in this plan, else ``None``."""
        f = self._flat(leaves)
        return f.buffers[k] if f is not None else None

    def out(self, flats: Sequence[Tensor], made: Sequence[Sequence[Tensor] | None] | None = None) -> list[Tensor]:
        """The leaves of a result, one buffer per group, laid out for the next step."""
        return lay_out(self.plan, flats, made)


def step_plan(
    *leaf_lists: Sequence[Tensor],
    names: Callable[[], Sequence[str]] | None = None,
    labels: Sequence[str] | None = None,
    why: Why | None = None,
) -> Step | None:
    """The flat layout for updating these parallel leaf lists together, or ``None`` for leaf by leaf.

    The first list laid out by fddp (gradients in their buckets, or this optimizer's own results)
    sets the plan: read in place, and the results keep that plan. Otherwise one buffer per dtype
    and device, in tree order. Flat buffers are used only when every leaf is a plain contiguous
    tensor with the first list's dtype and device, when no torch.func transform or
    ``torch.compile`` tracing is active (``out=`` and the buffer pool are eager-only), and when
    autograd does not need to see the arithmetic.

    Args:
        *leaf_lists: parallel lists of tensors (params, grads, state...), the same length.
        names: returns the leaves' paths, for error messages (called only on error).
        labels: what each list is (``"params"``, ``"grads"``...), for error messages.
        why: where given, notes on the decision are appended to it.

    Raises:
        ValueError: a leaf's shape differs from the first list's, on any path (elementwise ops
            would otherwise broadcast it silently).
    """
    ref = leaf_lists[0]
    ref_specs = specs_of(ref)
    specs = [ref_specs] + [specs_of(leaves) for leaves in leaf_lists[1:]]
    if any(s != ref_specs for s in specs[1:]):
        _check_shapes(leaf_lists, names, labels)
        return note(why, "leaf by leaf: the inputs' dtypes or devices differ")
    if not multi_tensor_ok(ref) or torch.compiler.is_compiling():
        return note(why, "leaf by leaf: inside a torch.func transform or torch.compile")
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*(t for leaves in leaf_lists for t in leaves)):
        return note(why, "leaf by leaf: autograd records the step (an input requires grad)")
    known: dict[int, Flat | None] = {}
    adopted: BucketPlan | None = None
    for leaves in leaf_lists:
        f = known[id(leaves)] = flat_of(leaves)
        if f is None:
            if not (all(map(Tensor.is_contiguous, leaves)) and all(x is torch.strided for x in map(_layout_of, leaves))):
                return note(why, "leaf by leaf: a leaf is not a contiguous dense tensor")
        elif adopted is None:
            # A list laid out by fddp (gradients in their buckets, or this optimizer's own
            # results) sets the plan: read in place, and the results keep that plan.
            adopted = f.plan
    if adopted is None:
        adopted = _layout.optim_plan(ref_specs)
        summary = f"flat: {len(adopted.buckets)} buffer(s) of fddp.optim's own layout"
    else:
        summary = f"flat: {len(adopted.buckets)} buffer(s) in the layout the inputs came in"
    step = Step(adopted, known)
    if why is not None:
        why.append(summary)
        _note_copies(why, step, leaf_lists, labels, names)
    return step


def note(why: list | None, text: str) -> None:
    """Append ``text`` to ``why`` where the caller asked for notes (``fddp.optim.fast_path``); return ``None``."""
    if why is not None:
        why.append(text)
    return None


def _note_copies(
    why: Why, step: Step, leaf_lists: Sequence[Sequence[Tensor]], labels: Sequence[str] | None, names: Callable[[], Sequence[str]] | None
) -> None:
    for k, leaves in enumerate(leaf_lists):
        if not step.lies_in(leaves):
            label = labels[k] if labels else f"input {k}"
            reason = _layout.why_not_flat(leaves, names() if names is not None else [str(i) for i in range(len(leaves))])
            why.append(f"{label}: copied into flat buffers ({reason})")


def _check_shapes(leaf_lists: Sequence[Sequence[Tensor]], names: Callable[[], Sequence[str]] | None, labels: Sequence[str] | None) -> None:
    ref = leaf_lists[0]
    for k, leaves in enumerate(leaf_lists[1:], 1):
        for i, (t, r) in enumerate(zip(leaves, ref)):
            if t.shape != r.shape:
                where = f"leaf {names()[i]!r}" if names is not None else f"leaf {i}"
                what = f"{labels[k]} has" if labels else f"input {k} has"
                ref_name = labels[0] if labels else "input 0"
                raise ValueError(f"shapes differ at {where}: {what} {tuple(t.shape)}, {ref_name} has {tuple(r.shape)}")


def copy(leaves: Sequence[Tensor], group: Group) -> Tensor:
    """A new flat buffer holding a copy of the group's leaves."""
    return copy_with_views(leaves, group)[0]


def copy_with_views(leaves: Sequence[Tensor], group: Group) -> tuple[Tensor, list[Tensor]]:
    """A new flat buffer holding a copy of the group's leaves, and its views shaped like them."""
    out = new(group)
    out_views = views(out, group)
    torch._foreach_copy_(out_views, [leaves[i] for i in group.indices])
    return out, out_views


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
    step: Step | None,
    inputs: Sequence[Sequence[Tensor] | None],
    like: Sequence[Tensor],
    num_outputs: int,
) -> list[list]:
    """Apply ``unit`` to each flat group of ``step``, or to each leaf when ``step`` is ``None``.

    ``unit(*tensors, new)`` receives one tensor per input list (``None`` for an absent input) and a
    ``new()`` that returns an output buffer (a pooled flat buffer, or ``None`` meaning "allocate",
    leaf by leaf); it returns ``num_outputs`` tensors or ``None``s.

    Returns:
        ``num_outputs`` leaf lists (``None`` where the unit returned ``None``), laid out in the
        step's plan on the flat path.
    """
    n = len(like)
    if step is None:
        outs: list[list] = [[None] * n for _ in range(num_outputs)]
        for i in range(n):
            res = unit(*(None if xs is None else xs[i] for xs in inputs), _no_buffer)
            for k in range(num_outputs):
                outs[k][i] = res[k]
        return outs
    per_output: list[list] = [[] for _ in range(num_outputs)]
    for k, group in enumerate(step.groups):
        flats = [None if xs is None else step.read(xs, k) for xs in inputs]
        res = unit(*flats, functools.partial(new, group))
        del flats  # drop our references so a copied-in input buffer is free again right away
        for j in range(num_outputs):
            per_output[j].append(res[j])
    return [[None] * n if bufs[0] is None else step.out(bufs) for bufs in per_output]


def _no_buffer() -> None:
    return None
