"""Adafactor: ``adafactor`` as ``torch.optim.Adafactor`` (to the bit in ``apply_gradients``), and
optax's ``scale_by_factored_rms`` (the factored second moment of ``optax.adafactor``).

Both are leaf by leaf: each step reads norms and means of whole leaves.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import numpy as np
import optree
import torch
from torch import Tensor

from fddp._layout import SplitTree, has_split

from . import _checks as checks
from . import _elementwise as ew
from ._base import Applied, Apply, FusedUpdate, GradientTransformationExtraArgs
from ._checks import Params, ScalarOrSchedule, Updates
from ._flat import multi_tensor_ok
from ._names import torch_names

__all__ = ["AdafactorState", "adafactor", "FactoredState", "scale_by_factored_rms"]


class AdafactorState(NamedTuple):
    """State of :func:`adafactor`.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        row_var: per leaf of 2 or more dimensions, the row factor (the leaf's shape with a last
            dimension of 1); an empty tensor for the other leaves (torch keeps ``None``).
        col_var: the column factor (the leaf's shape with a next-to-last dimension of 1), or empty.
        variance: per leaf of 0 or 1 dimension, the running average of the squared gradient, or empty.
    """

    count: Tensor
    row_var: Updates
    col_var: Updates
    variance: Updates


@dataclasses.dataclass(frozen=True)
class _Adafactor:
    lr: ScalarOrSchedule
    beta2_decay: float
    eps1: float | None
    eps2: float
    d: float
    weight_decay: float


@torch_names
def adafactor(
    lr: ScalarOrSchedule = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
) -> GradientTransformationExtraArgs:
    """Adafactor, as ``torch.optim.Adafactor`` (its keyword names, defaults and numbers).

    torch's variant (not optax's: see :func:`scale_by_factored_rms` for optax's factored
    moments): relative step sizes ``min(lr, 1/sqrt(t)) * max(eps2, rms(param))``, the update
    clipped at an RMS of ``d``, decoupled weight decay. ``apply_gradients`` equals
    ``torch.optim.Adafactor(foreach=False)`` to the bit on the CPU, reading the count and each
    leaf's two norms on the host as torch does. On a GPU, where each read would make the host
    wait for the GPU, it keeps them on the device, and each step rounds once more than torch's
    (the step size, a tensor, multiplies the update before the add). ``update`` keeps them on the
    device too (vmap- and compile-friendly) and agrees to float rounding.

    Args:
        lr: learning rate (the relative step's cap), a float or a schedule.
        beta2_decay: the second moment's decay at step ``t`` is ``1 - t ** beta2_decay``.
        eps: ``(eps1, eps2)``: the floor of the variance estimate (``None``: the dtype's
            machine epsilon) and of the parameters' RMS.
        d: the clipping threshold of the update's RMS.
        weight_decay: decoupled decay: params shrink by ``lr * weight_decay`` each step.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is an :class:`AdafactorState`.

    Example:
        >>> params = {"w": torch.ones(4, 3), "b": torch.zeros(3)}
        >>> opt = fddp.optim.adafactor(lr=1e-2)
        >>> state = opt.init(params)
        >>> grads = {"w": torch.full((4, 3), 0.5), "b": torch.ones(3)}
        >>> params, state = fddp.optim.apply_gradients(opt, grads, state, params)
    """
    checks.check_lr(lr, "adafactor")
    checks.check_nonneg(weight_decay, "weight_decay", "adafactor")
    if not isinstance(d, (int, float)) or not d >= 1.0:
        raise ValueError(f"adafactor: invalid d={d!r}; the clipping threshold must be >= 1, as torch's")
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"adafactor: invalid eps={eps!r}; expected a pair (eps1 or None, eps2), torch's default (None, 1e-3)")
    if eps[0] is not None:
        checks.check_nonneg(eps[0], "eps[0]", "adafactor")
    checks.check_nonneg(eps[1], "eps[1]", "adafactor")
    if not isinstance(beta2_decay, (int, float)) or beta2_decay > 0:
        raise ValueError(f"adafactor: invalid beta2_decay={beta2_decay!r}; expected a float <= 0")
    cfg = _Adafactor(lr, float(beta2_decay), None if eps[0] is None else float(eps[0]), float(eps[1]), float(d), float(weight_decay))
    return GradientTransformationExtraArgs(functools.partial(_init, cfg), FusedUpdate(cfg, _update, _applied))


def refuse_shards(tree: Params, where: str) -> None:
    """Factored moments need whole matrices (row and column means), which a shard does not hold."""
    if isinstance(tree, SplitTree) or has_split(checks.flatten(tree)[1]):
        raise TypeError(
            f"{where}: factored second moments take row and column means of whole matrices, and fddp.zero's shards hold "
            "slices of them; use it on replicated parameters, or an elementwise optimizer (adamw, rmsprop, lion) on shards"
        )


def _init(cfg: _Adafactor, params: Params) -> AdafactorState:
    refuse_shards(params, "adafactor.init")
    leaves, treedef = checks.init_leaves(params, "adafactor")
    rows, cols, vs = [], [], []
    for p in leaves:
        empty = p.new_zeros(0)
        if p.dim() > 1:
            rows.append(p.new_zeros((*p.shape[:-1], 1)))
            cols.append(p.new_zeros((*p.shape[:-2], 1, p.shape[-1])))
            vs.append(empty)
        else:
            rows.append(empty)
            cols.append(empty)
            vs.append(torch.zeros_like(p, memory_format=torch.preserve_format))
    tree = functools.partial(optree.tree_unflatten, treedef)
    return AdafactorState(checks.zeros_count(leaves), tree(rows), tree(cols), tree(vs))


def _step(cfg: _Adafactor, grads, state: AdafactorState, params, apply: bool):
    treedef, gs, (rows, cols, vs), ps = ew.leaves(
        "adafactor.update", AdafactorState, grads, state, params, ("row_var", "col_var", "variance"), True
    )
    lr = checks.lr_at(cfg.lr, state.count)
    # torch's Python floats, the step and each leaf's two norms read on the host, where the count is
    # on the CPU (free there); elsewhere float64 tensors on its device (no host read: see ew.on_host).
    host = apply and ew.on_host(state.count)
    if host:
        lr, step = ew.host(lr), float(state.count.item() + 1)
    else:
        step = (state.count + 1).to(torch.float64)
    one_minus_beta2 = ew.power(step, cfg.beta2_decay)
    rho_max = ew.divide(1, ew.power(step, 0.5))
    if host:
        rho = min(lr, rho_max)
    else:
        rho = torch.clamp(rho_max, max=lr) if not isinstance(lr, Tensor) else torch.minimum(lr.to(torch.float64), rho_max)
    out = [_leaf(cfg, g, r, c, v, p, lr, one_minus_beta2, rho, apply, host) for g, r, c, v, p in zip(gs, rows, cols, vs, ps)]
    tree = functools.partial(optree.tree_unflatten, treedef)
    r, c, v, u = ([x[k] for x in out] for k in range(4))
    return tree(u), AdafactorState(state.count + 1, tree(r), tree(c), tree(v))


def _update(cfg: _Adafactor, grads: Updates, state: AdafactorState, params: Params | None = None):
    return _step(cfg, grads, state, params, False)


def _applied(cfg: _Adafactor, grads: Updates, state: AdafactorState, params: Params, request: Apply):
    leaves = optree.tree_leaves(params)
    if not leaves or not _eager(leaves):
        return ew.note(request.why, "adafactor: update + apply_updates (inside a torch.func transform or torch.compile)")
    where = "the norms read on the host" if ew.on_host(state.count) else "the norms kept on the device"
    ew.note(request.why, f"adafactor: torch's single-tensor step, leaf by leaf, {where}")
    new_params, new_state = _step(cfg, grads, state, params, True)
    return Applied(new_params), new_state


def _eager(leaves) -> bool:
    """Whether torch's host-reading step may run: eager, outside transforms, autograd not recording."""
    return multi_tensor_ok(leaves) and not torch.compiler.is_compiling() and not any(t.requires_grad for t in leaves)


def _leaf(cfg: _Adafactor, g, row, col, var, p, lr, one_minus_beta2, rho, apply: bool, host: bool):
    """torch's ``_single_tensor_adafactor`` on one leaf, out of place: (row, col, variance, new
    param or update). ``host``: the norms read on the host, the scalars Python floats, as torch's."""
    eps1 = cfg.eps1 if cfg.eps1 is not None else torch.finfo(p.dtype).eps
    n = p.numel()
    if host:
        alpha = max(cfg.eps2, p.norm(2).item() / (n**0.5)) * rho
        omb = one_minus_beta2
    else:
        alpha = torch.clamp(p.norm(2).to(torch.float64) / (n**0.5), min=cfg.eps2) * rho
        omb = one_minus_beta2.to(p.dtype)
    q = p
    if cfg.weight_decay and apply:
        decay = 1 - lr * cfg.weight_decay
        q = torch.mul(p, decay if not isinstance(decay, Tensor) else decay.to(p.dtype))
    if g.dim() > 1:
        # Out of place (vmap has no batching rule for square_, clamp_...): the same arithmetic.
        row_mean = torch.norm(g, dim=-1, keepdim=True).square().div(g.size(-1))
        row = torch.lerp(row, row_mean, omb)
        col_mean = torch.norm(g, dim=-2, keepdim=True).square().div(g.size(-2))
        col = torch.lerp(col, col_mean, omb)
        est = row @ col
        est = est.div(row.mean(dim=-2, keepdim=True).clamp(min=eps1))
    else:
        var = torch.lerp(var, g * g, omb)
        est = var
    u = est.clamp(min=eps1 * eps1).rsqrt().mul(g)
    if host:
        denom = max(1.0, u.norm(2).item() / ((u.numel() ** 0.5) * cfg.d))
        return row, col, var, q.add(u, alpha=-alpha / denom)
    denom = torch.clamp(u.norm(2).to(torch.float64) / ((u.numel() ** 0.5) * cfg.d), min=1.0)
    step = (-alpha / denom).to(u.dtype)
    if apply:
        # The norms on the device: the step size is a tensor, so the update is multiplied, then added,
        # one rounding more than torch's add(alpha=), a fused multiply-add on the CPU.
        return row, col, var, torch.addcmul(q, u, step)
    u = u.mul(step)
    if cfg.weight_decay:
        u = ew.axpy(u, p, -lr * cfg.weight_decay, None)
    return row, col, var, u


# --- optax's scale_by_factored_rms ------------------------------------------------------------


class FactoredState(NamedTuple):
    """State of :func:`scale_by_factored_rms` (optax's ``FactoredState``).

    Attributes:
        count: number of updates so far (int64 scalar tensor).
        v_row: per factored leaf, the row statistics (the leaf without its largest dimension);
            a zero of shape ``(1,)`` for the others, as optax.
        v_col: per factored leaf, the column statistics (without its second largest dimension).
        v: per unfactored leaf, the running average of the squared gradient (shape ``(1,)`` for
            factored ones).
    """

    count: Tensor
    v_row: Updates
    v_col: Updates
    v: Updates


def _factored_dims(shape: tuple[int, ...], factored: bool, min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """optax's choice: the two largest dimensions, if the smaller of them is big enough."""
    if not factored or len(shape) < 2:
        return None
    sorted_dims = np.argsort(shape)
    if shape[sorted_dims[-2]] < min_dim_size_to_factor:
        return None
    return int(sorted_dims[-2]), int(sorted_dims[-1])


def scale_by_factored_rms(
    factored: bool = True,
    decay_rate: float = 0.8,
    step_offset: int = 0,
    min_dim_size_to_factor: int = 128,
    epsilon: float = 1e-30,
    decay_rate_fn: Callable[[Tensor, float], Tensor] | None = None,
) -> GradientTransformationExtraArgs:
    """Scale by a factored estimate of the gradient's RMS, as ``optax.scale_by_factored_rms``.

    optax's names, defaults and numbers: the decay at count ``i`` is
    ``1 - (i - step_offset + 1) ** -decay_rate`` (in float32, as optax computes it); a leaf of two
    or more dimensions whose two largest are at least ``min_dim_size_to_factor`` keeps row and
    column means of ``g**2 + epsilon``, the others a full running average.

    Args:
        factored: factor the second moment of matrices.
        decay_rate: the exponent of the decay schedule.
        step_offset: subtracted from the count in the schedule (fine tuning).
        min_dim_size_to_factor: factor only leaves whose two largest dimensions are at least this.
        epsilon: added to the squared gradient.
        decay_rate_fn: ``fn(step, decay_rate) -> tensor``, optax's override of the schedule.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`FactoredState`; needs
        ``params`` in ``update``, as optax's.

    Example:
        >>> params = {"w": torch.ones(256, 128)}
        >>> t = fddp.optim.scale_by_factored_rms()
        >>> direction, state = t.update({"w": torch.ones(256, 128)}, t.init(params), params)
    """
    where = "scale_by_factored_rms"

    def decay_at(count: Tensor) -> Tensor:
        if decay_rate_fn is not None:
            return torch.as_tensor(decay_rate_fn(count - step_offset, decay_rate))
        t = (count - step_offset + 1).to(torch.float32)
        return 1.0 - t ** (-decay_rate)

    def init(params: Params) -> FactoredState:
        refuse_shards(params, f"{where}.init")
        leaves, treedef = checks.init_leaves(params, where)
        rows, cols, vs = [], [], []
        for p in leaves:
            one = p.new_zeros((1,))
            dims = _factored_dims(tuple(p.shape), factored, min_dim_size_to_factor)
            if dims is not None:
                d1, d0 = dims
                rows.append(p.new_zeros(tuple(s for i, s in enumerate(p.shape) if i != d0)))
                cols.append(p.new_zeros(tuple(s for i, s in enumerate(p.shape) if i != d1)))
                vs.append(one)
            else:
                rows.append(one)
                cols.append(p.new_zeros((1,)))
                vs.append(torch.zeros_like(p))
        tree = functools.partial(optree.tree_unflatten, treedef)
        return FactoredState(checks.zeros_count(leaves), tree(rows), tree(cols), tree(vs))

    def update(grads: Updates, state: FactoredState, params: Params | None = None, **extra_args) -> tuple[Updates, FactoredState]:
        if params is None:
            raise ValueError(f"{where}.update: params are required (as optax's); call update(grads, state, params)")
        treedef, gs, (rows, cols, vs), ps = ew.leaves(f"{where}.update", FactoredState, grads, state, params, ("v_row", "v_col", "v"), True)
        dr = decay_at(state.count)
        out = []
        for g, row, col, v, p in zip(gs, rows, cols, vs, ps):
            dt = p.dtype
            rate, keep = dr.to(dt), (1.0 - dr).to(dt)
            dims = _factored_dims(tuple(p.shape), factored, min_dim_size_to_factor)
            sq = g * g + epsilon
            if dims is not None:
                d1, d0 = dims
                row = (rate * row + keep * sq.mean(dim=d0)).to(dt)
                col = (rate * col + keep * sq.mean(dim=d1)).to(dt)
                reduced_d1 = d1 - 1 if d1 > d0 else d1
                row_col_mean = row.mean(dim=reduced_d1, keepdim=True)
                row_factor = (row / row_col_mean) ** -0.5
                col_factor = col**-0.5
                u = g * row_factor.unsqueeze(d0) * col_factor.unsqueeze(d1)
                out.append((u, row, col, p.new_zeros((1,))))
            else:
                v = (rate * v + keep * sq).to(dt)
                out.append((g * v**-0.5, p.new_zeros((1,)), p.new_zeros((1,)), v))
        tree = functools.partial(optree.tree_unflatten, treedef)
        u, r, c, v = ([x[k] for x in out] for k in range(4))
        return tree(u), FactoredState(state.count + 1, tree(r), tree(c), tree(v))

    return GradientTransformationExtraArgs(init, update)


