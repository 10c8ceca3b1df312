"""Core of ``fddp.optim``: ``GradientTransformation``, ``chain``, ``apply_updates`` and ``apply_gradients``.

An optimizer is a pair of pure functions over pytrees of tensors (optax's design):
``init(params) -> state`` and ``update(grads, state, params) -> (updates, new_state)``. Updates are
added to parameters (``params + updates``), so a descent step has negative updates.

The fused step is part of the optimizer's value, not a table beside it (optax's
``GradientTransformationExtraArgs`` is the model): a :class:`GradientTransformationExtraArgs`'s
``update`` takes keyword arguments it may use, and :func:`apply_gradients` passes one,
``apply=Apply(donate)``, asking the transformation to apply its step to the parameters itself.
One that can (``sgd``, ``adam``, ``adamw``: torch's fused kernels, or the step written straight
into new buffers) returns ``(Applied(new_params), new_state)``; any other returns its updates as
usual, and ``apply_gradients`` adds them. ``chain`` forwards the request to its last
transformation, and a wrapper keeps the fast path by forwarding ``**extra_args`` the same way.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, NamedTuple

import optree
import torch
from torch import Tensor

from fddp._dist import settle
from fddp._layout import SplitTree
from fddp._tree import FUNCTIONALIZE_FIX, article

from . import _flat as flat
from ._checks import OptState, Params, Updates, describe, flatten, leaves_like, paths_of

__all__ = [
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "EmptyState",
    "Apply",
    "Applied",
    "FusedUpdate",
    "apply_updates",
    "apply_gradients",
    "chain",
    "fast_path",
]


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


class GradientTransformationExtraArgs(GradientTransformation):
    """A :class:`GradientTransformation` whose ``update`` takes extra keyword arguments.

    ``update(grads, state, params=None, **extra_args)``: each argument is used by the
    transformations that know it and ignored by the others (optax's class of the same name).
    fddp passes one, ``apply=Apply(donate)`` (see :class:`Apply`), from :func:`apply_gradients`.
    Every transformation ``fddp.optim`` makes is one; a wrapper that forwards ``**extra_args`` to
    the transformation it wraps keeps that transformation's fused step.

    Example:
        >>> def logged(opt):
        ...     def update(grads, state, params=None, **extra_args):
        ...         print("step")
        ...         return opt.update(grads, state, params, **extra_args)
        ...     return fddp.optim.GradientTransformationExtraArgs(opt.init, update)
        >>> params, state = fddp.optim.apply_gradients(logged(fddp.optim.adamw(1e-3)), grads, state, params)
    """

    __slots__ = ()


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


class Apply(NamedTuple):
    """``update``'s ``apply=`` argument: apply the step to ``params`` in the same call, if you can.

    A transformation that can returns ``(Applied(new_params), new_state)``, equal to its updates
    added to ``params`` up to rounding; one that cannot returns its updates as usual. Only
    :func:`apply_gradients` asks, and only the last transformation of a ``chain`` is asked.

    Attributes:
        donate: ``params`` and the state may be updated in place (see :func:`apply_gradients`).
        why: where given, a list the transformation appends notes to on the path it took
            (:func:`fast_path` reads them).

    Example:
        >>> out, state = opt.update(grads, state, params, apply=fddp.optim.Apply(donate=False))
        >>> params = out.params if isinstance(out, fddp.optim.Applied) else fddp.optim.apply_updates(params, out)
    """

    donate: bool = False
    why: list | None = None


class Applied(NamedTuple):
    """Returned by ``update`` in place of the updates when it applied the step (see :class:`Apply`).

    Attributes:
        params: the new parameters.

    Example:
        >>> out, state = opt.update(grads, state, params, apply=fddp.optim.Apply())
        >>> if isinstance(out, fddp.optim.Applied):
        ...     params = out.params
    """

    params: Params


class FusedUpdate(NamedTuple):
    """An ``update`` with a fused step: ``update(grads, state, params=None, *, apply=None)``.

    With ``apply=`` (:class:`Apply`), ``applied(cfg, grads, state, params, apply)`` runs first and
    its ``(Applied(new_params), new_state)`` is the answer, unless it returns ``None`` (these
    inputs take no fused step); otherwise ``pure(cfg, grads, state, params)``, the pure update.
    ``sgd``, ``adam`` and ``adamw`` are made this way.

    Example:
        >>> opt = GradientTransformationExtraArgs(functools.partial(_init, cfg), FusedUpdate(cfg, _update, _applied))
    """

    cfg: Any
    pure: Callable[..., tuple[Updates, OptState]]
    applied: Callable[..., tuple[Applied, OptState] | None]

    def __call__(
        self, grads: Updates, state: OptState, params: Params | None = None, *, apply: Apply | None = None, **_: Any
    ) -> tuple[Any, OptState]:
        if apply is not None:
            out = self.applied(self.cfg, grads, state, params, apply)
            if out is not None:
                return out
        return self.pure(self.cfg, grads, state, params)


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
    p_leaves, treedef = flatten(params)
    u_leaves = leaves_like(updates, treedef, "updates", "params")
    if all(map(isinstance, itertools.chain(p_leaves, u_leaves), itertools.repeat(Tensor))):
        step = flat.step_plan(p_leaves, u_leaves, names=lambda: paths_of(treedef), labels=("params", "updates"))
        if step is not None and (step.lies_in(p_leaves) or step.lies_in(u_leaves)):
            # Updates from fddp.optim are views of flat buffers: one add per buffer, into a pooled one.
            out = [torch.add(step.read(p_leaves, k), step.read(u_leaves, k), out=flat.new(g)) for k, g in enumerate(step.groups)]
            return optree.tree_unflatten(treedef, step.out(out))
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
    _check_arguments(opt, grads, state, params)
    if isinstance(params, SplitTree):
        params.check_group("optim.apply_gradients")
    settle()  # the step boundary of NCCL groups: their batched calls checked (read at the next one)
    return _apply(opt, grads, state, params, Apply(bool(donate)))


def _apply(opt: GradientTransformation, grads: Updates, state: OptState, params: Params, request: Apply) -> tuple[Params, OptState]:
    if isinstance(opt, GradientTransformationExtraArgs):
        out, new_state = opt.update(grads, state, params, apply=request)
        if isinstance(out, Applied):
            return out.params, new_state
    else:
        if request.why is not None:
            request.why.append(
                "update + apply_updates: the optimizer is a plain GradientTransformation, whose update takes no "
                "extra arguments; make it a GradientTransformationExtraArgs whose update forwards **extra_args "
                "to the transformation it wraps to keep that one's fused step"
            )
        out, new_state = opt.update(grads, state, params)
    return apply_updates(params, out), new_state


def _check_arguments(opt: Any, grads: Any, state: Any, params: Any) -> None:
    """Name the mistake when ``apply_gradients`` gets a module, or its arguments in another order."""
    if not isinstance(opt, GradientTransformation):
        raise TypeError(
            f"fddp.optim.apply_gradients: opt must be a GradientTransformation (fddp.optim.sgd(...), adamw(...)), "
            f"got {type(opt).__name__}; the arguments are (opt, grads, state, params)"
        )
    for name, x in (("grads", grads), ("state", state), ("params", params)):
        if isinstance(x, torch.nn.Module):
            raise TypeError(
                f"fddp.optim.apply_gradients: {name} must be a pytree of tensors, got the module {type(x).__name__} itself; "
                f"{FUNCTIONALIZE_FIX}"
            )
    if not _is_state(state):
        for place, name, x in (("2nd", "the gradients", grads), ("4th", "the parameters", params)):
            if _is_state(x):
                raise TypeError(
                    f"fddp.optim.apply_gradients: the {place} argument is {article(type(x).__name__)} (an optimizer "
                    f"state) where {name} go, and the 3rd, where the state goes, is {article(type(state).__name__)}: "
                    "the arguments are apply_gradients(opt, grads, state, params)"
                )


def _is_state(x: Any) -> bool:
    """Whether ``x`` looks like an optimizer state: a NamedTuple whose type is a ...State, or a chain's tuple of them."""
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return type(x).__name__.endswith("State")
    return type(x) is tuple and len(x) > 0 and all(_is_state(s) for s in x)


def fast_path(opt: GradientTransformation, grads: Updates, state: OptState, params: Params, /, *, donate: bool = False) -> str:
    """Say which path :func:`apply_gradients` takes on these inputs, and why: fused or not, flat
    buffers or leaf by leaf, which inputs are read in place and which are copied (and the leaf that
    made them copied: a ``tree_map`` over the gradients, say).

    It runs the step once (on copies of ``params`` and ``state`` when ``donate``), so call it while
    tuning, not in the loop.

    Example:
        >>> print(fddp.optim.fast_path(opt, grads, state, params))
        adamw: torch's fused kernel on copies of params and state
        flat: 3 buffer(s) in the layout the inputs came in
    """
    why = flat.Why()
    if donate:
        state, params = copy.deepcopy(state), copy.deepcopy(params)
    _check_arguments(opt, grads, state, params)
    _apply(opt, grads, state, params, Apply(bool(donate), why))
    return "\n".join(why) if why else "update + apply_updates"


def chain(*transforms: GradientTransformation) -> GradientTransformationExtraArgs:
    """Compose transformations: each one's updates are the next one's gradients.

    The state is a tuple holding one state per transformation. Extra arguments to ``update``
    (``apply=`` from :func:`apply_gradients`) go to the last transformation, so a chain that ends
    in ``sgd`` or ``adamw`` keeps its fused step.

    Args:
        *transforms: the transformations, applied left to right.

    Returns:
        A ``GradientTransformationExtraArgs``.

    Example:
        >>> opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(1e-3))
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(f"chain: argument {i} must be a GradientTransformation, got {type(t).__name__}")
    init = _ChainInit(transforms)
    return GradientTransformationExtraArgs(init, _ChainUpdate(transforms))


class _ChainInit(NamedTuple):
    transforms: tuple[GradientTransformation, ...]

    def __call__(self, params: Params) -> tuple:
        return tuple(t.init(params) for t in self.transforms)


class _ChainUpdate(NamedTuple):
    transforms: tuple[GradientTransformation, ...]

    def __call__(self, grads: Updates, state: tuple, params: Params | None = None, **extra_args: Any) -> tuple[Any, tuple]:
        transforms = self.transforms
        if type(state) is not tuple or len(state) != len(transforms):
            raise TypeError(
                f"chain.update expected a tuple of {len(transforms)} states (from this chain's init), got {describe(state)}"
            )
        new_states = []
        for i, (t, s) in enumerate(zip(transforms, state)):
            last = i == len(transforms) - 1
            if last and extra_args and isinstance(t, GradientTransformationExtraArgs):
                grads, s = t.update(grads, s, params, **extra_args)
            else:
                grads, s = t.update(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)

