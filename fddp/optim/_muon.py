"""Muon: the momentum of each matrix orthogonalised by Newton-Schulz, as ``torch.optim.Muon``; another
optimizer (AdamW by default) for the other leaves.

Per 2-D leaf, with ``mu`` the momentum, ``g`` the gradient and ``B`` the momentum buffer (torch's
arithmetic, line for line)::

    B = B.lerp(g, 1 - mu)                   # an average of the gradients, not a sum
    U = g.lerp(B, mu) if nesterov else B
    O = NS(U)                               # 5 quintic Newton-Schulz steps, in bfloat16
    p = p * (1 - lr * weight_decay)         # decoupled decay, by the unadjusted lr
    p = p - lr * adjust(shape) * O          # adjust: sqrt(max(1, rows / cols)) ("original")

On ``fddp.zero``'s shards the elementwise lines run on each rank's slices, and each matrix is
orthogonalised whole by one rank (``_muon_shards``).
"""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch
from torch import Tensor

from fddp._layout import SplitTree

from . import _checks as checks
from . import _flat as flat
from . import _muon_shards as shards
from ._adam import adamw
from ._base import Applied, Apply, FusedUpdate, GradientTransformation, GradientTransformationExtraArgs
from ._checks import Params, ScalarOrSchedule, Updates
from ._groups import Labels, _ByPath, by_path, multi_transform
from ._names import torch_names
from ._newton_schulz import (
    ADJUST,
    NS_COEFFICIENTS,
    MuonConfig,
    MuonState,
    check_matrices,
    decays,
    descend,
    lr_now,
    momentum_step,
    orthogonalize,
)

__all__ = ["MuonState", "muon"]

@torch_names
def muon(
    lr: ScalarOrSchedule = 1e-3,
    momentum: float = 0.95,
    weight_decay: float = 0.1,
    nesterov: bool = True,
    *,
    ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    adjust_lr_fn: str | None = "original",
    ns_dtype: torch.dtype | None = torch.bfloat16,
    mask: Labels | None = None,
    fallback: GradientTransformation | None = None,
) -> GradientTransformationExtraArgs:
    """Muon for the matrices, ``fallback`` (AdamW) for the other leaves, as ``torch.optim.Muon``.

    The leaves ``mask`` picks (every 2-D leaf, by default) take Muon's step: torch's momentum
    buffer (an average, ``B.lerp(g, 1 - momentum)``), Nesterov's mix ``g.lerp(B, momentum)``, five
    quintic Newton-Schulz steps in bfloat16 that orthogonalise it, decoupled weight decay by
    ``lr``, and a step of ``lr`` times the shape's adjustment. ``apply_gradients`` equals
    ``torch.optim.Muon`` to the bit (tests/test_muon.py: 50 steps); ``update`` +
    ``apply_updates`` does too wherever a parameter stays within a factor two of its old value
    (the update ``new - p`` is then exact), and differs by one rounding elsewhere.

    The other leaves (biases, norms, embeddings that ``mask`` leaves out) take ``fallback``'s
    step: ``fddp.optim.adamw(lr)`` by default, torch's AdamW defaults otherwise; pass your own
    (``fallback=fddp.optim.adamw(3e-4, weight_decay=0.0)``), as torch users pair ``Muon`` with a
    second optimizer. The state is a :class:`fddp.optim.MultiTransformState` holding a
    :class:`MuonState` (``"muon"``) and the fallback's state (``"fallback"``).

    On ``fddp.zero``'s shards (stages 1 to 3) the momentum stays on the shards and each matrix is
    orthogonalised whole by one rank, its *owner* (matrices dealt to the ranks by size, largest
    first, to the least loaded): each rank sends its pieces of every matrix to the matrix's owner
    (one all-to-all, in ``ns_dtype``), the owners run Newton-Schulz, and the results come back the
    same way. The parameters equal replicated Muon's to the bit (the same arithmetic on the same
    values; tests/test_muon_zero.py). The update is then a collective: every rank of the shards'
    group must step together.

    Where optax's ``contrib.muon`` differs (fddp follows torch, whose arithmetic users port from;
    ``ns_dtype=None`` gives optax's float32 Newton-Schulz): optax corrects the momentum's bias
    (``mu / (1 - beta**t)``, and Nesterov's mix of the corrected momentum and gradient), divides by
    ``norm + 1e-8`` where torch clamps the norm at ``1e-7``, runs Newton-Schulz in the input's
    dtype, and scales by ``sqrt(max(1, shape[-1] / shape[-2]))``, which on JAX's ``(in, out)``
    kernels is torch's ``sqrt(max(1, rows / cols))`` on ``(out, in)`` weights; its fallback is
    a Nesterov AdamW with Muon's own learning rate, and its weight decay defaults to 0.

    Args:
        lr: the learning rate, a float or a schedule (a function of the step count).
        momentum: the momentum factor ``mu`` in ``[0, 1)``.
        weight_decay: decoupled decay: the matrices shrink by ``lr * weight_decay`` each step
            (torch's default 0.1).
        nesterov: Nesterov's mix ``g.lerp(B, momentum)`` in place of ``B``.
        ns_coefficients: the quintic's ``(a, b, c)``.
        ns_steps: Newton-Schulz steps (fewer than 100).
        eps: the smallest norm Newton-Schulz divides by.
        adjust_lr_fn: ``"original"`` (Keller Jordan's ``sqrt(max(1, rows / cols))``),
            ``"match_rms_adamw"`` (Moonshot's ``0.2 * sqrt(max(rows, cols))``) or ``"none"``;
            ``None`` is ``"original"``, as in torch.
        ns_dtype: the dtype Newton-Schulz runs in (torch's bfloat16); ``None``: the gradient's.
        mask: the leaves Muon steps: True for those, as a tree of bools shaped like the
            parameters (or a prefix of it) or a function of them (see :func:`fddp.optim.by_path`);
            ``None``: every 2-D leaf. Each must be 2-D (a convolution's kernel is not).
        fallback: the transformation of the other leaves; ``None``: ``fddp.optim.adamw(lr)``.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a ``MultiTransformState``.

    Example:
        >>> hidden = fddp.optim.by_path(lambda path, p: p.ndim == 2 and not path.startswith(("tok", "head")))
        >>> opt = fddp.optim.muon(0.02, mask=hidden, fallback=fddp.optim.adamw(3e-4, weight_decay=0.0))
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, grads, state, params)
    """
    core = _make(lr, momentum, weight_decay, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn, ns_dtype)
    if fallback is None:
        fallback = adamw(lr)
    elif not isinstance(fallback, GradientTransformation):
        raise TypeError(
            f"muon: fallback must be a GradientTransformation (fddp.optim.adamw(3e-4), ...) for the leaves Muon does not "
            f"step, got {checks.describe(fallback)}"
        )
    return multi_transform({"muon": core, "fallback": fallback}, _labels(mask))


def _make(lr, momentum, weight_decay, nesterov, coefficients, steps, eps, adjust, ns_dtype) -> GradientTransformationExtraArgs:
    checks.check_lr(lr, "muon")
    checks.check_nonneg(weight_decay, "weight_decay", "muon")
    checks.check_nonneg(eps, "eps", "muon")
    if not isinstance(momentum, (int, float)) or isinstance(momentum, bool) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"muon: invalid momentum={momentum!r}; expected a float in [0, 1)")
    if not isinstance(steps, int) or isinstance(steps, bool) or not 0 <= steps < 100:
        raise ValueError(f"muon: invalid ns_steps={steps!r}; expected an int in [0, 100) (torch's bound)")
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
        raise ValueError(f"muon: invalid ns_coefficients={coefficients!r}; expected three floats (a, b, c)")
    adjust = "original" if adjust is None else adjust
    if adjust not in ADJUST:
        raise ValueError(f"muon: invalid adjust_lr_fn={adjust!r}; expected one of {ADJUST} (or None: 'original')")
    if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
        raise TypeError(f"muon: ns_dtype must be a floating torch.dtype (torch.bfloat16) or None, got {ns_dtype!r}")
    cfg = MuonConfig(lr, float(momentum), weight_decay, bool(nesterov), tuple(map(float, coefficients)), steps, eps, adjust, ns_dtype)
    return GradientTransformationExtraArgs(functools.partial(_init, cfg), FusedUpdate(cfg, _pure, _applied))


def _labels(mask: Labels | None) -> Labels:
    """``mask`` as multi_transform's labels: True -> ``"muon"``, False -> ``"fallback"`` (any other
    value is kept, so that multi_transform names the leaf and its value)."""
    if mask is None:
        return _DEFAULT
    if isinstance(mask, _ByPath):
        fn = mask.fn
        return by_path(lambda path, p: _name(fn(path, p)))
    if callable(mask):
        return lambda tree: _named(mask(tree), tree)
    return lambda tree: _named(mask, tree)


def _name(b: Any) -> Any:
    return "muon" if b is True else "fallback" if b is False else b


def _named(given: Any, tree: Any) -> Any:
    try:
        full = optree.tree_broadcast_prefix(given, tree, none_is_leaf=True)
    except ValueError as e:
        raise ValueError(
            f"muon: mask must be a tree of bools shaped like the parameters (or a prefix of it), or a function of them: {e}"
        ) from None
    return optree.tree_map(_name, full, none_is_leaf=True)


_DEFAULT = by_path(lambda path, p: "muon" if p.ndim == 2 else "fallback")


def _init(cfg: MuonConfig, params: Params) -> MuonState:
    leaves, treedef = checks.init_leaves(params, "muon")
    buffers = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in leaves]
    return MuonState(checks.zeros_count(leaves), optree.tree_unflatten(treedef, buffers))


def _leaves(cfg: MuonConfig, grads: Updates, state: MuonState, params: Params | None, need_params: bool):
    where = cfg.where
    checks.check_state(state, MuonState, where, grads=grads, params=params)
    ms, treedef = checks.flatten(state.momentum_buffer)
    gs, _ = checks.check_grads(grads, treedef, where)
    ps = None
    if need_params or params is not None:
        ps = checks.params_leaves(params, treedef, where, "weight_decay != 0")
        checks.check_dtypes(gs, ps, treedef, where, "params")
    else:
        checks.check_dtypes(gs, ms, treedef, where, "state.momentum_buffer")
    check_matrices([tuple(g.shape) for g in gs], lambda: checks.paths_of(treedef), where)
    return treedef, gs, ms, ps


def _pure(cfg: MuonConfig, grads: Updates, state: MuonState, params: Params | None = None) -> tuple[Updates, MuonState]:
    """``update``: the updates ``new - p`` (``-lr * adjust * O`` without parameters, for ``weight_decay=0``)."""
    if isinstance(grads, SplitTree):
        return shards.step(cfg, grads, state, params, None)
    treedef, gs, ms, ps = _leaves(cfg, grads, state, params, bool(cfg.weight_decay))
    lr = lr_now(cfg, state.count)
    new_ms, out = [], []
    for i, (g, m) in enumerate(zip(gs, ms)):
        m, u = momentum_step(cfg, g, m)
        o = orthogonalize(u, cfg.coefficients, cfg.steps, cfg.eps, cfg.ns_dtype)
        step = lr * cfg.ratio(tuple(g.shape))
        if ps is None:
            out.append(torch.mul(o.to(g.dtype), -step if not isinstance(step, Tensor) else -step.to(g.dtype)))
        else:
            out.append(torch.sub(descend(ps[i], o, decays(cfg, lr), step), ps[i]))
        new_ms.append(m)
    state = MuonState(state.count + 1, optree.tree_unflatten(treedef, new_ms))
    return optree.tree_unflatten(treedef, out), state


def _applied(cfg: MuonConfig, grads: Updates, state: MuonState, params: Params, request: Apply) -> tuple[Applied, MuonState]:
    """``apply_gradients``: torch's step itself, in place on donated parameters and buffers."""
    if isinstance(grads, SplitTree):
        return shards.step(cfg, grads, state, params, request)
    treedef, gs, ms, ps = _leaves(cfg, grads, state, params, True)
    in_place = request.donate and flat.disjoint(gs, ps, ms) and not checks.module_aliases(ps)
    flat.note(request.why, f"muon: torch.optim.Muon's step leaf by leaf, {'in place on the donated' if in_place else 'into new'} tensors")
    lr = lr_now(cfg, state.count)
    decay = decays(cfg, lr)
    new_ps, new_ms = [], []
    for g, m, p in zip(gs, ms, ps):
        m, u = momentum_step(cfg, g, m, in_place=in_place)
        o = orthogonalize(u, cfg.coefficients, cfg.steps, cfg.eps, cfg.ns_dtype)
        new_ps.append(descend(p, o, decay, lr * cfg.ratio(tuple(g.shape)), in_place=in_place))
        new_ms.append(m)
    state = MuonState(state.count + 1, optree.tree_unflatten(treedef, new_ms))
    return Applied(optree.tree_unflatten(treedef, new_ps)), state
