"""Tests for fddp.optim against torch.optim, torch.optim.lr_scheduler and clip_grad_norm_."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

from fddp import optim
from fddp.optim import _flat as flat

# Trajectories follow their own parameters (grads at our params vs torch's at torch's), so ulp-level
# differences random-walk over 100 steps; atol covers parameters near zero.
RTOL, ATOL = 1e-5, 1e-6


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10)
    )


def _data(n: int = 32):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def _loss_fn(model):
    x, y = _data()

    def loss(params):
        return torch.nn.functional.cross_entropy(functional_call(model, params, (x,)), y)

    return loss


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _run_pair(fopt, topt_factory, steps=100, scheduler_factory=None):
    model = _model()
    loss = _loss_fn(model)
    params = _params(model)
    tmodel = copy.deepcopy(model)
    topt = topt_factory(tmodel.parameters())
    sched = scheduler_factory(topt) if scheduler_factory else None
    state = fopt.init(params)
    for _ in range(steps):
        updates, state = fopt.update(grad(loss)(params), state, params)
        params = optim.apply_updates(params, updates)
        topt.zero_grad()
        torch.nn.functional.cross_entropy(tmodel(_data()[0]), _data()[1]).backward()
        topt.step()
        if sched:
            sched.step()
    for k, p in tmodel.named_parameters():
        torch.testing.assert_close(params[k], p.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
    return state


SGD_CONFIGS = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, dampening=0.5),
    dict(momentum=0.9, nesterov=True),
    dict(momentum=0.9, weight_decay=1e-2),
    dict(weight_decay=1e-2),
]


@pytest.mark.parametrize("kw", SGD_CONFIGS, ids=str)
def test_sgd_matches_torch(kw):
    _run_pair(optim.sgd(0.05, **kw), lambda ps: torch.optim.SGD(ps, lr=0.05, **kw))


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adam_matches_torch(amsgrad, wd):
    _run_pair(
        optim.adam(1e-3, weight_decay=wd, amsgrad=amsgrad),
        lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=wd, amsgrad=amsgrad),
    )


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_matches_torch(amsgrad):
    _run_pair(
        optim.adamw(1e-3, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=amsgrad),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.1, amsgrad=amsgrad),
    )


def test_adamw_cosine_schedule_matches_lr_scheduler():
    S = torch.optim.lr_scheduler
    _run_pair(
        optim.adamw(optim.cosine_decay(1e-3, decay_steps=100, alpha=0.1)),
        lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        scheduler_factory=lambda o: S.CosineAnnealingLR(o, T_max=100, eta_min=1e-4),
    )


def test_sgd_linear_schedule_matches_lr_scheduler():
    S = torch.optim.lr_scheduler
    _run_pair(
        optim.sgd(optim.linear(0.02, 0.1, transition_steps=40), momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        scheduler_factory=lambda o: S.LinearLR(o, start_factor=0.2, end_factor=1.0, total_iters=40),
    )


def _torch_lrs(make_sched, base, n):
    p = torch.nn.Parameter(torch.zeros(1))
    o = torch.optim.SGD([p], lr=base)
    s = make_sched(o)
    out = []
    for _ in range(n):
        out.append(o.param_groups[0]["lr"])
        o.step()
        s.step()
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (optim.constant(0.1), lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=1.0)),
        (optim.linear(0.01, 0.1, 30), lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 30)),
        (optim.cosine_decay(0.1, 60, alpha=0.2), lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 60, 0.02)),
        (optim.exponential_decay(0.1, 0.97), lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.97)),
        (
            optim.warmup_cosine_decay(0.01, 0.1, warmup_steps=10, decay_steps=60, end_value=0.005),
            lambda o: torch.optim.lr_scheduler.SequentialLR(
                o,
                [
                    torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 10),
                    torch.optim.lr_scheduler.CosineAnnealingLR(o, 50, 0.005),
                ],
                milestones=[10],
            ),
        ),
    ],
    ids=["constant", "linear", "cosine", "exponential", "warmup_cosine"],
)
def test_schedules_match_lr_scheduler(ours, theirs):
    n = 60
    expected = _torch_lrs(theirs, 0.1, n)
    got = torch.stack([ours(torch.tensor(i)) for i in range(n)])
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_clip_by_global_norm_matches_torch():
    params = _params(_model())
    grads = {k: torch.randn_like(v) * 10 for k, v in params.items()}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    for k, p in ref.items():
        p.grad = grads[k].clone()
    torch.nn.utils.clip_grad_norm_(list(ref.values()), 1.0)
    clip = optim.clip_by_global_norm(1.0)
    out, _ = clip.update(grads, clip.init(params))
    for k in params:
        torch.testing.assert_close(out[k], ref[k].grad, rtol=0, atol=0)
    small = {k: v * 1e-6 for k, v in grads.items()}
    out, _ = clip.update(small, clip.init(params))
    for k in params:
        torch.testing.assert_close(out[k], small[k], rtol=0, atol=0)


def _deep(seed: int = 0, dtype=None) -> torch.nn.Module:
    # Twelve layers: optree sorts "10.weight" before "2.weight", torch keeps definition order.
    torch.manual_seed(seed)
    layers = [m for _ in range(6) for m in (torch.nn.Linear(9, 9), torch.nn.LayerNorm(9))]
    model = torch.nn.Sequential(*layers)
    if dtype is not None:
        model[3].to(dtype)  # a second dtype: torch groups norms by device and dtype
    return model


def _torch_clip(model, grads, max_norm):
    ref = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p, (k, _) in zip(ref, model.named_parameters()):
        p.grad = grads[k].clone()
    total = torch.nn.utils.clip_grad_norm_(ref, max_norm, foreach=True)
    return total, {k: p.grad for p, (k, _) in zip(ref, model.named_parameters())}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "with_bf16"])
def test_clip_and_global_norm_equal_torch_foreach_to_the_bit(dtype):
    # Issue 41: the norms were stacked in optree's sorted order, not torch's, 7.45e-9 off at one step.
    model = _deep(dtype=dtype)
    params = _params(model)
    assert list(params) != sorted(params)
    clip = optim.clip_by_global_norm(1.0)
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        grads = {k: (torch.randn(v.shape, generator=g) * 0.3).to(v.dtype) for k, v in params.items()}
        total, ref = _torch_clip(model, grads, 1.0)
        norm = optim.global_norm(grads)
        assert norm.dtype == total.dtype and torch.equal(norm, total), (seed, norm, total)
        assert torch.equal(norm, torch.nn.utils.get_total_norm(list(grads.values()), foreach=True))
        out, state = clip.update(grads, clip.init(params))
        assert torch.equal(state.norm, total)
        for k in params:
            assert torch.equal(out[k], ref[k]), (seed, k)
    # Under the norm: scaled by exactly 1, as torch.
    small = {k: v * 1e-3 for k, v in grads.items()}
    out, state = clip.update(small, clip.init(params))
    assert all(torch.equal(out[k], small[k]) for k in params) and float(state.norm) < 1


def test_clip_state_logs_the_norm_through_chain_and_apply_gradients():
    model = _deep()
    params = _params(model)
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2))
    state = opt.init(params)
    assert isinstance(state[0], optim.ClipByGlobalNormState) and float(state[0].norm) == 0.0
    tmodel = copy.deepcopy(model)
    topt = torch.optim.AdamW(tmodel.parameters(), lr=1e-2, fused=True)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
        params, state = optim.apply_gradients(opt, grads, state, params)
        for k, p in tmodel.named_parameters():
            p.grad = grads[k].clone()
        total = torch.nn.utils.clip_grad_norm_(tmodel.parameters(), 0.5, foreach=True)
        topt.step()
        assert torch.equal(state[0].norm, total)
        for k, p in tmodel.named_parameters():
            assert torch.equal(params[k], p.detach()), (i, k)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_clip_and_global_norm_equal_torch_foreach_on_cuda():
    # torch's CUDA _foreach_norm and its stacking order, as on the CPU; bf16 leaves included.
    model = _deep(dtype=torch.bfloat16).cuda()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    clip = optim.clip_by_global_norm(1.0)
    for seed in range(4):
        g = torch.Generator(device="cuda").manual_seed(seed)
        grads = {k: (torch.randn(v.shape, generator=g, device="cuda") * 0.3).to(v.dtype) for k, v in params.items()}
        total, ref = _torch_clip(model, grads, 1.0)
        assert torch.equal(optim.global_norm(grads), total)
        out, state = clip.update(grads, clip.init(params))
        assert torch.equal(state.norm, total) and all(torch.equal(out[k], ref[k]) for k in params)


def test_global_norm_of_an_empty_tree_and_the_errors():
    assert torch.equal(optim.global_norm({}), torch.tensor(0.0))
    with pytest.raises(TypeError, match="grad 'b' must be a tensor"):
        optim.global_norm({"a": torch.ones(2), "b": 3})


def test_chain_clip_then_sgd_matches_torch():
    model = _model()
    loss = _loss_fn(model)
    params = _params(model)
    tmodel = copy.deepcopy(model)
    topt = torch.optim.SGD(tmodel.parameters(), lr=0.5, momentum=0.9)
    opt = optim.chain(optim.clip_by_global_norm(0.1), optim.sgd(0.5, momentum=0.9))
    state = opt.init(params)
    x, y = _data()
    for _ in range(20):
        updates, state = opt.update(grad(loss)(params), state, params)
        params = optim.apply_updates(params, updates)
        topt.zero_grad()
        torch.nn.functional.cross_entropy(tmodel(x), y).backward()
        torch.nn.utils.clip_grad_norm_(tmodel.parameters(), 0.1)
        topt.step()
    for k, p in tmodel.named_parameters():
        torch.testing.assert_close(params[k], p.detach(), rtol=RTOL, atol=ATOL)


def test_accumulate_equals_big_batch():
    # Float64: four means of 8 samples and one mean of 32 are different reductions (conv backward
    # picks its kernel by batch size and thread count), and Adam scales a near-zero gradient's
    # rounding up to a whole step; in float32 that difference would depend on the CPU.
    model = _model().double()
    x, y = _data(32)
    x = x.double()
    params = _params(model)

    def loss(p, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (xb,)), yb)

    big = optim.adam(1e-2)
    acc = optim.accumulate(optim.adam(1e-2), every_k=4)
    pb, pa = params, params
    sb, sa = big.init(params), acc.init(params)
    for step in range(3):
        u, sb = big.update(grad(loss)(pb, x, y), sb, pb)
        pb = optim.apply_updates(pb, u)
        for i in range(4):
            before = pa
            u, sa = acc.update(grad(loss)(pa, x[i * 8 : (i + 1) * 8], y[i * 8 : (i + 1) * 8]), sa, pa)
            pa = optim.apply_updates(pa, u)
            if i < 3:
                assert all(torch.equal(pa[k], before[k]) for k in pa)
        assert int(sa.inner.count) == step + 1 and int(sa.mini_step) == 0
        for k in pb:
            torch.testing.assert_close(pa[k], pb[k], rtol=1e-8, atol=1e-9)  # Adam: lr * rounding / eps at worst


def test_accumulate_sync_once_pattern():
    """The documented pattern (sync the window sum on the k-th step) equals plain accumulation."""
    params = _params(_model())
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(4)]
    opt = optim.accumulate(optim.sgd(0.1), every_k=4)
    s1 = s2 = opt.init(params)
    for i, g in enumerate(grads):
        u1, s1 = opt.update(g, s1, params)
        if (i + 1) % 4 == 0:
            g = optree.tree_map(torch.add, s2.grad_sum, g)  # identity stands in for fddp.ddp_step
            s2 = s2._replace(grad_sum=optree.tree_map(torch.zeros_like, s2.grad_sum))
        u2, s2 = opt.update(g, s2, params)
    for k in params:
        torch.testing.assert_close(u1[k], u2[k], rtol=1e-6, atol=1e-7)


ALL_OPTS = {
    "sgd": lambda: optim.sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2),
    "nesterov": lambda: optim.sgd(optim.cosine_decay(0.1, 10), momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(1e-2, weight_decay=1e-2, amsgrad=True),
    "adamw": lambda: optim.adamw(optim.warmup_cosine_decay(0.0, 1e-2, 2, 10)),
    "chain": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2)),
    "accumulate": lambda: optim.accumulate(optim.adamw(1e-2), every_k=2),
}


def _force_per_leaf(monkeypatch):
    monkeypatch.setattr(flat, "multi_tensor_ok", lambda tensors: False)


def flat_and_per_leaf(make, params, monkeypatch, steps=4):
    """``steps`` of ``update`` + ``apply_updates`` of the optimizer ``make()`` on random gradients,
    on the flat (multi-tensor) path and then forced per leaf: both results, as flat leaf lists."""
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(steps)]

    def run():
        opt = make()
        p, s = params, opt.init(params)
        for g in grads:
            u, s = opt.update(g, s, p)
            p = optim.apply_updates(p, u)
        return optree.tree_leaves((p, s))

    fast = run()
    _force_per_leaf(monkeypatch)
    return fast, run()


@pytest.mark.parametrize("name", ALL_OPTS)
def test_flat_and_per_leaf_paths_identical(name, monkeypatch):
    fast, slow = flat_and_per_leaf(ALL_OPTS[name], _params(_model()), monkeypatch)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ALL_OPTS)
def test_vmap_ensemble_equals_separate_updates(name):
    models = [_model(seed) for seed in range(8)]
    stacked, _ = stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    loss = _loss_fn(models[0])
    opt = ALL_OPTS[name]()
    state = vmap(opt.init)(stacked)
    singles = [(_params(m), opt.init(_params(m))) for m in models]
    for _ in range(3):
        # Both sides take the same gradients: vmap(grad) and a loop of grad run different kernels,
        # which round differently on some CPUs, and Adam normalises that difference up to ~1e-5.
        grads = vmap(grad(loss))(stacked)
        updates, state, stacked, singles = vmapped_and_alone(opt, grads, state, stacked, singles)
    assert_members_equal(stacked, state, singles)
    assert all(u.dtype == torch.float32 for u in updates.values())


def test_update_compiles_to_one_graph_and_matches_eager():
    # fullgraph=True: no graph break in update (no .item(), no float() of a tensor), with a
    # schedule and with a constant lr and weight decay. Float64, so that inductor's fused kernels
    # and eager's, which round differently, agree far below the tolerance on any CPU.
    params = {k: v.double() for k, v in _params(_model()).items()}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    scheduled = optim.adamw(optim.warmup_cosine_decay(0.0, 1e-2, 2, 10), amsgrad=True)
    constant = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))

    def both(grads, states, params):
        (u1, s1), (u2, s2) = scheduled.update(grads, states[0], params), constant.update(grads, states[1], params)
        return (u1, u2), (s1, s2)

    compiled = torch.compile(both, fullgraph=True)
    s_e = s_c = (scheduled.init(params), constant.init(params))
    for _ in range(3):
        u_e, s_e = both(grads, s_e, params)
        u_c, s_c = compiled(grads, s_c, params)
        for a, b in zip(optree.tree_leaves(u_c), optree.tree_leaves(u_e)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-15)
    assert int(s_c[0].count) == 3


DTYPE_OPTS = {**ALL_OPTS, "plain_sgd": lambda: optim.sgd(0.1)}


def test_torch_refuses_a_gradient_of_another_dtype():
    # The rule fddp.optim follows: a gradient has its parameter's dtype.
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(RuntimeError, match="dtype"):
        p.grad = torch.ones(3, dtype=torch.float64)


@pytest.mark.parametrize("how", ["update", "apply_gradients", "donate"])
@pytest.mark.parametrize("name", DTYPE_OPTS)
def test_gradients_of_another_dtype_are_refused_naming_the_leaf(name, how):
    params = _params(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    grads["3.weight"] = grads["3.weight"].double()
    opt = DTYPE_OPTS[name]()
    state = opt.init(params)
    message = r"grad '3.weight' has dtype torch.float64, but its parameter has dtype torch.float32"
    with pytest.raises(TypeError, match=message):
        if how == "update":
            opt.update(grads, state, params)
        else:
            optim.apply_gradients(opt, grads, state, params, donate=how == "donate")
    # bf16 parameters with bf16 gradients are fine; float32 updates into bf16 params too (apply_updates casts).
    bf16 = {k: v.bfloat16() for k, v in params.items()}
    updates, _ = opt.update({k: torch.ones_like(v) for k, v in bf16.items()}, opt.init(bf16), bf16)
    optim.apply_updates(bf16, {k: u.float() for k, u in updates.items()})


@pytest.mark.parametrize("name", ALL_OPTS)
def test_inputs_are_not_modified(name):
    params = _params(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = ALL_OPTS[name]()
    state = opt.init(params)
    state = opt.update(grads, state, params)[1]  # a non-trivial state
    snapshot = [t.clone() for t in optree.tree_leaves((grads, state, params))]
    updates, _ = opt.update(grads, state, params)
    optim.apply_updates(params, updates)
    for before, after in zip(snapshot, optree.tree_leaves((grads, state, params))):
        assert torch.equal(before, after)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_bf16_params_stay_bf16(name):
    params = {k: v.to(torch.bfloat16) for k, v in _params(_model()).items()}
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = ALL_OPTS[name]()
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    new = optim.apply_updates(params, updates)
    assert all(v.dtype == torch.bfloat16 for v in new.values())
    fp32_updates = {k: u.float() for k, u in updates.items()}
    assert all(v.dtype == torch.bfloat16 for v in optim.apply_updates(params, fp32_updates).values())


def test_count_is_a_tensor_and_state_is_a_namedtuple_pytree():
    params = _params(_model())
    state = optim.adamw().init(params)
    assert isinstance(state, optim.AdamState) and state.count.dtype == torch.int64
    assert all(isinstance(t, torch.Tensor) for t in optree.tree_leaves(state))


def test_grads_tree_mismatch_names_the_leaf():
    params = _params(_model())
    opt = optim.adamw()
    state = opt.init(params)
    grads = {k: v for k, v in params.items() if k != "3.bias"}
    with pytest.raises(ValueError, match=r"missing '3.bias'"):
        opt.update(grads, state, params)
    grads = dict(params, extra=torch.zeros(1))
    with pytest.raises(ValueError, match=r"unexpected 'extra'"):
        opt.update(grads, state, params)
    with pytest.raises(TypeError, match=r"grad '0.bias' must be a tensor, got NoneType"):
        opt.update(dict(params, **{"0.bias": None}), state, params)
    with pytest.raises(ValueError, match="params are required"):
        opt.update(params, state)


def test_state_from_another_optimizer_is_rejected():
    params = _params(_model())
    adam_state = optim.adam().init(params)
    with pytest.raises(TypeError, match="sgd.update: expected an SGDState .*got AdamState"):
        optim.sgd(0.1).update(params, adam_state, params)
    with pytest.raises(TypeError, match="amsgrad"):
        optim.adam(amsgrad=True).update(params, adam_state, params)
    with pytest.raises(TypeError, match="chain.update expected a tuple of 2 states"):
        optim.chain(optim.clip_by_global_norm(1.0), optim.adam()).update(params, adam_state, params)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: optim.sgd(-0.1), r"lr=-0\.1"),
        (lambda: optim.adam(lr=-1.0), r"lr=-1\.0"),
        (lambda: optim.adamw(betas=(1.0, 0.999)), r"betas\[0\]=1\.0"),
        (lambda: optim.adam(betas=(0.9, -0.1)), r"betas\[1\]=-0\.1"),
        (lambda: optim.adam(eps=-1e-8), r"eps=-1e-08"),
        (lambda: optim.adamw(weight_decay=-1.0), r"weight_decay=-1\.0"),
        (lambda: optim.sgd(0.1, momentum=-0.9), r"momentum=-0\.9"),
        (lambda: optim.sgd(0.1, nesterov=True), "nesterov"),
        (lambda: optim.clip_by_global_norm(0.0), r"max_norm=0\.0"),
        (lambda: optim.accumulate(optim.sgd(0.1), 0), r"every_k=0"),
        (lambda: optim.cosine_decay(0.1, 0), r"decay_steps=0"),
    ],
)
def test_invalid_hyperparameters_rejected_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def vmapped_and_alone(opt, grads: dict, state, stacked: dict, singles: list) -> tuple:
    """One step of a vmapped ensemble and of each member alone, from the same stacked gradients."""
    updates, state = vmap(opt.update)(grads, state, stacked)
    stacked = optim.apply_updates(stacked, updates)
    new = []
    for i, (p, s) in enumerate(singles):
        u, s = opt.update({k: g[i] for k, g in grads.items()}, s, p)
        new.append((optim.apply_updates(p, u), s))
    return updates, state, stacked, new


def assert_members_equal(stacked: dict, state, singles: list) -> None:
    """Each ensemble member's parameters and state equal the member stepped alone (float32 roundings)."""
    for i, (p, s) in enumerate(singles):
        for k in p:
            torch.testing.assert_close(stacked[k][i], p[k], rtol=1e-6, atol=1e-7)
        for a, b in zip(optree.tree_leaves(state), optree.tree_leaves(s)):
            torch.testing.assert_close(a[i], b, rtol=1e-6, atol=1e-7)
