"""Local gradient accumulation for the no-sync window: sum k micro-batches, then one synchronisation.

torch DDP needs a ``no_sync()`` context to stop its hooks from all-reducing every micro-batch. In
fddp nothing communicates unless ``ddp_step`` is called, so skipping synchronisation is just
summing gradients locally, which is what :func:`accumulate_grads` does, purely::

    acc = fddp.GradAccumulator()
    for i, (x, y) in enumerate(micro_batches):
        g = torch.func.grad(loss_fn)(params, x, y)                 # local: no communication
        acc = fddp.accumulate_grads(acc, g, weight=len(x))
        if (i + 1) % k == 0:                                        # 1 of k micro-steps talks
            grads = fddp.ddp_step(params, acc.mean(), weight=acc.weight)
            acc = fddp.GradAccumulator()
            updates, state = opt.update(grads, state, params)
            params = fddp.optim.apply_updates(params, updates)

With each micro-batch weighted by its sample count (and ``loss_fn`` a mean over the micro-batch),
``grads`` is the gradient of the mean loss over every sample of the window on every rank: one
large-batch step, exactly, whatever the micro-batch sizes.

The last micro-batch need not be summed first: ``fddp.grad_and_value``'s function takes the window
so far as ``accumulated=`` and reduces the window's mean while the last backward runs, as torch
DDP's last backward after ``no_sync()`` does (:func:`window` and :func:`window_value` give each
leaf's mean with the very arithmetic of ``accumulate_grads`` then :meth:`GradAccumulator.mean`)::

    step = fddp.grad_and_value(loss_fn)
    acc = fddp.GradAccumulator()
    for x, y in micro_batches[:-1]:
        acc = fddp.accumulate_grads(acc, torch.func.grad(loss_fn)(params, x, y))
    grads, loss = step(params, *micro_batches[-1], accumulated=acc)  # the window's mean, averaged

``fddp.optim.accumulate`` is the other half of the picture: an optimizer wrapper that steps once
every k calls. Use this module when the window must end in a synchronisation, or when micro-batches
differ in size or miss gradients (``None`` leaves).
"""

from __future__ import annotations

from numbers import Real
from typing import Any, NamedTuple

import optree
import torch

from fddp._tree import adopt_torch_nodes, path_str

__all__ = ["GradAccumulator", "accumulate_grads", "Window", "window", "window_value"]

_ZERO = torch.zeros((), dtype=torch.float64)  # the empty window's weight; never written to


class GradAccumulator(NamedTuple):
    """The running, weighted sum of a window's gradients (plain data; every operation is pure).

    ``GradAccumulator()`` is an empty window: no gradients yet (``grad_sum`` is ``None``, which
    :func:`fddp.ddp_step` reads as all zeros), weight 0.

    Attributes:
        grad_sum: ``sum_i w_i * g_i``, a tree of the gradients' structure, or ``None`` before the
            first micro-batch. A leaf stays ``None`` while every gradient added for it was ``None``
            (an unused parameter).
        weight: ``sum_i w_i``, a float64 scalar tensor.
        count: the number of micro-batches added.

    Example:
        >>> acc = fddp.accumulate_grads(fddp.GradAccumulator(), {"w": torch.ones(2)}, weight=3)
        >>> acc = fddp.accumulate_grads(acc, {"w": torch.zeros(2)}, weight=1)
        >>> acc.mean()["w"], float(acc.weight), acc.count
        (tensor([0.7500, 0.7500]), 4.0, 2)
    """

    grad_sum: Any = None
    weight: torch.Tensor = _ZERO
    count: int = 0

    def mean(self) -> Any:
        """Return the weighted mean gradient ``grad_sum / weight``; never NaN, even at weight 0.

        ``None`` leaves stay ``None`` (so do all leaves of a window of weight 0 given as numbers),
        and an empty window gives ``None``; :func:`fddp.ddp_step` counts both as zeros.

        Example:
            >>> grads = fddp.ddp_step(params, acc.mean(), weight=acc.weight)
        """
        if self.count == 0:
            return None
        # A window of weight 0 has an all-zero sum (see accumulate_grads), so 0 / tiny is 0, not NaN.
        denom = self.weight.clamp_min(torch.finfo(torch.float64).tiny)
        return optree.tree_map(lambda s: None if s is None else _div(s, denom), self.grad_sum, none_is_leaf=True)


def accumulate_grads(
    acc: GradAccumulator, grads: Any, /, *, weight: float | torch.Tensor | None = None
) -> GradAccumulator:
    """Return ``acc`` with ``weight * grads`` added: the local half of a no-sync window.

    Nothing here communicates. Leaves that are ``None`` add nothing; a micro-batch of weight 0
    (an empty one) adds nothing either, even if its gradients are NaN (the mean of an empty loss).

    Args:
        acc: the window so far; ``fddp.GradAccumulator()`` starts one (its structure is then
            taken from ``grads``).
        grads: this micro-batch's gradients, a pytree of tensors (or ``None`` leaves).
        weight: this micro-batch's weight, usually its number of samples when the loss is a mean
            over the micro-batch; ``None`` means 1 (a plain sum, and ``mean()`` divides by the
            count). Must be >= 0. A tensor weight stays on its device and is never read back to
            Python (no device sync), so its sign is not checked.

    Returns:
        A new :class:`GradAccumulator`; ``acc`` and ``grads`` are not modified.

    Raises:
        ValueError: ``grads`` has a different structure from ``acc.grad_sum``, a leaf has a
            different shape, or ``weight`` is negative or not a scalar.

    Example:
        >>> acc = fddp.GradAccumulator()
        >>> for x, y in micro_batches:
        ...     acc = fddp.accumulate_grads(acc, torch.func.grad(loss_fn)(params, x, y), weight=len(x))
        >>> grads = fddp.ddp_step(params, acc.mean(), weight=acc.weight)
    """
    w, w_number = _check_weight(weight)
    adopt_torch_nodes()  # a container type registered with torch since fddp last flattened
    paths, g_leaves, g_spec = optree.tree_flatten_with_path(grads, none_is_leaf=True)
    if not isinstance(acc, GradAccumulator):
        raise TypeError(f"fddp.accumulate_grads: acc must be a GradAccumulator, got {type(acc).__name__}")
    if acc.count == 0:
        s_leaves: list[torch.Tensor | None] = [None] * len(g_leaves)
        s_spec = g_spec
    else:
        s_leaves, s_spec = optree.tree_flatten(acc.grad_sum, none_is_leaf=True)
        if s_spec != g_spec:
            raise ValueError(
                "fddp.accumulate_grads: grads must have the structure of the window's earlier grads.\n"
                f"  expected: {s_spec}\n  got:      {g_spec}"
            )
    out = []
    for path, s, g in zip(paths, s_leaves, g_leaves):
        if g is not None and not isinstance(g, torch.Tensor):
            raise TypeError(
                f"fddp.accumulate_grads: grad {path_str(path)!r} must be a torch.Tensor or None, got {type(g).__name__}"
            )
        if g is not None and s is not None and g.shape != s.shape:
            raise ValueError(
                f"fddp.accumulate_grads: grad {path_str(path)!r} has shape {tuple(g.shape)}, but the window's "
                f"earlier grads have shape {tuple(s.shape)}"
            )
        out.append(_add(s, g, w, w_number))
    return GradAccumulator(optree.tree_unflatten(s_spec, out), acc.weight + w, acc.count + 1)


def _add(s: torch.Tensor | None, g: torch.Tensor | None, w: torch.Tensor, w_number: float | None) -> torch.Tensor | None:
    """``s + w * g`` for one leaf (``None`` for a missing one)."""
    if g is None or w_number == 0:  # a weight-0 micro-batch's NaN must not leak into the sum
        return s
    g = g.detach()
    if w_number is None:
        # A tensor weight is never read back to Python (that would force a device sync).
        g = torch.where(w > 0, g * w.to(g.device), torch.zeros((), dtype=g.dtype, device=g.device))
    elif w_number != 1:
        g = g * w_number
    return g if s is None else s + g


class Window(NamedTuple):
    """A window's earlier micro-batches and its last one's weight, ready to take the last gradients
    leaf by leaf (:func:`window`).

    Attributes:
        sums: per leaf (flatten order), the earlier micro-batches' weighted sum, or ``None``.
        w: the last micro-batch's weight, a float64 scalar tensor.
        w_number: the same as a Python float, where it was a number.
        weight: the window's whole weight (every micro-batch's).
        denom: what the sums are divided by (the weight, kept off zero).
    """

    sums: list
    w: torch.Tensor
    w_number: float | None
    weight: torch.Tensor
    denom: torch.Tensor


def window(acc: GradAccumulator, spec: Any, weight: float | torch.Tensor | None, what: str) -> Window:
    """The window ``acc`` closed by one more micro-batch of ``weight``, for a tree of structure ``spec``.

    Raises:
        TypeError: ``acc`` is not a :class:`GradAccumulator`.
        ValueError: its sums have another structure than ``spec``, or ``weight`` is negative.
    """
    if not isinstance(acc, GradAccumulator):
        raise TypeError(f"fddp.{what}: accumulated must be a fddp.GradAccumulator, got {type(acc).__name__}")
    w, w_number = _check_weight(weight)
    if acc.count == 0:
        sums: list = [None] * spec.num_leaves
    else:
        sums, s_spec = optree.tree_flatten(acc.grad_sum, none_is_leaf=True)
        if s_spec != spec:
            raise ValueError(
                f"fddp.{what}: accumulated holds gradients of another structure than the differentiated argument.\n"
                f"  expected: {spec}\n  got:      {s_spec}"
            )
    total = acc.weight + w
    return Window(sums, w, w_number, total, total.clamp_min(torch.finfo(torch.float64).tiny))


def window_value(win: Window, i: int, g: torch.Tensor | None) -> torch.Tensor | None:
    """Leaf ``i``'s mean over the window, its last gradient ``g`` added: the arithmetic of
    :func:`accumulate_grads` then :meth:`GradAccumulator.mean`, to the bit."""
    total = _add(win.sums[i], g, win.w, win.w_number)
    return None if total is None else _div(total, win.denom)


def _check_weight(weight: float | torch.Tensor | None) -> tuple[torch.Tensor, float | None]:
    """Return the weight as a float64 scalar tensor, and as a Python float when it was a number."""
    if weight is None:
        weight = 1.0
    if isinstance(weight, Real) and not isinstance(weight, bool):
        if not weight >= 0:  # also rejects NaN
            raise ValueError(f"fddp.accumulate_grads: weight must be >= 0 (a sample count), got {weight!r}")
        return torch.tensor(float(weight), dtype=torch.float64), float(weight)
    if isinstance(weight, torch.Tensor) and weight.numel() == 1 and not weight.is_complex():
        return weight.detach().to(torch.float64).reshape(()), None
    raise ValueError(f"fddp.accumulate_grads: weight must be a number or a one-element real tensor, got {weight!r}")


def _div(s: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    # Divide in float64, then round once: the weight sum need not be representable in s's dtype.
    return (s.to(torch.float64) / denom.to(s.device)).to(s.dtype)
