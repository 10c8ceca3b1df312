"""A guard that fails any collective fddp issues outside a call scope.

Installed in every worker of ``tests/dist.py`` (so every multi-process test of the suite runs under
it): each ``torch.distributed`` collective is wrapped, and a collective whose nearest caller
outside torch is fddp's own code must run while some fddp call is in progress in this process (a
public function decorated with ``fddp._dist.entry``) or while a backward owes that call's
collectives. Otherwise it raises ``UnscopedCollective`` at once, naming the caller: a public
function that communicates without the scope would leave its peers waiting when it fails.
Collectives the tests issue themselves (torch DDP, FSDP2 and their own references) are not fddp's
and pass.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch.distributed as dist

_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "isend",
    "irecv",
    "send",
    "recv",
)
_TORCH = os.path.dirname(os.path.dirname(os.path.abspath(dist.__file__)))  # .../site-packages/torch


class UnscopedCollective(AssertionError):
    """fddp issued a collective outside any call scope."""


def _fddp_root() -> str:
    import fddp

    return os.path.dirname(os.path.abspath(fddp.__file__))


def _caller() -> str | None:
    """The file and line of the nearest caller outside torch and this module, if it is fddp's."""
    root = _fddp_root()
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_TORCH) and path != os.path.abspath(__file__):
            return f"{os.path.relpath(path, os.path.dirname(root))}:{frame.f_lineno}" if path.startswith(root) else None
        frame = frame.f_back
    return None


def scoped() -> bool:
    """Whether an fddp call is in progress in this process, or a backward owes one's collectives."""
    from fddp._dist import _groups

    return any(st.busy() for _, st in _groups.states())


def _guard(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        where = _caller()
        if where is not None and not scoped():
            raise UnscopedCollective(
                f"{where} issued torch.distributed.{name} outside any fddp call scope: decorate the public function "
                "that reaches it with fddp._dist.entry, so a failure on one rank reaches its peers"
            )
        return fn(*args, **kwargs)

    guarded.__fddp_guarded__ = fn  # type: ignore[attr-defined]
    return guarded


def install() -> None:
    """Wrap every collective of ``torch.distributed`` with the guard (idempotent)."""
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None and not hasattr(fn, "__fddp_guarded__"):
            setattr(dist, name, _guard(name, fn))
