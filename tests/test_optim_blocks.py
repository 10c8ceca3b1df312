"""optax's building blocks in use: the optax-habit AdamW against fddp's adamw and torch.optim.AdamW,
on ZeRO's shards, under vmap, in inject_hyperparams; the names and their errors.

Their numbers against optax itself are tests/test_optax.py's.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.nn.functional as F

import fddp
from fddp import optim
from models import TinyGPT

VOCAB, CONTEXT, WIDTH, STEPS, WARMUP = 32, 6, 16, 20, 4
PEAK, END, WD, BETAS, EPS, MAX_NORM = 3e-2, 3e-3, 0.1, (0.9, 0.95), 1e-8, 0.85
SCHEDULE = optim.warmup_cosine_decay_schedule(0.0, PEAK, warmup_steps=WARMUP, decay_steps=STEPS, end_value=END)
DECAY = optim.by_path(lambda path, p: p.ndim >= 2)  # no decay on biases and norms


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, WIDTH, 2 * WIDTH).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=g)
    return ids[:, :-1], ids[:, 1:].flatten()


def _fddp(opt, fused: bool) -> tuple[dict, list[float]]:
    """``STEPS`` steps of ``opt`` (a chain starting with clip_by_global_norm) on the model; the
    parameters and the logged norms."""
    apply_fn, params = fddp.functionalize(_model())
    params = {k: v.detach().clone() for k, v in params.items()}
    grad_fn = torch.func.grad(lambda p, x, y: F.cross_entropy(apply_fn(p, x), y))
    state, norms = opt.init(params), []
    for step in range(STEPS):
        g = grad_fn(params, *_batch(step))
        if fused:
            params, state = optim.apply_gradients(opt, g, state, params)
        else:
            updates, state = opt.update(g, state, params)
            params = optim.apply_updates(params, updates)
        norms.append(float(state[0].norm))
    return params, norms


def _torch() -> tuple[dict, list[float]]:
    """torch.optim.AdamW with two param groups (nanoGPT's), clip_grad_norm_ and the schedule as LambdaLR."""
    model = _model()
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1.0, betas=BETAS, eps=EPS, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float(SCHEDULE(torch.tensor(step))))
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=True)))
        opt.step()
        sched.step()
    return {k: v.detach() for k, v in model.named_parameters()}, norms


def _optax_habit() -> optim.GradientTransformation:
    return optim.chain(
        optim.clip_by_global_norm(MAX_NORM),
        optim.scale_by_adam(b1=BETAS[0], b2=BETAS[1], eps=EPS),
        optim.add_decayed_weights(WD, mask=DECAY),
        optim.scale_by_learning_rate(SCHEDULE),
    )


def _rel(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in b)


def test_the_optax_habit_adamw_equals_fddps_adamw_and_torchs_adamw_with_param_groups():
    """The optax-habit LM: ``chain(clip_by_global_norm, scale_by_adam, add_decayed_weights(mask=),
    scale_by_learning_rate(warmup_cosine))``, float64, 20 steps.

    fddp's ``adamw(mask=)`` (``apply_gradients``: torch's fused kernel per group) equals
    ``torch.optim.AdamW`` with two param groups to the bit: the same arithmetic. The chain is
    optax's arithmetic, ``-lr * (m / bc1 / (sqrt(v / bc2) + eps) + wd * p)``, where torch computes
    ``p * (1 - lr * wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)``: equal in exact arithmetic,
    each a few roundings apart per step. Adam normalises each step to about ``lr``, so those
    differences do not grow geometrically: after 20 steps they stay near ``steps * eps`` relative
    to the parameters (measured about 1e-15); the bound, 1e-13, is a hundred times that and a
    billion times below a real difference (a step of another size, or decay on a bias: 1e-4 or more).
    """
    ref, ref_norms = _torch()
    fused, fused_norms = _fddp(optim.chain(optim.clip_by_global_norm(MAX_NORM), optim.adamw(SCHEDULE, BETAS, EPS, WD, mask=DECAY)), True)
    assert all(torch.equal(fused[k], ref[k]) for k in ref)
    assert fused_norms == ref_norms
    assert min(ref_norms) < MAX_NORM < max(ref_norms)  # some steps clipped, some not
    for fused_path in (False, True):
        habit, habit_norms = _fddp(_optax_habit(), fused_path)
        assert _rel(habit, ref) < 1e-13, _rel(habit, ref)
        assert habit_norms == pytest.approx(ref_norms, rel=1e-12)
    # The mask matters: decaying every leaf is far from torch's groups.
    everywhere, _ = _fddp(
        optim.chain(optim.clip_by_global_norm(MAX_NORM), optim.scale_by_adam(*BETAS, EPS), optim.add_decayed_weights(WD),
                    optim.scale_by_learning_rate(SCHEDULE)),
        False,
    )  # fmt: skip
    assert _rel(everywhere, ref) > 1e-6


# --- composition: shards, vmap, inject_hyperparams ------------------------------------------------------

CAPS = dict(bucket_cap_mb=0.0005, first_bucket_mb=0.0002)  # shards that cut through leaves

BLOCKS = {
    "scale_by_adam": lambda: optim.chain(optim.scale_by_adam(nesterov=True), optim.scale_by_learning_rate(1e-2)),
    "scale_by_amsgrad": lambda: optim.chain(optim.scale_by_amsgrad(), optim.scale(-1e-2)),
    "decayed_masked": lambda: optim.chain(
        optim.scale_by_adam(),
        optim.add_decayed_weights(lambda c: 0.1 * 0.9 ** c.double(), mask=DECAY),
        optim.scale_by_learning_rate(SCHEDULE),
    ),
    "trace": lambda: optim.chain(optim.trace(0.9, nesterov=True), optim.scale_by_schedule(lambda c: -0.05 / (1 + c.double()))),
    "ema": lambda: optim.chain(optim.ema(0.8), optim.clip(0.3), optim.scale(-0.1)),
    "rms": lambda: optim.chain(optim.scale_by_rms(bias_correction=True), optim.scale_by_learning_rate(1e-2)),
    "stddev": lambda: optim.chain(optim.scale_by_stddev(initial_scale=1.0), optim.scale_by_learning_rate(1e-2)),
    "zero_nans": lambda: optim.chain(optim.zero_nans(), optim.identity(), optim.scale(-0.1)),
    "apply_if_finite": lambda: optim.apply_if_finite(optim.chain(optim.scale_by_adam(), optim.scale(-0.1)), 2),
    "multi_transform": lambda: optim.multi_transform(
        {True: optim.chain(optim.scale_by_adam(), optim.scale(-1e-2)), False: optim.chain(optim.trace(0.5), optim.scale(-0.1))}, DECAY
    ),
}


def _grads_like(params: dict, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in params.items()}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_blocks_on_zero_shards_equal_the_replicated_step_to_the_bit(name):
    """One process, ZeRO shards cut through leaves: every block is elementwise (apply_if_finite's
    verdict and the norm are taken over the shards), so the shards step as the whole tensors do."""
    fddp.init()
    _, params = fddp.functionalize(TinyGPT(VOCAB, WIDTH, 2 * WIDTH))
    params = {k: v.detach().clone() for k, v in params.items()}
    opt = BLOCKS[name]()
    p, s = params, opt.init(params)
    sh = fddp.zero.shard(params, **CAPS)
    ss = opt.init(sh)
    assert any(len(pieces) > 1 for pieces in sh.split.pieces)
    for step in range(4):
        g = _grads_like(params, step)
        if name in ("zero_nans", "apply_if_finite") and step == 1:
            g["head.weight"][0, 0] = float("nan")
        p, s = optim.apply_gradients(opt, g, s, p)
        sh, ss = optim.apply_gradients(opt, fddp.zero.shard(g, **CAPS), ss, sh)
    full = fddp.zero.gather(sh).wait()
    assert all(torch.equal(full[k], p[k]) for k in p), name
    assert all(torch.equal(t[c.held :], torch.zeros_like(t[c.held :])) for t, c in zip(sh.shards, sh.layout.cuts))  # padding stays 0
    if name == "apply_if_finite":
        assert int(s.total_notfinite) == int(ss.total_notfinite) == 1


@pytest.mark.parametrize("name", sorted(set(BLOCKS) - {"multi_transform"}))
def test_blocks_under_vmap_equal_each_member_alone(name):
    """An ensemble of 3 optimizers under ``torch.func.vmap`` (counts, states, schedules batched)
    equals each member stepped alone."""
    opt = BLOCKS[name]()
    params = {"w": torch.randn(3, 4, 5), "b": torch.randn(3, 5)}
    state = torch.func.vmap(opt.init)(params)
    alone = [({k: v[i] for k, v in params.items()}, None) for i in range(3)]
    alone = [(p, opt.init(p)) for p, _ in alone]
    step = torch.func.vmap(lambda g, s, p: opt.update(g, s, p))
    for t in range(3):
        grads = {k: torch.randn_like(v) for k, v in params.items()}
        if name in ("zero_nans", "apply_if_finite") and t == 1:
            grads["w"][1, 0, 0] = float("nan")
        updates, state = step(grads, state, params)
        new = []
        for i, (p, s) in enumerate(alone):
            u, s = opt.update({k: v[i] for k, v in grads.items()}, s, p)
            assert all(torch.allclose(updates[k][i], u[k], rtol=1e-6, atol=1e-7) for k in u), (name, t, i)
            new.append((optim.apply_updates(p, u), s))
        alone = new
        params = optim.apply_updates(params, updates)


def test_inject_hyperparams_with_optax_names():
    """inject_hyperparams holds a block's numbers in the state, under the block's (optax's) names."""
    opt = optim.inject_hyperparams(optim.scale_by_adam)(b1=0.9, b2=0.99, eps=1e-8)
    params = {"w": torch.randn(4)}
    state = opt.init(params)
    ref = optim.scale_by_adam(b1=0.9, b2=0.99, eps=1e-8)
    ref_state = ref.init(params)
    for _ in range(3):
        g = {"w": torch.randn(4)}
        u, state = opt.update(g, state, params)
        v, ref_state = ref.update(g, ref_state, params)
        assert torch.equal(u["w"], v["w"])
    assert float(state.hyperparams["b2"]) == 0.99
    state = optim.set_hyperparams(state, b1=0.5)
    u, state = opt.update(g, state, params)
    assert not torch.equal(u["w"], optim.scale_by_adam(0.9, 0.99).update(g, ref_state, params)[0]["w"])


# --- names -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, parts",
    [
        (lambda: optim.adamw(learning_rate=1e-3), ["optax's keyword 'learning_rate'", "lr="]),
        (lambda: optim.adam(b1=0.9), ["'b1'", "betas=(b1, b2)"]),
        (lambda: optim.sgd(learning_rate=0.1, momentum=0.9), ["'learning_rate'", "lr="]),
        (lambda: optim.muon(learning_rate=0.02), ["'learning_rate'", "lr="]),
        (lambda: optim.inject_hyperparams(optim.adamw)(lr=1e-3, b2=0.95), ["'b2'", "betas=(b1, b2)"]),
        (lambda: optim.sgd(0.1, momentm=0.9), ["unexpected keyword argument 'momentm'", "did you mean 'momentum'"]),
    ],
)
def test_optax_keywords_on_the_all_in_ones_name_torchs(call, parts):
    with pytest.raises(TypeError) as e:
        call()
    for part in parts:
        assert part in str(e.value), (part, str(e.value))


def test_a_missing_name_suggests_the_nearest():
    for name, want in [("adamx", "'adam'"), ("warmup_cosine", "'warmup_cosine_decay_schedule'"), ("MultiSteps", "'accumulate'"),
                       ("scale_by_adams", "'scale_by_adam'")]:  # fmt: skip
        with pytest.raises(AttributeError) as e:
            getattr(optim, name)
        assert want in str(e.value), str(e.value)
    assert not hasattr(optim, "__no_such_dunder__")
    assert optim.apply_if_finite is fddp.apply_if_finite


def test_every_block_is_exported_and_every_state_is_a_namedtuple_of_tensors():
    params = {"w": torch.randn(2, 3), "b": torch.randn(3)}
    for make in BLOCKS.values():
        state = make().init(params)
        assert all(isinstance(x, torch.Tensor) for x in optree.tree_leaves(state)), state


def test_piecewise_constant_schedule_is_torchs_multisteplr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[10, 25, 40], gamma=0.3)
    ours = optim.piecewise_constant_schedule(0.1, {m: 0.3 for m in (10, 25, 40)})
    for step in range(60):
        assert float(ours(torch.tensor(step))) == opt.param_groups[0]["lr"], step
        opt.step()
        sched.step()


def test_traces_buffer_is_torch_sgds_momentum_buffer():
    """``trace``'s buffer is ``torch.optim.SGD``'s without dampening, to the bit (the same multiply
    and add), fed the same gradients at the same parameters."""
    p = torch.nn.Parameter(torch.randn(7, 3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True)
    t = optim.trace(0.9, nesterov=True)
    state = t.init({"p": p.detach()})
    for step in range(10):
        g = torch.randn(7, 3)
        p.grad = g.clone()
        opt.step()
        _, state = t.update({"p": g}, state)
        assert torch.equal(state.trace["p"], opt.state[p]["momentum_buffer"]), step


def test_block_states_round_trip_a_checkpoint(tmp_path):
    """Every block's state (counts, bool flags, moments) saves and loads as any fddp state, and the
    resumed run continues bit for bit."""
    fddp.init()
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    for name, make in BLOCKS.items():
        opt = make()
        state = opt.init(params)
        g = {k: torch.randn_like(v) for k, v in params.items()}
        _, state = opt.update(g, state, params)
        path = tmp_path / f"{name}.pt"
        fddp.checkpoint.save(path, state)
        back = fddp.checkpoint.load(path, like=opt.init(params))
        a, _ = opt.update(g, state, params)
        b, _ = opt.update(g, back, params)
        assert all(torch.equal(a[k], b[k]) for k in a), name


def _nan_on_one_rank_worker() -> tuple:
    """2 ranks, ZeRO-2 shards of one tree; a NaN in a gradient element that one rank holds."""
    fddp.init()
    rank = fddp.rank()
    params = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    opt = optim.apply_if_finite(optim.chain(optim.scale_by_adam(), optim.scale(-0.1)), 3)
    sh = fddp.zero.shard(params)
    state = opt.init(sh)
    g = {"w": torch.ones(3, 4), "b": torch.ones(5)}
    g["b"][-1] = float("nan")  # in one rank's shard only (the test checks which holds it)
    gs = fddp.zero.shard(g)
    holds_nan = bool(torch.isnan(torch.cat([t.flatten() for t in gs.shards])).any())
    new_sh, state = optim.apply_gradients(opt, gs, state, sh)
    kept = all(torch.equal(a, b) for a, b in zip(new_sh.shards, sh.shards))
    return rank, holds_nan, kept, int(state.total_notfinite), int(state.inner_state[0].count)


def test_apply_if_finite_on_shards_skips_on_every_rank_together():
    """The verdict is the ranks' together (one all-reduce): the rank whose shard holds no NaN skips too."""
    from dist import run

    results = run(_nan_on_one_rank_worker, 2)
    assert sorted(r[1] for r in results) == [False, True]  # one rank's shard holds the NaN, the other's does not
    assert all(kept and total == 1 and count == 0 for _, _, kept, total, count in results), results
