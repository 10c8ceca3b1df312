"""What the ranks must agree on before an outer step: the fragments, the schedule, the configuration.

Plain, deterministic data computed from the parameter tree and the configuration alone, so every
rank that holds the same tree and configuration computes the same fragments and the same steps
to sync them on, without talking to the others.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import types
from typing import Any, NamedTuple, Sequence

import optree
import torch

from fddp import _tree
from fddp.optim import GradientTransformation

__all__ = ["Fragment", "split", "split_by", "merge_offset", "launches", "warm", "describe"]


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


def split_by(params: Any, groups: Sequence[Sequence[str]], what: str) -> tuple[Fragment, ...]:
    """Cut the tree's leaves into the fragments the user named: each a list of leaf prefixes.

    A prefix names a leaf (``"head.weight"``) or every leaf under a module (``"blocks.0"`` takes
    ``"blocks.0.attn.weight"``, ``"blocks.0.mlp.bias"``, ...; ``"a/b"`` for nested trees). Every leaf must
    fall in exactly one fragment; leaves keep their definition order inside it.
    """
    leaves = optree.tree_leaves(params, none_is_leaf=True)
    paths = list(_tree.paths(optree.tree_structure(params, none_is_leaf=True)))
    order = definition_order(params)
    owner: dict[int, int] = {}
    for f, prefixes in enumerate(groups):
        for prefix in prefixes:
            hits = [i for i in order if _under(paths[i], prefix)]
            if not hits:
                raise ValueError(
                    f"fddp.{what}: fragment {f}'s prefix {prefix!r} names no leaf of the tree; its leaves are "
                    f"{_some([paths[i] for i in order])}"
                )
            for i in hits:
                if owner.setdefault(i, f) != f:
                    raise ValueError(
                        f"fddp.{what}: leaf {paths[i]!r} is in fragment {owner[i]} and in fragment {f} (prefix "
                        f"{prefix!r}); give every leaf to exactly one fragment"
                    )
    left = [paths[i] for i in order if i not in owner]
    if left:
        raise ValueError(
            f"fddp.{what}: {len(left)} leaves are in no fragment: {_some(left)}; add their prefixes to a fragment "
            "(every leaf must be synchronised by exactly one)"
        )
    out = []
    for f in range(len(groups)):
        idx = tuple(i for i in order if owner[i] == f)
        out.append(Fragment(idx, tuple(paths[i] for i in idx), sum(leaves[i].numel() * leaves[i].element_size() for i in idx)))
    return tuple(out)


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith((prefix + ".", prefix + "/"))


def _some(names: Sequence[str], n: int = 6) -> str:
    return ", ".join(repr(x) for x in names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def merge_offset(fragment: int, count: int, every: int) -> int:
    """The step (mod ``every``) at which fragment ``fragment`` of ``count`` merges: evenly staggered,
    the last one on multiples of ``every``."""
    return ((fragment + 1) * every) // count % every


def launches(step: int, fragment: int, count: int, every: int, delay: int, warmup: int = 0) -> bool:
    """Whether fragment ``fragment`` starts its synchronisation at ``step`` (1-based inner steps);
    after ``warmup`` synchronous steps the rounds start anew, as if at step 0."""
    return step > warmup and (step - warmup + delay - merge_offset(fragment, count, every)) % every == 0


def warm(step: int, warmup: int) -> bool:
    """Whether ``step`` is one of the ``warmup`` synchronous steps (every fragment, averaged at once)."""
    return step <= warmup


def describe(obj: Any) -> str:
    """A description of a value that ranks running the same code and settings describe alike.

    Optimizers are pairs of closures: their settings (learning rates, momenta, schedules) live in
    the closures' cells, so a function is described by its qualified name, a digest of its bytecode,
    its constants (``lambda c: 0.7 * c`` against ``0.5 * c``), its cells and defaults, and the
    globals it reads, recursively; other objects by their attributes. Numbers compare by value
    (``1 == 1.0``). At most ``_BUDGET`` values are described: a closure that holds a data set is not
    walked whole.
    """
    return _Describer().of(obj, 0)


_BUDGET = 4096


class _Describer:
    def __init__(self) -> None:
        self.left = _BUDGET
        self.seen: set[int] = set()

    def of(self, obj: Any, depth: int) -> str:
        self.left -= 1
        if isinstance(obj, bool) or obj is None or isinstance(obj, (str, bytes, complex)):
            return repr(obj)
        if isinstance(obj, int):
            return repr(float(obj)) if abs(obj) < 2**53 else repr(obj)  # 25 and 25.0 step alike
        if isinstance(obj, float):
            return repr(obj)
        if isinstance(obj, (torch.dtype, torch.device)):
            return str(obj)
        if isinstance(obj, torch.Tensor):
            values = obj.detach().cpu().tolist() if obj.numel() <= 16 else f"sum {float(obj.detach().double().sum())!r}"
            return f"tensor{tuple(obj.shape)} {obj.dtype} {values}"
        if isinstance(obj, types.ModuleType):
            return f"module {obj.__name__}"
        if isinstance(obj, type):
            return f"{obj.__module__}.{obj.__qualname__}"
        if depth > 8 or id(obj) in self.seen or self.left <= 0:
            return f"<{type(obj).__name__}>"
        self.seen.add(id(obj))
        try:
            return self._compound(obj, depth + 1)
        finally:
            self.seen.discard(id(obj))

    def _compound(self, obj: Any, depth: int) -> str:
        of = self.of
        if isinstance(obj, GradientTransformation):
            return f"GradientTransformation({of(obj.update, depth)})"
        if isinstance(obj, (tuple, list)):
            return f"{type(obj).__name__}({', '.join(of(x, depth) for x in obj)})"
        if isinstance(obj, (set, frozenset)):
            return f"{type(obj).__name__}({', '.join(sorted(of(x, depth) for x in obj))})"
        if isinstance(obj, dict):
            return "{" + ", ".join(f"{of(k, depth)}: {of(v, depth)}" for k, v in obj.items()) + "}"
        if dataclasses.is_dataclass(obj):  # an optimizer's configuration (fddp.optim's)
            fields = ", ".join(f"{f.name}={of(getattr(obj, f.name), depth)}" for f in dataclasses.fields(obj))
            return f"{type(obj).__qualname__}({fields})"
        if isinstance(obj, functools.partial):
            return f"partial({', '.join(of(a, depth) for a in (obj.func, *obj.args, *obj.keywords.values()))})"
        if isinstance(obj, types.FunctionType):
            return self._function(obj, depth)
        if isinstance(obj, types.MethodType):
            return f"method({of(obj.__func__, depth)} of {of(obj.__self__, depth)})"
        if isinstance(obj, types.BuiltinFunctionType):
            return getattr(obj, "__qualname__", type(obj).__name__)
        attrs = _attributes(obj)
        if attrs is not None:  # a callable object (a schedule class, an argparse.Namespace in a closure)
            inner = ", ".join(f"{k}={of(v, depth)}" for k, v in attrs)
            return f"{type(obj).__module__}.{type(obj).__qualname__}({inner})"
        return f"<{type(obj).__module__}.{type(obj).__qualname__}>"

    def _function(self, fn: types.FunctionType, depth: int) -> str:
        of = self.of
        parts = []
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                parts.append(f"{name}={of(cell.cell_contents, depth)}")
            except ValueError:  # an empty cell
                parts.append(f"{name}=<empty>")
        parts += [of(d, depth) for d in fn.__defaults__ or ()]
        parts += [f"{k}={of(v, depth)}" for k, v in (fn.__kwdefaults__ or {}).items()]
        if fn.__module__ == "fddp" or fn.__module__.startswith("fddp."):
            # fddp's own code is the same on every rank that imports the same fddp: its settings
            # are in the cells; its constants and globals would only lengthen the message.
            return f"{fn.__module__}.{fn.__qualname__}({', '.join(parts)})"
        codes = _codes(fn.__code__)
        consts = [c for code in codes for c in code.co_consts if not isinstance(c, types.CodeType)]
        if consts:
            parts.append(f"consts={of(tuple(consts), depth)}")
        read = [n for code in codes for n in code.co_names if n in fn.__globals__]
        if read:
            parts.append("globals={" + ", ".join(f"{n}={of(fn.__globals__[n], depth)}" for n in dict.fromkeys(read)) + "}")
        code = hashlib.blake2b(b"".join(c.co_code for c in codes), digest_size=6).hexdigest()
        return f"{fn.__module__}.{fn.__qualname__}[{code}]({', '.join(parts)})"


def _codes(code: types.CodeType) -> list[types.CodeType]:
    """A code object and those nested in it (a lambda inside a schedule's body)."""
    out = [code]
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out += _codes(c)
    return out


def _attributes(obj: Any) -> list[tuple[str, Any]] | None:
    """An object's attributes by name (``__dict__`` and ``__slots__``), or ``None`` if it has none."""
    out: dict[str, Any] = dict(getattr(obj, "__dict__", None) or {})
    for klass in type(obj).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                out.setdefault(name, getattr(obj, name))
    return sorted(out.items()) if out else None
