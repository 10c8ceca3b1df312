"""Names: the all-in-one optimizers take torch.optim's keywords, and a missing name suggests the nearest one.

fddp.optim has two conventions, each where its users come from: the building blocks (``scale_by_adam``,
``add_decayed_weights``, ...) take optax's names, the all-in-one optimizers (``sgd``, ``adamw``,
...) take torch.optim's (``lr``, ``betas``). An optax keyword given to an all-in-one optimizer is a
``TypeError`` that names the torch keyword to write, also through ``inject_hyperparams``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from typing import Callable, Iterable, TypeVar

__all__ = ["torch_names", "missing_attribute"]

F = TypeVar("F", bound=Callable)

# optax's keyword -> (the torch.optim keyword that holds it, how to write it)
_OPTAX_TO_TORCH = {
    "learning_rate": ("lr", "lr=..."),
    "b1": ("betas", "betas=(b1, b2)"),
    "b2": ("betas", "betas=(b1, b2)"),
    "decay": ("alpha", "alpha=... (torch.optim.RMSprop's name for the squares' decay)"),
    "initial_scale": ("initial_accumulator_value", "initial_accumulator_value=..."),
}

# optax names whose fddp counterpart has another name
_OPTAX_NAMES = {
    "MultiSteps": "accumulate",
    "apply_every": "accumulate",
}


def torch_names(fn: F) -> F:
    """Make ``fn`` (an all-in-one optimizer) refuse an unknown keyword with a message naming the one to write.

    An optax keyword (``learning_rate=``, ``b1=``) names the torch.optim keyword that takes it; any
    other unknown keyword names the nearest of ``fn``'s own.

    Example:
        >>> @torch_names
        ... def adamw(lr=1e-3, betas=(0.9, 0.999)): ...
        >>> adamw(learning_rate=1e-3)
        Traceback (most recent call last):
        TypeError: adamw() got optax's keyword 'learning_rate': ... write lr=... ...
    """
    params = inspect.signature(fn).parameters
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    allowed = frozenset(name for name, p in params.items() if p.kind in kinds)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        if not allowed.issuperset(kwargs):
            raise TypeError(_unexpected(fn.__name__, next(k for k in kwargs if k not in allowed), allowed))
        return fn(*args, **kwargs)

    return checked  # type: ignore[return-value]


def _unexpected(name: str, key: str, allowed: frozenset) -> str:
    own = ", ".join(sorted(allowed))
    if key in _OPTAX_TO_TORCH and _OPTAX_TO_TORCH[key][0] in allowed:
        fix = _OPTAX_TO_TORCH[key][1]
        return (
            f"{name}() got optax's keyword {key!r}: fddp.optim's all-in-one optimizers take torch.optim's names; "
            f"write {fix} (its keywords: {own}). optax's names are those of the building blocks: "
            "fddp.optim.chain(fddp.optim.scale_by_adam(b1=..., b2=...), fddp.optim.add_decayed_weights(weight_decay, mask=...), "
            "fddp.optim.scale_by_learning_rate(learning_rate))"
        )
    close = difflib.get_close_matches(key, sorted(allowed), n=2)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"{name}() got an unexpected keyword argument {key!r}{hint} (its keywords: {own})"


def missing_attribute(module: str, name: str, names: Iterable[str]) -> str:
    """The message of the ``AttributeError`` for ``module.name``, suggesting the nearest existing names.

    Example:
        >>> missing_attribute("fddp.optim", "adamx", ["adam", "adamw", "sgd"])
        "module 'fddp.optim' has no attribute 'adamx'; did you mean 'adam' or 'adamw'?"
    """
    names = sorted(set(names))
    close = [_OPTAX_NAMES[name]] if name in _OPTAX_NAMES else difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    if not close:
        lowered = {n.lower(): n for n in names}
        close = [lowered[n] for n in difflib.get_close_matches(name.lower(), list(lowered), n=3, cutoff=0.5)]
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else f"; its names: {', '.join(names)}"
    return f"module {module!r} has no attribute {name!r}{hint}"
