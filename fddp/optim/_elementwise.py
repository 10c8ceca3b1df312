"""What torch.optim's elementwise optimizers share here: one per-tensor step, two ways to run it.

``rmsprop``, ``adagrad``, ``nadam``, ``radam`` (and ``adafactor``, leaf by leaf) each write one
function of one tensor, a *unit*, that takes the gradient, the state and the parameter and returns
the new state and either the update (``update``) or the new parameter (``apply_gradients``):

- ``update`` takes its step's scalars (learning rate, bias corrections) as float64 tensors derived
  from the count, so it never reads a tensor on the host and works under ``vmap`` and
  ``torch.compile``; the update is added by ``apply_updates``.
- ``apply_gradients`` (eager, outside torch.func transforms) runs torch's own single-tensor
  arithmetic, op for op, writing the new parameter itself (``param.addcdiv_(grad, avg, value=-lr)``
  becomes ``torch.addcdiv(param, grad, avg, value=-lr)``). Where the count is on the CPU it reads
  it once (``int(count)``, as ``torch.optim``'s non-capturable step reads its CPU ``step``) and
  computes the scalars in Python floats: equal to ``torch.optim.*(foreach=False)`` to the bit.
  Elsewhere (a GPU) that read would make the host wait for the GPU at every step, so the scalars
  stay float64 tensors on the count's device (:func:`on_host` decides), computed by the same
  operations in the same order (:func:`power`, :func:`divide`), and the units use tensor scalars
  in the forms that give the same numbers on the CPU (``addcdiv(p, g * c, d)`` for
  ``addcdiv(p, g, d, value=c)``); see each optimizer for the op, if any, that rounds once more.
  On CUDA the float64 ``pow`` is CUDA's, not the C library's, and a few of torch's CUDA kernels
  order a scalar's arithmetic differently (a division by a host scalar is a multiplication by its
  reciprocal there): a step may differ from torch's by a rounding.

Both run on fddp's flat buffers (``_flat.run``) where the inputs allow, else leaf by leaf.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import optree
import torch
from torch import Tensor

from . import _checks as checks
from . import _flat as flat
from ._base import Applied, FusedUpdate
from ._flat import note

__all__ = ["Scalars", "on_host", "host", "power", "divide", "axpy", "scale", "run", "leaves", "zeros", "note", "fused_update", "check_args"]


class Scalars:
    """A step's scalars: Python floats, or float64 tensors cast once per dtype they meet."""

    def __init__(self, **values: Any) -> None:
        self.values = values
        self.cache: dict = {}

    def get(self, dtype: torch.dtype) -> dict:
        if dtype not in self.cache:
            self.cache[dtype] = {k: v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in self.values.items()}
        return self.cache[dtype]


def on_host(count: Tensor) -> bool:
    """Whether ``apply_gradients`` reads the step count on the host and computes its scalars in
    Python floats, as ``torch.optim`` does: where the count is on the CPU, a read costs nothing.

    On a GPU a read (``.item()``) waits for every kernel queued before it, each step, and the host
    stops running ahead; there the scalars stay float64 tensors on the count's device.
    """
    return count.device.type == "cpu"


def host(x: Any) -> Any:
    """A tensor scalar read on the host as a Python number (the apply path's one read), else ``x``."""
    if isinstance(x, Tensor):
        return x.item()
    return x


def power(x: float | Tensor, e: float) -> float | Tensor:
    """``x ** e`` as Python computes it for a float (C's ``pow``), for a float or a float64 tensor.

    torch's ``tensor ** number`` takes shortcuts for some exponents (``sqrt`` for 0.5, ``rsqrt``,
    ``reciprocal``) that round differently from ``pow`` (its CPU ``sqrt`` of float64 is not even
    correctly rounded); a tensor exponent takes none, and on the CPU calls the same ``pow``.
    """
    if isinstance(x, Tensor):
        return torch.pow(x, torch.full_like(x, e))
    return x**e


def divide(a: float | Tensor, b: float | Tensor) -> float | Tensor:
    """``a / b`` in one rounding, as Python's: torch's ``number / tensor`` is ``reciprocal(b) * a``, two."""
    if isinstance(b, Tensor) and not isinstance(a, Tensor):
        return torch.full_like(b, a) / b
    return a / b


def axpy(x: Tensor, y: Tensor, a: float | Tensor, out: Tensor | None) -> Tensor:
    """``x + a * y``: ``torch.add(alpha=)`` for a Python float, as torch.optim; a tensor ``a`` (a schedule's lr) multiplies."""
    if isinstance(a, Tensor):
        return torch.addcmul(x, y, a, out=out)
    return torch.add(x, y, alpha=a, out=out)


def scale(x: Tensor, a: float | Tensor, out: Tensor | None) -> Tensor:
    """``a * x``."""
    return torch.mul(x, a, out=out)


def run(
    unit: Callable[..., tuple],
    gs: list[Tensor],
    states: Sequence[list[Tensor] | None],
    ps: list[Tensor] | None,
    treedef: Any,
    num_outputs: int,
    *,
    labels: Sequence[str],
    apply: bool,
    why: list | None = None,
) -> list[list] | None:
    """Run ``unit(g, *states, p, new)`` over the leaves (flat buffers where possible).

    ``labels`` names the state lists, for errors. With ``apply`` (``apply_gradients``), ``None``
    when the step cannot take flat buffers (inside a transform, or leaves that are not dense): the
    caller then falls back to ``update`` + ``apply_updates``, as the docs of ``apply_gradients`` say.
    """
    present = [(s, name) for s, name in zip(states, labels) if s is not None]
    # The parameters first where the step writes them (their layout is the results'), else last.
    first, last = ([ps], []) if ps is not None and apply else ([], [ps] if ps is not None else [])
    lists = first + [s for s, _ in present] + [gs] + last
    names = ["params"] * len(first) + [n for _, n in present] + ["grads"] + ["params"] * len(last)
    step = flat.step_plan(*lists, names=lambda: checks.paths_of(treedef), labels=names, why=why)
    if apply and step is None:
        return None
    return flat.run(unit, step, [gs, *states, ps], gs, num_outputs)


def leaves(
    where: str, cls: type, grads: Any, state: Any, params: Any, fields: Sequence[str], need_params: bool
) -> tuple[Any, list[Tensor], list[list[Tensor] | None], list[Tensor] | None]:
    """The inputs' leaves, checked: ``(treedef, grads, each state field's leaves or None, params or None)``.

    ``fields`` are the state's per-leaf trees (``()`` where an option leaves one out).
    """
    checks.check_state(state, cls, where, grads=grads, params=params)
    trees = [getattr(state, f) for f in fields]
    first = next((t for t in trees if not _is_empty(t)), None)
    if first is not None:
        ref, treedef = checks.flatten(first)
        gs, _ = checks.check_grads(grads, treedef, where)
    else:
        gs, treedef = checks.check_grads(grads, None, where)
        ref = None
    lists = [None if _is_empty(t) else checks.leaves_like(t, treedef, f"state.{f}", "grads") for t, f in zip(trees, fields)]
    ps = checks.params_leaves(params, treedef, where, "weight_decay != 0") if need_params else None
    if ps is not None:
        checks.check_dtypes(gs, ps, treedef, where, "params")
    elif ref is not None:
        checks.check_dtypes(gs, ref, treedef, where, "the optimizer state")
    return treedef, gs, lists, ps


def _is_empty(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 0


def zeros(leaves: Sequence[Tensor], treedef: Any, value: float = 0.0) -> Any:
    """A tree of tensors like ``leaves``, filled with ``value``."""
    return optree.tree_unflatten(treedef, [torch.full_like(p, value, memory_format=torch.preserve_format) for p in leaves])


def check_args(where: str, lr: Any, betas: Any = None, **nonneg: Any) -> None:
    """Raise on an optimizer's bad arguments: ``lr``, then each of ``nonneg`` (>= 0) in order, then ``betas``.

    Example:
        >>> check_args("nadam", lr, betas, eps=eps, weight_decay=weight_decay)
    """
    checks.check_lr(lr, where)
    for name, v in nonneg.items():
        checks.check_nonneg(v, name, where)
    if betas is not None:
        check_betas(betas, where)


def check_betas(betas: Any, where: str) -> None:
    """Raise unless ``betas`` is a pair of floats in [0, 1), as torch.optim checks them."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: invalid betas={betas!r}; expected a pair (beta1, beta2)")
    for i, b in enumerate(betas):
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0.0 <= b < 1.0:
            raise ValueError(f"{where}: invalid betas[{i}]={b!r}; expected a float in [0, 1)")


def fused_update(name: str, cfg: Any, step: Callable[..., Any]) -> FusedUpdate:
    """The ``update`` of an optimizer whose ``step(cfg, grads, state, params, apply, why=None)`` is both ways.

    ``step`` returns ``(updates, state)`` with ``apply=False`` and ``(new_params, state)``, or None
    where the inputs take no fused step, with ``apply=True``.

    Example:
        >>> update = fused_update("nadam", cfg, _step)
    """

    def pure(cfg: Any, grads: Any, state: Any, params: Any = None) -> Any:
        return step(cfg, grads, state, params, False)

    def applied(cfg: Any, grads: Any, state: Any, params: Any, request: Any) -> Any:
        out = step(cfg, grads, state, params, True, request.why)
        if out is None:
            return None
        note(request.why, f"{name}: torch's single-tensor step, written straight into new flat buffers")
        return Applied(out[0]), out[1]

    return FusedUpdate(cfg, pure, applied)
