"""Core of ``fddp.optim``: ``GradientTransformation``, ``chain``, ``apply_updates`` and shared checks.

An optimizer is a pair of pure functions over pytrees of tensors (optax's design):
``init(params) -> state`` and ``update(grads, state, params) -> (updates, new_state)``. Updates are
added to parameters (``params + updates``), so a descent step has negative updates.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, NamedTuple, Sequence, Union

import optree
import torch
from torch import Tensor

from fddp._layout import MODULE_ALIAS
from fddp._tree import paths
from fddp import _shard

from . import _flat as flat

PyTree = Any
Params = PyTree
Updates = PyTree
OptState = Any
Schedule = Callable[[Tensor], Tensor]
ScalarOrSchedule = Union[float, Schedule]

_functorch = torch._C._functorch


class GradientTransformation(NamedTuple):
    """A pair of pure functions ``init`` and ``update`` (an optimizer or a piece of one).

    Attributes:
        init: ``init(params) -> state``; the state is a pytree of tensors (NamedTuples).
        update: ``update(grads, state, params=None) -> (updates, new_state)``; never modifies
            its inputs.

    Example:
        >>> opt = fddp.optim.sgd(lr=0.1)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def apply_updates(params: Params, updates: Updates, /) -> Params:
    """Return ``params + updates``, cast back to each parameter's dtype.

    A ``None`` update leaves its parameter unchanged. Inputs are not modified.

    Args:
        params: a pytree of tensors.
        updates: a pytree with the same structure, as returned by ``update``.

    Returns:
        The new parameters, a pytree with the structure of ``params``.

    Example:
        >>> updates, state = opt.update(grads, state, params)
        >>> params = fddp.optim.apply_updates(params, updates)
    """
    p_leaves, treedef = _flatten(params)
    u_leaves = _leaves_like(updates, treedef, "updates", "params")
    groups = None
    if all(isinstance(x, Tensor) for x in p_leaves) and all(isinstance(x, Tensor) for x in u_leaves):
        groups = flat.groups_for(p_leaves, u_leaves, names=lambda: _paths(treedef), labels=("params", "updates"))
    tiles = [(flat.tiled(p_leaves, g), flat.tiled(u_leaves, g)) for g in groups or ()]
    if any(t is not None for pair in tiles for t in pair):
        # Updates from fddp.optim are views of flat buffers: one add per buffer, into a pooled one.
        out = list(p_leaves)
        for g, (P, U) in zip(groups, tiles):
            P = P if P is not None else flat.copy(p_leaves, g)
            U = U if U is not None else flat.copy(u_leaves, g)
            flat.scatter(out, flat.views(torch.add(P, U, out=flat.new(g)), g), g)
        return optree.tree_unflatten(treedef, out)
    idx = [i for i, u in enumerate(u_leaves) if u is not None and p_leaves[i] is not None]
    ps = [p_leaves[i] for i in idx]
    us = [u_leaves[i] for i in idx]
    if flat.multi_tensor_ok(ps) and all(p.dtype == u.dtype for p, u in zip(ps, us)):
        new = torch._foreach_add(ps, us)
    else:
        # Adding in the wider dtype then casting is what optax does for bf16 params + fp32 updates.
        new = [torch.add(p, u).to(p.dtype) for p, u in zip(ps, us)]
    out = list(p_leaves)
    for i, t in zip(idx, new):
        out[i] = t
    return optree.tree_unflatten(treedef, out)


def apply_gradients(
    opt: GradientTransformation, grads: Updates, state: OptState, params: Params, /, *, donate: bool = False
) -> tuple[Params, OptState]:
    """One optimizer step: ``update`` then ``apply_updates``, fused where fddp can.

    The result is that of ``opt.update`` followed by ``apply_updates`` (flax's ``apply_gradients``),
    computed faster for ``sgd`` (without dampening), ``adam`` and ``adamw``, alone or last in a
    ``chain``, in eager calls outside torch.func transforms:

    - ``adam``/``adamw`` run torch's fused kernel (``torch._fused_adam_``/``_fused_adamw_``, that
      of ``torch.optim.Adam(fused=True)``, whose results they equal to the bit) in place on new
      copies of the parameters and state;
    - ``sgd`` writes its step straight into new buffers, ``b' = g + momentum * b`` and
      ``p' = p - lr * b'``, without an ``updates`` tree: about the memory traffic of
      ``torch.optim.SGD`` in place. Each line is one ``torch.add(..., alpha=)``, which rounds
      once where ``torch.optim.SGD`` (and ``update``) multiply, then add: about a quarter of the
      values differ in the last bit.

    Either way it may differ from ``update`` + ``apply_updates`` in the last bits (rounding), and
    nothing is modified in place: params and state come back as new tensors. Elsewhere (``vmap``,
    ``torch.compile``, other transformations) it is exactly ``update`` + ``apply_updates``.

    ``donate=True`` gives ``params`` and ``state`` away, as JAX's ``donate_argnums`` does: where a
    fused path applies, torch's fused kernel (``torch._fused_sgd_``/``_fused_adam_``/
    ``_fused_adamw_``) updates their tensors in place, with no new memory at all, and the returned
    trees hold those same tensors; results equal ``torch.optim.*(fused=True)`` to the bit. Do not
    use the old trees afterwards (they hold the new values), nor donate tensors something else still
    needs, such as an EMA copy or the fallback of ``fddp.apply_if_finite``. Trees whose leaves share
    memory (tied weights) are never updated in place, nor are a module's own parameters as
    :func:`fddp.functionalize` hands them out: the first donated step copies those (the module is
    never written) and returns parameters of your own, which later steps update in place. The
    state of a ``chain``'s earlier transforms is not donated.

    Gradients must have their parameter's dtype, as torch requires of ``param.grad``: a float64
    gradient for a float32 parameter raises a ``TypeError`` naming the leaf, in every optimizer
    and on every path (``update``, ``apply_gradients``, donated or not).

    Args:
        opt: the optimizer.
        grads: gradients, a pytree like ``params``.
        state: the optimizer state (from ``opt.init`` or the previous step).
        params: the parameters.
        donate: allow ``params`` and ``state`` to be updated in place (see above).

    Returns:
        ``(new_params, new_state)``.

    Example:
        >>> opt = fddp.optim.adamw(lr=1e-3)
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, grads, state, params)
        >>> params, state = fddp.optim.apply_gradients(opt, grads, state, params, donate=True)
    """
    if not isinstance(opt, GradientTransformation):
        raise TypeError(f"apply_gradients: opt must be a GradientTransformation, got {type(opt).__name__}")
    if isinstance(params, _shard.Sharded):
        params.layout.check_group("optim.apply_gradients")
    fused = _FUSED.get(opt.update)
    if fused is not None:
        out = fused(grads, state, params, bool(donate))
        if out is not None:
            return out
    updates, state = opt.update(grads, state, params)
    return apply_updates(params, updates), state


# update function -> fused ``(grads, state, params, donate) -> (new_params, new_state) | None`` (None:
# not applicable to these inputs; use update + apply_updates). Keyed weakly by the update closure so
# that optimizers can be created freely; GradientTransformation itself stays a plain pair.
_FUSED: "weakref.WeakKeyDictionary[Callable, Callable]" = weakref.WeakKeyDictionary()


def _register_fused(opt: GradientTransformation, fused: Callable) -> GradientTransformation:
    _FUSED[opt.update] = fused
    return opt


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transformations: each one's updates are the next one's gradients.

    The state is a tuple holding one state per transformation.

    Args:
        *transforms: the transformations, applied left to right.

    Returns:
        A ``GradientTransformation``.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(1e-3))
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain: argument {i} must be a GradientTransformation, got {type(t).__name__}")

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(grads: Updates, state: tuple, params: Params | None = None) -> tuple[Updates, tuple]:
        if type(state) is not tuple or len(state) != len(transforms):
            raise TypeError(
                f"chain.update expected a tuple of {len(transforms)} states (from this chain's init), "
                f"got {_describe(state)}"
            )
        new_states = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)

    opt = GradientTransformation(init, update)
    last = _FUSED.get(transforms[-1].update) if transforms else None
    if last is None:
        return opt

    def fused(grads: Updates, state: tuple, params: Params, donate: bool) -> tuple[Params, tuple] | None:
        # Every transform but the last as usual, then the last one fused into the step.
        if type(state) is not tuple or len(state) != len(transforms):
            return None  # let update raise its error
        new_states = []
        for t, s in zip(transforms[:-1], state[:-1]):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        out = last(grads, state[-1], params, donate)
        if out is None:
            updates, s = transforms[-1].update(grads, state[-1], params)
            out = apply_updates(params, updates), s
        return out[0], tuple(new_states) + (out[1],)

    return _register_fused(opt, fused)


# ---------------------------------------------------------------------------------------------
# Shared helpers (private).


def _flatten(tree: PyTree) -> tuple[list, optree.PyTreeSpec]:
    # None leaves are kept so that "missing" gradients are reported rather than silently dropped.
    return optree.tree_flatten(tree, none_is_leaf=True)


def _paths(treedef: optree.PyTreeSpec) -> list[str]:
    return list(paths(treedef))  # fddp's one path format: "exp_avg/0.weight"


def _leaves_like(tree: PyTree, treedef: optree.PyTreeSpec, name: str, ref: str) -> list:
    """Flatten ``tree``, raising a ValueError naming the leaf paths if it does not match ``treedef``."""
    leaves, got = _flatten(tree)
    if got != treedef:
        why = _shard.explain(treedef, got, ref, name)
        if why is not None:
            raise ValueError(f"{name} must have the same tree structure as {ref}: {why}")
        want_paths, got_paths = _paths(treedef), _paths(got)
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


def _check_grads(grads: Updates, treedef: optree.PyTreeSpec | None, where: str) -> tuple[list, optree.PyTreeSpec]:
    """Flatten grads, checking structure against ``treedef`` (if given) and rejecting ``None`` leaves."""
    if treedef is None:
        leaves, treedef = _flatten(grads)
    else:
        leaves = _leaves_like(grads, treedef, "grads", "the optimizer state (params at init)")
    if not all(isinstance(g, Tensor) for g in leaves):
        for path, g in zip(_paths(treedef), leaves):
            if not isinstance(g, Tensor):
                raise TypeError(
                    f"{where}: grad {path!r} must be a tensor, got {_describe(g)}; "
                    "pass zeros for frozen parameters or drop them from both params and grads"
                )
    return leaves, treedef


def _check_dtypes(gs: Sequence[Tensor], like: Sequence[Tensor], treedef: optree.PyTreeSpec, where: str, like_name: str) -> None:
    """Raise a TypeError naming the leaf unless every gradient has its parameter's dtype.

    torch's rule: ``param.grad`` must have the parameter's dtype (``param.grad = g`` raises
    otherwise), so torch.optim's kernels never see a float64 gradient for a float32 parameter
    (its SGD would accept one, its Adam would not). Here every optimizer refuses, on every path.
    ``like`` is the parameters or a state tree shaped from them (a momentum buffer, a moment).
    """
    for i, (g, p) in enumerate(zip(gs, like)):
        if g.dtype != p.dtype:
            raise TypeError(
                f"{where}: grad {_paths(treedef)[i]!r} has dtype {g.dtype}, but its parameter has dtype "
                f"{p.dtype} (as {like_name} says); a gradient must have its parameter's "
                "dtype, as torch requires of param.grad. Cast it first: "
                "optree.tree_map(lambda g, p: g.to(p.dtype), grads, params)"
            )


def _module_aliases(leaves: Sequence[Tensor]) -> bool:
    """Whether any leaf is an alias of a module's own parameter, as ``fddp.functionalize`` hands them out.

    Donating those would update the module in place; the fused steps copy them instead (once: the
    parameters they return are the caller's own).
    """
    return any(getattr(t, MODULE_ALIAS, False) for t in leaves)


def _params_leaves(params: Params | None, treedef: optree.PyTreeSpec, where: str, why: str) -> list:
    if params is None:
        raise ValueError(f"{where}: params are required ({why}); call update(grads, state, params)")
    return _leaves_like(params, treedef, "params", "grads")


def _check_state(state: Any, cls: type, where: str) -> None:
    if type(state) is not cls:
        raise TypeError(
            f"{where} expected a {cls.__name__} (from this optimizer's init), got {_describe(state)}; "
            "was the state created by a different optimizer?"
        )


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"Tensor(shape={tuple(x.shape)}, dtype={x.dtype})"
    return type(x).__name__


def _check_lr(lr: ScalarOrSchedule, where: str) -> None:
    if callable(lr):
        return
    if isinstance(lr, Tensor):
        raise TypeError(f"{where}: lr must be a float or a schedule (a function of the step count), got a Tensor")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or not math.isfinite(lr) or lr < 0:
        raise ValueError(f"{where}: invalid lr={lr!r}; expected a finite float >= 0 or a schedule")


def _check_nonneg(value: float, name: str, where: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: invalid {name}={value!r}; expected a finite float >= 0")


def _lr_at(lr: ScalarOrSchedule, count: Tensor) -> float | Tensor:
    """The learning rate for the update at ``count`` (0 for the first update)."""
    return lr(count) if callable(lr) else float(lr)


def _fused_kernels_take(groups: tuple | None) -> bool:
    """Whether torch's fused optimizer kernels take every flat group (a float dtype, CPU or CUDA)."""
    return groups is not None and all(
        g.dtype in _FUSED_DTYPES and g.device.type in ("cpu", "cuda") for g in groups
    )


_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _zeros_count(leaves: Sequence[Tensor]) -> Tensor:
    # The count lives with the parameters so that scalar tensors derived from it (lr, bias
    # corrections) can be mixed with parameter tensors in foreach ops and under vmap.
    device = next((t.device for t in leaves if isinstance(t, Tensor)), torch.device("cpu"))
    return torch.zeros((), dtype=torch.int64, device=device)
