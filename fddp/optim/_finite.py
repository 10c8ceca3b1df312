"""Skipping non-finite steps: a choice between two trees on the device, and optax's ``apply_if_finite`` wrapper.

``apply_if_finite(finite, new, old)`` (also ``fddp.apply_if_finite``) keeps ``old`` where a step
was not finite; ``apply_if_finite(opt, max_consecutive_errors)`` is optax's wrapper of the same
name, an optimizer that skips the updates of ``opt`` while they hold a NaN or an Inf.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from fddp._layout import SplitTree
from fddp._tree import adopt_torch_nodes, path_str

from ._base import GradientTransformation, GradientTransformationExtraArgs
from ._checks import Params, Updates, check_grads, check_state, describe, flatten, zeros_count
from ._clip import global_norm

__all__ = ["ApplyIfFiniteState", "apply_if_finite"]

_MISSING = object()


class ApplyIfFiniteState(NamedTuple):
    """State of ``apply_if_finite(opt, max_consecutive_errors)`` (optax's fields).

    Attributes:
        notfinite_count: non-finite updates in a row (an int64 scalar tensor), 0 after a finite one.
        last_finite: whether the latest updates were finite (a bool scalar tensor).
        total_notfinite: non-finite updates since ``init`` (an int64 scalar tensor).
        inner_state: the wrapped optimizer's state.
    """

    notfinite_count: Tensor
    last_finite: Tensor
    total_notfinite: Tensor
    inner_state: Any


def apply_if_finite(finite: Any, new: Any = _MISSING, old: Any = _MISSING, /, max_consecutive_errors: int | None = None) -> Any:
    """Skip a step that is not finite: choose between two trees, or wrap an optimizer (optax's form).

    **Two trees**, ``apply_if_finite(finite, new, old)`` (``fddp.apply_if_finite`` is this
    function): return ``new`` where ``finite`` is true and ``old`` where it is false, leaf by leaf.
    Use it to skip an update whose gradients held a NaN or an Inf: pass the new and the old
    ``(params, opt_state)``, and both come back unchanged together (the optimizer's step count
    included). The choice is ``torch.where(finite, new_leaf, old_leaf)``, so it stays on the device
    and works under ``torch.func.vmap`` (a batched ``finite`` selects per ensemble member, broadcast
    against the leaves' leading dimensions) and ``torch.compile``. A leaf that is the same tensor
    object in both trees is passed through.

    **An optimizer**, ``apply_if_finite(opt, max_consecutive_errors)`` (optax's
    ``apply_if_finite``): its updates are ``opt``'s while the incoming updates are all finite, and
    zeros, with ``opt``'s state kept as it was, while they hold a NaN or an Inf, until more than
    ``max_consecutive_errors`` such steps in a row, after which ``opt``'s update is taken anyway.
    Its state is an :class:`ApplyIfFiniteState`. ``opt`` runs at every step and ``torch.where``
    chooses (no host sync, vmap-friendly; ``opt``'s fused step is not used). On ``fddp.zero``'s
    shards the verdict is the ranks' together (one scalar all-reduce, as
    :func:`fddp.optim.global_norm`), so every rank skips alike.

    Args:
        finite: a bool tensor with one element (``info.finite`` from :func:`fddp.ddp_step` or
            :func:`fddp.grad_and_value`), or a Python bool; or the optimizer to wrap.
        new: the tree to take when ``finite`` is true; or ``max_consecutive_errors``.
        old: the tree to keep otherwise; the same structure as ``new``, with leaves of the same
            shape and dtype. Non-tensor leaves (a Python step count, say) must be equal in both.
        max_consecutive_errors: with an optimizer, the non-finite steps in a row it skips (an int >= 0).

    Returns:
        The chosen tree, with the structure of ``new``; or the wrapping optimizer, a
        ``GradientTransformationExtraArgs``.

    Raises:
        ValueError: the trees differ in structure, or two leaves in shape or dtype (naming the leaf).
        TypeError: ``finite`` is not a bool, or two non-tensor leaves differ.

    Example:
        >>> grads, info = fddp.ddp_step(params, grads, check_finite=True, return_info=True)
        >>> updates, new_state = opt.update(grads, state, params)
        >>> new_params = fddp.optim.apply_updates(params, updates)
        >>> params, state = fddp.apply_if_finite(info.finite, (new_params, new_state), (params, state))
        >>> opt = fddp.optim.apply_if_finite(fddp.optim.adamw(1e-3), max_consecutive_errors=5)
        >>> params, state = fddp.optim.apply_gradients(opt, grads, opt.init(params), params)
        >>> int(state.total_notfinite)
        0
    """
    if isinstance(finite, GradientTransformation):
        if old is not _MISSING:
            raise TypeError(
                "apply_if_finite(opt, max_consecutive_errors): got a third argument; did you mean apply_if_finite(finite, new, old)?"
            )
        limit = max_consecutive_errors if new is _MISSING else new
        return _wrap(finite, limit)
    if new is _MISSING or old is _MISSING:
        raise TypeError(
            f"apply_if_finite: expected apply_if_finite(finite, new, old) (choose between two trees) or "
            f"apply_if_finite(opt, max_consecutive_errors) (wrap an optimizer), got {describe(finite)} first and "
            f"{1 + (new is not _MISSING)} argument(s) in all"
        )
    if max_consecutive_errors is not None:
        raise TypeError(
            "apply_if_finite(finite, new, old) takes no max_consecutive_errors; that is apply_if_finite(opt, max_consecutive_errors)"
        )
    return _select(finite, new, old)


def _wrap(inner: GradientTransformation, limit: Any) -> GradientTransformationExtraArgs:
    if limit is _MISSING or limit is None or isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise TypeError(f"apply_if_finite: max_consecutive_errors must be an int >= 0, got {limit!r}")
    where = "apply_if_finite.update"

    def init(params: Params) -> ApplyIfFiniteState:
        # The counters live with the parameters: the verdict is computed there, and a CUDA verdict
        # moved to a CPU counter would be a host sync per step.
        zero = zeros_count(flatten(params)[0])
        return ApplyIfFiniteState(zero, torch.ones((), dtype=torch.bool, device=zero.device), zero.clone(), inner.init(params))

    def update(
        grads: Updates, state: ApplyIfFiniteState, params: Params | None = None, **extra_args: Any
    ) -> tuple[Updates, ApplyIfFiniteState]:
        check_state(state, ApplyIfFiniteState, where, grads=grads, params=params)
        gs, _ = check_grads(grads, None, where)
        isfinite = _all_finite(grads, gs).to(state.notfinite_count.device)
        notfinite_count = torch.where(isfinite, torch.zeros_like(state.notfinite_count), state.notfinite_count + 1)
        # extra_args (apply_gradients' fused request) are not forwarded: the choice needs the updates.
        updates, new_inner = inner.update(grads, state.inner_state, params)
        take = isfinite | (notfinite_count > limit)
        zeros = optree.tree_map(torch.zeros_like, updates)
        updates = _select(take, updates, zeros)
        new_inner = _select(take, new_inner, state.inner_state)
        total = torch.where(isfinite, state.total_notfinite, state.total_notfinite + 1)
        return updates, ApplyIfFiniteState(notfinite_count, isfinite, total, new_inner)

    return GradientTransformationExtraArgs(init, update)


def _all_finite(grads: Any, gs: list[Tensor]) -> Tensor:
    """Whether every element is finite: on shards the ranks' verdict together (a NaN or Inf makes the sum of squares one)."""
    if isinstance(grads, SplitTree):
        return torch.isfinite(global_norm(grads))
    if not gs:
        return torch.ones((), dtype=torch.bool)
    device = gs[0].device
    return torch.stack([torch.isfinite(g).all().to(device) for g in gs]).all()


def _select(finite: torch.Tensor | bool, new: Any, old: Any, /) -> Any:
    """``torch.where(finite, new, old)`` leaf by leaf (see :func:`apply_if_finite`)."""
    if isinstance(finite, bool):
        finite = torch.tensor(finite)
    if not isinstance(finite, torch.Tensor) or finite.dtype != torch.bool or finite.numel() != 1:
        got = f"a {finite.dtype} tensor of shape {tuple(finite.shape)}" if isinstance(finite, torch.Tensor) else type(finite).__name__
        raise TypeError(f"fddp.apply_if_finite: finite must be a bool tensor with one element (info.finite), got {got}")
    finite = finite.reshape(())
    adopt_torch_nodes()  # a container type registered with torch since fddp last flattened
    paths, new_leaves, spec = optree.tree_flatten_with_path(new)
    old_leaves, old_spec = optree.tree_flatten(old)
    if old_spec != spec:
        raise ValueError(f"fddp.apply_if_finite: new and old must have the same tree structure; new: {spec}, old: {old_spec}")
    on: dict[torch.device, torch.Tensor] = {}  # the condition, moved once per device
    out = []
    for path, n, o in zip(paths, new_leaves, old_leaves):
        if n is o:
            out.append(n)
            continue
        if not (isinstance(n, torch.Tensor) and isinstance(o, torch.Tensor)):
            if isinstance(n, torch.Tensor) or isinstance(o, torch.Tensor) or n != o:
                raise TypeError(
                    f"fddp.apply_if_finite: leaf {path_str(path)!r} is {n!r} in new and {o!r} in old; a "
                    "leaf that may change must be a tensor (a Python value cannot be chosen on the device)"
                )
            out.append(n)
            continue
        if n.shape != o.shape or n.dtype != o.dtype:
            raise ValueError(
                f"fddp.apply_if_finite: leaf {path_str(path)!r} has shape {tuple(n.shape)} and dtype "
                f"{n.dtype} in new, but shape {tuple(o.shape)} and dtype {o.dtype} in old"
            )
        cond = on.get(n.device)
        if cond is None:
            cond = on[n.device] = finite.to(n.device)
        out.append(torch.where(cond, n, o))
    return optree.tree_unflatten(spec, out)
