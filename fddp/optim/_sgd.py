"""SGD with momentum, dampening, Nesterov and L2 weight decay, matching ``torch.optim.SGD``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import optree
import torch
from torch import Tensor

from . import _flat as flat
from ._base import (
    GradientTransformation,
    Params,
    ScalarOrSchedule,
    Updates,
    _check_dtypes,
    _check_grads,
    _check_lr,
    _check_nonneg,
    _check_state,
    _flatten,
    _fused_kernels_take,
    _lr_at,
    _module_aliases,
    _paths,
    _register_fused,
    _params_leaves,
    _zeros_count,
)


class SGDState(NamedTuple):
    """State of ``sgd``.

    Attributes:
        count: number of updates applied so far (int64 scalar tensor).
        momentum_buffer: same tree as params when ``momentum != 0``, else ``()``.
    """

    count: Tensor
    momentum_buffer: Updates | tuple


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD``.

    As in torch, the momentum buffer at the first step is the gradient itself (not dampened).

    Args:
        lr: learning rate, a float or a schedule (a function of the step count).
        momentum: momentum factor.
        dampening: dampening for momentum.
        nesterov: use Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).
        weight_decay: L2 penalty (``grad + weight_decay * param``); needs ``params`` in ``update``.

    Returns:
        A ``GradientTransformation`` whose state is an ``SGDState``.

    Example:
        >>> opt = fddp.optim.sgd(lr=0.1, momentum=0.9, nesterov=True)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(grads, state, params)
    """
    _check_lr(lr, "sgd")
    _check_nonneg(momentum, "momentum", "sgd")
    _check_nonneg(dampening, "dampening", "sgd")
    _check_nonneg(weight_decay, "weight_decay", "sgd")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(
            f"sgd: nesterov=True requires momentum > 0 and dampening == 0, got momentum={momentum!r}, "
            f"dampening={dampening!r}"
        )
    where = "sgd.update"

    def init(params: Params) -> SGDState:
        leaves, treedef = _flatten(params)
        buf = ()
        if momentum:
            buf = optree.tree_unflatten(treedef, [torch.zeros_like(p) for p in leaves])
        return SGDState(_zeros_count(leaves), buf)

    def leaves_of(grads: Updates, state: SGDState, params: Params | None, need_params: bool):
        _check_state(state, SGDState, where)
        if bool(momentum) != (not _is_empty(state.momentum_buffer)):
            raise TypeError(f"{where}: the state has no momentum buffer matching momentum={momentum!r}")
        if momentum:
            bufs, treedef = _flatten(state.momentum_buffer)
            gs, _ = _check_grads(grads, treedef, where)
        else:
            bufs = None
            gs, treedef = _check_grads(grads, None, where)
        ps = _params_leaves(params, treedef, where, "weight_decay != 0") if need_params else None
        if momentum:
            _check_dtypes(gs, bufs, treedef, where, "state.momentum_buffer")
        elif params is not None:
            _check_dtypes(gs, ps if ps is not None else _params_leaves(params, treedef, where, ""), treedef, where, "params")
        # Plain SGD called without params has nothing to compare with: its updates have the
        # gradients' dtype, and apply_updates casts them to the parameters'.
        return treedef, gs, bufs, ps

    def update(grads: Updates, state: SGDState, params: Params | None = None) -> tuple[Updates, SGDState]:
        treedef, gs, bufs, ps = leaves_of(grads, state, params, bool(weight_decay))

        count = state.count
        neg_lr = -_lr_at(lr, count)
        if not isinstance(neg_lr, Tensor):
            neg_lr = torch.tensor(neg_lr, dtype=torch.float64, device=count.device)
        # torch's first-step buffer is the raw gradient: with a zero buffer, ``0 * m + 1 * g == g``
        # exactly, so we only need per-step factors when dampening would scale the first gradient.
        first = count == 0
        keep = torch.where(first, 0.0, momentum).to(torch.float64) if dampening else momentum
        mix = torch.where(first, 1.0, 1.0 - dampening).to(torch.float64) if dampening else 1.0

        ref = bufs if momentum else gs
        groups = flat.groups_for(
            ref, *([gs] if momentum else []), *([ps] if weight_decay else []), names=lambda: _paths(treedef),
            labels=["momentum_buffer" if momentum else "grads"] + (["grads"] if momentum else []) + ["params"],
        )
        scalars = _Scalars(neg_lr, keep, mix)
        unit = functools.partial(_sgd_unit, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay, scalars=scalars)
        new_bufs, u = flat.run(unit, groups, [gs, bufs, ps], ref, 2)
        new_buf = optree.tree_unflatten(treedef, new_bufs) if momentum else ()
        return optree.tree_unflatten(treedef, u), SGDState(count + 1, new_buf)

    def fused(grads: Updates, state: SGDState, params: Params, donate: bool) -> tuple[Params, SGDState] | None:
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
        if momentum and dampening:
            return None
        treedef, gs, bufs, ps = leaves_of(grads, state, params, True)
        groups = flat.groups_for(
            ps, gs, *([bufs] if momentum else []), names=lambda: _paths(treedef),
            labels=("params", "grads", "momentum_buffer"),
        )
        if groups is None:
            return None
        lr_t = _lr_at(lr, state.count)
        donated = [ps] + ([bufs] if momentum else [])
        # A module's own parameters (fresh from fddp.functionalize) are copied, never donated.
        # Checked only when donating: the overlap check sorts every leaf's span.
        in_place = donate and flat.disjoint(gs, *donated) and not _module_aliases(ps)
        if in_place and _FUSED_SGD is not None and _fused_kernels_take(groups) and flat.kernels_take(params, treedef):
            for group in groups:
                leaves = [[ps[i] for i in group.indices], [gs[i] for i in group.indices]]
                if momentum:
                    leaves.append([bufs[i] for i in group.indices])
                # One tensor per leaf, or a sharded tree's leaf-aligned pieces (copied back after).
                lists, after = flat.kernel_lists(params, group, leaves, (1,))
                if lists[0]:  # a rank may hold nothing of a sharded group; the kernel refuses empty lists
                    _FUSED_SGD(
                        lists[0], lists[1], lists[2] if momentum else [],
                        weight_decay=weight_decay, momentum=momentum, lr=lr_t, dampening=dampening,
                        nesterov=nesterov, maximize=False, is_first_step=False,
                    )
                after()
            return optree.tree_unflatten(treedef, ps), SGDState(state.count + 1, state.momentum_buffer)
        new_p, new_b = [None] * len(ps), [None] * len(ps)
        for group in groups:
            P = flat.as_flat(ps, group)
            G = flat.tiled(gs, group)  # gradients from fddp.optim's own buffers; else read leaf by leaf
            d = None  # the direction, d = g (+ wd p), then the momentum buffer, then Nesterov's
            if weight_decay:
                d = _axpy(gs, G, P, weight_decay, group, ps)
            if momentum:
                B = flat.as_flat(bufs, group)
                if d is None:
                    b = _axpy(gs, G, B, momentum, group, ps)
                else:
                    b = torch.add(d, B, alpha=momentum, out=flat.new(group))
                flat.scatter(new_b, flat.views(b, group), group)
                if nesterov:
                    d = _axpy(gs, G, b, momentum, group, ps) if d is None else torch.add(d, b, alpha=momentum, out=d)
                else:
                    d = b
            if d is None:  # plain SGD: p' = p - lr g, leaf by leaf unless g is flat
                d = G
            out = flat.new(group)
            if d is None:
                for v, i, pv in zip(flat.views(out, group), group.indices, flat.views(P, group)):
                    _step(pv, gs[i], lr_t, v)
            else:
                _step(P, d, lr_t, out)
            flat.scatter(new_p, flat.views(out, group), group)
        p = optree.tree_unflatten(treedef, new_p)
        return p, SGDState(state.count + 1, optree.tree_unflatten(treedef, new_b) if momentum else ())

    return _register_fused(GradientTransformation(init, update), fused)


# A private torch op (present since torch 2.4); without it donated steps take the pure path.
_FUSED_SGD = getattr(torch, "_fused_sgd_", None)


def _is_empty(x) -> bool:
    return isinstance(x, tuple) and len(x) == 0


def _axpy(gs: list[Tensor], G: Tensor | None, Y: Tensor, alpha: float, group: flat.Group, like: list[Tensor]) -> Tensor:
    """A new flat buffer holding ``g + alpha * Y`` for the group's gradients ``g`` (flat ``G`` if any)."""
    out = flat.new(group)
    if G is not None:
        return torch.add(G, Y, alpha=alpha, out=out)
    for v, i, y in zip(flat.views(out, group), group.indices, flat.views(Y, group)):
        torch.add(gs[i], y, alpha=alpha, out=v)
    return out


def _step(p: Tensor, d: Tensor, lr, out: Tensor) -> None:
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


def _sgd_unit(g, buf, p, new, *, momentum, nesterov, weight_decay, scalars):
    """One SGD update of one tensor: a flat buffer of many leaves, or a single leaf.

    Out of place throughout, as ``adam._adam_unit``; ``out=`` is a pooled flat buffer or ``None``.
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
