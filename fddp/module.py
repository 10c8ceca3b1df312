"""Turn an ``nn.Module`` into a pure function of a parameter pytree (and, optionally, of its buffers)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["functionalize", "functionalize_with_buffers"]

Params = dict[str, torch.Tensor]


def _check_module(model: Any, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fddp.{what}: expected a torch.nn.Module, got {type(model).__name__}")


def functionalize(model: nn.Module, /) -> tuple[Callable[..., Any], Params]:
    """Split a module into a pure ``apply_fn`` and its parameters.

    ``apply_fn(params, *args, **kwargs)`` returns exactly what ``model(*args, **kwargs)`` returns,
    with ``params`` in place of the module's own parameters (``torch.func.functional_call``).
    Buffers are read from the module as they are at call time; a layer that updates buffers in
    training mode (BatchNorm's running statistics) updates the module's buffers in place. For a
    step that stays pure, use :func:`functionalize_with_buffers`.

    Args:
        model: the module. Its parameters are not copied: ``params`` holds detached aliases, and fddp
            never writes into them.

    Returns:
        ``(apply_fn, params)``, where ``params`` maps ``named_parameters()`` names to tensors.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> apply_fn, params = fddp.functionalize(model)
        >>> sorted(params)
        ['bias', 'weight']
        >>> x = torch.randn(4, 3)
        >>> torch.equal(apply_fn(params, x), model(x))
        True
    """
    _check_module(model, "functionalize")
    params = {name: p.detach() for name, p in model.named_parameters()}
    slots = _parameter_slots(model)
    names = set(params)

    def apply_fn(params: Params, /, *args: Any, **kwargs: Any) -> Any:
        # functional_call's general machinery (walking the modules, accessors, strictness checks)
        # costs about 10 us per parameter per call, 1 ms a step on a 100-tensor transformer. With
        # exactly the names functionalize returned, swapping the tensors into the slots computed
        # once is the same thing; anything else, and tracing, goes through functional_call.
        if torch.compiler.is_compiling() or not isinstance(params, dict) or params.keys() != names:
            return functional_call(model, params, args, kwargs)
        with _swapped(slots, params):
            return model(*args, **kwargs)

    return apply_fn, params


def _parameter_slots(model: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(module, attribute, name)`` for every registered parameter, a tied one once per module.

    ``name`` is the parameter's first name (``named_parameters()`` keeps only that one), so a
    parameter tied into several modules receives the same tensor in each, as functional_call's
    ``tie_weights`` does.
    """
    first: dict[int, str] = {}
    slots = []
    for name, p in model.named_parameters(remove_duplicate=False):
        prefix, _, attr = name.rpartition(".")
        slots.append((model.get_submodule(prefix), attr, first.setdefault(id(p), name)))
    return slots


class _swapped:
    """Put ``params`` into the module's parameter slots for the duration of a call, then restore."""

    def __init__(self, slots: list[tuple[nn.Module, str, str]], params: Params) -> None:
        self.slots, self.params = slots, params
        self.saved: list = []

    def __enter__(self) -> None:
        for module, attr, name in self.slots:
            self.saved.append(module._parameters[attr])
            module._parameters[attr] = self.params[name]

    def __exit__(self, *exc: Any) -> None:
        for (module, attr, _), old in zip(self.slots, self.saved):
            module._parameters[attr] = old


def functionalize_with_buffers(model: nn.Module, /) -> tuple[Callable[..., Any], Params, Params]:
    """Split a module into a pure ``apply_fn``, its parameters and its buffers.

    ``apply_fn(params, buffers, *args, **kwargs)`` returns ``(output, new_buffers)``: the module
    runs on copies of ``buffers``, so the ``buffers`` passed in are never modified, and the updated
    statistics come back as a new dict. Pass ``new_buffers`` to the next step (and, across ranks,
    through :func:`fddp.sync_buffers` when the rank-local statistics should agree).

    Args:
        model: the module; its own parameters and buffers are left untouched.

    Returns:
        ``(apply_fn, params, buffers)``.

    Example:
        >>> model = torch.nn.BatchNorm1d(3)
        >>> apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
        >>> out, new_buffers = apply_fn(params, buffers, torch.randn(8, 3))
        >>> int(new_buffers["num_batches_tracked"]), int(buffers["num_batches_tracked"])
        (1, 0)
    """
    _check_module(model, "functionalize_with_buffers")
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def apply_fn(params: Params, buffers: Params, /, *args: Any, **kwargs: Any) -> tuple[Any, Params]:
        # Layers update buffers in place (running_mean.mul_(...)); give them copies to update.
        new_buffers = {name: b.clone() for name, b in buffers.items()}
        out = functional_call(model, (params, new_buffers), args, kwargs)
        return out, new_buffers

    return apply_fn, params, buffers
