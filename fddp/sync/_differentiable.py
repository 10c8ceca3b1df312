"""ddp_step under autograd and torch.func transforms (work in progress)."""

from __future__ import annotations

from typing import Any

import optree
import torch

_functorch = torch._C._functorch


def active_transform() -> str | None:
    interp = _functorch.peek_interpreter_stack()
    if interp is None:
        return None
    return str(interp.key())


def refuse_under_transforms(what: str, hint: str = "") -> None:
    t = active_transform()
    if t is not None:
        raise RuntimeError(f"fddp.{what} cannot run inside {t}{': ' + hint if hint else ''}")


def needed(params: Any, grads: Any) -> bool:
    if torch.compiler.is_compiling():
        return False
    if _functorch.peek_interpreter_stack() is not None:
        return True
    if not torch.is_grad_enabled():
        return False
    return any(isinstance(g, torch.Tensor) and g.requires_grad for g in optree.tree_leaves(grads))


def ddp_step(params, grads, options, state):
    raise NotImplementedError
