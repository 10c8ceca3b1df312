"""The checks every fddp.optim transformation shares: trees that match, dtypes, states, hyperparameters.

Errors name the leaf by fddp's one path format (``exp_avg/0.weight``), say what was expected and
what arrived, and the fix.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Callable, Sequence, Union

import optree
import torch
from torch import Tensor

from fddp._layout import explain_split, module_aliases
from fddp._tree import FUNCTIONALIZE_FIX, article, flatten, paths

__all__ = [
    "PyTree",
    "Params",
    "Updates",
    "OptState",
    "Schedule",
    "ScalarOrSchedule",
    "flatten",
    "paths_of",
    "leaves_like",
    "init_leaves",
    "check_grads",
    "check_dtypes",
    "module_aliases",
    "params_leaves",
    "check_state",
    "describe",
    "check_lr",
    "check_nonneg",
    "lr_at",
    "zeros_count",
]

PyTree = Any
Params = PyTree
Updates = PyTree
OptState = Any
Schedule = Callable[[Tensor], Tensor]
ScalarOrSchedule = Union[float, Schedule]


def paths_of(treedef: optree.PyTreeSpec) -> list[str]:
    return list(paths(treedef))  # fddp's one path format: "exp_avg/0.weight"


def leaves_like(tree: PyTree, treedef: optree.PyTreeSpec, name: str, ref: str) -> list:
    """Flatten ``tree``, raising a ValueError naming the leaf paths if it does not match ``treedef``."""
    leaves, got = flatten(tree)
    if got != treedef:
        why = explain_split(treedef, got, ref, name)
        if why is not None:
            raise ValueError(f"{name} must have the same tree structure as {ref}: {why}")
        want_paths, got_paths = paths_of(treedef), paths_of(got)
        missing = [p for p in want_paths if p not in set(got_paths)]
        extra = [p for p in got_paths if p not in set(want_paths)]
        detail = ""
        if missing:
            detail += f"; missing {', '.join(map(repr, missing[:5]))}{' ...' if len(missing) > 5 else ''}"
        if extra:
            detail += f"; unexpected {', '.join(map(repr, extra[:5]))}{' ...' if len(extra) > 5 else ''}"
        if not detail:  # the same leaves in other containers: show the structures, cut short
            detail = f": expected {str(treedef)[:200]}, got {str(got)[:200]}"
        raise ValueError(f"{name} must have the same tree structure as {ref}{detail}")
    return leaves


def init_leaves(params: Params, where: str) -> tuple[list[Tensor], optree.PyTreeSpec]:
    """Flatten the parameters an optimizer's ``init`` gets; name the first leaf that is no tensor.

    ``where`` is the optimizer's name (``"adamw"``); the message calls it ``<where>.init``.
    """
    leaves, treedef = flatten(params)
    if all(map(isinstance, leaves, itertools.repeat(Tensor))):
        return leaves, treedef
    if isinstance(params, torch.nn.Module):
        raise TypeError(
            f"{where}.init: expected the parameters as a pytree of tensors, got the module {type(params).__name__} itself; "
            f"{FUNCTIONALIZE_FIX}"
        )
    for path, p in zip(paths_of(treedef), leaves):
        if not isinstance(p, Tensor):
            fix = (
                FUNCTIONALIZE_FIX if isinstance(p, torch.nn.Module)
                else "make it a tensor (torch.tensor(value)) or keep it out of the tree given to init and update"
            )  # fmt: skip
            raise TypeError(f"{where}.init: every parameter must be a tensor, but leaf {path!r} is {describe(p)}; {fix}")
    return leaves, treedef


def check_grads(grads: Updates, treedef: optree.PyTreeSpec | None, where: str) -> tuple[list, optree.PyTreeSpec]:
    """Flatten grads, checking structure against ``treedef`` (if given) and rejecting ``None`` leaves."""
    if isinstance(grads, torch.nn.Module):
        raise TypeError(f"{where}: grads must be a pytree of tensors, got the module {type(grads).__name__} itself; {FUNCTIONALIZE_FIX}")
    if treedef is None:
        leaves, treedef = flatten(grads)
    else:
        leaves = leaves_like(grads, treedef, "grads", "the optimizer state (params at init)")
    if not all(map(isinstance, leaves, itertools.repeat(Tensor))):
        for path, g in zip(paths_of(treedef), leaves):
            if not isinstance(g, Tensor):
                raise TypeError(
                    f"{where}: grad {path!r} must be a tensor, got {describe(g)}; "
                    "pass zeros for frozen parameters or drop them from both params and grads"
                )
    return leaves, treedef


def check_dtypes(gs: Sequence[Tensor], like: Sequence[Tensor], treedef: optree.PyTreeSpec, where: str, like_name: str) -> None:
    """Raise a TypeError naming the leaf unless every gradient has its parameter's dtype.

    torch's rule: ``param.grad`` must have the parameter's dtype (``param.grad = g`` raises
    otherwise), so torch.optim's kernels never see a float64 gradient for a float32 parameter
    (its SGD would accept one, its Adam would not). Here every optimizer refuses, on every path.
    ``like`` is the parameters or a state tree shaped from them (a momentum buffer, a moment).
    """
    if not torch.compiler.is_compiling() and list(map(_dtype, gs)) == list(map(_dtype, like)):
        return  # the usual case, compared in C (dynamo does not trace attrgetter)
    for i, (g, p) in enumerate(zip(gs, like)):
        if g.dtype != p.dtype:
            raise TypeError(
                f"{where}: grad {paths_of(treedef)[i]!r} has dtype {g.dtype}, but its parameter has dtype "
                f"{p.dtype} (as {like_name} says); a gradient must have its parameter's "
                "dtype, as torch requires of param.grad. Cast it first: "
                "optree.tree_map(lambda g, p: g.to(p.dtype), grads, params)"
            )


_dtype = operator.attrgetter("dtype")


def params_leaves(params: Params | None, treedef: optree.PyTreeSpec, where: str, why: str) -> list:
    if params is None:
        raise ValueError(f"{where}: params are required ({why}); call update(grads, state, params)")
    if isinstance(params, torch.nn.Module):
        raise TypeError(f"{where}: params must be a pytree of tensors, got the module {type(params).__name__} itself; {FUNCTIONALIZE_FIX}")
    return leaves_like(params, treedef, "params", "grads")


def check_state(state: Any, cls: type, where: str, *, grads: Any = None, params: Any = None) -> None:
    """Raise unless ``state`` is a ``cls``; say so if it arrived in another argument's place."""
    if type(state) is cls:
        return
    for name, x in (("grads", grads), ("params", params)):
        if type(x) is cls:
            raise TypeError(
                f"{where}: got the optimizer state ({article(cls.__name__)}) as {name} and {article(type(state).__name__)} as the "
                "state; the arguments are update(grads, state, params)"
            )
    raise TypeError(
        f"{where}: expected {article(cls.__name__)} (from this optimizer's init) as the state, got {describe(state)}; "
        "was the state created by a different optimizer?"
    )


def describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    if isinstance(x, torch.nn.Module):
        return f"the module {type(x).__name__}"
    return type(x).__name__


def check_lr(lr: ScalarOrSchedule, where: str) -> None:
    if callable(lr):
        return
    if isinstance(lr, Tensor):
        raise TypeError(f"{where}: lr must be a float or a schedule (a function of the step count), got a Tensor")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"{where}: invalid lr={lr!r}; expected a finite float >= 0 or a schedule")


def check_nonneg(value: float, name: str, where: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: invalid {name}={value!r}; expected a finite float >= 0")


def lr_at(lr: ScalarOrSchedule, count: Tensor) -> float | Tensor:
    """The learning rate for the update at ``count`` (0 for the first update)."""
    return lr(count) if callable(lr) else float(lr)


def zeros_count(leaves: Sequence[Tensor]) -> Tensor:
    # The count lives with the parameters so that scalar tensors derived from it (lr, bias
    # corrections) can be mixed with parameter tensors in foreach ops and under vmap.
    device = next((t.device for t in leaves if isinstance(t, Tensor)), torch.device("cpu"))
    return torch.zeros((), dtype=torch.int64, device=device)
