"""What the ranks must agree on before an outer step: the fragments, the schedule, the configuration.

Plain, deterministic data computed from the parameter tree and the configuration alone, so every
rank that holds the same tree and configuration computes the same fragments and the same steps
to sync them on, without talking to the others.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, NamedTuple

import optree
import torch

from fddp import _tree
from fddp.optim import GradientTransformation

__all__ = ["Fragment", "split", "merge_offset", "launches", "describe"]

class Fragment(NamedTuple):
    """A group of leaves synchronised together.

    Attributes:
        indices: the leaves' indices in the tree's flatten order, in definition order.
        paths: their paths (``a/b/0``), the keys of the fragment's tree.
        nbytes: the bytes of its leaves.
    """

    indices: tuple[int, ...]
    paths: tuple[str, ...]
    nbytes: int


def definition_order(tree: Any) -> list[int]:
    """The leaf indices in the order the tree was built (module registration order for a model)."""
    order = _tree.definition_order(tree)
    return list(range(optree.tree_structure(tree, none_is_leaf=True).num_leaves)) if order is None else list(order)


def split(params: Any, count: int, what: str) -> tuple[Fragment, ...]:
    """Cut the tree's leaves, in definition order, into ``count`` runs of about equal bytes.

    The cut after fragment ``k`` falls on the leaf boundary nearest to ``(k + 1) / count`` of the
    bytes (each fragment gets at least one leaf): contiguous layers travel together, as in
    Streaming DiLoCo's sequential fragments.
    """
    leaves = optree.tree_leaves(params, none_is_leaf=True)
    if count > len(leaves):
        raise ValueError(f"fddp.{what}: fragments={count} but the tree has only {len(leaves)} leaves; use at most that many")
    paths = list(_tree.paths(optree.tree_structure(params, none_is_leaf=True)))
    order = definition_order(params)
    sizes = [leaves[i].numel() * leaves[i].element_size() for i in order]
    total = sum(sizes)
    prefix = [0]
    for n in sizes:
        prefix.append(prefix[-1] + n)
    cuts: list[int] = []
    for k in range(1, count):
        # The boundary nearest to k/count of the bytes, after the previous cut and leaving one
        # leaf for each fragment still to come.
        lo, hi = (cuts[-1] if cuts else 0) + 1, len(order) - (count - k)
        target = total * k / count
        cuts.append(min(range(lo, hi + 1), key=lambda j: (abs(prefix[j] - target), j)))
    bounds = [0, *cuts, len(order)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        idx = tuple(order[a:b])
        out.append(Fragment(idx, tuple(paths[i] for i in idx), sum(sizes[a:b])))
    return tuple(out)


def merge_offset(fragment: int, count: int, every: int) -> int:
    """The step (mod ``every``) at which fragment ``fragment`` of ``count`` merges: evenly staggered,
    the last one on multiples of ``every``."""
    return ((fragment + 1) * every) // count % every


def launches(step: int, fragment: int, count: int, every: int, delay: int) -> bool:
    """Whether fragment ``fragment`` starts its synchronisation at ``step`` (1-based inner steps)."""
    return (step + delay - merge_offset(fragment, count, every)) % every == 0


def describe(obj: Any) -> str:
    """A description of a value that ranks running the same code and settings describe alike.

    Optimizers are pairs of closures: their settings (learning rate, momentum, schedules) live in
    the closures' cells, so a function is described by its qualified name and its cells, recursively.
    """
    return _describe(obj, 0, set())


def _describe(obj: Any, depth: int, seen: set[int]) -> str:
    if isinstance(obj, (bool, int, float, complex, str, bytes, type(None))):
        return repr(obj)
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        values = obj.detach().cpu().tolist() if obj.numel() <= 16 else f"sum {float(obj.detach().double().sum())!r}"
        return f"tensor{tuple(obj.shape)} {obj.dtype} {values}"
    if depth > 8 or id(obj) in seen:
        return f"<{type(obj).__name__}>"
    seen = seen | {id(obj)}
    if isinstance(obj, GradientTransformation):
        return f"GradientTransformation({_describe(obj.update, depth + 1, seen)})"
    if isinstance(obj, (tuple, list)):
        inner = ", ".join(_describe(x, depth + 1, seen) for x in obj)
        return f"{type(obj).__name__}({inner})"
    if isinstance(obj, dict):
        inner = ", ".join(f"{k!r}: {_describe(v, depth + 1, seen)}" for k, v in obj.items())
        return "{" + inner + "}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # an optimizer's configuration (fddp.optim's)
        fields = ", ".join(f"{f.name}={_describe(getattr(obj, f.name), depth + 1, seen)}" for f in dataclasses.fields(obj))
        return f"{type(obj).__qualname__}({fields})"
    if isinstance(obj, functools.partial):
        args = ", ".join(_describe(a, depth + 1, seen) for a in (obj.func, *obj.args, *obj.keywords.values()))
        return f"partial({args})"
    if isinstance(obj, types.FunctionType):
        cells = []
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                cells.append(f"{name}={_describe(cell.cell_contents, depth + 1, seen)}")
            except ValueError:  # an empty cell
                cells.append(f"{name}=<empty>")
        defaults = [_describe(d, depth + 1, seen) for d in obj.__defaults__ or ()]
        return f"{obj.__module__}.{obj.__qualname__}({', '.join(cells + defaults)})"
    if isinstance(obj, (types.BuiltinFunctionType, types.MethodType, type)):
        return getattr(obj, "__qualname__", type(obj).__name__)
    return f"<{type(obj).__module__}.{type(obj).__qualname__}>"
