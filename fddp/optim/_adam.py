"""Adam and AdamW, matching ``torch.optim.Adam`` / ``torch.optim.AdamW`` step for step."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from . import _checks as checks
from . import _flat as flat
from . import _kernels
from ._base import Applied, Apply, FusedUpdate, GradientTransformationExtraArgs
from ._checks import Params, ScalarOrSchedule, Updates
from ._groups import Labels, grouped
from ._names import torch_names

__all__ = ["AdamState", "adam", "adamw"]


class AdamState(NamedTuple):
    """State of ``adam`` / ``adamw``.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        exp_avg: first moment, same tree as params.
        exp_avg_sq: second moment, same tree as params.
        max_exp_avg_sq: running maximum of ``exp_avg_sq`` when ``amsgrad=True``, else ``()``
            (an empty pytree, not ``None``: ``vmap`` accepts only tensors as outputs).
    """

    count: Tensor
    exp_avg: Updates
    exp_avg_sq: Updates
    max_exp_avg_sq: Updates | tuple


@torch_names
def adam(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    mask: Labels | None = None,
) -> GradientTransformationExtraArgs:
    """Adam with L2 weight decay added to the gradient, as ``torch.optim.Adam``.

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        betas: coefficients of the running averages of the gradient and its square, each in [0, 1).
        eps: term added to the denominator.
        weight_decay: L2 penalty (``grad + weight_decay * param``); needs ``params`` in ``update``.
        amsgrad: use the running maximum of the second moment (AMSGrad).
        mask: where weight decay applies: True for the leaves it decays, as a tree of bools shaped
            like the parameters (or a prefix of it) or a function ``mask(params) -> such a tree``
            (see :func:`fddp.optim.by_path`); ``None`` decays every leaf. torch's two param groups,
            one with ``weight_decay=0``: each group takes its own fused step.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is an ``AdamState``; ``apply_gradients``
        runs torch's fused kernel.

    Example:
        >>> opt = fddp.optim.adam(lr=1e-3)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    return _masked("adam", lr, betas, eps, weight_decay, amsgrad, mask, decoupled=False)


@torch_names
def adamw(
    lr: ScalarOrSchedule = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    mask: Labels | None = None,
) -> GradientTransformationExtraArgs:
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    Args:
        lr: as in :func:`adam`.
        betas: as in :func:`adam`.
        eps: as in :func:`adam`.
        weight_decay: decoupled decay: params shrink by ``lr * weight_decay`` each step (where
            :func:`adam`'s L2 penalty adds ``weight_decay * param`` to the gradient).
        amsgrad: as in :func:`adam`.
        mask: where weight decay applies (as in :func:`adam`; optax's ``adamw(mask=)``). Language
            models leave biases and norms undecayed: ``mask=fddp.optim.by_path(lambda path, p:
            p.ndim >= 2)``.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is an ``AdamState``; ``apply_gradients``
        runs torch's fused kernel.

    Example:
        >>> opt = fddp.optim.adamw(lr=1e-3, weight_decay=1e-2)
        >>> state = opt.init(params)
        >>> opt = fddp.optim.adamw(lr=1e-3, weight_decay=0.1, mask=fddp.optim.by_path(lambda path, p: p.ndim >= 2))
        >>> updates, state = opt.update(grads, state, params)
        >>> params = fddp.optim.apply_updates(params, updates)
    """
    return _masked("adamw", lr, betas, eps, weight_decay, amsgrad, mask, decoupled=True)


@dataclasses.dataclass(frozen=True)
class _Adam:
    name: str
    lr: ScalarOrSchedule
    b1: float
    b2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    decoupled: bool
    # A constant lr makes the decay factor a constant too: rounded to each dtype once, in eager
    # Python, rather than in update (a float() of a tensor there is a graph break under compile).
    const_decay: dict | None = dataclasses.field(compare=False, hash=False)
    # torch's fused kernel (a private op, present since torch 2.4); without it apply_gradients is
    # update + apply_updates.
    kernel: Any = dataclasses.field(compare=False, hash=False)

    @property
    def where(self) -> str:
        return f"{self.name}.update"


def _masked(
    name: str, lr: ScalarOrSchedule, betas: tuple[float, float], eps: float, weight_decay: float, amsgrad: bool, mask: Labels | None,
    *, decoupled: bool,
) -> GradientTransformationExtraArgs:
    decayed = _make(name, lr, betas, eps, weight_decay, amsgrad, decoupled=decoupled)
    if mask is None:
        return decayed
    plain = _make(name, lr, betas, eps, 0.0, amsgrad, decoupled=decoupled)
    return grouped({True: decayed, False: plain}, mask, name, donated_alike=True)


def _make(
    name: str, lr: ScalarOrSchedule, betas: tuple[float, float], eps: float, weight_decay: float, amsgrad: bool, *, decoupled: bool
) -> GradientTransformationExtraArgs:
    checks.check_lr(lr, name)
    checks.check_nonneg(eps, "eps", name)
    checks.check_nonneg(weight_decay, "weight_decay", name)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{name}: invalid betas={betas!r}; expected a pair (beta1, beta2)")
    for i, b in enumerate(betas):
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0.0 <= b < 1.0:
            raise ValueError(f"{name}: invalid betas[{i}]={b!r}; expected a float in [0, 1)")
    const_decay = _rounded_decays(1.0 - float(lr) * weight_decay) if decoupled and weight_decay and not callable(lr) else None
    kernel = getattr(torch, "_fused_adamw_" if decoupled else "_fused_adam_", None)
    cfg = _Adam(name, lr, float(betas[0]), float(betas[1]), eps, weight_decay, bool(amsgrad), decoupled, const_decay, kernel)
    return GradientTransformationExtraArgs(functools.partial(_init, cfg), FusedUpdate(cfg, _update, _applied))


def _init(cfg: _Adam, params: Params) -> AdamState:
    leaves, treedef = checks.init_leaves(params, cfg.name)

    def zeros() -> Any:
        return optree.tree_unflatten(treedef, [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves])

    return AdamState(checks.zeros_count(leaves), zeros(), zeros(), zeros() if cfg.amsgrad else ())


def _leaves(cfg: _Adam, grads: Updates, state: AdamState, params: Params | None, need_params: bool):
    """The inputs' leaves, checked: (treedef, grads, moments, max moments or None, params or None)."""
    where = cfg.where
    checks.check_state(state, AdamState, where, grads=grads, params=params)
    if cfg.amsgrad != (not _is_empty(state.max_exp_avg_sq)):
        raise TypeError(f"{where}: the state was created with amsgrad={not cfg.amsgrad}, this optimizer has amsgrad={cfg.amsgrad}")
    ms, treedef = checks.flatten(state.exp_avg)
    gs, _ = checks.check_grads(grads, treedef, where)
    vs = checks.flatten(state.exp_avg_sq)[0]
    vmaxs = checks.flatten(state.max_exp_avg_sq)[0] if cfg.amsgrad else None
    ps = checks.params_leaves(params, treedef, where, "weight_decay != 0") if need_params else None
    if ps is not None:
        checks.check_dtypes(gs, ps, treedef, where, "params")
    else:
        checks.check_dtypes(gs, ms, treedef, where, "state.exp_avg")
    return treedef, gs, ms, vs, vmaxs, ps


def _update(cfg: _Adam, grads: Updates, state: AdamState, params: Params | None = None) -> tuple[Updates, AdamState]:
    wd = cfg.weight_decay
    treedef, gs, ms, vs, vmaxs, ps = _leaves(cfg, grads, state, params, bool(wd))
    count = state.count
    lr_t = checks.lr_at(cfg.lr, count)
    # Bias corrections in float64 from the tensor step, as torch does in Python floats.
    t = (count + 1).to(torch.float64)
    bc1 = 1.0 - torch.pow(cfg.b1, t)
    bc2_sqrt = torch.sqrt(1.0 - torch.pow(cfg.b2, t))
    # torch: -lr/bc1 * m / (sqrt(v)/bc2_sqrt + eps). Multiplying through by bc2_sqrt saves one
    # full pass over the parameters: m * (-lr*bc2_sqrt/bc1) / (sqrt(v) + eps*bc2_sqrt).
    step_size = -lr_t * bc2_sqrt / bc1
    eps_hat = cfg.eps * bc2_sqrt
    l2 = wd if (wd and not cfg.decoupled) else 0.0
    decay = _decay(lr_t, wd, count.device) if (cfg.decoupled and wd) else None
    leaves = [ms, gs, vs] + ([vmaxs] if cfg.amsgrad else []) + ([ps] if ps is not None else [])
    labels = ["exp_avg", "grads", "exp_avg_sq"] + (["max_exp_avg_sq"] if cfg.amsgrad else []) + ["params"]
    step = flat.step_plan(*leaves, names=lambda: checks.paths_of(treedef), labels=labels)
    scalars = _Scalars(step=step_size, eps_hat=eps_hat, decay=decay, rounded=cfg.const_decay)
    unit = functools.partial(_unit, b1=cfg.b1, b2=cfg.b2, l2=l2, scalars=scalars)
    m, v, vmax, u = flat.run(unit, step, [gs, ms, vs, vmaxs, ps], ms, 4)
    new_state = AdamState(
        count + 1,
        optree.tree_unflatten(treedef, m),
        optree.tree_unflatten(treedef, v),
        optree.tree_unflatten(treedef, vmax) if cfg.amsgrad else (),
    )
    return optree.tree_unflatten(treedef, u), new_state


def _applied(cfg: _Adam, grads: Updates, state: AdamState, params: Params, request: Apply) -> tuple[Applied, AdamState] | None:
    """``apply_gradients`` with torch's fused kernel, in place on copies of params and state
    or, donated, on params and state themselves."""
    why = request.why
    if cfg.kernel is None:
        return flat.note(why, f"{cfg.name}: update + apply_updates (this torch has no fused kernel)")
    treedef, gs, ms, vs, vmaxs, ps = _leaves(cfg, grads, state, params, True)
    amsgrad = cfg.amsgrad
    step = flat.step_plan(
        ps, gs, ms, vs, *([vmaxs] if amsgrad else []), names=lambda: checks.paths_of(treedef),
        labels=("params", "grads", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), why=why,
    )  # fmt: skip
    if not _kernels.kernels_take(step, params, treedef):
        return flat.note(why, f"{cfg.name}: update + apply_updates (the fused kernel does not take these leaves)")
    lr_t = checks.lr_at(cfg.lr, state.count)
    # The kernel reads the step count from a float tensor, as torch.optim keeps it (no sync).
    count = (state.count + 1).to(torch.float32)
    trees = [ps, ms, vs] + ([vmaxs] if amsgrad else [])
    # A module's own parameters (fresh from fddp.functionalize) are copied, never donated.
    in_place = request.donate and flat.disjoint(gs, *trees) and not checks.module_aliases(ps)
    where = "in place on the donated params and state" if in_place else "on copies of params and state"
    flat.note(why, f"{cfg.name}: torch's fused kernel, {where}")
    bufs: list[list[Tensor]] = [[] for _ in trees]
    made: list[list[list[Tensor]]] = [[] for _ in trees]
    for group in step.groups:
        if in_place:
            new = [[leaves[i] for i in group.indices] for leaves in trees]
        else:
            # Copies of params and state, updated in place by the kernel: the inputs stay as they were.
            copies = [flat.copy_with_views(leaves, group) for leaves in trees]
            new = [v for _, v in copies]
            for j, (b, v) in enumerate(copies):
                bufs[j].append(b)
                made[j].append(v)
        # One tensor per leaf, or a split tree's leaf-aligned pieces (copied back after).
        lists, after = _kernels.kernel_lists(params, group, [new[0], [gs[i] for i in group.indices], *new[1:]], (1,))
        p_, g_, m_, v_, *vmax_ = lists
        if p_:  # a rank may hold nothing of a sharded group; the kernel refuses empty lists
            cfg.kernel(
                p_, g_, m_, v_, vmax_[0] if amsgrad else [], [count] * len(p_),
                lr=_kernels.kernel_lr(lr_t), beta1=cfg.b1, beta2=cfg.b2, weight_decay=cfg.weight_decay, eps=cfg.eps,
                amsgrad=amsgrad, maximize=False,
            )  # fmt: skip
        after()
    if in_place:
        outs = trees
    else:
        outs = [step.out(b, m) for b, m in zip(bufs, made)]
    p, m, v, *vmax = [optree.tree_unflatten(treedef, out) for out in outs]
    return Applied(p), AdamState(state.count + 1, m, v, vmax[0] if amsgrad else ())


def _is_empty(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 0


def _decay(lr_t, weight_decay: float, device) -> float | Tensor:
    """``c = 1 - lr * weight_decay``, the factor torch decays parameters by (``param.mul_(c)``).

    A Python float for a constant lr (no tensor op, which matters under vmap, where every op on a
    batched scalar costs as much as one on the parameters), else a float64 tensor. torch rounds
    ``c`` to the parameter's dtype, which changes the effective decay noticeably (fp32 rounding of
    1 - 1e-5 is off by ~0.3% of the decay; in bf16 it is exactly 1). ``_Scalars`` applies the same
    rounding per dtype, which keeps trajectories on torch's.
    """
    if isinstance(lr_t, Tensor):
        return torch.as_tensor(1.0 - lr_t * weight_decay, dtype=torch.float64, device=device)
    return 1.0 - lr_t * weight_decay


def _rounded_decays(c: float, dtypes: tuple = (torch.float32, torch.float64, torch.float16, torch.bfloat16)) -> dict:
    """``c`` rounded to each dtype, minus 1, as Python floats (exact: see ``_Scalars.get``)."""
    return {dtype: float(torch.tensor(c, dtype=dtype)) - 1.0 for dtype in dtypes}


class _Scalars:
    """The step's scalar tensors, cast once per dtype they are used with.

    Casting explicitly keeps results in the leaf's dtype: under vmap the batching rules of some ops
    would otherwise promote a batched float64 scalar, and the result, to float64.
    """

    def __init__(
        self, step: Tensor, eps_hat: Tensor, decay: float | Tensor | None, rounded: dict[torch.dtype, float] | None
    ) -> None:
        self.step, self.eps_hat, self.decay, self.rounded = step, eps_hat, decay, rounded
        self.cache: dict = {}

    def get(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:
        if dtype not in self.cache:
            decay = None
            # Exact: c rounded to the dtype, minus 1, is representable in that dtype.
            if isinstance(self.decay, Tensor):
                decay = (self.decay.to(dtype).to(torch.float64) - 1.0).to(dtype)
            elif self.decay is not None:
                rounded = self.rounded or {}
                decay = rounded[dtype] if dtype in rounded else _rounded_decays(self.decay, (dtype,))[dtype]
            self.cache[dtype] = (self.step.to(dtype), self.eps_hat.to(dtype), decay)
        return self.cache[dtype]


def _unit(g, m, v, vmax, p, new, *, b1, b2, l2, scalars):
    """One Adam update of one tensor: a flat buffer of many leaves, or a single leaf.

    Out of place throughout (``out=`` is a fresh pooled buffer, or ``None`` leaf by leaf): under
    vmap an in-place op on an unbatched tensor with batched arguments is an error. Writing into a
    buffer the unit itself just made (``out=o`` twice) is in place only on flat buffers.
    """
    step, eps_hat, decay = scalars.get(g.dtype)
    if l2:
        g = torch.add(g, p, alpha=l2, out=new())
    m = torch.lerp(m, g, 1.0 - b1, out=new())
    o = new()
    v = torch.addcmul(torch.mul(v, b2, out=o), g, g, value=1.0 - b2, out=o)
    if vmax is not None:
        vmax = torch.maximum(vmax, v, out=new())
    # torch: -lr/bc1 * m / (sqrt(v)/bc2_sqrt + eps). Multiplied through by bc2_sqrt this is
    # m / (sqrt(v) + eps*bc2_sqrt) * (-lr*bc2_sqrt/bc1), one pass fewer.
    o = new()
    u = torch.add(torch.sqrt(v if vmax is None else vmax, out=o), eps_hat, out=o)
    u = torch.mul(torch.div(m, u, out=o), step, out=o)
    if isinstance(decay, Tensor):
        u = torch.addcmul(u, p, decay, out=o)
    elif decay is not None:
        u = torch.add(u, p, alpha=decay, out=o)
    return m, v, vmax, u
