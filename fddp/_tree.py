"""Pytrees of tensors: leaves and their paths, leaf specs, definition order, and structure diffs.

Every error in fddp names a leaf by its path in one format: the keys from the root joined by
``/`` (``"0.weight"`` for a top-level parameter, ``"exp_avg/0.weight"`` inside an
``AdamState``, ``"<root>"`` for the tree itself). Paths are computed only when a message or a
signature needs them, and cached per tree structure.

:func:`flatten` is optree's ``tree_flatten`` (``None`` is a leaf) with a fast path for the tree
fddp meets most, a flat dict of tensors (``fddp.functionalize``'s parameters): its structure is
cached per key order, so a call reads the values and builds no spec.

Every container torch.func accepts is one fddp accepts: :func:`adopt_torch_nodes` registers with
optree (in its global namespace, where fddp flattens) each type registered with
``torch.utils._pytree`` that optree does not know, with torch's own flatten and unflatten
functions: ``tensordict.TensorDict``, dataclasses passed to ``register_dataclass``, any type passed
to ``register_pytree_node``. It runs at import and again whenever torch's registry has grown, so a
type registered after ``import fddp`` is adopted at fddp's next flatten. Named tuples and
``None`` optree handles itself, as torch does.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from typing import Any, NamedTuple, Sequence

import optree
import optree.registry
import torch
import torch.utils._pytree as _torch_pytree

from fddp import _caches

__all__ = [
    "LeafSpec",
    "adopt_torch_nodes",
    "article",
    "definition_order",
    "first_difference",
    "flatten",
    "not_a_module",
    "path_str",
    "paths",
    "specs_of",
    "structure_rows",
    "tensor_leaves",
]

_SHOWN_KEYS = 5  # a node's keys shown in a message, around the first that differs


def path_str(entries: Sequence[Any]) -> str:
    """Format a path, a sequence of optree entries or of plain keys, as ``a/b/0``.

    Example:
        >>> path_str(("layer", 0, "weight"))
        'layer/0/weight'
    """
    if not entries:
        return "<root>"
    return "/".join(str(getattr(e, "field", None) or getattr(e, "entry", e)) for e in entries)


def article(name: str) -> str:
    """``name`` with its indefinite article, for a message: ``"an AdamState"``, ``"a dict"``.

    A name that starts with an initialism (``SGDState``) takes the article of its first letter's
    sound, "an ess".

    Example:
        >>> article("AdamState"), article("SGDState"), article("PowerSGDState")
        ('an AdamState', 'an SGDState', 'a PowerSGDState')
    """
    initialism = len(name) > 1 and name[:2].isupper()
    vowel = name[:1] in "AEFHILMNORSX" if initialism else name[:1].lower() in "aeiou"
    return f"{'an' if vowel else 'a'} {name}"


FUNCTIONALIZE_FIX = "call `apply_fn, params = fddp.functionalize(model)` and pass params (a dict of its tensors) or a tree shaped like it"
BUFFERS_FIX = "call `apply_fn, params, buffers = fddp.functionalize_with_buffers(model)` and pass buffers (a dict of its buffers)"


def not_a_module(x: Any, what: str, name: str, fix: str = FUNCTIONALIZE_FIX) -> None:
    """Raise a TypeError that says how to get a pytree of tensors if ``x`` is a ``torch.nn.Module``.

    fddp never takes a module where values go: a module flattens to one opaque leaf, which would
    otherwise be reported as "leaf '<root>' is Linear".

    Example:
        >>> not_a_module(torch.nn.Linear(2, 2), "ddp_step", "params")
        Traceback (most recent call last):
        TypeError: fddp.ddp_step: params must be a pytree of tensors, got the module Linear itself; call ...
    """
    if isinstance(x, torch.nn.Module):
        raise TypeError(f"fddp.{what}: {name} must be a pytree of tensors, got the module {type(x).__name__} itself; {fix}")


@_caches.cached(maxsize=256)
def paths(spec: optree.PyTreeSpec) -> tuple[str, ...]:
    """Return the path of every leaf of ``spec``, in flatten order (NamedTuple fields by name)."""
    return tuple(path_str(tuple(a)) for a in spec.accessors())


_Tensor = torch.Tensor
_GLOBAL = vars(optree.registry)["__GLOBAL_NAMESPACE"]  # fddp flattens in optree's global namespace
_adopted_from = [0]  # len(torch's registry) when last adopted: a cheap test for new registrations


def _key(k: Any) -> Any:
    """A torch key path entry (``MappingKey``, ``GetAttrKey``, ``SequenceKey``) as a plain key."""
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return getattr(k, attr)
    return k


def _bridge(node: Any) -> tuple[Any, Any]:
    """optree's flatten and unflatten functions for a node type torch.utils._pytree describes."""
    flatten_fn, unflatten_fn, with_keys = node.flatten_fn, node.unflatten_fn, node.flatten_with_keys_fn

    if with_keys is None:

        def flatten_node(x: Any) -> tuple[Any, Any]:
            return flatten_fn(x)
    else:
        # The keys name the leaves in messages. Their context is not always flatten_fn's
        # (register_dataclass's differs), so the children and context come from flatten_fn.

        def flatten_node(x: Any) -> tuple[Any, Any, Any]:
            children, context = flatten_fn(x)
            return children, context, [_key(k) for k, _ in with_keys(x)[0]]

    def unflatten_node(context: Any, children: Any) -> Any:
        return unflatten_fn(list(children), context)

    return flatten_node, unflatten_node


def adopt_torch_nodes() -> None:
    """Register with optree the container types ``torch.utils._pytree`` knows and optree does not.

    torch's own internal types (``torch.Size``, ``torch.fx`` collections, ...) are left as optree
    sees them; a type optree already knows (built-in containers, fddp's own, a user's global
    registration) keeps its registration. Cheap when nothing new was registered.

    Example:
        >>> import dataclasses, torch.utils._pytree
        >>> @dataclasses.dataclass
        ... class Pair:
        ...     w: torch.Tensor
        ...     b: torch.Tensor
        >>> _ = torch.utils._pytree.register_dataclass(Pair)
        >>> adopt_torch_nodes(); flatten(Pair(torch.ones(1), torch.zeros(1)))[0]
        [tensor([1.]), tensor([0.])]
    """
    nodes = _torch_pytree.SUPPORTED_NODES
    if len(nodes) == _adopted_from[0] or torch.compiler.is_compiling():
        return  # under torch.compile: dynamo traces no registration (types met eagerly first are known)
    for cls, node in list(nodes.items()):
        if not isinstance(cls, type) or cls.__module__.split(".")[0] == "torch" or optree.register_pytree_node.get(cls) is not None:
            continue
        flatten_node, unflatten_node = _bridge(node)
        entry = optree.GetAttrEntry if dataclasses.is_dataclass(cls) else optree.GetItemEntry
        try:
            optree.register_pytree_node(cls, flatten_node, unflatten_node, path_entry_type=entry, namespace=_GLOBAL)
        except ValueError:  # registered in an optree namespace of its own: that registration stands
            continue
    _adopted_from[0] = len(nodes)


def flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    """``optree.tree_flatten(tree, none_is_leaf=True)``, a few times faster on a flat dict of tensors.

    Example:
        >>> flatten({"b": torch.ones(1), "a": torch.zeros(1)})
        ([tensor([0.]), tensor([1.])], PyTreeSpec({'a': *, 'b': *}, NoneIsLeaf))
    """
    if type(tree) is dict and not torch.compiler.is_compiling():
        flat = _flat_dict(tree)
        if flat is not None:
            return flat
    return _optree_flatten(tree)


def _flat_dict(tree: dict) -> tuple[list[torch.Tensor], optree.PyTreeSpec] | None:
    """A flat dict of tensors' leaves and structure (the usual tree, without optree's walk), or ``None``."""
    spec, keys = _dict_spec(tuple(tree))
    if spec is not None:
        leaves = list(map(tree.__getitem__, keys))
        if all(map(isinstance, leaves, itertools.repeat(_Tensor))):
            return leaves, spec
    return None


def _optree_flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    if len(_torch_pytree.SUPPORTED_NODES) != _adopted_from[0] and not torch.compiler.is_compiling():
        adopt_torch_nodes()
    return optree.tree_flatten(tree, none_is_leaf=True)


@_caches.cached(maxsize=64)
def _dict_spec(keys: tuple) -> tuple[optree.PyTreeSpec | None, tuple]:
    """A flat dict's structure and its keys in flatten order, from its keys in insertion order."""
    try:
        spec = optree.tree_structure(dict.fromkeys(keys, 0), none_is_leaf=True)
    except TypeError:  # keys optree cannot sort among themselves: its own flatten decides
        return None, ()
    return spec, tuple(spec.entries())


_spec_fields = operator.attrgetter("shape", "dtype", "device")


def specs_of(leaves: Sequence[torch.Tensor]) -> tuple[tuple, ...]:
    """Each tensor's ``(shape, dtype, device)``: equal, and hashing equal, to its :class:`LeafSpec`."""
    if torch.compiler.is_compiling():  # dynamo does not trace attrgetter
        return tuple((t.shape, t.dtype, t.device) for t in leaves)
    return tuple(map(_spec_fields, leaves))


def tensor_leaves(tree: Any, what: str, *, none_ok: bool = False, name: str = "the tree") -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten a tree whose leaves must be tensors (or ``None`` if ``none_ok``); name the first that is not.

    ``name`` is what the caller calls the tree (``"params"``), for the message when it is a module.

    Example:
        >>> tensor_leaves({"w": 1.0}, "ddp_step")
        Traceback (most recent call last):
        TypeError: fddp.ddp_step: every leaf must be a torch.Tensor, but leaf 'w' is float
    """
    if type(tree) is dict and not torch.compiler.is_compiling():
        flat = _flat_dict(tree)
        if flat is not None:
            return flat  # every leaf checked a tensor already
    leaves, spec = _optree_flatten(tree)
    if all(map(isinstance, leaves, itertools.repeat(_Tensor))):
        return leaves, spec
    not_a_module(tree, what, name)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) and not (none_ok and leaf is None):
            allowed = "a torch.Tensor or None" if none_ok else "a torch.Tensor"
            fix = f"; {FUNCTIONALIZE_FIX}" if isinstance(leaf, torch.nn.Module) else _container_fix(leaf)
            raise TypeError(
                f"fddp.{what}: every leaf must be {allowed}, but leaf {paths(spec)[i]!r} is {type(leaf).__name__}{fix}"
            )
    return leaves, spec


def _container_fix(leaf: Any) -> str:
    """The fix for a leaf that may be a container no pytree registry knows, or ``""``."""
    if leaf is None or isinstance(leaf, (int, float, complex, str, bytes)):
        return ""
    how = "torch.utils._pytree.register_dataclass" if dataclasses.is_dataclass(leaf) else "torch.utils._pytree.register_pytree_node"
    return f"; if it is a container of tensors, register its class with {how} (torch.func needs that too) and fddp flattens it"


class LeafSpec(NamedTuple):
    """What a bucket plan needs to know of a leaf: its shape, dtype and device.

    A named tuple rather than a dataclass: every synchronising call builds one per leaf and hashes
    and compares the tuple of them (the signature and plan caches), and a tuple does that in C
    (about 60 us a call less on a 100-tensor model).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> "LeafSpec":
        return LeafSpec(tuple(t.shape), t.dtype, t.device)

    @property
    def numel(self) -> int:
        return functools.reduce(lambda a, b: a * b, self.shape, 1)

    def describe(self) -> str:
        # Device *type* only: cuda:0 on one rank and cuda:1 on another is the normal case.
        return f"shape={self.shape} dtype={self.dtype} device={self.device.type}"


def _insertion_paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """optree-style leaf paths with dicts walked in insertion order (plain Python, so it traces)."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _insertion_paths(v, prefix + (k,))]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in _insertion_paths(v, prefix + (i,))]
    return [prefix]


def definition_order(tree: Any, spec: optree.PyTreeSpec | None = None) -> tuple[int, ...] | None:
    """Return the leaf indices (into ``optree``'s flatten order) in the order the tree was built.

    optree flattens a dict in sorted key order, so ``'layers.10'`` comes before ``'layers.2'`` and
    ``'bias'`` before ``'weight'``. A dict of parameters is built in module registration order,
    the order forward uses them and the reverse of the order backward produces their gradients,
    which is the order buckets should fill. ``None`` when the two orders agree, or when the tree
    holds node types other than dicts, lists and tuples (their flatten order is kept). ``spec``,
    the tree's structure where the caller has it, spares a walk over a flat dict's values.

    Example:
        >>> definition_order({"b": torch.zeros(1), "a": torch.zeros(1)})
        (1, 0)
    """
    if type(tree) is dict and not torch.compiler.is_compiling() and (
        _flat_spec(spec, len(tree)) if spec is not None else all(map(isinstance, tree.values(), itertools.repeat(_Tensor)))
    ):
        # The usual tree, a flat dict of tensors (fddp.functionalize's): its order depends on the
        # keys alone, cached per key tuple instead of walking the tree on every call.
        return _flat_dict_order(tuple(tree))
    return _definition_order(tree)


def _flat_spec(spec: optree.PyTreeSpec, n: int) -> bool:
    """Whether ``spec`` (a dict's of ``n`` entries) holds a leaf in every entry: the dict is flat
    (read from the structure the caller has, instead of walking the values again)."""
    return spec.num_leaves == n and spec.num_nodes == n + 1


@_caches.cached(maxsize=64)
def _flat_dict_order(keys: tuple) -> tuple[int, ...] | None:
    return _definition_order(dict.fromkeys(keys))  # None values are leaves, as tensors are


def _definition_order(tree: Any) -> tuple[int, ...] | None:
    ins = _insertion_paths(tree)
    index = {p: i for i, p in enumerate(optree.tree_paths(tree, none_is_leaf=True))}
    if len(index) != len(ins) or any(p not in index for p in ins):
        return None
    order = tuple(index[p] for p in ins)
    return None if order == tuple(range(len(order))) else order


Row = tuple  # (where, what is there, the node's keys or None): one line of a tree's description


def structure_rows(tree: Any) -> list[Row]:
    """Describe ``tree`` as rows ``(path, what is there, keys)``: every node (a dict's keys in
    insertion order) before its children, every leaf with its spec. Two ranks' rows compare row by
    row; :func:`first_difference` names the first that differs.

    Example:
        >>> structure_rows({"b": torch.zeros(2), "a": None})
        [('<root>', 'dict', ('b', 'a')), ('b', 'tensor shape=(2,) dtype=torch.float32 device=cpu', None), ('a', 'None', None)]
    """
    rows: list[Row] = []

    def walk(node: Any, prefix: tuple) -> None:
        here = path_str(prefix)
        if isinstance(node, torch.Tensor):
            rows.append((here, "tensor " + LeafSpec.of(node).describe(), None))
            return
        if node is None:
            rows.append((here, "None", None))
            return
        if isinstance(node, dict):
            keys = tuple(node.keys())  # insertion order: the order buckets fill in
            rows.append((here, type(node).__name__, keys))
            for k in keys:
                walk(node[k], prefix + (k,))
            return
        out = optree.tree_flatten_one_level(node, none_is_leaf=True)
        if not out.entries and optree.treespec_is_leaf(optree.tree_structure(node, none_is_leaf=True)):
            rows.append((here, f"leaf of type {type(node).__name__}", None))
            return
        fields = getattr(type(node), "_fields", None)
        names = tuple(fields) if fields else tuple(out.entries)
        rows.append((here, type(node).__name__, names))
        for name, child in zip(names, out.children):
            walk(child, prefix + (name,))

    walk(tree, ())
    return rows


def _describe(row: Row, at: int) -> str:
    """A row for a message; a node's keys shown around position ``at``, cut to a readable length."""
    where, what, keys = row
    if keys is None:
        return what
    start = max(0, min(at - 2, len(keys) - _SHOWN_KEYS))
    shown = ", ".join(repr(k) for k in keys[start : start + _SHOWN_KEYS])
    before = "..., " if start > 0 else ""
    rest = len(keys) - start - _SHOWN_KEYS
    after = f", ... and {rest} more" if rest > 0 else ""
    return f"{what} with keys [{before}{shown}{after}]"


def first_difference(ref: Sequence[Row], other: Sequence[Row], ref_name: str, other_name: str) -> str | None:
    """Name the first row where two descriptions differ, or ``None`` if they are equal.

    Example:
        >>> first_difference([("w", "tensor shape=(2,)", None)], [("w", "tensor shape=(3,)", None)], "rank 0", "rank 1")
        "at 'w': rank 0 has tensor shape=(2,), rank 1 has tensor shape=(3,)"
    """
    for i in range(max(len(ref), len(other))):
        a = ref[i] if i < len(ref) else None
        b = other[i] if i < len(other) else None
        if a == b:
            continue
        if a is None:
            return f"{other_name} has more: {b[0]!r} ({_describe(b, 0)}), which {ref_name} lacks"
        if b is None:
            return f"{ref_name} has more: {a[0]!r} ({_describe(a, 0)}), which {other_name} lacks"
        at = 0
        if a[2] is not None and b[2] is not None:  # two nodes: show their keys where they part
            at = next((k for k, (x, y) in enumerate(zip(a[2], b[2])) if x != y), min(len(a[2]), len(b[2])))
        if a[0] == b[0]:
            where = a[0] if a[0].startswith("option ") else f"at {a[0]!r}"
            fix = ""
            if a[1] == b[1] and a[2] is not None and b[2] is not None and len(a[2]) == len(b[2]) and set(a[2]) == set(b[2]):
                # Insertion order fixes the order in which buckets fill and the leaves travel.
                fix = ": the same keys in another order; build the dicts in the same key order on every rank (it is the buckets' order)"
            return f"{where}: {ref_name} has {_describe(a, at)}, {other_name} has {_describe(b, at)}{fix}"
        return f"{ref_name} has {a[0]!r} ({_describe(a, at)}) where {other_name} has {b[0]!r} ({_describe(b, at)})"
    return None


adopt_torch_nodes()
