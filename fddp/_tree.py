"""Pytrees of tensors: leaves and their paths, leaf specs, definition order, and structure diffs.

Every error in fddp names a leaf by its path in one format: the keys from the root joined by
``/`` (``"0.weight"`` for a top-level parameter, ``"exp_avg/0.weight"`` inside an
``AdamState``, ``"<root>"`` for the tree itself). Paths are computed only when a message or a
signature needs them, and cached per tree structure.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import optree
import torch

__all__ = [
    "LeafSpec",
    "definition_order",
    "first_difference",
    "path_str",
    "paths",
    "structure_rows",
    "tensor_leaves",
]

_SHOWN_KEYS = 8  # keys listed in a structure message before "... and N more"


def path_str(entries: Sequence[Any]) -> str:
    """Format a path, a sequence of optree entries or of plain keys, as ``a/b/0``.

    Example:
        >>> path_str(("layer", 0, "weight"))
        'layer/0/weight'
    """
    if not entries:
        return "<root>"
    return "/".join(str(getattr(e, "field", None) or getattr(e, "entry", e)) for e in entries)


@functools.lru_cache(maxsize=256)
def paths(spec: optree.PyTreeSpec) -> tuple[str, ...]:
    """Return the path of every leaf of ``spec``, in flatten order (NamedTuple fields by name)."""
    return tuple(path_str(tuple(a)) for a in spec.accessors())


def tensor_leaves(tree: Any, what: str, *, none_ok: bool = False) -> tuple[list[Any], optree.PyTreeSpec]:
    """Flatten a tree whose leaves must be tensors (or ``None`` if ``none_ok``); name the first that is not.

    Example:
        >>> tensor_leaves({"w": 1.0}, "ddp_step")
        Traceback (most recent call last):
        TypeError: fddp.ddp_step: every leaf must be a torch.Tensor, but leaf 'w' is float
    """
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) and not (none_ok and leaf is None):
            allowed = "a torch.Tensor or None" if none_ok else "a torch.Tensor"
            raise TypeError(
                f"fddp.{what}: every leaf must be {allowed}, but leaf {paths(spec)[i]!r} is {type(leaf).__name__}"
            )
    return leaves, spec


@dataclass(frozen=True)
class LeafSpec:
    """What a bucket plan needs to know of a leaf: its shape, dtype and device."""

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


def definition_order(tree: Any) -> tuple[int, ...] | None:
    """Return the leaf indices (into ``optree``'s flatten order) in the order the tree was built.

    optree flattens a dict in sorted key order, so ``'layers.10'`` comes before ``'layers.2'`` and
    ``'bias'`` before ``'weight'``. A dict of parameters is built in module registration order,
    the order forward uses them and the reverse of the order backward produces their gradients,
    which is the order buckets should fill. ``None`` when the two orders agree, or when the tree
    holds node types other than dicts, lists and tuples (their flatten order is kept).

    Example:
        >>> definition_order({"b": torch.zeros(1), "a": torch.zeros(1)})
        (1, 0)
    """
    ins = _insertion_paths(tree)
    index = {p: i for i, p in enumerate(optree.tree_paths(tree, none_is_leaf=True))}
    if len(index) != len(ins) or any(p not in index for p in ins):
        return None
    order = tuple(index[p] for p in ins)
    return None if order == tuple(range(len(order))) else order


def structure_rows(tree: Any) -> list[tuple[str, str]]:
    """Describe ``tree`` as ``(path, what is there)`` rows: every node (a dict's keys in insertion
    order) before its children, every leaf with its spec. Two ranks' rows compare row by row.

    Example:
        >>> structure_rows({"b": torch.zeros(2), "a": None})
        [('<root>', "dict with keys ['b', 'a']"), ('b', 'tensor shape=(2,) dtype=torch.float32 device=cpu'), ('a', 'None')]
    """
    rows: list[tuple[str, str]] = []

    def walk(node: Any, prefix: tuple) -> None:
        here = path_str(prefix)
        if isinstance(node, torch.Tensor):
            rows.append((here, "tensor " + LeafSpec.of(node).describe()))
            return
        if node is None:
            rows.append((here, "None"))
            return
        if isinstance(node, dict):
            keys = list(node.keys())  # insertion order: the order buckets fill in
            rows.append((here, f"{type(node).__name__} with keys {_cut(keys)}"))
            for k in keys:
                walk(node[k], prefix + (k,))
            return
        out = optree.tree_flatten_one_level(node, none_is_leaf=True)
        if not out.entries and optree.treespec_is_leaf(optree.tree_structure(node, none_is_leaf=True)):
            rows.append((here, f"leaf of type {type(node).__name__}"))
            return
        fields = getattr(type(node), "_fields", None)
        names = list(fields) if fields else list(out.entries)
        rows.append((here, f"{type(node).__name__} with {'fields' if fields else 'entries'} {_cut(names)}"))
        for name, child in zip(names, out.children):
            walk(child, prefix + (name,))

    walk(tree, ())
    return rows


def _cut(items: list[Any]) -> str:
    shown = ", ".join(repr(k) for k in items[:_SHOWN_KEYS])
    more = f", ... and {len(items) - _SHOWN_KEYS} more" if len(items) > _SHOWN_KEYS else ""
    return f"[{shown}{more}]"


def first_difference(ref: Sequence[tuple[str, str]], other: Sequence[tuple[str, str]], ref_name: str, other_name: str) -> str | None:
    """Name the first row where two descriptions differ, or ``None`` if they are equal.

    Example:
        >>> first_difference([("w", "tensor shape=(2,)")], [("w", "tensor shape=(3,)")], "rank 0", "rank 1")
        "at 'w': rank 0 has tensor shape=(2,), rank 1 has tensor shape=(3,)"
    """
    for i in range(max(len(ref), len(other))):
        a = ref[i] if i < len(ref) else None
        b = other[i] if i < len(other) else None
        if a == b:
            continue
        if a is None:
            return f"{other_name} has more: {b[0]!r} ({b[1]}), which {ref_name} lacks"
        if b is None:
            return f"{ref_name} has more: {a[0]!r} ({a[1]}), which {other_name} lacks"
        if a[0] == b[0]:
            where = a[0] if a[0].startswith("option ") else f"at {a[0]!r}"
            return f"{where}: {ref_name} has {a[1]}, {other_name} has {b[1]}"
        return f"{ref_name} has {a[0]!r} ({a[1]}) where {other_name} has {b[0]!r} ({b[1]})"
    return None
