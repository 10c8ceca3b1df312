"""Adagrad, matching ``torch.optim.Adagrad`` (to the bit in ``apply_gradients``)."""

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

__all__ = ["AdagradState", "adagrad"]


class AdagradState(NamedTuple):
    """State of :func:`adagrad`.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        sum: the sum of the squared gradients (from ``initial_accumulator_value``), same tree as params.
    """

    count: Tensor
    sum: Updates


@dataclasses.dataclass(frozen=True)
class _Adagrad:
    lr: ScalarOrSchedule
    lr_decay: float
    weight_decay: float
    initial_accumulator_value: float
    eps: float


@torch_names
def adagrad(
    lr: ScalarOrSchedule = 1e-2,
    lr_decay: float = 0.0,
    weight_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    eps: float = 1e-10,
) -> GradientTransformationExtraArgs:
    """Adagrad, as ``torch.optim.Adagrad`` (its keyword names and defaults).

    ``apply_gradients`` equals ``torch.optim.Adagrad(foreach=False)`` (torch's default on the
    CPU) to the bit, reading the count on the host as torch does, where it is on the CPU; on a GPU
    it reads nothing on the host (its step size a float64 tensor on the device, the same
    arithmetic); ``update`` + ``apply_updates`` agrees with it to float rounding. (torch's
    ``foreach=True`` multiplies the gradient by the step size before dividing, one rounding away.)

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        lr_decay: the step size at step ``t`` (from 1) is ``lr / (1 + (t - 1) * lr_decay)``.
        weight_decay: L2 penalty (``grad + weight_decay * param``); needs ``params`` in ``update``.
        initial_accumulator_value: the sum's starting value.
        eps: term added to the denominator.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is an :class:`AdagradState`.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> opt = fddp.optim.adagrad(lr=0.1)
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, {"w": torch.full((3,), 0.5)}, state, params)
    """
    ew.check_args("adagrad", lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, initial_accumulator_value=initial_accumulator_value)
    cfg = _Adagrad(lr, float(lr_decay), float(weight_decay), float(initial_accumulator_value), float(eps))
    return GradientTransformationExtraArgs(functools.partial(_init, cfg), ew.fused_update("adagrad", cfg, _step))


def _init(cfg: _Adagrad, params: Params) -> AdagradState:
    leaves, treedef = checks.init_leaves(params, "adagrad")
    return AdagradState(checks.zeros_count(leaves), ew.zeros(leaves, treedef, cfg.initial_accumulator_value))


def _step(cfg: _Adagrad, grads, state: AdagradState, params, apply: bool, why=None):
    treedef, gs, (sums,), ps = ew.leaves("adagrad.update", AdagradState, grads, state, params, ("sum",), bool(cfg.weight_decay) or apply)
    count = state.count
    lr = checks.lr_at(cfg.lr, count)
    # torch: clr = lr / (1 + (step - 1) * lr_decay), in Python floats from the step read on the host
    # (free on the CPU); elsewhere float64 tensors on the count's device (no host read: see ew.on_host).
    if apply and ew.on_host(count):
        clr = ew.host(lr) / (1 + float(count.item()) * cfg.lr_decay)
    else:
        clr = ew.divide(lr, 1 + count.to(torch.float64) * cfg.lr_decay) if cfg.lr_decay else lr
    unit = functools.partial(_unit, cfg=cfg, scalars=ew.Scalars(clr=-clr), apply=apply)
    out = ew.run(unit, gs, [sums], ps, treedef, 2, labels=("sum",), apply=apply, why=why)
    if out is None:
        return None
    new_sums, u = out
    return optree.tree_unflatten(treedef, u), AdagradState(count + 1, optree.tree_unflatten(treedef, new_sums))


def _unit(g, s, p, new, *, cfg: _Adagrad, scalars: ew.Scalars, apply: bool):
    """torch's ``_single_tensor_adagrad`` (dense) on one tensor, out of place."""
    neg_clr = scalars.get(g.dtype)["clr"]
    if cfg.weight_decay:
        g = torch.add(g, p, alpha=cfg.weight_decay, out=new())
    s = torch.addcmul(s, g, g, value=1, out=new())
    o = new()  # a pooled flat buffer, or None leaf by leaf
    std = torch.add(torch.sqrt(s, out=o), cfg.eps, out=o)
    if apply and not isinstance(neg_clr, Tensor):
        return s, torch.addcdiv(p, g, std, value=neg_clr, out=new())
    if apply:  # value * g first, then / std: addcdiv(value=)'s order on the CPU
        return s, torch.addcdiv(p, torch.mul(g, neg_clr, out=new()), std, out=new())
    d = torch.div(g, std, out=o)
    return s, ew.scale(d, neg_clr, new())
