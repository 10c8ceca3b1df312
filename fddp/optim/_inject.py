"""Hyperparameters held in the optimizer's state (optax's ``inject_hyperparams``).

A torch user changes ``optimizer.param_groups[0]["lr"]`` mid-run (a scheduler, a plateau rule, a
warm restart) and reads it back for logging. Here the optimizer is a pure value, so the numbers
that may change live in its state: ``inject_hyperparams(adamw)(lr=1e-3, weight_decay=0.1)``
builds ``adamw`` anew at every step from the values in the state, which :func:`set_hyperparams`
replaces and anyone can read (``state.hyperparams["lr"]``). The values are CPU scalar tensors,
read as Python numbers at each step: torch.optim's own arithmetic (its hyperparameters are
Python floats), no device synchronisation, and a state ``fddp.checkpoint`` saves like any other.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from ._base import GradientTransformation, GradientTransformationExtraArgs
from ._checks import OptState, Params, Updates, check_state, describe

__all__ = ["InjectHyperparamsState", "inject_hyperparams", "set_hyperparams"]

# Callables under these names are the optimizer's own arguments (which leaves a group holds), never schedules.
_NEVER_SCHEDULES = ("mask", "labels")


class InjectHyperparamsState(NamedTuple):
    """State of an optimizer made by :func:`inject_hyperparams`.

    Attributes:
        count: the number of updates so far (an int64 CPU scalar tensor).
        hyperparams: each injected hyperparameter's value at the latest update (before the first,
            the value the first will use), by name: a float64 CPU scalar tensor, or a tuple of them
            (``betas``), whatever number it was given as (as optax stores them). Read it for logging:
            ``float(state.hyperparams["lr"])``; change it with :func:`set_hyperparams`.
        inner_state: the optimizer's own state.
    """

    count: Tensor
    hyperparams: dict
    inner_state: Any


def inject_hyperparams(
    make: Callable[..., GradientTransformation], /, *, static_args: Sequence[str] = ()
) -> Callable[..., GradientTransformationExtraArgs]:
    """Turn an optimizer factory into one whose numeric hyperparameters live in the state.

    ``inject_hyperparams(fddp.optim.adamw)(lr=1e-3, weight_decay=0.1)`` is ``adamw(lr=1e-3,
    weight_decay=0.1)`` whose ``lr`` and ``weight_decay`` are in its state, where
    :func:`set_hyperparams` changes them between steps and ``state.hyperparams`` shows them.
    Every keyword argument that is a number or a tuple of numbers (``betas``) is injected; one
    that is a function is a schedule of the step count (``fddp.optim.cosine_decay(...)``,
    evaluated at every step, its value recorded in the state); anything else (booleans such as
    ``amsgrad``, ``mask=``, the names in ``static_args``) is passed to ``make`` unchanged.

    Values are stored as float64 whatever they were given as: ``lr=1`` followed by
    ``set_hyperparams(state, lr=0.5)`` holds 0.5. An argument first given as an ``int`` reaches
    ``make`` as an ``int`` while its value is whole (a factory's ``every=4`` stays a count), as a
    ``float`` otherwise.

    Each step calls ``make`` with the state's values as Python numbers and runs that optimizer's
    ``update`` with the extra arguments it was given: the results are those of the optimizer
    built with those numbers, fused step included (``apply_gradients``). A changed value is a new
    constant to ``torch.compile`` (a retrace); a schedule given to the optimizer itself
    (``adamw(lr=schedule)``) is not. Not for ``vmap`` with a value per member.

    Args:
        make: a function returning a ``GradientTransformation``: ``fddp.optim.adamw``, or your own
            (``lambda lr: fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(lr))``).
        static_args: names of arguments to pass unchanged even if they are numbers or functions.

    Returns:
        A function taking ``make``'s arguments by keyword and returning a
        ``GradientTransformationExtraArgs`` whose state is an :class:`InjectHyperparamsState`.

    Example:
        >>> opt = fddp.optim.inject_hyperparams(fddp.optim.adamw)(lr=1e-3, weight_decay=0.1)
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, grads, state, params)
        >>> state = fddp.optim.set_hyperparams(state, lr=float(state.hyperparams["lr"]) * 0.1)  # StepLR
    """
    if not callable(make):
        raise TypeError(f"inject_hyperparams: expected an optimizer factory such as fddp.optim.adamw, got {describe(make)}")
    static_names = frozenset(static_args)
    name = getattr(make, "__name__", "the optimizer")

    def build(*args: Any, **kwargs: Any) -> GradientTransformationExtraArgs:
        if args:
            raise TypeError(
                f"inject_hyperparams({name}): pass the hyperparameters by name (lr=..., weight_decay=...), got {len(args)} positional"
            )
        static, numbers, schedules = {}, {}, {}
        for key, value in kwargs.items():
            if key in static_names or key in _NEVER_SCHEDULES:
                static[key] = value
            elif callable(value):
                schedules[key] = value
            elif _numeric(value):
                numbers[key] = value
            else:
                static[key] = value
        names = set(numbers) | set(schedules)
        # Which arguments arrived as ints: make gets them back as ints while their value is whole.
        ints = {k: _is_int(v) for k, v in numbers.items()}
        where = f"inject_hyperparams({name}).update"

        def values_at(count: Tensor, stored: dict) -> dict:
            values = dict(stored)
            for key, schedule in schedules.items():
                values[key] = _as_state(schedule(count), key)
            return values

        last: list = [None, None]  # the latest values and the optimizer made from them: most steps change nothing

        def inner(values: dict) -> GradientTransformation:
            numbers = {k: _as_number(v, ints.get(k, False)) for k, v in values.items()}
            if numbers == last[0]:
                return last[1]
            t = make(**static, **numbers)
            if not isinstance(t, GradientTransformation):
                raise TypeError(f"inject_hyperparams: {name}(...) must return a GradientTransformation, got {describe(t)}")
            last[0], last[1] = numbers, t
            return t

        first = values_at(torch.zeros((), dtype=torch.int64), {k: _as_state(v, k) for k, v in numbers.items()})
        inner(first)  # invalid values fail here, at construction, as the optimizer's own would

        def init(params: Params) -> InjectHyperparamsState:
            count = torch.zeros((), dtype=torch.int64)
            values = values_at(count, {k: _as_state(v, k) for k, v in numbers.items()})
            return InjectHyperparamsState(count, values, inner(values).init(params))

        def update(
            grads: Updates, state: InjectHyperparamsState, params: Params | None = None, **extra_args: Any
        ) -> tuple[Any, InjectHyperparamsState]:
            check_state(state, InjectHyperparamsState, where, grads=grads, params=params)
            if not isinstance(state.hyperparams, dict) or state.hyperparams.keys() != names:
                got = sorted(state.hyperparams) if isinstance(state.hyperparams, dict) else describe(state.hyperparams)
                raise TypeError(f"{where}: the state holds the hyperparameters {got}, this optimizer injects {sorted(names)}")
            values = values_at(state.count, state.hyperparams)
            t = inner(values)
            if isinstance(t, GradientTransformationExtraArgs):
                out, inner_state = t.update(grads, state.inner_state, params, **extra_args)
            else:
                out, inner_state = t.update(grads, state.inner_state, params)
            return out, InjectHyperparamsState(state.count + 1, values, inner_state)

        return GradientTransformationExtraArgs(init, update)

    return build


def set_hyperparams(state: OptState, /, **values: Any) -> OptState:
    """Return ``state`` with new values for injected hyperparameters (see :func:`inject_hyperparams`).

    Every :class:`InjectHyperparamsState` in ``state`` that holds a name gets the value (a
    :func:`fddp.optim.multi_transform` of injected optimizers: every group, as a torch scheduler
    sets every param group). The next update uses it. A hyperparameter given as a schedule is
    recomputed from the step count at every update, so setting it has no lasting effect.

    Args:
        state: an optimizer state holding injected hyperparameters.
        **values: the new values: numbers (or tuples of numbers, for ``betas``) or scalar tensors.

    Returns:
        The new state; ``state`` is not modified.

    Raises:
        KeyError: a name that no injected optimizer in ``state`` holds.

    Example:
        >>> state = fddp.optim.set_hyperparams(state, lr=1e-4)
        >>> float(state.hyperparams["lr"])
        0.0001
    """
    found: set[str] = set()
    held: set[str] = set()

    def walk(node: Any) -> Any:
        if isinstance(node, InjectHyperparamsState):
            new = dict(node.hyperparams)
            held.update(new)
            for key, value in values.items():
                if key in new:
                    new[key] = _like(value, new[key], key)
                    found.add(key)
            return node._replace(hyperparams=new, inner_state=walk(node.inner_state))
        if isinstance(node, Tensor):
            return node
        if isinstance(node, tuple) and hasattr(type(node), "_fields"):
            return type(node)(*map(walk, node))
        if type(node) in (tuple, list):
            return type(node)(map(walk, node))
        if isinstance(node, dict):
            return type(node)((k, walk(v)) for k, v in node.items())
        return node

    new_state = walk(state)
    missing = [k for k in values if k not in found]
    if missing:
        if not held:
            raise KeyError(
                f"set_hyperparams: the state holds no injected hyperparameters (got {describe(state)}); build the "
                "optimizer with fddp.optim.inject_hyperparams(fddp.optim.adamw)(lr=..., ...) to change them mid-run"
            )
        raise KeyError(f"set_hyperparams: no injected hyperparameter {missing[0]!r}; the state holds {', '.join(sorted(held))}")
    return new_state


def _numeric(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return len(value) > 0 and all(map(_numeric, value))
    if isinstance(value, Tensor):
        return value.dim() == 0 and not value.dtype.is_complex and value.dtype != torch.bool
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> Any:
    """Whether ``value`` was given as an integer (a tuple of answers for a tuple)."""
    if isinstance(value, (tuple, list)):
        return tuple(map(_is_int, value))
    if isinstance(value, Tensor):
        return not value.is_floating_point()
    return isinstance(value, int)


def _as_state(value: Any, key: str) -> Any:
    """A hyperparameter's value as the state holds it: a float64 CPU scalar tensor, or a tuple of them.

    Always float64: a state that kept an integer's int64 would truncate every later value set into
    it (``lr=1`` then ``set_hyperparams(lr=0.5)`` would hold 0).
    """
    if isinstance(value, (tuple, list)):
        return tuple(_as_state(v, key) for v in value)
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(f"inject_hyperparams: {key} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return value.detach().to("cpu", torch.float64)
    if not _numeric(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"inject_hyperparams: {key} must be a finite number, got {value!r}")
    return torch.tensor(value, dtype=torch.float64)


def _as_number(value: Any, was_int: Any = False) -> Any:
    """The Python number ``make`` gets: an int where the argument arrived as one and is whole, else a float."""
    if isinstance(value, tuple):
        flags = was_int if isinstance(was_int, tuple) and len(was_int) == len(value) else (False,) * len(value)
        return tuple(map(_as_number, value, flags))
    if not value.is_floating_point():  # a state saved before values were stored as floats
        return int(value)
    x = float(value)
    return int(x) if was_int and x.is_integer() else x


def _like(value: Any, old: Any, key: str) -> Any:
    """``value`` in the form of the value it replaces: a float64 scalar, or a tuple of them."""
    if isinstance(old, tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(old):
            raise ValueError(f"set_hyperparams: {key} holds {len(old)} values, got {value!r}")
        return tuple(_like(v, o, key) for v, o in zip(value, old))
    return _as_state(value, key)
