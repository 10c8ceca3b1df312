"""fddp.optim's building blocks and schedules against optax itself: the same gradients, float64, 60 steps.

Each transformation runs beside optax's (``jax_enable_x64``, optax run eagerly: each jnp op is
one XLA call, as fddp's are torch calls), both fed the same float64 gradients, each updating its
own parameters. The arithmetic is optax's operation for operation; what may differ is the last
bit of a transcendental (``pow`` in a bias correction, ``cos`` in a schedule, ``rsqrt``, ``sqrt``
is correctly rounded on both), which then propagates. So the bound is in units of float64's eps
(2.2e-16), relative to each leaf's largest value over the run: ``TOL_ULPS`` ulps, far below any real error (a
wrong order of operations or a missing bias correction is off by 1e-3 or more), and ``EXACT``
lists the transformations whose arithmetic has no transcendental at all and must equal optax
to the bit.
"""

from __future__ import annotations

import numpy as np
import optree
import pytest
import torch

from fddp import optim

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
jax.config.update("jax_enable_x64", True)
jnp = jax.numpy

STEPS = 60
SHAPES = {"b": (4,), "s": (), "w": (5, 4)}
MASK = {"b": False, "s": False, "w": True}
TOL_ULPS = 16  # bound on |fddp - optax| / max|optax| per leaf and run, in float64 eps (measured: at most 3)
EPS = float(np.finfo(np.float64).eps)


def _params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}


def _grads(step: int, nans: bool = False) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    out = {k: torch.randn(s, generator=g, dtype=torch.float64) * (1 + step % 3) for k, s in SHAPES.items()}
    if nans and step % 7 == 3:
        out["w"] = out["w"].clone()
        out["w"][1, 2] = float("nan")
    if nans and step % 11 == 5:
        out["b"] = torch.full_like(out["b"], float("inf"))
    return out


def _j(tree):
    return optree.tree_map(lambda t: jnp.asarray(t.numpy()), tree)


def _ulps(a: np.ndarray, b: np.ndarray, floor: float = 0.0) -> float:
    """The largest difference relative to the largest value, in float64 eps: a normwise bound, over
    a leaf's whole trajectory (a value near zero, from a cancellation in ``(1 - b1) * g + b1 * m``
    or a parameter crossing zero, holds the rounding error of the larger values it came from);
    NaNs and infinities must match exactly. ``floor``: the smallest scale (the parameters start at
    about 1)."""
    assert a.shape == b.shape and a.dtype == b.dtype == np.float64
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return 0.0
    assert np.isfinite(a[~same]).all() and np.isfinite(b[~same]).all(), (a, b)
    scale = max(np.max(np.abs(b[np.isfinite(b)])), floor)
    return float(np.max(np.abs(a - b)[~same]) / scale / EPS)


def _run(fddp_opt, optax_opt, *, nans: bool = False, steps: int = STEPS, jit: bool = False) -> float:
    """Both optimizers for ``steps`` steps from the same parameters; the worst difference (ulps) of
    each leaf's updates, parameters and state over the run. Non-float state (counts, flags) must be equal."""
    p = _params()
    jp = _j(p)
    s, js = fddp_opt.init(p), optax_opt.init(jp)
    optax_update = jax.jit(optax_opt.update) if jit else optax_opt.update
    ours: dict = {}
    theirs: dict = {}
    for step in range(steps):
        g = _grads(step, nans)
        u, s = fddp_opt.update(g, s, p)
        ju, js = optax_update(_j(g), js, jp)
        p = optim.apply_updates(p, u)
        jp = optax.apply_updates(jp, ju)
        pairs = [(("u", k), u[k], ju[k]) for k in SHAPES] + [(("p", k), p[k], jp[k]) for k in SHAPES]
        state_pairs = list(zip(_state_leaves(s), jax.tree.leaves(js), strict=True))
        pairs += [(("s", i), x, y) for i, (x, y) in enumerate(state_pairs)]
        for key, x, y in pairs:
            ours.setdefault(key, []).append(x.numpy())
            theirs.setdefault(key, []).append(np.asarray(y))
    worst = 0.0
    for key in ours:
        x, y = np.stack(ours[key]), np.stack(theirs[key])
        if x.dtype != np.float64:
            assert np.array_equal(x, y.astype(x.dtype)), (key, x, y)
            continue
        worst = max(worst, _ulps(x, y, floor=1.0 if key[0] == "p" else 0.0))
    return worst


def _state_leaves(state) -> list:
    return [x for x in optree.tree_leaves(state, none_is_leaf=False) if isinstance(x, torch.Tensor)]


def _f64(schedule):
    """optax's schedule fed a float64 count: optax passes an int32 count, and jax computes ``int32 / int``
    in float32 even under ``jax_enable_x64``, where fddp's schedules compute in float64."""
    return lambda count: schedule(jnp.asarray(count, jnp.float64))


def _sched_torch(count):  # torch computes 0.97 ** int64 in float32 (its default dtype): ask for float64
    return 0.1 * 0.97 ** count.double()


def _sched_jax(count):
    return 0.1 * 0.97 ** jnp.asarray(count, jnp.float64)


CASES = {
    # name: (fddp, optax)
    "identity": (optim.identity(), optax.identity()),
    "scale": (optim.scale(-0.3), optax.scale(-0.3)),
    "scale_by_schedule": (optim.scale_by_schedule(_sched_torch), optax.scale_by_schedule(_sched_jax)),
    "scale_by_learning_rate": (optim.scale_by_learning_rate(0.1), optax.scale_by_learning_rate(0.1)),
    "scale_by_learning_rate_schedule": (
        optim.scale_by_learning_rate(optim.linear_schedule(0.0, 0.1, 20)),
        optax.scale_by_learning_rate(_f64(optax.linear_schedule(0.0, 0.1, 20))),
    ),
    "scale_by_learning_rate_no_flip": (
        optim.scale_by_learning_rate(0.1, flip_sign=False),
        optax.scale_by_learning_rate(0.1, flip_sign=False),
    ),
    "add_decayed_weights": (optim.add_decayed_weights(0.1), optax.add_decayed_weights(0.1)),
    "add_decayed_weights_mask": (optim.add_decayed_weights(0.1, mask=MASK), optax.add_decayed_weights(0.1, mask=MASK)),
    "add_decayed_weights_mask_fn": (
        optim.add_decayed_weights(0.1, mask=optim.by_path(lambda path, p: p.ndim >= 2)),
        optax.add_decayed_weights(0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    ),
    "add_decayed_weights_schedule": (optim.add_decayed_weights(_sched_torch), optax.add_decayed_weights(_sched_jax)),
    "trace": (optim.trace(0.9), optax.trace(0.9)),
    "trace_nesterov": (optim.trace(0.9, nesterov=True), optax.trace(0.9, nesterov=True)),
    "ema": (optim.ema(0.9), optax.ema(0.9)),
    "ema_no_debias": (optim.ema(0.9, debias=False), optax.ema(0.9, debias=False)),
    "clip": (optim.clip(1.5), optax.clip(1.5)),
    "scale_by_rms": (optim.scale_by_rms(), optax.scale_by_rms()),
    "scale_by_rms_torch_eps": (
        optim.scale_by_rms(0.99, 1e-6, initial_scale=1.0, eps_in_sqrt=False, bias_correction=True),
        optax.scale_by_rms(0.99, 1e-6, initial_scale=1.0, eps_in_sqrt=False, bias_correction=True),
    ),
    "scale_by_stddev": (optim.scale_by_stddev(), optax.scale_by_stddev()),
    "scale_by_stddev_bias_corrected": (
        optim.scale_by_stddev(0.95, 1e-6, eps_in_sqrt=False, bias_correction=True),
        optax.scale_by_stddev(0.95, 1e-6, eps_in_sqrt=False, bias_correction=True),
    ),
    "scale_by_adam": (optim.scale_by_adam(), optax.scale_by_adam()),
    "scale_by_adam_args": (
        optim.scale_by_adam(0.8, 0.95, eps=1e-6, eps_root=1e-10),
        optax.scale_by_adam(0.8, 0.95, eps=1e-6, eps_root=1e-10),
    ),
    "scale_by_adam_nesterov": (optim.scale_by_adam(nesterov=True), optax.scale_by_adam(nesterov=True)),
    "scale_by_amsgrad": (optim.scale_by_amsgrad(b2=0.9), optax.scale_by_amsgrad(b2=0.9)),
    "adamw_chain": (
        optim.chain(
            optim.scale_by_adam(b2=0.95),
            optim.add_decayed_weights(0.1, mask=MASK),
            optim.scale_by_learning_rate(optim.warmup_cosine_decay_schedule(0.0, 1e-2, 10, STEPS, 1e-3)),
        ),
        optax.chain(
            optax.scale_by_adam(b2=0.95),
            optax.add_decayed_weights(0.1, mask=MASK),
            optax.scale_by_learning_rate(_f64(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, STEPS, 1e-3))),
        ),
    ),
}
WITH_NANS = {
    "zero_nans": (optim.zero_nans(), optax.zero_nans()),
    "apply_if_finite": (
        optim.apply_if_finite(optim.chain(optim.scale_by_adam(), optim.scale(-0.1)), 1),
        optax.apply_if_finite(optax.chain(optax.scale_by_adam(), optax.scale(-0.1)), 1),
    ),
}
# No transcendental in the arithmetic: equal to optax to the bit.
EXACT = {
    "identity", "scale", "scale_by_learning_rate", "scale_by_learning_rate_no_flip", "scale_by_learning_rate_schedule",
    "add_decayed_weights", "add_decayed_weights_mask", "add_decayed_weights_mask_fn", "trace", "trace_nesterov",
    "ema_no_debias", "clip", "zero_nans",
}  # fmt: skip
# Compiled by jax, for time (optax's lax.cond and a joined schedule re-trace at every eager call):
# XLA then contracts a * b + c into one fused multiply-add, which rounds once, so these are
# compared within the bound, never to the bit.
JIT = {"apply_if_finite", "adamw_chain"}


@pytest.mark.parametrize("name", sorted(CASES) + sorted(WITH_NANS))
def test_transformation_equals_optax(name):
    fddp_opt, optax_opt = CASES.get(name) or WITH_NANS[name]
    worst = _run(fddp_opt, optax_opt, nans=name in WITH_NANS, jit=name in JIT)
    bound = 0 if name in EXACT else TOL_ULPS
    assert worst <= bound, f"{name}: {worst:.1f} ulps from optax (bound {bound})"


# --- schedules ----------------------------------------------------------------------------------------

SCHEDULES = {
    # name: (fddp, optax), optax's arguments on both sides
    "constant_schedule": (optim.constant_schedule(0.3), optax.constant_schedule(0.3)),
    "linear_schedule": (optim.linear_schedule(0.1, 0.01, 50, transition_begin=20), optax.linear_schedule(0.1, 0.01, 50, 20)),
    "polynomial_schedule": (optim.polynomial_schedule(0.1, 0.001, 2.5, 100, 10), optax.polynomial_schedule(0.1, 0.001, 2.5, 100, 10)),
    "polynomial_schedule_no_steps": (optim.polynomial_schedule(0.1, 0.0, 2, 0), optax.polynomial_schedule(0.1, 0.0, 2, 0)),
    "cosine_decay_schedule": (optim.cosine_decay_schedule(0.1, 150, alpha=0.05), optax.cosine_decay_schedule(0.1, 150, alpha=0.05)),
    "cosine_decay_schedule_exponent": (
        optim.cosine_decay_schedule(0.1, 150, 0.1, exponent=2.0),
        optax.cosine_decay_schedule(0.1, 150, 0.1, exponent=2.0),
    ),
    "exponential_decay": (optim.exponential_decay(0.1, 30, 0.5), optax.exponential_decay(0.1, 30, 0.5)),
    "exponential_decay_all": (
        optim.exponential_decay(0.1, 30, 0.5, transition_begin=15, staircase=True, end_value=0.01),
        optax.exponential_decay(0.1, 30, 0.5, transition_begin=15, staircase=True, end_value=0.01),
    ),
    "exponential_growth_bounded": (
        optim.exponential_decay(0.1, 10, 1.5, end_value=2.0),
        optax.exponential_decay(0.1, 10, 1.5, end_value=2.0),
    ),
    "piecewise_constant_schedule": (
        optim.piecewise_constant_schedule(0.1, {30: 0.1, 80: 0.5, 140: 0.0}),
        optax.piecewise_constant_schedule(0.1, {30: 0.1, 80: 0.5, 140: 0.0}),
    ),
    "join_schedules": (
        optim.join_schedules(
            [optim.constant_schedule(0.2), optim.linear_schedule(0.2, 0.0, 40), optim.cosine_decay_schedule(0.1, 50)], [25, 60]
        ),
        optax.join_schedules(
            [optax.constant_schedule(0.2), optax.linear_schedule(0.2, 0.0, 40), optax.cosine_decay_schedule(0.1, 50)], [25, 60]
        ),
    ),
    "warmup_constant_schedule": (optim.warmup_constant_schedule(0.0, 0.1, 40), optax.warmup_constant_schedule(0.0, 0.1, 40)),
    "warmup_cosine_decay_schedule": (
        optim.warmup_cosine_decay_schedule(0.0, 0.1, 20, 150, end_value=0.001),
        optax.warmup_cosine_decay_schedule(0.0, 0.1, 20, 150, end_value=0.001),
    ),
    "warmup_cosine_decay_schedule_no_warmup": (
        optim.warmup_cosine_decay_schedule(0.1, 0.1, 0, 150, exponent=0.5),
        optax.warmup_cosine_decay_schedule(0.1, 0.1, 0, 150, exponent=0.5),
    ),
    "warmup_exponential_decay_schedule": (
        optim.warmup_exponential_decay_schedule(0.0, 0.1, 20, 25, 0.7, transition_begin=5, end_value=0.02),
        optax.warmup_exponential_decay_schedule(0.0, 0.1, 20, 25, 0.7, transition_begin=5, end_value=0.02),
    ),
}
# No transcendental (pow with an integer power, clamps, where): equal to optax to the bit.
EXACT_SCHEDULES = {
    "constant_schedule", "linear_schedule", "polynomial_schedule_no_steps", "piecewise_constant_schedule", "warmup_constant_schedule",
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_equals_optax(name):
    """Steps 0 to 199 (past every boundary and end), optax's schedule fed a float64 count (see
    :func:`_f64`); fddp's a float64 tensor, as every fddp schedule returns."""
    ours, theirs = SCHEDULES[name]
    counts = range(200)
    a = np.array([ours(torch.tensor(c)).item() for c in counts])
    assert all(ours(torch.tensor(c)).dtype == torch.float64 for c in (0, 199))
    b = np.array([float(_f64(theirs)(c)) for c in counts])  # one count at a time, as optimizers call them
    worst = _ulps(a, b)
    bound = 0 if name in EXACT_SCHEDULES else 4  # cos and pow: one rounding each, propagated once
    assert worst <= bound, f"{name}: {worst:.1f} ulps from optax (bound {bound})"
    assert np.ptp(b) > 0 or name in ("constant_schedule", "polynomial_schedule_no_steps")  # the range exercises the schedule


def test_schedules_in_a_transformation_under_vmap_and_with_an_int64_count():
    """A schedule gets fddp's int64 count tensor, batched under vmap (an ensemble of optimizers whose
    counts differ), and gives each member its own value."""
    schedule = optim.warmup_cosine_decay_schedule(0.0, 0.1, 5, 50)
    counts = torch.tensor([0, 3, 10, 60])
    batched = torch.func.vmap(schedule)(counts)
    assert torch.equal(batched, torch.stack([schedule(c) for c in counts]))


def test_fddps_earlier_exponential_decay_is_optaxs_with_one_step_per_factor():
    old = optim.exponential_decay(0.1, 0.97)  # fddp's (init_value, decay_rate), torch's ExponentialLR
    new = optim.exponential_decay(0.1, transition_steps=1, decay_rate=0.97)
    assert all(torch.equal(old(torch.tensor(c)), new(torch.tensor(c))) for c in range(50))
    assert float(old(torch.tensor(10))) == pytest.approx(0.1 * 0.97**10, rel=1e-15)
