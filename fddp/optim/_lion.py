"""Lion: optax's ``scale_by_lion``, and ``lion`` built on it (optax's numbers, torch's keyword names)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from . import _checks as checks
from . import _elementwise as ew
from ._base import GradientTransformationExtraArgs
from ._by_leaf import layout_of, leaf_flags
from ._checks import Params, ScalarOrSchedule, Updates
from ._groups import Labels
from ._names import torch_names
from ._trust_ratio import _decayed, _scale_by_lr

__all__ = ["ScaleByLionState", "scale_by_lion", "LionState", "lion"]


class ScaleByLionState(NamedTuple):
    """State of :func:`scale_by_lion` (optax's).

    Attributes:
        count: number of updates so far (int64 scalar tensor).
        mu: the momentum, same tree as params.
    """

    count: Tensor
    mu: Updates


LionState = ScaleByLionState  # lion's state: optax's lion chains scale_by_lion with stateless blocks


def _lion_direction(gs: list[Tensor], mus: list[Tensor], b1: float, b2: float) -> tuple[list[Tensor], list[Tensor]]:
    """optax: ``sign((1 - b1) g + b1 m)``, and the momentum ``(1 - b2) g + b2 m``."""
    us = [torch.sign((1.0 - b1) * g + b1 * m) for g, m in zip(gs, mus)]
    return us, [(1.0 - b2) * g + b2 * m for g, m in zip(gs, mus)]


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformationExtraArgs:
    """Rescale updates by Lion's sign of an interpolated momentum, as ``optax.scale_by_lion``.

    The update is ``sign((1 - b1) * g + b1 * mu)`` and the momentum becomes
    ``(1 - b2) * g + b2 * mu`` (optax's default ``mode="hard"``). Elementwise: it runs on
    ``fddp.zero``'s shards as on whole parameters.

    Args:
        b1: the weight of the momentum in the update's sign.
        b2: the momentum's decay.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`ScaleByLionState`.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> t = fddp.optim.scale_by_lion()
        >>> direction, state = t.update({"w": torch.tensor([0.5, -1.0, 0.0])}, t.init(params))
    """
    ew.check_betas((b1, b2), "scale_by_lion")
    where = "scale_by_lion.update"

    def init(params: Params) -> ScaleByLionState:
        leaves, treedef = checks.init_leaves(params, "scale_by_lion")
        return ScaleByLionState(checks.zeros_count(leaves), ew.zeros(leaves, treedef))

    def update(grads: Updates, state: ScaleByLionState, params: Params | None = None, **extra: Any) -> tuple[Updates, ScaleByLionState]:
        treedef, gs, (mus,), _ = ew.leaves(where, ScaleByLionState, grads, state, params, ("mu",), False)
        us, new_mu = _lion_direction(gs, mus, b1, b2)
        tree = functools.partial(optree.tree_unflatten, treedef)
        return tree(us), ScaleByLionState(state.count + 1, tree(new_mu))

    return GradientTransformationExtraArgs(init, update)


@torch_names
def lion(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.99),
    weight_decay: float = 1e-3,
    *,
    mask: Labels | None = None,
) -> GradientTransformationExtraArgs:
    """Lion, as ``optax.lion`` (optax's numbers and defaults, torch's keyword names).

    ``chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(lr))``: the update is ``-lr * (sign((1 - b1) g + b1 m) + weight_decay * p)``.
    torch.optim has no Lion. Its learning rate is typically 3-10x smaller than AdamW's, its
    weight decay 3-10x larger.

    Args:
        lr: learning rate, a float or a schedule; optax's ``learning_rate``.
        betas: optax's ``(b1, b2)``.
        weight_decay: decoupled decay, added to the sign before the learning rate.
        mask: where weight decay applies (as in :func:`fddp.optim.adamw`); ``None`` decays every leaf.

    Returns:
        A ``GradientTransformationExtraArgs`` whose state is a :class:`LionState`.

    Example:
        >>> params = {"w": torch.ones(3)}
        >>> opt = fddp.optim.lion(lr=1e-4, weight_decay=1e-2)
        >>> state = opt.init(params)
        >>> params, state = fddp.optim.apply_gradients(opt, {"w": torch.full((3,), 0.5)}, state, params)
    """
    ew.check_args("lion", lr, betas, weight_decay=weight_decay)
    b1, b2 = float(betas[0]), float(betas[1])
    where = "lion.update"

    def init(params: Params) -> LionState:
        leaves, treedef = checks.init_leaves(params, "lion")
        return LionState(checks.zeros_count(leaves), ew.zeros(leaves, treedef))

    def update(grads: Updates, state: LionState, params: Params | None = None, **extra: Any) -> tuple[Updates, LionState]:
        treedef, gs, (mus,), ps = ew.leaves(where, LionState, grads, state, params, ("mu",), bool(weight_decay))
        us, new_mu = _lion_direction(gs, mus, b1, b2)
        if weight_decay:
            layout = layout_of(params, ps, treedef, where)
            us = _decayed(layout, us, ps, weight_decay, leaf_flags(mask, params, ps, treedef, where))
        us = _scale_by_lr(us, checks.lr_at(lr, state.count))
        tree = functools.partial(optree.tree_unflatten, treedef)
        return tree(us), LionState(state.count + 1, tree(new_mu))

    return GradientTransformationExtraArgs(init, update)
