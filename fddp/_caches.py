"""The registry of everything fddp remembers between calls, so that one call forgets it all.

Every cache in fddp joins here when its module is imported (equinox's ``_caches.py`` is the
model): memoised functions through :func:`cached`, other stores (the host buffer pool, the
per-group state) through :func:`register`. :func:`clear_all` clears each of them, and
:func:`registered` names them, so a test can check that nothing fddp keeps escapes
``fddp.clear_caches()``. This module imports nothing of fddp's: every other module may join.
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

__all__ = ["cached", "register", "clear_all", "registered"]

F = TypeVar("F", bound=Callable)

_clearers: dict[str, Callable[[], None]] = {}


def register(name: str, clear: Callable[[], None]) -> None:
    """Join the registry: ``clear()`` is called by :func:`clear_all`.

    Example:
        >>> _store: dict = {}
        >>> register("fddp.example._store", _store.clear)
    """
    if name in _clearers:
        raise ValueError(f"fddp: a cache named {name!r} is already registered")
    _clearers[name] = clear


def cached(maxsize: int, name: str | None = None) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered under ``name`` (default: the function's
    ``module.qualname``).

    While ``torch.compile`` traces, the plain function runs instead: dynamo does not trace
    ``lru_cache`` wrappers (it warns and falls back), and what is traced is computed once anyway.

    Example:
        >>> @cached(maxsize=64)
        ... def square(n: int) -> int:
        ...     return n * n
    """

    def wrap(fn: F) -> F:
        memo = functools.lru_cache(maxsize=maxsize)(fn)
        register(name or f"{fn.__module__}.{fn.__qualname__}", memo.cache_clear)

        @functools.wraps(fn)
        def call(*args):  # type: ignore[no-untyped-def]
            if torch.compiler.is_compiling():
                return fn(*args)
            return memo(*args)

        call.cache_clear = memo.cache_clear  # type: ignore[attr-defined]
        call.cache_info = memo.cache_info  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap


def clear_all() -> None:
    """Clear every registered cache."""
    for clear in _clearers.values():
        clear()


def registered() -> tuple[str, ...]:
    """The names of the registered caches (``module.qualname``), in registration order."""
    return tuple(_clearers)
