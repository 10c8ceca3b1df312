"""RMSprop, matching ``torch.optim.RMSprop`` (to the bit in ``apply_gradients``)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import optree
import torch
from torch import Tensor

from . import _checks as checks
from . import _elementwise as ew
from ._base import GradientTransformationExtraArgs
from ._checks import Params, ScalarOrSchedule, Updates
from ._names import torch_names

__all__ = ["RMSpropState", "rmsprop"]


class RMSpropState(NamedTuple):
    """State of :func:`rmsprop`.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        square_avg: running average of the squared gradient, same tree as params.
        grad_avg: running average of the gradient when ``centered``, else ``()``.
        momentum_buffer: when ``momentum > 0``, else ``()``.
    """

    count: Tensor
    square_avg: Updates
    grad_avg: Updates | tuple
    momentum_buffer: Updates | tuple


@dataclasses.dataclass(frozen=True)
class _RMSprop:
    lr: ScalarOrSchedule
    alpha: float
    eps: float
    weight_decay: float
    momentum: float
    centered: bool


@torch_names
def rmsprop(
    lr: ScalarOrSchedule = 1e-2,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float = 0.0,
    centered: bool = False,
) -> GradientTransformationExtraArgs:
    """RMSprop, as ``torch.optim.RMSprop`` (its keyword names and defaults).

    ``apply_gradients`` equals ``torch.optim.RMSprop(foreach=False)`` to the bit (torch's
    single-tensor arithmetic, op for op, a schedule's lr read on the host as torch's Python float)
    where the count is on the CPU. On a GPU it reads nothing on the host: a schedule's lr stays a
    tensor on the device, and with momentum the step then rounds once more than torch's.
    ``update`` + ``apply_updates`` agrees with it to float rounding (the update is a separate
    tensor, added afterwards).

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        alpha: smoothing constant of the squared gradient's running average.
        eps: term added to the denominator (outside the square root, as torch).
        weight_decay: L2 penalty (``grad + weight_decay * param``); needs ``params`` in ``update``.
        momentum: momentum factor (a buffer of ``grad / avg``).
        centered: divide by the gradient's estimated variance instead of its second moment.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is an :class:`RMSpropState`.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> opt = fddp.optim.rmsprop(lr=1e-2, momentum=0.9)
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, {"w": torch.full((3,), 0.5)}, state, params)
    """
    ew.check_args("rmsprop", lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum)
    cfg = _RMSprop(lr, float(alpha), float(eps), float(weight_decay), float(momentum), bool(centered))
    return GradientTransformationExtraArgs(functools.partial(_init, cfg), ew.fused_update("rmsprop", cfg, _step))


def _init(cfg: _RMSprop, params: Params) -> RMSpropState:
    leaves, treedef = checks.init_leaves(params, "rmsprop")
    return RMSpropState(
        checks.zeros_count(leaves),
        ew.zeros(leaves, treedef),
        ew.zeros(leaves, treedef) if cfg.centered else (),
        ew.zeros(leaves, treedef) if cfg.momentum > 0 else (),
    )


_FIELDS = ("square_avg", "grad_avg", "momentum_buffer")


def _step(cfg: _RMSprop, grads, state: RMSpropState, params, apply: bool, why=None):
    need = bool(cfg.weight_decay) or apply
    treedef, gs, (sq, ga, buf), ps = ew.leaves("rmsprop.update", RMSpropState, grads, state, params, _FIELDS, need)
    if (ga is not None) != cfg.centered or (buf is not None) != (cfg.momentum > 0):
        raise TypeError("rmsprop.update: the state was made by an rmsprop with other centered/momentum options")
    lr = checks.lr_at(cfg.lr, state.count)
    # A schedule's lr read on the host where the count is on the CPU (free there), else kept on its device.
    scalars = ew.Scalars(lr=-ew.host(lr) if apply and ew.on_host(state.count) else -lr)
    unit = functools.partial(_unit, cfg=cfg, scalars=scalars, apply=apply)
    out = ew.run(unit, gs, [sq, ga, buf], ps, treedef, 4, labels=_FIELDS, apply=apply, why=why)
    if out is None:
        return None
    new_sq, new_ga, new_buf, u = out
    tree = functools.partial(optree.tree_unflatten, treedef)
    new_state = RMSpropState(
        state.count + 1, tree(new_sq), tree(new_ga) if cfg.centered else (), tree(new_buf) if cfg.momentum > 0 else ()
    )
    return tree(u), new_state


def _unit(g, sq, ga, buf, p, new, *, cfg: _RMSprop, scalars: ew.Scalars, apply: bool):
    """torch's ``_single_tensor_rmsprop`` on one tensor, out of place: the new state, and the new
    parameter (``apply``) or the update."""
    neg_lr = scalars.get(g.dtype)["lr"]
    if cfg.weight_decay:
        g = torch.add(g, p, alpha=cfg.weight_decay, out=new())
    o = new()
    sq = torch.addcmul(torch.mul(sq, cfg.alpha, out=o), g, g, value=1 - cfg.alpha, out=o)
    a = new()  # a pooled flat buffer, or None leaf by leaf (never a result: out= of a batched tensor fails under vmap)
    if cfg.centered:
        ga = torch.lerp(ga, g, 1 - cfg.alpha, out=new())
        avg = torch.sqrt(torch.addcmul(sq, ga, ga, value=-1, out=a), out=a)
    else:
        avg = torch.sqrt(sq, out=a)
    avg = torch.add(avg, cfg.eps, out=a)
    if cfg.momentum > 0:
        o = new()
        buf = torch.addcdiv(torch.mul(buf, cfg.momentum, out=o), g, avg, out=o)
        # A tensor lr (a schedule's, on the device) multiplies, then adds: one rounding more than
        # torch's add(alpha=-lr), a fused multiply-add on the CPU.
        out = ew.axpy(p, buf, neg_lr, new()) if apply else ew.scale(buf, neg_lr, new())
    elif apply and not isinstance(neg_lr, Tensor):
        out = torch.addcdiv(p, g, avg, value=neg_lr, out=new())
    elif apply:  # value * g first, then / avg: addcdiv(value=)'s order on the CPU
        out = torch.addcdiv(p, torch.mul(g, neg_lr, out=new()), avg, out=new())
    else:
        out = ew.scale(torch.div(g, avg, out=a), neg_lr, new())
    return sq, ga if cfg.centered else None, buf if cfg.momentum > 0 else None, out
