"""Stage 3's units: which submodules are gathered as one, their buckets, and the layout that records them.

A *unit* is a submodule whose forward uses only its own parameters (a transformer block, an
embedding, a head). :func:`resolve` turns ``fully_shard``'s ``units=`` (or the default rule: units
chosen by size, :func:`_by_size`) into units and checks that every trainable parameter lies in exactly one;
:func:`plan` lays each unit's parameters out as one bucket per dtype, in forward order;
:class:`UnitLayout` is stage 2's :class:`~fddp.shard_layout.ShardLayout` of that plan, with the units
(and hybrid sharding's replica group) recorded, so that stage-3 trees are recognised as such.
:class:`Released` is what the module holds in place of each parameter once the shards hold it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import optree
import torch
import torch.distributed as dist
from torch import nn

from fddp import _layout
from fddp._tree import paths
from fddp.zero import _layout as shard_layout

__all__ = ["UnitLayout", "Unit", "Released", "ReleasedUse", "resolve", "plan"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclasses.dataclass(frozen=True, repr=False)
class UnitLayout(shard_layout.ShardLayout):
    """A stage-3 shard layout: stage 2's cut of a plan whose buckets are the units' parameters.

    Attributes:
        units: the units' names (``""``: the root unit), in forward order.
        unit_buckets: per unit, the indices of its buckets (one per dtype and device) in ``plan``.
        replica_group: hybrid sharding's replica group (``None``: no replicas).
        replicas: the size of ``replica_group`` (1 without one).

    Example:
        >>> apply_fn, shards = fddp.zero.fully_shard(model)
        >>> shards.layout.units  # ('embed', 'encoder.layers.0', ..., 'head')
    """

    units: tuple[str, ...] = ()
    unit_buckets: tuple[tuple[int, ...], ...] = ()
    replica_group: Any = None
    replicas: int = 1

    stage: ClassVar[int] = 3

    def __repr__(self) -> str:
        hybrid = f", replicas={self.replicas}" if self.replicas > 1 else ""
        return (
            f"UnitLayout(world={self.world}, rank={self.rank}{hybrid}, units={len(self.units)}, "
            f"buckets={len(self.plan.buckets)}, leaves={self.plan.num_leaves}, elements={self.numel})"
        )

    def unit_of(self, k: int) -> str | None:
        """The name of the unit that holds bucket ``k`` (``'<root>'`` for the root unit)."""
        for u, ks in zip(self.units, self.unit_buckets):
            if k in ks:
                return u or "<root>"
        return None

    def describe(self) -> list[tuple]:
        """The layout as signature rows: the cut, the units and their leaves (not the rank)."""
        names = paths(self.spec)
        rows: list[tuple] = [("shard layout", f"stage 3, world={self.world} replicas={self.replicas} align={self.align}", None)]
        # The unit list first: ranks that chose other units are told so, not a bucket's size.
        rows.append(("fully_shard units", f"[{', '.join(repr(u or '<root>') for u in self.units)}]", None))
        for u, ks in zip(self.units, self.unit_buckets):
            for k in ks:
                b, c = self.plan.buckets[k], self.cuts[k]
                shown = [names[i] for i in b.indices]
                leaves = ", ".join(shown) if len(shown) <= 3 else f"{len(shown)} leaves: {shown[0]} ... {shown[-1]}"
                rows.append((f"unit {u or '<root>'!r} bucket {k}", f"{b.numel} elements of {b.dtype} ({leaves}), shards of {c.size}", None))
        return rows

    def check_group(self, what: str) -> None:
        """Raise unless this process holds these shards' place: rank, world size, replica group size."""
        n, r = (dist.get_world_size(self.group), dist.get_rank(self.group)) if dist.is_initialized() else (1, 0)
        replicas = dist.get_world_size(self.replica_group) if self.replicas > 1 and dist.is_initialized() else 1
        if (n, r, replicas) != (self.world, self.rank, self.replicas):
            hybrid = f" (x {self.replicas} replicas)" if self.replicas > 1 else ""
            now = f" (x {replicas} replicas)" if replicas > 1 else ""
            raise RuntimeError(
                f"fddp.{what}: these stage-3 shards were made for rank {self.rank} of {self.world} ranks{hybrid}, but "
                f"this process is rank {r} of {n}{now}. Shards move between world sizes only through a checkpoint: "
                "fddp.checkpoint.save_sharded(directory, tree) on the old ranks, then, on the new ones, "
                "fddp.checkpoint.load_sharded(directory, like) with `like` made by fddp.zero.fully_shard(model) "
                "(and opt.init of its shards), which reshards."
            )


@dataclasses.dataclass(eq=False)
class Unit:
    """One unit: its module, its buckets, and the module slots its parameters go into."""

    name: str
    module: nn.Module
    leaves: list[int]  # leaf indices (tree-flatten order), in the module's definition order
    buckets: tuple[int, ...] = ()
    # (module, attribute, position of the bucket among the unit's, position of the leaf in it)
    slots: list[tuple[nn.Module, str, int, int]] = dataclasses.field(default_factory=list)
    forward: Callable[..., Any] | None = None  # the module's own forward, bound


def writes_in_place(module: nn.Module) -> bool:
    """Whether ``module``'s forward writes its own trainable parameter in place: an embedding with
    ``max_norm`` renormalises the rows it looks up (``torch.embedding_renorm_``, under no_grad).
    ``fully_shard`` refuses such a module: the write cannot reach the shards."""
    if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or module.max_norm is None:
        return False
    return module.weight.requires_grad


class ReleasedUse(RuntimeError):
    """A :class:`Released` placeholder was computed with; ``name`` is the parameter's."""

    def __init__(self, message: str, name: str) -> None:
        super().__init__(message)
        self.name = name


class Released(nn.Parameter):
    """What a module holds in place of a parameter that :func:`fully_shard` took: shape and dtype only.

    A ``Parameter`` (``load_state_dict(..., assign=True)`` replaces it), with no storage, that
    refuses every operation with an error that says where the values are.
    """

    @staticmethod
    def __new__(cls, name: str, like: torch.Tensor) -> "Released":
        r = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=like.requires_grad)
        r._fddp_name = name
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        name = next((a._fddp_name for a in optree.tree_leaves((args, kwargs)) if isinstance(a, Released)), "?")
        raise ReleasedUse(
            f"fddp.zero.fully_shard: parameter {name!r} lives in the shards now, and the module holds no "
            f"value for it ({func} was called on it). Run the module through the apply_fn fully_shard "
            "returned; a parameter used outside its unit's forward must be in a unit that encloses "
            "that use; to put the trained values back into the module, fddp.zero.write_back(apply_fn, shards)",
            name,
        )

    def __repr__(self) -> str:  # no dispatch: shown in a debugger
        return f"<released parameter {self._fddp_name!r} of shape {tuple(self.shape)}, in fddp.zero shards>"


def _chosen(
    model: nn.Module, units: Any, trainable: dict[int, list[str]], what: str, min_bytes: int = 0
) -> list[tuple[str, nn.Module]]:
    """The unit modules ``units`` names, outermost, in definition order; ``""`` for the root if listed."""
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    holds = {n: any(id(p) in trainable for p in m.parameters()) for n, m in model.named_modules()}
    if units is None:
        return _by_size(model, _default_units(model, holds), trainable, min_bytes)
    if isinstance(units, (str, nn.Module, type)) or not isinstance(units, Sequence):
        raise TypeError(
            f"fddp.{what}: units must be a list of submodule names, submodules or module classes (or None "
            f"for units chosen by size), got {type(units).__name__}"
        )
    chosen: list[str] = []
    for item in units:
        if isinstance(item, str):
            if item and item not in holds:
                raise ValueError(f"fddp.{what}: units names {item!r}, which is not a submodule of {type(model).__name__}")
            if item and not holds[item]:
                raise ValueError(f"fddp.{what}: unit {item!r} holds no trainable parameters")
            chosen.append(item)
        elif isinstance(item, nn.Module):
            if id(item) not in names:
                raise ValueError(f"fddp.{what}: units holds a {type(item).__name__} that is not a submodule of the model")
            chosen.append(names[id(item)])
        elif isinstance(item, type) and issubclass(item, nn.Module):
            chosen += [n for n, m in model.named_modules() if isinstance(m, item) and n and holds[n]]
        else:
            raise TypeError(f"fddp.{what}: units holds {item!r}; expected submodule names, submodules or module classes")
    repeated = [n for n, c in collections.Counter(chosen).items() if c > 1]
    if repeated:
        raise ValueError(f"fddp.{what}: unit {repeated[0] or '<root>'!r} is listed twice")
    # Nested class matches keep the outermost; named units must not nest.
    outer = [n for n in chosen if n and not any(o and n.startswith(o + ".") for o in chosen)]
    nested = [n for n in chosen if n and n not in outer]
    explicit = {x if isinstance(x, str) else names.get(id(x)) for x in units if not isinstance(x, type)}
    for n in nested:
        if n in explicit:
            o = next(o for o in outer if n.startswith(o + "."))
            raise ValueError(f"fddp.{what}: units must not nest: {n!r} is inside unit {o!r}")
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    out = sorted(set(outer), key=order.__getitem__)
    for n in out:
        m = model.get_submodule(n)
        if type(m).forward is nn.Module.forward:
            children = [f"{n}.{c}" for c, _ in m.named_children()]
            shown = ", ".join(repr(c) for c in children[:2]) + (", ..." if len(children) > 2 else "")
            raise ValueError(
                f"fddp.{what}: unit {n!r} is a {type(m).__name__}, a container with no forward of its own: the model "
                "calls its children, never it, so a unit there would never be gathered. Name its children "
                f"(units=[{shown}], or their class) or the module whose forward calls them"
            )
    return ([("", model)] if "" in chosen else []) + [(n, model.get_submodule(n)) for n in out]


def _default_units(model: nn.Module, holds: dict[str, bool]) -> list[tuple[str, nn.Module]]:
    """One unit per block: each child of a ModuleList / Sequential / ModuleDict, and each other
    module that owns parameters itself (with its whole subtree), found from the root down; the
    root's own parameters (and nothing else) are left for the root unit."""
    out: list[tuple[str, nn.Module]] = []

    def walk(name: str, m: nn.Module) -> None:
        for child, sub in m.named_children():
            full = f"{name}.{child}" if name else child
            if not holds.get(full, False):
                continue
            if isinstance(sub, _CONTAINERS):
                walk(full, sub)
            elif isinstance(m, _CONTAINERS) or any(True for _ in sub.parameters(recurse=False)):
                out.append((full, sub))
            else:
                walk(full, sub)

    walk("", model)
    return out


def _by_size(
    model: nn.Module, fine: list[tuple[str, nn.Module]], trainable: dict[int, list[str]], min_bytes: int
) -> list[tuple[str, nn.Module]]:
    """Units of at least ``min_bytes`` of trainable parameters, from the finest ones (``fine``).

    Every unit costs three collectives a step (its gather, its gather again in backward, its
    reduction), a latency a unit of a few kilobytes does not earn back in memory. FSDP's
    ``size_based_auto_wrap_policy``, without nesting: from the leaves up, a fine unit of at least
    ``min_bytes`` stays a unit; a smaller one joins its parent's leftovers. A parent that can be
    called (not a ``ModuleList`` or ``ModuleDict``) becomes the unit in place of what lies inside
    it when that is one unit and some leftovers (a block's LayerNorm joins its Linear), or no unit
    and leftovers of at least ``min_bytes``. What is left over at the top is the root unit,
    gathered for the whole forward (FSDP2's root). A module whose parameters are tied to one
    outside it is never a unit (its leftovers go up to a module that holds both, or the root).
    """
    fine_names = {n for n, _ in fine}

    def own(name: str, m: nn.Module) -> tuple[int, bool]:
        """This subtree's trainable bytes, and whether all its parameters' names lie inside it."""
        seen, n, inside = set(), 0, True
        for p in m.parameters():
            if id(p) in trainable and id(p) not in seen:
                seen.add(id(p))
                n += p.numel() * p.element_size()
                inside = inside and all(q.startswith(name + ".") for q in trainable[id(p)])
        return n, inside

    def visit(name: str, m: nn.Module) -> tuple[int, list[str]]:
        """(bytes left for an enclosing unit, the units chosen in this subtree)."""
        if name in fine_names:
            n, inside = own(name, m)
            return (0, [name]) if n >= min_bytes and inside else (n, [])
        left = sum(p.numel() * p.element_size() for p in m.parameters(recurse=False) if id(p) in trainable)
        found: list[str] = []
        for child, sub in m.named_children():
            sub_left, sub_found = visit(f"{name}.{child}" if name else child, sub)
            left, found = left + sub_left, found + sub_found
        if name and left and len(found) <= 1 and type(m).forward is not nn.Module.forward and own(name, m)[1]:
            # Nothing or one unit inside: the module is the unit (a block's small LayerNorm
            # joins its large Linear, not the root), if its leftovers reach the size.
            if found or left >= min_bytes:
                return 0, [name]
        return left, found

    chosen = visit("", model)[1]
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return [(n, model.get_submodule(n)) for n in sorted(chosen, key=order.__getitem__)]


def plan(units: list[Unit], specs: list[tuple[tuple[int, ...], torch.dtype, torch.device]]) -> _layout.BucketPlan:
    """One bucket per unit and (dtype, device), units in forward order; inside a bucket the leaves
    lie in reverse definition order, as in stage 2's buckets (a one-unit tree is stage 2's one bucket)."""
    buckets = []
    for u in units:
        groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
        for i in u.leaves:
            groups.setdefault(specs[i][1:], []).append(i)
        ks = []
        for (dtype, device), idx in groups.items():
            idx = idx[::-1]
            numels = tuple(_numel(specs[i][0]) for i in idx)
            offsets = tuple(sum(numels[:j]) for j in range(len(numels)))
            ks.append(len(buckets))
            buckets.append(_layout.Bucket(tuple(idx), tuple(specs[i][0] for i in idx), numels, offsets, dtype, device))
        u.buckets = tuple(ks)
    return _layout.BucketPlan(tuple(buckets), len(specs))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def resolve(
    model: nn.Module, units: Any, params: dict[str, torch.Tensor], trainable: dict[int, list[str]], index: dict[str, int], what: str,
    min_bytes: int = 0,
) -> list[Unit]:  # fmt: skip
    """Resolve the units (``None``: by size, at least ``min_bytes`` each); check that every
    trainable parameter lies in exactly one."""
    chosen = _chosen(model, units, trainable, what, min_bytes)
    explicit_root = any(n == "" for n, _ in chosen)
    owner: dict[int, str] = {}
    out = []
    for name, m in chosen:
        if name == "":
            continue
        ids = []
        for _, p in m.named_parameters(remove_duplicate=False):
            if id(p) not in trainable:
                continue
            if id(p) in owner and owner[id(p)] != name:
                raise ValueError(
                    f"fddp.{what}: parameter {trainable[id(p)][0]!r} is in units {owner[id(p)]!r} and {name!r} "
                    "(a weight tied between them); put the modules that share it into one unit"
                )
            if id(p) not in owner:
                owner[id(p)] = name
                ids.append(id(p))
        out.append(Unit(name, m, [index[trainable[i][0]] for i in ids]))  # definition order
    left = [ns[0] for i, ns in trainable.items() if i not in owner]  # definition order
    # A parameter also reached under another name outside its unit is tied across the boundary.
    for i, ns in trainable.items():
        if i in owner:
            outside = [n for n in ns if not (n.startswith(owner[i] + "."))]
            if outside:
                raise ValueError(
                    f"fddp.{what}: parameter {ns[0]!r} of unit {owner[i]!r} is also {outside[0]!r}, outside it (a tied "
                    "weight); put the modules that share it into one unit"
                )
    if left:
        if units is not None and not explicit_root:
            shown = ", ".join(repr(n) for n in left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
            raise ValueError(
                f"fddp.{what}: parameters {shown} are in no unit; add their modules to units, or '' (the root) "
                "to gather them for the whole forward"
            )
        out.insert(0, Unit("", model, [index[n] for n in left]))
    return out
