"""rmsprop, adagrad, nadam, radam and adafactor against torch.optim's RMSprop, Adagrad, NAdam, RAdam, Adafactor.

``apply_gradients`` runs torch's single-tensor arithmetic op for op, so after 30 steps on the same
gradients its parameters equal ``torch.optim.*(foreach=False)``'s to the bit (float32, on any
CPU: the same kernels on the same values). ``update`` + ``apply_updates`` adds the update as a
separate tensor (one rounding more per step), and agrees within 1e-6.
"""

from __future__ import annotations

import optree
import pytest
import torch
from test_optim import assert_members_equal, vmapped_and_alone
from torch.func import stack_module_state, vmap

from fddp import optim
from fddp.optim import _flat as flat

STEPS = 30


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 131), torch.nn.LayerNorm(131))


def _grads(params: dict, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in params.items()}


CASES = {
    "rmsprop": (optim.rmsprop, torch.optim.RMSprop, dict(lr=1e-2)),
    "rmsprop_centered_momentum_wd": (
        optim.rmsprop, torch.optim.RMSprop, dict(lr=1e-2, alpha=0.9, centered=True, momentum=0.5, weight_decay=0.1)
    ),
    "rmsprop_momentum": (optim.rmsprop, torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9, eps=1e-6)),
    "adagrad": (optim.adagrad, torch.optim.Adagrad, dict(lr=0.1)),
    "adagrad_all": (
        optim.adagrad, torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1, eps=1e-8)
    ),
    "nadam": (optim.nadam, torch.optim.NAdam, dict(lr=1e-2)),
    "nadam_l2": (optim.nadam, torch.optim.NAdam, dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, momentum_decay=1e-2)),
    "nadamw": (optim.nadam, torch.optim.NAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    "radam": (optim.radam, torch.optim.RAdam, dict(lr=1e-2)),
    "radam_l2": (optim.radam, torch.optim.RAdam, dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    "radamw": (optim.radam, torch.optim.RAdam, dict(lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)),
    "adafactor": (optim.adafactor, torch.optim.Adafactor, dict(lr=1e-2)),
    "adafactor_all": (optim.adafactor, torch.optim.Adafactor, dict(lr=0.1, beta2_decay=-0.5, eps=(1e-20, 1e-2), d=1.5, weight_decay=0.1)),
}


def _torch_run(T, kw: dict, params: dict, steps: int) -> dict:
    model = _model()
    topt = T(model.parameters(), foreach=False, **kw)
    for step in range(steps):
        grads = _grads(params, step)
        for k, p in model.named_parameters():
            p.grad = grads[k].clone()
        topt.step()
    return {k: p.detach() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", CASES)
def test_apply_gradients_equals_torch_to_the_bit_and_update_within_rounding(name):
    make, T, kw = CASES[name]
    opt = make(**kw)
    start = {k: v.detach().clone() for k, v in _model().named_parameters()}
    expected = _torch_run(T, kw, start, STEPS)
    applied, s1 = start, opt.init(start)
    updated, s2 = start, opt.init(start)
    for step in range(STEPS):
        grads = _grads(start, step)
        applied, s1 = optim.apply_gradients(opt, grads, s1, applied)
        u, s2 = opt.update(grads, s2, updated)
        updated = optim.apply_updates(updated, u)
    assert max((expected[k] - start[k]).abs().max().item() for k in start) > 1e-3  # it trained
    for k in start:
        assert torch.equal(applied[k], expected[k]), (name, k, (applied[k] - expected[k]).abs().max().item())
        torch.testing.assert_close(updated[k], expected[k], rtol=1e-5, atol=1e-6)


def _with_schedule(make, T) -> tuple[dict, torch.nn.Module]:
    """12 steps of ``make(lr=schedule)`` and of torch's ``T`` whose lr is set to the schedule's
    value before each step (a schedule's value at count i is torch's lr at step i + 1): the
    parameters, and torch's model."""
    sched = optim.linear(0.02, 0.1, transition_steps=10)
    start = {k: v.detach().clone() for k, v in _model().named_parameters()}
    model = _model()
    topt = T(model.parameters(), lr=0.02, foreach=False)
    opt = make(lr=sched)
    params, state = start, opt.init(start)
    for step in range(12):
        for g in topt.param_groups:
            g["lr"] = float(sched(torch.tensor(step)))
        grads = _grads(start, step)
        for k, p in model.named_parameters():
            p.grad = grads[k].clone()
        topt.step()
        params, state = optim.apply_gradients(opt, grads, state, params)
    return params, model


def test_schedules_match_torch_lr_changes():
    for make, T in ((optim.rmsprop, torch.optim.RMSprop), (optim.radam, torch.optim.RAdam), (optim.nadam, torch.optim.NAdam)):
        params, model = _with_schedule(make, T)
        for k, p in model.named_parameters():
            assert torch.equal(params[k], p.detach()), (make.__name__, k)


ELEMENTWISE = ["rmsprop_centered_momentum_wd", "adagrad_all", "nadamw", "radam_l2"]


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_flat_and_per_leaf_paths_identical(name, monkeypatch):
    make, _, kw = CASES[name]
    params = {k: v.detach().clone() for k, v in _model().named_parameters()}

    def run():
        opt = make(**kw)
        p, s = params, opt.init(params)
        for step in range(4):
            u, s = opt.update(_grads(params, step), s, p)
            p = optim.apply_updates(p, u)
        return optree.tree_leaves((p, s))

    fast = run()
    monkeypatch.setattr(flat, "multi_tensor_ok", lambda tensors: False)
    for a, b in zip(fast, run()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", [*ELEMENTWISE, "adafactor_all", "lamb", "lars", "lion"])
def test_vmap_ensemble_equals_separate_updates(name):
    if name in CASES:
        make, _, kw = CASES[name]
        opt = make(**kw)
    else:
        opt = {"lamb": lambda: optim.lamb(1e-2, weight_decay=0.1), "lars": lambda: optim.lars(0.1, weight_decay=1e-2),
               "lion": lambda: optim.lion(1e-3)}[name]()  # fmt: skip
    models = [_model(seed) for seed in range(4)]
    stacked, _ = stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    state = vmap(opt.init)(stacked)
    singles = [({k: v.detach().clone() for k, v in m.named_parameters()},) for m in models]
    singles = [(p, opt.init(p)) for (p,) in singles]
    for step in range(3):
        grads = {k: g.expand(4, *g.shape).clone() for k, g in _grads(singles[0][0], step).items()}
        updates, state, stacked, singles = vmapped_and_alone(opt, grads, state, stacked, singles)
    assert_members_equal(stacked, state, singles)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: optim.rmsprop(lr=-1.0), r"lr=-1\.0"),
        (lambda: optim.rmsprop(momentum=-0.1), r"momentum=-0\.1"),
        (lambda: optim.adagrad(lr_decay=-1.0), r"lr_decay=-1\.0"),
        (lambda: optim.nadam(betas=(1.0, 0.9)), r"betas\[0\]=1\.0"),
        (lambda: optim.radam(eps=-1.0), r"eps=-1\.0"),
        (lambda: optim.adafactor(d=0.5), r"d=0\.5"),
        (lambda: optim.adafactor(eps=1e-3), r"eps=0\.001"),
        (lambda: optim.lamb(betas=(0.9, 1.0)), r"betas\[1\]=1\.0"),
        (lambda: optim.lars(0.1, momentum=-1.0), r"momentum=-1\.0"),
        (lambda: optim.lion(1e-4, weight_decay=-1.0), r"weight_decay=-1\.0"),
    ],
)
def test_invalid_hyperparameters_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_state_from_another_optimizer_is_refused():
    params = {k: v.detach().clone() for k, v in _model().named_parameters()}
    with pytest.raises(TypeError, match="rmsprop.update: expected an RMSpropState"):
        optim.rmsprop().update(params, optim.adagrad().init(params), params)
    with pytest.raises(TypeError, match="centered/momentum"):
        optim.rmsprop(centered=True).update(params, optim.rmsprop().init(params), params)


def test_gradients_of_another_dtype_are_refused_naming_the_leaf():
    params = {k: v.detach().clone() for k, v in _model().named_parameters()}
    grads = dict(_grads(params, 0))
    grads["2.weight"] = grads["2.weight"].double()
    for make in (optim.rmsprop, optim.adagrad, optim.nadam, optim.radam, optim.adafactor, lambda: optim.lamb(), lambda: optim.lion(1e-4)):
        opt = make()
        with pytest.raises(TypeError, match=r"grad '2.weight' has dtype torch.float64"):
            optim.apply_gradients(opt, grads, opt.init(params), params)


NEW = ["rmsprop", "adagrad", "nadam", "radam", "adafactor", "lamb", "lars", "lion", "scale_by_trust_ratio", "scale_by_lion",
       "scale_by_radam", "scale_by_factored_rms"]  # fmt: skip


@pytest.mark.parametrize("name", NEW)
def test_docstring_example_runs(name):
    import doctest

    import fddp

    obj = getattr(optim, name)
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={"fddp": fddp, "torch": torch})
    assert tests and tests[0].examples, f"{name} has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for t in tests:
        runner.run(t)
    assert runner.failures == 0, f"{name}'s example failed (see the output above)"
