"""SGD with momentum, dampening, Nesterov and L2 weight decay, matching ``torch.optim.SGD``."""

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

__all__ = ["SGDState", "sgd"]


class SGDState(NamedTuple):
    """State of ``sgd``.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        momentum_buffer: same tree as params when ``momentum != 0``, else ``()``.
    """

    count: Tensor
    momentum_buffer: Updates | tuple


@torch_names
def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    mask: Labels | None = None,
) -> GradientTransformationExtraArgs:
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    As in torch, the momentum buffer at the first step is the gradient itself (not dampened).

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        momentum: momentum factor.
        dampening: dampening for momentum.
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        weight_decay: L2 penalty (``grad + weight_decay * param``); needs ``params`` in ``update``.
        mask: where weight decay applies, as in :func:`fddp.optim.adam`; ``None`` decays every leaf.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is an ``SGDState``; ``apply_gradients``
        runs its fused step.

    Example:
        >>> opt = fddp.optim.sgd(lr=0.1, momentum=0.9, nesterov=True)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    checks.check_lr(lr, "sgd")
    checks.check_nonneg(momentum, "momentum", "sgd")
    checks.check_nonneg(dampening, "dampening", "sgd")
    checks.check_nonneg(weight_decay, "weight_decay", "sgd")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"sgd: nesterov=True requires momentum > 0 and dampening == 0, got momentum={momentum!r}, "
            f"dampening={dampening!r}"
        )
    decayed = _make(_SGD(lr, momentum, dampening, bool(nesterov), weight_decay))
    if mask is None:
        return decayed
    return grouped({True: decayed, False: _make(_SGD(lr, momentum, dampening, bool(nesterov), 0.0))}, mask, "sgd")


def _make(cfg: "_SGD") -> GradientTransformationExtraArgs:
    return GradientTransformationExtraArgs(functools.partial(_init, cfg), FusedUpdate(cfg, _update, _applied))


@dataclasses.dataclass(frozen=True)
class _SGD:
    lr: ScalarOrSchedule
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float


_WHERE = "sgd.update"


def _init(cfg: _SGD, params: Params) -> SGDState:
    leaves, treedef = checks.init_leaves(params, "sgd")
    buf: Any = ()
    if cfg.momentum:
        buf = optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])
    return SGDState(checks.zeros_count(leaves), buf)


def _leaves(cfg: _SGD, grads: Updates, state: SGDState, params: Params | None, need_params: bool):
    """The inputs' leaves, checked: (treedef, grads, momentum buffers or None, params or None, fresh).

    ``fresh``: momentum is on but the state holds no buffer (it was off until now:
    ``inject_hyperparams`` changed it). As in torch, whose buffer is made at the first step that
    uses momentum, the buffer starts as this step's gradient: zeros here, with the first step's
    factors.
    """
    checks.check_state(state, SGDState, _WHERE, grads=grads, params=params)
    fresh = bool(cfg.momentum) and _is_empty(state.momentum_buffer)
    if cfg.momentum and not fresh:
        bufs, treedef = checks.flatten(state.momentum_buffer)
        gs, _ = checks.check_grads(grads, treedef, _WHERE)
    else:
        gs, treedef = checks.check_grads(grads, None, _WHERE)
        bufs = [torch.zeros_like(g) for g in gs] if fresh else None
    ps = checks.params_leaves(params, treedef, _WHERE, "weight_decay != 0") if need_params else None
    if cfg.momentum and not fresh:
        checks.check_dtypes(gs, bufs, treedef, _WHERE, "state.momentum_buffer")
    elif params is not None:
        checks.check_dtypes(gs, ps if ps is not None else checks.params_leaves(params, treedef, _WHERE, ""), treedef, _WHERE, "params")
    # Plain SGD called without params has nothing to compare with: its updates have the
    # gradients' dtype, and apply_updates casts them to the parameters'.
    return treedef, gs, bufs, ps, fresh


def _kept(cfg: _SGD, state: SGDState) -> Any:
    """The buffer a step without momentum hands on: torch keeps a buffer it no longer uses."""
    return () if cfg.momentum else state.momentum_buffer


def _update(cfg: _SGD, grads: Updates, state: SGDState, params: Params | None = None) -> tuple[Updates, SGDState]:
    treedef, gs, bufs, ps, fresh = _leaves(cfg, grads, state, params, bool(cfg.weight_decay))
    momentum, dampening = cfg.momentum, cfg.dampening
    count = state.count
    neg_lr = -checks.lr_at(cfg.lr, count)
    if not isinstance(neg_lr, Tensor):
        neg_lr = torch.full((), neg_lr, dtype=torch.float64, device=count.device)  # a fill: torch.tensor(x, device=cuda) is a synced copy
    # torch's first-step buffer is the raw gradient: with a zero buffer, ``0 * m + 1 * g == g``
    # exactly, so we only need per-step factors when dampening would scale the first gradient.
    first = torch.ones((), dtype=torch.bool) if fresh else count == 0
    keep = torch.where(first, 0.0, momentum).to(torch.float64) if dampening else momentum
    mix = torch.where(first, 1.0, 1.0 - dampening).to(torch.float64) if dampening else 1.0
    ref = bufs if momentum else gs
    step = flat.step_plan(
        ref, *([gs] if momentum else []), *([ps] if cfg.weight_decay else []), names=lambda: checks.paths_of(treedef),
        labels=["momentum_buffer" if momentum else "grads"] + (["grads"] if momentum else []) + ["params"],
    )  # fmt: skip
    scalars = _Scalars(neg_lr, keep, mix)
    unit = functools.partial(_unit, momentum=momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay, scalars=scalars)
    new_bufs, u = flat.run(unit, step, [gs, bufs, ps], ref, 2)
    new_buf = optree.tree_unflatten(treedef, new_bufs) if momentum else _kept(cfg, state)
    return optree.tree_unflatten(treedef, u), SGDState(count + 1, new_buf)


def _applied(cfg: _SGD, grads: Updates, state: SGDState, params: Params, request: Apply) -> tuple[Applied, SGDState] | None:
    """``apply_gradients``: the step straight into new flat buffers, without an ``updates`` tree.

    Each new value is written once: ``b' = g + momentum * b`` (``g`` including weight decay),
    then ``p' = p - lr * b'``, reading the gradients where they lie. That reads and writes less
    than torch's fused kernel would on copies of the parameters and buffers (the copies alone
    are two passes), and about as much as ``torch.optim.SGD`` in place. Donated params and
    buffers are updated in place by that kernel instead. Its first step copies the gradient
    into the buffer, which needs the step count in Python; from a zero buffer
    ``momentum * 0 + g`` is that copy exactly. Dampened momentum needs the first-step rule per
    step and takes ``update`` + ``apply_updates``.
    """
    why = request.why
    if cfg.momentum and cfg.dampening:
        return flat.note(why, "sgd: update + apply_updates (dampened momentum has no fused step)")
    treedef, gs, bufs, ps, _ = _leaves(cfg, grads, state, params, True)
    momentum = cfg.momentum
    step = flat.step_plan(
        ps, gs, *([bufs] if momentum else []), names=lambda: checks.paths_of(treedef),
        labels=("params", "grads", "momentum_buffer"), why=why,
    )  # fmt: skip
    if step is None:
        return flat.note(why, "sgd: update + apply_updates")
    lr_t = checks.lr_at(cfg.lr, state.count)
    donated = [ps] + ([bufs] if momentum else [])
    # A module's own parameters (fresh from fddp.functionalize) are copied, never donated.
    # Checked only when donating: the overlap check sorts every leaf's span.
    in_place = request.donate and flat.disjoint(gs, *donated) and not checks.module_aliases(ps)
    if in_place and _FUSED_SGD is not None and _kernels.kernels_take(step, params, treedef):
        flat.note(why, "sgd: torch's fused kernel, in place on the donated params and momentum buffers")
        for group in step.groups:
            leaves = [[ps[i] for i in group.indices], [gs[i] for i in group.indices]]
            if momentum:
                leaves.append([bufs[i] for i in group.indices])
            # One tensor per leaf, or a split tree's leaf-aligned pieces (copied back after).
            lists, after = _kernels.kernel_lists(params, group, leaves, (1,))
            if lists[0]:  # a rank may hold nothing of a sharded group; the kernel refuses empty lists
                _FUSED_SGD(
                    lists[0], lists[1], lists[2] if momentum else [],
                    weight_decay=cfg.weight_decay, momentum=momentum, lr=_kernels.kernel_lr(lr_t), dampening=cfg.dampening,
                    nesterov=cfg.nesterov, maximize=False, is_first_step=False,
                )  # fmt: skip
            after()
        new_buf = optree.tree_unflatten(treedef, bufs) if momentum else _kept(cfg, state)
        return Applied(optree.tree_unflatten(treedef, ps)), SGDState(state.count + 1, new_buf)
    flat.note(why, "sgd: the step written straight into new flat buffers")
    new_p, new_b = [], []
    for k, group in enumerate(step.groups):
        p, b = _group_step(cfg, step, k, group, gs, bufs, ps, lr_t)
        new_p.append(p)
        new_b.append(b)
    new_params = optree.tree_unflatten(treedef, step.out(new_p))
    new_buf = optree.tree_unflatten(treedef, step.out(new_b)) if momentum else _kept(cfg, state)
    return Applied(new_params), SGDState(state.count + 1, new_buf)


def _group_step(cfg: _SGD, step: flat.Step, k: int, group: flat.Group, gs, bufs, ps, lr_t) -> tuple[Tensor, Tensor | None]:
    """One group's new parameters and momentum buffer, each written once into a new flat buffer."""
    momentum = cfg.momentum
    P = step.read(ps, k)
    G = step.buffer(gs, k)  # gradients laid out in this plan; else read leaf by leaf
    d = None  # the direction, d = g (+ wd p), then the momentum buffer, then Nesterov's
    b = None
    if cfg.weight_decay:
        d = _axpy(gs, G, P, cfg.weight_decay, group)
    if momentum:
        B = step.read(bufs, k)
        b = _axpy(gs, G, B, momentum, group) if d is None else torch.add(d, B, alpha=momentum, out=flat.new(group))
        if cfg.nesterov:
            d = _axpy(gs, G, b, momentum, group) if d is None else torch.add(d, b, alpha=momentum, out=d)
        else:
            d = b
    if d is None:  # plain SGD: p' = p - lr g, leaf by leaf unless g is flat
        d = G
    out = flat.new(group)
    if d is None:
        for v, i, pv in zip(flat.views(out, group), group.indices, flat.views(P, group)):
            _descend(pv, gs[i], lr_t, v)
    else:
        _descend(P, d, lr_t, out)
    return out, b


# A private torch op (present since torch 2.4); without it donated steps take the pure path.
_FUSED_SGD = getattr(torch, "_fused_sgd_", None)


def _is_empty(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 0


def _axpy(gs: list[Tensor], G: Tensor | None, Y: Tensor, alpha: float, group: flat.Group) -> Tensor:
    """A new flat buffer holding ``g + alpha * Y`` for the group's gradients ``g`` (flat ``G`` if any)."""
    out = flat.new(group)
    if G is not None:
        return torch.add(G, Y, alpha=alpha, out=out)
    for v, i, y in zip(flat.views(out, group), group.indices, flat.views(Y, group)):
        torch.add(gs[i], y, alpha=alpha, out=v)
    return out


def _descend(p: Tensor, d: Tensor, lr, out: Tensor) -> None:
    """``out = p - lr * d``; ``lr`` a float or, from a schedule, a scalar tensor."""
    if isinstance(lr, Tensor):
        torch.addcmul(p, d, (-lr).to(p.dtype), out=out)
    else:
        torch.add(p, d, alpha=-lr, out=out)


class _Scalars:
    """The step's scalar tensors, cast once per dtype they are used with (see ``adam._Scalars``)."""

    def __init__(self, neg_lr: Tensor, keep, mix) -> None:
        self.values = (neg_lr, keep, mix)
        self.cache: dict = {}

    def get(self, dtype: torch.dtype) -> tuple:
        if dtype not in self.cache:
            self.cache[dtype] = tuple(x.to(dtype) if isinstance(x, Tensor) else x for x in self.values)
        return self.cache[dtype]


def _unit(g, buf, p, new, *, momentum, nesterov, weight_decay, scalars):
    """One SGD update of one tensor: a flat buffer of many leaves, or a single leaf.

    Out of place throughout, as ``adam._unit``; ``out=`` is a pooled flat buffer or ``None``.
    """
    neg_lr, keep, mix = scalars.get(g.dtype)
    if weight_decay:
        g = torch.add(g, p, alpha=weight_decay, out=new())
    new_buf = None
    if momentum:
        o = new()
        new_buf = torch.mul(buf, keep, out=o)
        if isinstance(mix, Tensor):
            new_buf = torch.addcmul(new_buf, g, mix, out=o)
        else:
            new_buf = torch.add(new_buf, g, out=o)
        g = torch.add(g, new_buf, alpha=momentum, out=new()) if nesterov else new_buf
    return new_buf, torch.mul(g, neg_lr, out=new())
