"""Parameter groups: other transformations, or other hyperparameters, for some of the leaves.

torch.optim's param groups (``AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest,
"weight_decay": 0.0}])``) and optax's ``multi_transform`` / ``masked`` say the same thing: this
set of leaves gets this transformation. Here a group is chosen per leaf by a *label*, given as a
tree shaped like the parameters (or a prefix of it) or as a function of the parameters
(:func:`by_path` builds one from each leaf's path). Each group's transformation sees a tree of its
own leaves only: the others are replaced by an empty node (:class:`MaskedNode`), so its paths stay
the parameters' paths, and its fused step (``apply_gradients``) runs once per group, one kernel
call per dtype and device, as ``torch.optim.*(fused=True)`` runs once per param group.

On ``fddp.zero``'s shards (stages 1 to 3) the labels are those of the whole parameters, and a
group is the slices of the shards that hold its leaves (``_slices``): a per-leaf choice made per
slice, with the numbers of the replicated step.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Hashable, Mapping, NamedTuple

import optree
import torch
from torch import Tensor

from fddp._layout import SplitTree, has_split
from fddp._tree import specs_of

from . import _flat as flat
from ._base import Applied, Apply, EmptyState, GradientTransformation, GradientTransformationExtraArgs, apply_updates
from ._checks import OptState, Params, PyTree, Updates, check_grads, check_state, describe, flatten, leaves_like, paths_of
from ._slices import SplitPartition, broadcast_labels, labels_of

__all__ = [
    "MaskedNode",
    "MaskedState",
    "MultiTransformState",
    "by_path",
    "grouped",
    "masked",
    "multi_transform",
    "set_to_zero",
]


class MaskedNode(NamedTuple):
    """Stands for a leaf outside a group, in the tree that group's transformation sees: a node
    with no leaves, so the tree flattens to the group's leaves alone and keeps their paths
    (optax's ``MaskedNode``). A flat dict of parameters needs none: a group's tree is the dict of
    its own keys.

    Example:
        >>> optree.tree_leaves({"w": torch.ones(2), "b": fddp.optim.MaskedNode()}, none_is_leaf=True)
        [tensor([1., 1.])]
    """


_MASKED = MaskedNode()


class MultiTransformState(NamedTuple):
    """State of :func:`multi_transform`.

    Attributes:
        inner_states: each label's transformation's state, by label.
    """

    inner_states: dict


class MaskedState(NamedTuple):
    """State of :func:`masked`.

    Attributes:
        inner_state: the wrapped transformation's state, over the masked-in leaves.
    """

    inner_state: Any


Labels = Any  # a tree of labels shaped like the parameters (or a prefix of it), or a function of them


def by_path(fn: Callable[[str, Tensor], Any], /) -> Callable[[PyTree], PyTree]:
    """A labels (or mask) function that decides leaf by leaf from each leaf's path and shape.

    The path is fddp's one format: the keys from the root joined by ``/``, so a parameter of
    :func:`fddp.functionalize` is its ``named_parameters()`` name (``"blocks.0.ln1.weight"``).
    ``fn`` may read the leaf's shape, ``ndim`` and dtype, not its values: its answers are
    remembered per tree structure and leaf shapes, so a training loop calls it once per leaf.

    Args:
        fn: ``fn(path, leaf) -> label`` (a bool, for a mask).

    Returns:
        A function ``params -> tree of labels``, for ``mask=`` or ``labels=``.

    Example:
        >>> decay = fddp.optim.by_path(lambda path, p: p.ndim >= 2)  # no decay on biases and norms
        >>> opt = fddp.optim.adamw(3e-4, weight_decay=0.1, mask=decay)
    """
    if not callable(fn):
        raise TypeError(f"by_path: expected a function (path, leaf) -> label, got {describe(fn)}")
    return _ByPath(fn)


class _ByPath:
    """``by_path``'s function; its labels remembered per (structure, leaf specs), a few at a time."""

    _KEPT = 8  # trees one optimizer meets: the parameters, under vmap a member's, a test's

    def __init__(self, fn: Callable[[str, Tensor], Any]) -> None:
        self.fn = fn
        self.known: dict = {}

    def __call__(self, tree: PyTree) -> PyTree:
        leaves, treedef = flatten(tree)
        return optree.tree_unflatten(treedef, self.labels(leaves, treedef))

    def labels(self, leaves: list, treedef: optree.PyTreeSpec) -> list:
        key = (treedef, specs_of(leaves))
        found = self.known.get(key)
        if found is None:
            found = [self.fn(p, x) for p, x in zip(paths_of(treedef), leaves)]
            if len(self.known) >= self._KEPT:
                self.known.pop(next(iter(self.known)))
            self.known[key] = found
        return found


class _Partition:
    """Each leaf's label, and the leaves of each label, for one tree structure.

    A group's tree is the parameters' tree with a :class:`MaskedNode` for every other leaf; for a
    flat dict (``fddp.functionalize``'s parameters) it is the dict of the group's own keys, which
    has the same paths and flattens on fddp's fast path.
    """

    def __init__(self, treedef: optree.PyTreeSpec, labels: list, keys: tuple | None, where: str) -> None:
        self.treedef = treedef
        self.labels = labels
        self.keys = keys  # a flat dict's keys in flatten order, else None
        self.groups: dict[Any, list[int]] = {}
        _check_hashable(labels, lambda i: paths_of(treedef)[i], where)
        for i, label in enumerate(labels):
            self.groups.setdefault(label, []).append(i)

    def name(self, i: int) -> str:
        return paths_of(self.treedef)[i]

    def tree(self, leaves: list, label: Hashable) -> PyTree:
        """The tree of this label's leaves."""
        if self.keys is not None:
            keys = self.keys
            return {keys[i]: leaves[i] for i in self.groups.get(label, ())}
        labels = self.labels
        return optree.tree_unflatten(self.treedef, [x if labels[i] == label else _MASKED for i, x in enumerate(leaves)])

    def merge(self, parts: Mapping[Any, PyTree], like: Any = None) -> PyTree:
        """One tree from each label's tree of its leaves (every label's, or the leaves are None)."""
        out = [None] * len(self.labels)
        for label, tree in parts.items():
            for i, x in zip(self.groups[label], flatten(tree)[0]):
                out[i] = x
        return optree.tree_unflatten(self.treedef, out)


def _partition(labels: Labels, tree: PyTree, leaves: list, treedef: optree.PyTreeSpec, where: str) -> _Partition | SplitPartition:
    if isinstance(tree, SplitTree):
        # fddp.zero's shards: the whole parameters' labels, made per slice of the shards.
        whole = labels_of(labels, labels.labels if isinstance(labels, _ByPath) else None, tree, where)
        part = SplitPartition(tree, treedef, whole, where)
        _check_hashable(whole, part.name, where)
        return part
    if has_split(treedef):
        raise TypeError(
            f"{where}: labels and masks choose leaves of the parameters, but this tree holds fddp.zero's shards "
            "below its root; give the optimizer the sharded tree itself (the fddp.zero.Sharded), whose labels are "
            "those of the whole parameters"
        )
    flat_dict = type(tree) is dict and all(map(isinstance, tree.values(), itertools.repeat(Tensor)))
    keys = tuple(treedef.entries()) if flat_dict else None
    if isinstance(labels, _ByPath):
        return _Partition(treedef, labels.labels(leaves, treedef), keys, where)
    expected = (
        "the labels must be a tree shaped like the parameters, or a prefix of it (one label for a whole "
        "subtree), or a function returning one"
    )
    return _Partition(treedef, broadcast_labels(labels, tree, where, expected), keys, where)


def _check_hashable(labels: list, name: Callable[[int], str], where: str) -> None:
    for i, label in enumerate(labels):
        if not _hashable(label):
            raise TypeError(
                f"{where}: leaf {name(i)!r} has the label {label!r}; a label is a plain hashable "
                "value such as a str or a bool (for a mask, a Python bool: p.ndim >= 2, not a tensor)"
            )


def _check_labels(part: _Partition | SplitPartition, known: Mapping, where: str, what: str = "transforms") -> None:
    for label, idx in part.groups.items():
        if label not in known:
            name = part.name(idx[0])
            raise ValueError(
                f"{where}: leaf {name!r} has the label {label!r}, which is not one of the {what} "
                f"({', '.join(map(repr, known))}); label every leaf with one of them"
            )


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return not isinstance(x, Tensor)


def _leaves(grads: Updates, params: Params | None, where: str) -> tuple[list, list | None, optree.PyTreeSpec]:
    gs, treedef = check_grads(grads, None, where)
    ps = leaves_like(params, treedef, "params", "grads") if params is not None else None
    return gs, ps, treedef


def _sub_request(extra: dict) -> tuple[dict, Apply | None, list | None]:
    """The extra arguments for one group's ``update``: its own notes list where notes are asked for."""
    request = extra.get("apply")
    if not isinstance(request, Apply) or request.why is None:
        return extra, request, None
    notes = flat.Why()
    return {**extra, "apply": request._replace(why=notes)}, request, notes


def _run_group(
    t: GradientTransformation, label: Any, grads: Updates, state: OptState, params: Params | None, extra: dict
) -> tuple[Any, OptState]:
    """One group's update, asked to apply its step where ``extra`` asks (its notes prefixed by its label)."""
    if not isinstance(t, GradientTransformationExtraArgs):
        out, s = t.update(grads, state, params)
        _, request, _ = _sub_request(extra)
        if request is not None and request.why is not None:
            request.why.append(f"[{label!r}] update + apply_updates: a plain GradientTransformation")
        return out, s
    sub, request, notes = _sub_request(extra)
    out, s = t.update(grads, state, params, **sub)
    if notes is not None:
        request.why.extend(f"[{label!r}] {n}" for n in notes)
    return out, s


def _grouped_in_place(
    part: SplitPartition, transforms: Mapping, gs: list, state: OptState, params: Params, extra: dict
) -> tuple[Applied, OptState]:
    """``grouped``'s fused step on shards: every group steps its slices of one copy of the
    parameters and state in place (of the donated ones themselves, when donated), so the groups'
    results need no copy back; a group that cannot step in place is copied into its slices."""
    request: Apply = extra["apply"]
    if not request.donate:
        params, state = part.fresh(params), part.fresh(state)
    ps = flatten(params)[0]
    sub = {**extra, "apply": request._replace(donate=True)}
    outs, states = {}, {}
    for label in part.groups:
        sub_p = part.tree(ps, label)
        out, states[label] = _run_group(transforms[label], label, part.tree(gs, label), part.cut(state, label), sub_p, sub)
        outs[label] = _applied_params(out, sub_p)
    return Applied(part.merge(outs, ps, ps)), part.join(states, state, in_place=True)


def _cut(part: _Partition | SplitPartition, state: OptState, label: Hashable) -> OptState:
    """A group's state as its transformation sees it: on shards, its slices of the whole-shard state."""
    return part.cut(state, label) if isinstance(part, SplitPartition) else state


def _join(part: _Partition | SplitPartition, states: Mapping[Any, OptState], old: OptState) -> OptState:
    """The state to keep from a group's step: on shards, its slices written back into whole shards."""
    return part.join(states, old) if isinstance(part, SplitPartition) else next(iter(states.values()))


def _applied_params(out: Any, params: Params) -> Params:
    return out.params if isinstance(out, Applied) else apply_updates(params, out)


def multi_transform(transforms: Mapping[Hashable, GradientTransformation], labels: Labels, /) -> GradientTransformationExtraArgs:
    """Give each group of leaves its own transformation, chosen by the leaf's label (optax's
    ``multi_transform``; torch's param groups).

    Each transformation sees only its group's leaves (a tree with :class:`MaskedNode` in place of
    the others, so paths stay the parameters'), keeps its own state, and takes its own fused step
    in ``apply_gradients``: one kernel call per group and dtype, as ``torch.optim.*(fused=True)``
    runs per param group. A group with no leaves is not stepped.

    Args:
        transforms: the transformation of each label.
        labels: every leaf's label: a tree shaped like the parameters (or a prefix of it: one label
            for a whole subtree), or a function ``labels(params) -> such a tree`` (see
            :func:`by_path`), called on ``params`` (on the gradients when ``update`` gets none).

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`MultiTransformState`.

    Example:
        >>> # torch.optim.AdamW([{"params": body, "lr": 1e-4}, {"params": head, "lr": 1e-3}])
        >>> opt = fddp.optim.multi_transform(
        ...     {"body": fddp.optim.adamw(1e-4), "head": fddp.optim.adamw(1e-3)},
        ...     fddp.optim.by_path(lambda path, p: "head" if path.startswith("head.") else "body"),
        ... )
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"multi_transform: transforms must be a non-empty dict of label -> GradientTransformation, got {describe(transforms)}"
        )
    for label, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"multi_transform: transforms[{label!r}] must be a GradientTransformation, got {describe(t)}")
    transforms = dict(transforms)
    where = "multi_transform.update"

    def init(params: Params) -> MultiTransformState:
        leaves, treedef = flatten(params)
        part = _partition(labels, params, leaves, treedef, "multi_transform.init")
        _check_labels(part, transforms, "multi_transform.init")
        if isinstance(part, SplitPartition):
            # On shards each group's state spans the whole shards (its slices cut at each step),
            # so that it is a sharded tree like any other: checkpoints save and reshard it.
            return MultiTransformState({label: t.init(params) for label, t in transforms.items()})
        return MultiTransformState({label: t.init(part.tree(leaves, label)) for label, t in transforms.items()})

    def update(grads: Updates, state: MultiTransformState, params: Params | None = None, **extra: Any) -> tuple[Any, MultiTransformState]:
        check_state(state, MultiTransformState, where, grads=grads, params=params)
        if not isinstance(state.inner_states, dict) or state.inner_states.keys() != transforms.keys():
            raise TypeError(
                f"{where}: the state holds the labels {list(getattr(state.inner_states, 'keys', list)())}, this "
                f"multi_transform has {list(transforms)}; was the state made by another optimizer's init?"
            )
        gs, ps, treedef = _leaves(grads, params, where)
        part = _partition(labels, params if params is not None else grads, ps if ps is not None else gs, treedef, where)
        _check_labels(part, transforms, where)
        apply = extra.get("apply") is not None and ps is not None
        states = dict(state.inner_states)
        outs = {}
        for label in part.groups:
            sub_p = part.tree(ps, label) if ps is not None else None
            sub_s = _cut(part, states[label], label)
            out, new_s = _run_group(transforms[label], label, part.tree(gs, label), sub_s, sub_p, extra)
            states[label] = _join(part, {label: new_s}, states[label])
            outs[label] = _applied_params(out, sub_p) if apply else out
        merged = part.merge(outs, ps if apply else gs)
        return (Applied(merged) if apply else merged), MultiTransformState(states)

    return GradientTransformationExtraArgs(init, update)


def masked(inner: GradientTransformation, mask: Labels, /) -> GradientTransformationExtraArgs:
    """Apply ``inner`` to the leaves where ``mask`` is True; pass the others' updates through
    unchanged (optax's ``masked``).

    The leaves outside the mask keep their incoming updates: in a ``chain`` that is "skip this
    step for them" (``chain(masked(clip_by_global_norm(1.0), mask), adamw(...))`` clips some
    leaves only); alone, their parameters move by the raw gradient. To leave weight decay off
    some leaves, give the optimizer ``mask=`` instead (``adamw(..., mask=decay)``); to freeze
    leaves, label them with :func:`set_to_zero` in :func:`multi_transform`.

    Args:
        inner: the transformation for the masked-in leaves.
        mask: True for the leaves ``inner`` applies to: a tree of bools shaped like the parameters
            (or a prefix of it), or a function ``mask(params) -> such a tree`` (see :func:`by_path`).

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`MaskedState`.

    Example:
        >>> big = fddp.optim.by_path(lambda path, p: p.ndim >= 2)
        >>> opt = fddp.optim.chain(fddp.optim.masked(fddp.optim.clip_by_global_norm(1.0), big), fddp.optim.sgd(0.1))
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"masked: inner must be a GradientTransformation, got {describe(inner)}")
    where = "masked.update"
    bools = {True: None, False: None}

    def init(params: Params) -> MaskedState:
        leaves, treedef = flatten(params)
        part = _partition(mask, params, leaves, treedef, "masked.init")
        _check_labels(part, bools, "masked.init", "mask values")
        if isinstance(part, SplitPartition):
            return MaskedState(inner.init(params))  # spans the whole shards, as multi_transform's
        return MaskedState(inner.init(part.tree(leaves, True)))

    def update(grads: Updates, state: MaskedState, params: Params | None = None, **extra: Any) -> tuple[Any, MaskedState]:
        check_state(state, MaskedState, where, grads=grads, params=params)
        gs, ps, treedef = _leaves(grads, params, where)
        part = _partition(mask, params if params is not None else grads, ps if ps is not None else gs, treedef, where)
        _check_labels(part, bools, where, "mask values")
        apply = extra.get("apply") is not None and ps is not None
        if True not in part.groups:
            rest = apply_updates(params, grads) if apply else grads
            return (Applied(rest) if apply else rest), state
        sub_p = part.tree(ps, True) if ps is not None else None
        out, inner_state = _run_group(inner, True, part.tree(gs, True), _cut(part, state.inner_state, True), sub_p, extra)
        inner_state = _join(part, {True: inner_state}, state.inner_state)
        outs = {True: _applied_params(out, sub_p) if apply else out}
        if False in part.groups:
            passed = part.tree(gs, False)
            outs[False] = apply_updates(part.tree(ps, False), passed) if apply else passed
        merged = part.merge(outs, ps if apply else gs)
        return (Applied(merged) if apply else merged), MaskedState(inner_state)

    return GradientTransformationExtraArgs(init, update)


def set_to_zero() -> GradientTransformationExtraArgs:
    """Zero updates: the leaves it is given do not move (optax's ``set_to_zero``); stateless.

    With :func:`multi_transform` it freezes a group of leaves; ``apply_gradients`` returns their
    parameters as they are, without arithmetic.

    Example:
        >>> opt = fddp.optim.multi_transform(
        ...     {"train": fddp.optim.adamw(1e-3), "frozen": fddp.optim.set_to_zero()},
        ...     fddp.optim.by_path(lambda path, p: "frozen" if path.startswith("embed.") else "train"),
        ... )
    """
    where = "set_to_zero.update"

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params | None = None, **extra: Any) -> tuple[Any, EmptyState]:
        check_state(state, EmptyState, where, grads=grads, params=params)
        if params is not None and extra.get("apply") is not None:
            flat.note(extra["apply"].why, "set_to_zero: the parameters as they are")
            return Applied(params), state
        gs, treedef = check_grads(grads, None, where)
        return optree.tree_unflatten(treedef, [torch.zeros_like(g) for g in gs]), state

    return GradientTransformationExtraArgs(init, update)


def grouped(
    transforms: Mapping[Hashable, GradientTransformation], labels: Labels, where: str, *, donated_alike: bool = False
) -> GradientTransformationExtraArgs:
    """Like :func:`multi_transform`, for transformations of one kind (``adamw`` with and without
    weight decay), whose state stays one state of that kind over the whole tree.

    The transformations' states must be NamedTuples whose fields are trees shaped like the
    parameters (cut into groups) or values every group holds alike (a step count, ``()``); the
    state is the first transformation's ``init`` of the whole tree. How ``mask=`` is made.

    ``donated_alike``: the transformations' fused step gives the same numbers donated or not
    (``adam``/``adamw``: torch's fused kernel either way; not ``sgd``, whose own step rounds once
    where torch's kernel, its donated step, rounds twice). Then on shards every group steps its
    slices of one copy of the parameters and state in place, and nothing is copied back.
    """
    transforms = dict(transforms)
    first = next(iter(transforms.values()))

    def update(grads: Updates, state: OptState, params: Params | None = None, **extra: Any) -> tuple[Any, OptState]:
        gs, ps, treedef = _leaves(grads, params, f"{where}.update")
        part = _partition(labels, params if params is not None else grads, ps if ps is not None else gs, treedef, f"{where}.update")
        _check_labels(part, transforms, f"{where}.update", "mask values")
        if len(part.groups) <= 1:  # every leaf in one group (or none): that transformation on the whole tree
            label = next(iter(part.groups), next(iter(transforms)))
            return _run_group(transforms[label], label, grads, state, params, extra)
        if not (isinstance(state, tuple) and hasattr(type(state), "_fields")):
            raise TypeError(f"{where}.update: expected this optimizer's state (from its init), got {describe(state)}")
        split = isinstance(part, SplitPartition)
        apply = extra.get("apply") is not None and ps is not None
        if split and apply and (donated_alike or extra["apply"].donate):
            return _grouped_in_place(part, transforms, gs, state, params, extra)
        fields = [flatten(f) for f in state] if not split else []
        shaped = [spec == treedef for _, spec in fields]
        outs, states = {}, {}
        for label in part.groups:
            if split:
                sub_state = part.cut(state, label)
            else:
                sub_state = type(state)(*(part.tree(leaves, label) if s else f for (leaves, _), s, f in zip(fields, shaped, state)))
            sub_p = part.tree(ps, label) if ps is not None else None
            out, states[label] = _run_group(transforms[label], label, part.tree(gs, label), sub_state, sub_p, extra)
            outs[label] = _applied_params(out, sub_p) if apply else out
        merged = part.merge(outs, ps if apply else gs)
        if split:
            return (Applied(merged) if apply else merged), part.join(states, state)
        lead = states[next(iter(part.groups))]
        new_fields = []
        for k, (s, f) in enumerate(zip(shaped, lead)):
            new_fields.append(part.merge({label: st[k] for label, st in states.items()}) if s else f)
        return (Applied(merged) if apply else merged), type(state)(*new_fields)

    def init(params: Params) -> OptState:
        leaves, treedef = flatten(params)
        _check_labels(_partition(labels, params, leaves, treedef, f"{where}.init"), transforms, f"{where}.init", "mask values")
        return first.init(params)

    return GradientTransformationExtraArgs(init, update)

