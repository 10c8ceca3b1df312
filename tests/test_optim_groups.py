"""Parameter groups and injected hyperparameters against torch.optim's param groups and lr_scheduler.

The references are torch's: ``torch.optim.AdamW([{"params": ..., "weight_decay": 0.0}, ...])`` for
masks and groups, and a torch optimizer driven by ``torch.optim.lr_scheduler`` for hyperparameters
changed mid-run. ``apply_gradients`` runs torch's fused kernels once per group, so it equals
``fused=True`` to the bit at every step; ``update`` + ``apply_updates`` follows torch's
arithmetic with its own rounding (tolerances as in ``tests/test_optim.py``).
"""

from __future__ import annotations

import copy
import os
import tempfile

import optree
import pytest
import torch
from test_optim import flat_and_per_leaf
from torch.func import functional_call, grad, stack_module_state, vmap

import fddp
from fddp import optim

RTOL, ATOL = 1e-5, 1e-6


def _model(seed: int = 0) -> torch.nn.Module:
    # Matrices, biases and a norm: what a language-model recipe decays and what it does not.
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.Tanh(), torch.nn.Linear(16, 5)
    )


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, generator=g), torch.randint(0, 5, (32,), generator=g)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


DECAY = optim.by_path(lambda path, p: p.ndim >= 2)  # no decay on biases and norms


def _torch_groups(model, **no_decay):
    """torch's recipe: matrices in one group, biases and norms in another with ``no_decay``'s options."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim >= 2]},
        {"params": [p for _, p in named if p.ndim < 2], **no_decay},
    ]


def _train(opt, topt_factory, steps, *, fused, donate=False, each_step=None, every_step_exact=False):
    """Train ours and torch's side by side; ``each_step(i, state, topt, sched)`` may change both."""
    model = _model()
    x, y = _batch()
    params = _params(model)
    tmodel = copy.deepcopy(model)
    topt, sched = topt_factory(tmodel)
    state = opt.init(params)

    def loss(p):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    for i in range(steps):
        if each_step is not None:
            state = each_step(i, state, topt)
        g = grad(loss)(params)
        if fused:
            params, state = optim.apply_gradients(opt, g, state, params, donate=donate)
        else:
            updates, state = opt.update(g, state, params)
            params = optim.apply_updates(params, updates)
        topt.zero_grad()
        torch.nn.functional.cross_entropy(tmodel(x), y).backward()
        topt.step()
        if sched is not None:
            sched.step()
        if every_step_exact:
            for k, p in tmodel.named_parameters():
                assert torch.equal(params[k], p.detach()), f"step {i}: {k} differs from torch's"
    for k, p in tmodel.named_parameters():
        torch.testing.assert_close(params[k], p.detach(), rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
    return params, state


# --- masks and groups against torch's param groups ----------------------------------------------------

GROUPED = {
    # name: (ours, torch's param groups on the model, exact when fused)
    "adamw_mask": (
        lambda: optim.adamw(1e-2, betas=(0.8, 0.99), weight_decay=0.1, mask=DECAY),
        lambda m, fused: torch.optim.AdamW(_torch_groups(m, weight_decay=0.0), lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, fused=fused),
        True,
    ),
    "adam_l2_mask_amsgrad": (
        lambda: optim.adam(1e-2, weight_decay=0.1, amsgrad=True, mask=DECAY),
        lambda m, fused: torch.optim.Adam(_torch_groups(m, weight_decay=0.0), lr=1e-2, weight_decay=0.1, amsgrad=True, fused=fused),
        True,
    ),
    "multi_transform_lr": (
        lambda: optim.multi_transform(
            {"body": optim.adamw(1e-3, weight_decay=0.1), "head": optim.adamw(1e-2, weight_decay=0.0)},
            optim.by_path(lambda path, p: "head" if path.startswith("3.") else "body"),
        ),
        lambda m, fused: torch.optim.AdamW(
            [{"params": [p for k, p in m.named_parameters() if not k.startswith("3.")]},
             {"params": m[3].parameters(), "lr": 1e-2, "weight_decay": 0.0}],
            lr=1e-3, weight_decay=0.1, fused=fused,
        ),
        True,
    ),  # fmt: skip
    "sgd_mask_momentum": (
        lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, mask=DECAY),
        lambda m, fused: torch.optim.SGD(_torch_groups(m, weight_decay=0.0), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        False,  # fddp's fused SGD rounds b' = g + m b once, torch twice (tests/test_optim_fast.py)
    ),
    "multi_transform_sgd_adam": (
        lambda: optim.multi_transform(
            {True: optim.adamw(1e-2, weight_decay=0.1), False: optim.sgd(0.05)}, optim.by_path(lambda path, p: p.ndim >= 2)
        ),
        None,  # two torch optimizers: see test_multi_transform_of_two_kinds_equals_two_torch_optimizers
        False,
    ),
}


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
@pytest.mark.parametrize("name", [n for n, v in GROUPED.items() if v[1] is not None])
def test_groups_match_torch_param_groups(name, fused):
    make, make_torch, exact = GROUPED[name]
    steps = 20  # unfused, Adam at lr 1e-2 random-walks its rounding apart after ~50 steps
    _train(make(), lambda m: (make_torch(m, fused and exact), None), steps, fused=fused, every_step_exact=fused and exact)


@pytest.mark.parametrize("name", ["adamw_mask", "multi_transform_lr"])
def test_donated_groups_update_in_place_and_equal_torch_fused(name):
    make, make_torch, _ = GROUPED[name]
    opt = make()
    params, state = _train(opt, lambda m: (make_torch(m, True), None), 20, fused=True, donate=True, every_step_exact=True)

    def where(tree):  # every donated tensor (the counts are new scalars each step)
        return [t.data_ptr() for t in optree.tree_leaves(tree) if t.dim() > 0]

    before = where((params, state))
    new = optim.apply_gradients(opt, {k: torch.randn_like(v) for k, v in params.items()}, state, params, donate=True)
    assert where(new) == before, "not updated in place"


def test_multi_transform_of_two_kinds_equals_two_torch_optimizers():
    make, _, _ = GROUPED["multi_transform_sgd_adam"]
    model = _model()
    tmodel = copy.deepcopy(model)
    named = dict(tmodel.named_parameters())
    big = [p for p in named.values() if p.ndim >= 2]
    small = [p for p in named.values() if p.ndim < 2]
    topts = [torch.optim.AdamW(big, lr=1e-2, weight_decay=0.1, fused=True), torch.optim.SGD(small, lr=0.05)]
    x, y = _batch()
    params = _params(model)
    opt = make()
    state = opt.init(params)
    for _ in range(20):
        g = grad(lambda p: torch.nn.functional.cross_entropy(functional_call(model, p, (x,)), y))(params)
        params, state = optim.apply_gradients(opt, g, state, params)
        for o in topts:
            o.zero_grad()
        torch.nn.functional.cross_entropy(tmodel(x), y).backward()
        for o in topts:
            o.step()
    for k, p in named.items():
        assert torch.equal(params[k], p.detach()), k  # plain SGD's fused step and AdamW's are torch's to the bit
    assert set(state.inner_states) == {True, False} and int(state.inner_states[True].count) == 20


def test_masked_clips_the_masked_leaves_only():
    # chain(masked(clip, big), sgd): torch clips the matrices' gradients alone, then steps all.
    def clipped_sgd(tmodel):
        topt = torch.optim.SGD(tmodel.parameters(), lr=0.5, momentum=0.9)
        matrices = [p for p in tmodel.parameters() if p.ndim >= 2]

        def clip(*_):  # after backward, before the step
            torch.nn.utils.clip_grad_norm_(matrices, 0.1)

        topt.register_step_pre_hook(clip)
        return topt, None

    opt = optim.chain(optim.masked(optim.clip_by_global_norm(0.1), DECAY), optim.sgd(0.5, momentum=0.9))
    _, state = _train(opt, clipped_sgd, 20, fused=True)
    assert isinstance(state[0], optim.MaskedState)


def test_set_to_zero_freezes_a_group_and_the_rest_trains_as_alone():
    # Only the head trains in torch; the frozen leaves of its model keep their initial values, which
    # every_step_exact compares with ours at every step.
    frozen = optim.by_path(lambda path, p: "train" if path.startswith("3.") else "frozen")
    opt = optim.multi_transform({"train": optim.adamw(1e-2), "frozen": optim.set_to_zero()}, frozen)
    head_only = lambda m: (torch.optim.AdamW(m[3].parameters(), lr=1e-2, fused=True), None)  # noqa: E731
    params, state = _train(opt, head_only, 10, fused=True, every_step_exact=True)
    start = _params(_model())
    assert all(torch.equal(params[k], start[k]) for k in params if not k.startswith("3."))
    x, y = _batch()
    g = grad(lambda p: torch.nn.functional.cross_entropy(functional_call(_model(), p, (x,)), y))(params)
    updates, _ = opt.update(g, state, params)
    assert all(torch.equal(updates[k], torch.zeros_like(updates[k])) for k in params if not k.startswith("3."))


def test_labels_as_a_prefix_tree_and_the_paths_errors_name():
    params = {"body": {"w": torch.randn(3, 3), "b": torch.randn(3)}, "head": {"w": torch.randn(2, 3)}}
    grads = optree.tree_map(torch.randn_like, params)
    opt = optim.multi_transform({"a": optim.sgd(0.1), "b": optim.sgd(1.0)}, {"body": "a", "head": "b"})
    updates, state = opt.update(grads, opt.init(params), params)
    assert torch.equal(updates["body"]["b"], grads["body"]["b"] * -0.1)
    assert torch.equal(updates["head"]["w"], grads["head"]["w"] * -1.0)
    # A nested tree's groups see it with a MaskedNode for every other leaf: the paths stay, the
    # fused step runs per group, and the state checkpoints.
    adam = optim.multi_transform({"a": optim.adamw(1e-2), "b": optim.adamw(1e-3)}, {"body": "a", "head": "b"})
    s0 = adam.init(params)
    assert isinstance(s0.inner_states["a"].exp_avg["head"]["w"], optim.MaskedNode)
    fused, s1 = optim.apply_gradients(adam, grads, s0, params)
    u, s2 = adam.update(grads, s0, params)
    for a, b in zip(optree.tree_leaves((fused, s1)), optree.tree_leaves((optim.apply_updates(params, u), s2))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with tempfile.TemporaryDirectory() as d:
        fddp.checkpoint.save(os.path.join(d, "s.pt"), s1)
        loaded = fddp.checkpoint.load(os.path.join(d, "s.pt"), like=s1)
    assert all(torch.equal(a, b) for a, b in zip(optree.tree_leaves(loaded), optree.tree_leaves(s1)))
    with pytest.raises(ValueError, match=r"leaf 'head/w' has the label 'c', which is not one of the transforms \('a', 'b'\)"):
        optim.multi_transform({"a": optim.sgd(0.1), "b": optim.sgd(1.0)}, {"body": "a", "head": "c"}).init(params)
    with pytest.raises(ValueError, match="prefix"):
        optim.multi_transform({"a": optim.sgd(0.1)}, {"other": "a"}).init(params)
    with pytest.raises(TypeError, match=r"leaf 'body/b' has the label tensor\(False\); a label is a plain hashable value"):
        optim.adamw(mask=optim.by_path(lambda path, p: torch.tensor(p.ndim >= 2))).init(params)
    with pytest.raises(ValueError, match=r"leaf 'body/b' has the label 'yes'"):
        optim.adamw(mask=optim.by_path(lambda path, p: "yes")).update(grads, optim.adamw().init(params), params)
    # An optimizer with a mask keeps its own state type, over the whole tree.
    masked_state = optim.adamw(mask=optim.by_path(lambda path, p: p.ndim >= 2)).init(params)
    assert isinstance(masked_state, optim.AdamState) and masked_state.exp_avg["body"]["b"].shape == (3,)


def test_grouped_flat_and_per_leaf_paths_identical(monkeypatch):
    def make():
        return optim.chain(optim.masked(optim.clip_by_global_norm(0.5), DECAY), GROUPED["adamw_mask"][0]())

    fast, slow = flat_and_per_leaf(make, _params(_model()), monkeypatch)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_grouped_under_vmap_equals_separate_models():
    models = [_model(seed) for seed in range(3)]
    stacked, _ = stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    grads = {k: torch.randn_like(v) for k, v in stacked.items()}
    opt = GROUPED["adamw_mask"][0]()  # the mask sees each member's shapes: a bias is 1-d inside vmap
    updates, _ = vmap(opt.update)(grads, vmap(opt.init)(stacked), stacked)
    for i in range(3):
        p = {k: v[i] for k, v in stacked.items()}
        mine, _ = opt.update({k: v[i] for k, v in grads.items()}, opt.init(p), p)
        for k in p:
            torch.testing.assert_close(updates[k][i], mine[k], rtol=1e-6, atol=1e-7)


# --- hyperparameters as state against torch.optim.lr_scheduler --------------------------------------------


def test_step_lr_by_reading_back_and_setting_the_learning_rate():
    # StepLR(step_size=7, gamma=0.5), written as a user would: read the lr back, set it halved.
    opt = optim.inject_hyperparams(optim.adamw)(lr=1e-2, weight_decay=0.1)

    def each_step(i, state, topt):
        if i and i % 7 == 0:
            state = optim.set_hyperparams(state, lr=float(state.hyperparams["lr"]) * 0.5)
        assert float(state.hyperparams["lr"]) == topt.param_groups[0]["lr"]
        return state

    S = torch.optim.lr_scheduler
    for fused in (False, True):
        _train(
            opt,
            lambda m: (o := torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, fused=fused), S.StepLR(o, 7, 0.5)),
            30, fused=fused, each_step=each_step, every_step_exact=fused,
        )  # fmt: skip


def test_lambda_lr_on_every_group_of_injected_optimizers():
    # LambdaLR sets every param group's lr; set_hyperparams sets every injected group's.
    lam = lambda epoch: 1.0 / (1 + epoch) ** 0.5  # noqa: E731
    adamw = optim.inject_hyperparams(optim.adamw)
    opt = optim.multi_transform(
        {True: adamw(lr=1e-2, weight_decay=0.1), False: adamw(lr=1e-2, weight_decay=0.0)}, DECAY
    )

    def each_step(i, state, topt):
        return optim.set_hyperparams(state, lr=1e-2 * lam(i))

    S = torch.optim.lr_scheduler
    _train(
        opt,
        lambda m: (o := torch.optim.AdamW(_torch_groups(m, weight_decay=0.0), lr=1e-2, weight_decay=0.1, fused=True), S.LambdaLR(o, lam)),
        30, fused=True, each_step=each_step, every_step_exact=True,
    )  # fmt: skip


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_one_cycle_lr_and_momentum_set_each_step(fused):
    # OneCycleLR moves lr and beta1 at every step; a torch scheduler on a dummy optimizer computes
    # them (as a user porting a torch recipe might) and set_hyperparams hands both to ours.
    S = torch.optim.lr_scheduler
    dummy = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    clock = S.OneCycleLR(dummy, max_lr=1e-2, total_steps=40)
    opt = optim.inject_hyperparams(optim.adamw)(lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1, mask=DECAY)

    def each_step(i, state, topt):
        if i:
            dummy.step()
            clock.step()
        group = dummy.param_groups[0]
        assert group["lr"] == topt.param_groups[0]["lr"] and group["betas"] == topt.param_groups[0]["betas"]
        return optim.set_hyperparams(state, lr=group["lr"], betas=group["betas"])

    def reference(m):
        o = torch.optim.AdamW(_torch_groups(m, weight_decay=0.0), lr=1e-2, weight_decay=0.1, fused=fused)
        return o, S.OneCycleLR(o, max_lr=1e-2, total_steps=40)

    _, state = _train(opt, reference, 40, fused=fused, each_step=each_step, every_step_exact=fused)
    assert isinstance(state.inner_state, optim.AdamState) and int(state.count) == 40


def test_a_scheduled_hyperparameter_is_recorded_in_the_state():
    S = torch.optim.lr_scheduler
    seen = []
    opt = optim.inject_hyperparams(optim.sgd)(lr=optim.cosine_decay(0.1, 25, alpha=0.1), momentum=0.9)

    def each_step(i, state, topt):
        seen.append((float(state.hyperparams["lr"]), topt.param_groups[0]["lr"]))
        return state

    _train(
        opt,
        lambda m: (o := torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), S.CosineAnnealingLR(o, 25, 0.01)),
        25, fused=False, each_step=each_step,
    )  # fmt: skip
    # The state shows the lr of the update just taken: before step i that is step i - 1's.
    ours = torch.tensor([s[0] for s in seen], dtype=torch.float64)
    torch_lrs = torch.tensor([s[1] for s in seen], dtype=torch.float64)
    torch.testing.assert_close(ours[1:], torch_lrs[:-1], rtol=1e-12, atol=0)
    assert ours[0] == 0.1  # before the first update: the value the first will use


def test_injected_state_round_trips_through_a_checkpoint():
    params = _params(_model())
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(6)]
    opt = optim.inject_hyperparams(optim.adamw)(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, mask=DECAY)

    def run(p, s, gs):
        for g in gs:
            p, s = optim.apply_gradients(opt, g, s, p)
        return p, s

    p, s = run(params, opt.init(params), grads[:3])
    s = optim.set_hyperparams(s, lr=3e-3, betas=(0.8, 0.95))
    straight = run(p, s, grads[3:])
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "state.pt")
        fddp.checkpoint.save(path, {"params": p, "opt": s})
        loaded = fddp.checkpoint.load(path, like={"params": p, "opt": s})
    assert loaded["opt"].hyperparams["betas"][0].item() == 0.8
    resumed = run(loaded["params"], loaded["opt"], grads[3:])
    for a, b in zip(optree.tree_leaves(straight), optree.tree_leaves(resumed)):
        assert torch.equal(a, b)


def test_injected_hyperparameters_errors():
    params = _params(_model())
    state = optim.inject_hyperparams(optim.adamw)(lr=1e-3).init(params)
    with pytest.raises(KeyError, match="no injected hyperparameter 'weight_decay'; the state holds lr"):
        optim.set_hyperparams(state, weight_decay=0.1)
    with pytest.raises(KeyError, match="holds no injected hyperparameters"):
        optim.set_hyperparams(optim.adamw().init(params), lr=0.1)
    with pytest.raises(TypeError, match="by name"):
        optim.inject_hyperparams(optim.adamw)(1e-3)
    with pytest.raises(ValueError, match=r"lr=-1\.0"):
        optim.inject_hyperparams(optim.adamw)(lr=-1.0)  # the optimizer's own check, at construction
    with pytest.raises(ValueError, match="holds 2 values"):
        optim.set_hyperparams(optim.inject_hyperparams(optim.adam)(betas=(0.9, 0.99)).init(params), betas=0.9)
    # A set value is a CPU scalar of the kind it replaces, whatever it arrived as.
    new = optim.set_hyperparams(state, lr=torch.tensor(5e-4, dtype=torch.float32))
    assert new.hyperparams["lr"].dtype == torch.float64 and state.hyperparams["lr"].item() == 1e-3


def test_an_integer_hyperparameter_does_not_truncate_later_values():
    # Issue 38 item 6: lr=1, momentum=0 as ints, then set to 0.5 and 0.9, held 0 and 0 (int64).
    opt = optim.inject_hyperparams(optim.sgd)(lr=1, momentum=0)
    params = {"w": torch.ones(3)}
    state = optim.set_hyperparams(opt.init(params), lr=0.5, momentum=0.9)
    assert float(state.hyperparams["lr"]) == 0.5 and float(state.hyperparams["momentum"]) == 0.9
    assert state.hyperparams["lr"].dtype == torch.float64
    g = {"w": torch.full((3,), 2.0)}
    ref = torch.nn.Parameter(torch.ones(3))
    topt = torch.optim.SGD([ref], lr=0.5, momentum=0.9)
    for _ in range(3):
        params, state = optim.apply_gradients(opt, g, state, params)
        ref.grad = g["w"].clone()
        topt.step()
    assert torch.equal(params["w"], ref.detach())
    # Momentum switched on mid-run, then off, as torch's param_groups allow (its buffer is made at
    # the first step that uses momentum, and kept while momentum is 0).
    for fused in (False, True):
        opt = optim.inject_hyperparams(optim.sgd)(lr=1, momentum=0, dampening=0.5 if not fused else 0)
        params, state = {"w": torch.ones(3)}, None
        ref = torch.nn.Parameter(torch.ones(3))
        topt = torch.optim.SGD([ref], lr=1, momentum=0, dampening=0.5 if not fused else 0)
        state = opt.init(params)
        for i, (lr, mom) in enumerate([(1, 0), (0.5, 0.9), (0.5, 0.9), (0.25, 0), (0.25, 0.8)]):
            state = optim.set_hyperparams(state, lr=lr, momentum=mom)
            topt.param_groups[0].update(lr=lr, momentum=mom)
            gi = {"w": torch.tensor([0.5, -1.0, 2.0]) * (i + 1)}
            if fused:
                params, state = optim.apply_gradients(opt, gi, state, params)
            else:
                u, state = opt.update(gi, state, params)
                params = optim.apply_updates(params, u)
            ref.grad = gi["w"].clone()
            topt.step()
            assert torch.equal(params["w"], ref.detach()), (fused, i, params["w"], ref)
    # A factory argument that must stay an int gets an int while its value is whole.
    seen = []

    def make(lr, every):
        seen.append(type(every))
        return optim.sgd(lr)

    opt = optim.inject_hyperparams(make)(lr=0.1, every=4)
    state = opt.init(params)
    opt.update(g, optim.set_hyperparams(state, every=2), params)
    assert seen and all(t is int for t in seen)
