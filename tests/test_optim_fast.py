"""fddp.optim's fast paths: flat buffers for ``update`` and torch's fused kernels for ``apply_gradients``.

The references are torch's own: ``torch.optim.*(fused=True)`` for ``apply_gradients`` (equal to the
bit) and the leaf-by-leaf path for the flat one (``tests/test_optim.py`` compares the two bit for bit
over every optimizer; here we check what the flat buffers must never do: alias, leak or change
results the caller holds).
"""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from torch.func import functional_call, grad, stack_module_state, vmap

import fddp
from fddp import clear_caches as release_buffers
from fddp import optim
from fddp.optim import _flat as flat
from fddp.optim import _sgd


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10)
    )


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


FUSED_PAIRS = {
    # apply_gradients runs torch's fused Adam kernels: equal to torch.optim's fused=True, to the bit.
    "adam_l2_amsgrad": (
        lambda: optim.adam(1e-2, weight_decay=0.1, amsgrad=True),
        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, fused=True),
    ),
    "adamw": (
        lambda: optim.adamw(1e-2, betas=(0.8, 0.99), weight_decay=0.1),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, fused=True),
    ),
    "adamw_schedule": (
        lambda: optim.adamw(optim.linear(1e-2, 1e-2, 10)),  # a schedule: lr is a tensor
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    ),
    # SGD writes its step straight into new buffers, with torch.add's arithmetic: plain SGD is
    # torch's to the bit; with momentum, b' = g + m * b rounds once where torch rounds twice.
    "sgd": (lambda: optim.sgd(0.05), lambda ps: torch.optim.SGD(ps, lr=0.05)),
}
SGD_PAIRS = {
    "sgd_momentum": (
        lambda: optim.sgd(0.05, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    ),
    "sgd_momentum_wd": (
        lambda: optim.sgd(0.05, momentum=0.9, weight_decay=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2),
    ),
    "sgd_nesterov_wd": (
        lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    ),
    "sgd_nesterov_schedule": (
        lambda: optim.sgd(optim.linear(0.05, 0.05, 10), momentum=0.9, nesterov=True),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    ),
    "sgd_wd_schedule": (
        lambda: optim.sgd(optim.linear(0.05, 0.05, 10), weight_decay=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=1e-2),
    ),
}


def _trajectories(make, make_torch, steps, donate=False):
    """Train with apply_gradients and with torch; return (first, last) (params, state) and torch's params."""
    model = _model()
    x, y = _batch()
    params = _params(model)
    tmodel = copy.deepcopy(model)
    topt = make_torch(tmodel.parameters())
    opt = make()
    state = opt.init(params)
    first = (params, state)

    def loss(p):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    for _ in range(steps):
        params, state = optim.apply_gradients(opt, grad(loss)(params), state, params, donate=donate)
        topt.zero_grad()
        torch.nn.functional.cross_entropy(tmodel(x), y).backward()
        topt.step()
    assert int(state.count) == steps
    return first, (params, state), dict(tmodel.named_parameters())


@pytest.mark.parametrize("name", FUSED_PAIRS)
def test_apply_gradients_equals_torch_exactly(name):
    _, (params, _), theirs = _trajectories(*FUSED_PAIRS[name], steps=20)
    for k, p in theirs.items():
        torch.testing.assert_close(params[k], p.detach(), rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("name", SGD_PAIRS)
def test_apply_gradients_sgd_matches_torch(name):
    _, (params, _), theirs = _trajectories(*SGD_PAIRS[name], steps=100)
    for k, p in theirs.items():
        torch.testing.assert_close(params[k], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


UNFUSED = {
    # No fused kernel applies: dampened momentum, wrappers, or a transform that is not last.
    "sgd_dampening": lambda: optim.sgd(0.05, momentum=0.9, dampening=0.5),
    "accumulate": lambda: optim.accumulate(optim.adamw(1e-2), every_k=2),
    "chain_sgd_clip": lambda: optim.chain(optim.sgd(0.05), optim.clip_by_global_norm(0.5)),
}


@pytest.mark.parametrize("name", UNFUSED)
def test_apply_gradients_without_a_fused_kernel_is_update_then_apply(name):
    params = _params(_model())
    grads = [{k: torch.randn_like(v) for k, v in params.items()} for _ in range(4)]
    opt = UNFUSED[name]()
    p1 = p2 = params
    s1 = s2 = opt.init(params)
    for g in grads:
        p1, s1 = optim.apply_gradients(opt, g, s1, p1)
        u, s2 = opt.update(g, s2, p2)
        p2 = optim.apply_updates(p2, u)
    for a, b in zip(optree.tree_leaves((p1, s1)), optree.tree_leaves((p2, s2))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "last",
    [lambda: optim.adamw(1e-2), lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2)],
    ids=["adamw", "sgd"],
)
def test_apply_gradients_chain_fuses_the_last_transform(last):
    # Clipping hands the last transform flat gradients: the single-buffer path of each kernel.
    params = _params(_model())
    grads = [{k: 3 * torch.randn_like(v) for k, v in params.items()} for _ in range(5)]
    opt = optim.chain(optim.clip_by_global_norm(0.5), last())
    p1 = p2 = params
    s1 = s2 = opt.init(params)
    for g in grads:
        p1, s1 = optim.apply_gradients(opt, g, s1, p1)
        u, s2 = opt.update(g, s2, p2)
        p2 = optim.apply_updates(p2, u)
    # Fused and unfused steps round differently in the last bits only.
    for a, b in zip(optree.tree_leaves((p1, s1)), optree.tree_leaves((p2, s2))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert type(s1) is tuple and type(s1[1]) is type(s2[1]) and int(s1[1].count) == 5


def test_apply_gradients_under_vmap_equals_separate_models():
    models = [_model(seed) for seed in range(4)]
    stacked, _ = stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    grads = {k: torch.randn_like(v) for k, v in stacked.items()}
    opt = optim.adamw(1e-2)
    new, _ = vmap(lambda g, s, p: optim.apply_gradients(opt, g, s, p))(grads, vmap(opt.init)(stacked), stacked)
    for i in range(4):
        p = {k: v[i] for k, v in stacked.items()}
        mine, _ = optim.apply_gradients(opt, {k: v[i] for k, v in grads.items()}, opt.init(p), p)
        for k in p:
            torch.testing.assert_close(new[k][i], mine[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["sgd", "sgd_nesterov_wd", "adam_l2_amsgrad", "adamw"])
def test_apply_gradients_modifies_nothing_and_results_it_returned_never_change(name):
    params = _params(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = {**FUSED_PAIRS, **SGD_PAIRS}[name][0]()
    state = opt.init(params)
    history = []
    for _ in range(6):  # enough steps for the buffer pool to start recycling
        snapshot = [t.clone() for t in optree.tree_leaves((grads, state, params))]
        new_params, new_state = optim.apply_gradients(opt, grads, state, params)
        for before, after in zip(snapshot, optree.tree_leaves((grads, state, params))):
            assert torch.equal(before, after), "an input was modified"
        history.append((params, state, snapshot))
        params, state = new_params, new_state
    for old_params, old_state, snapshot in history:
        for before, now in zip(snapshot[len(grads):], optree.tree_leaves((old_state, old_params))):
            assert torch.equal(before, now), "a result still held by the caller changed"


def test_flat_results_tile_one_buffer_and_are_read_without_a_copy(monkeypatch):
    params = _params(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = optim.adamw(1e-2)
    updates, state = opt.update(grads, opt.init(params), params)
    params = optim.apply_updates(params, updates)
    step = flat.step_plan(optree.tree_leaves(params))
    assert len(step.groups) == 1
    for tree in (params, state.exp_avg, state.exp_avg_sq, updates):
        assert step.lies_in(optree.tree_leaves(tree))
    # The next step copies the fresh gradients in, and nothing else.
    copies = []
    real_copy = flat.copy
    monkeypatch.setattr(flat, "copy", lambda leaves, group: copies.append(leaves) or real_copy(leaves, group))
    updates, state = opt.update(grads, state, params)
    optim.apply_updates(params, updates)
    assert len(copies) == 1 and copies[0] is not None and copies[0][0] is optree.tree_leaves(grads)[0]


def test_flat_buffers_are_recycled_once_dropped():
    params = _params(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)
    seen = []
    for _ in range(8):
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
        del updates
        seen.append(params["0.weight"].untyped_storage().data_ptr())
    # With only the latest params and state alive, a handful of buffers go round.
    assert len(set(seen[2:])) <= 3, seen
    release_buffers()


def test_fast_paths_step_aside_for_autograd_and_non_contiguous_leaves():
    params = _params(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    opt = optim.adamw(1e-2)
    state = opt.init(params)
    ref, _ = optim.apply_gradients(opt, grads, state, params)
    # Differentiating through a step (meta-learning): autograd must see the arithmetic.
    lr_params = {k: v.clone().requires_grad_() for k, v in params.items()}
    new, _ = optim.apply_gradients(opt, grads, state, lr_params)
    assert all(v.requires_grad for v in new.values())
    sum(v.sum() for v in new.values()).backward()
    assert all(v.grad is not None for v in lr_params.values())
    # A transposed (non-contiguous) leaf goes leaf by leaf, with the same result up to rounding.
    t_params = dict(params, **{"3.weight": params["3.weight"].t().contiguous().t()})
    t_grads = dict(grads, **{"3.weight": grads["3.weight"].t().contiguous().t()})
    assert not t_params["3.weight"].is_contiguous()
    new, _ = optim.apply_gradients(opt, t_grads, state, t_params)
    for k in params:
        torch.testing.assert_close(new[k], ref[k], rtol=1e-6, atol=1e-7)


def test_shape_mismatch_is_an_error_naming_the_leaf():
    params = _params(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    grads["3.bias"] = torch.randn(1, 10)  # would broadcast silently
    opt = optim.adamw()
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"leaf '3.bias': grads has \(1, 10\), exp_avg has \(10,\)"):
        opt.update(grads, state, params)
    with pytest.raises(ValueError, match=r"leaf '3.bias': grads has \(1, 10\), params has \(10,\)"):
        optim.apply_gradients(opt, grads, state, params)
    with pytest.raises(ValueError, match=r"leaf '3.bias': updates has \(1, 10\)"):
        optim.apply_updates(params, grads)
    with pytest.raises(TypeError, match="must be a GradientTransformation"):
        optim.apply_gradients(lambda: None, grads, state, params)


DONATED = {
    "sgd_nesterov_wd": (
        lambda: optim.sgd(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
        lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, fused=True),
    ),
    "adam_l2_amsgrad": FUSED_PAIRS["adam_l2_amsgrad"],
    "adamw_schedule": FUSED_PAIRS["adamw_schedule"],
}


@pytest.mark.parametrize("name", DONATED)
def test_donated_step_is_in_place_and_equals_torch_fused_exactly(name):
    first, (params, state), theirs = _trajectories(*DONATED[name], steps=20, donate=True)

    def where(params, state):  # every donated tensor (the count is a new scalar each step)
        return [t.data_ptr() for t in optree.tree_leaves((params, state[1:]))]

    assert where(params, state) == where(*first), "not updated in place"
    for k, p in theirs.items():
        torch.testing.assert_close(params[k], p.detach(), rtol=0, atol=0, msg=lambda m: f"{k}: {m}")


def test_donation_skips_tied_leaves_vmap_and_earlier_chain_states():
    t = torch.randn(4)
    tied = {"a": t, "b": t}  # one tensor twice: an in-place step would apply twice
    before = t.clone()
    opt = optim.sgd(0.1, momentum=0.9)
    grads = {"a": torch.ones(4), "b": torch.ones(4)}
    new, _ = optim.apply_gradients(opt, grads, opt.init(tied), tied, donate=True)
    assert torch.equal(t, before)
    torch.testing.assert_close(new["a"], before - 0.1)
    # Dtypes torch's fused kernels lack (complex) take the pure path too.
    c = {"w": torch.randn(3, dtype=torch.complex64)}
    c0 = c["w"].clone()
    new, _ = optim.apply_gradients(opt, {"w": torch.ones(3, dtype=torch.complex64)}, opt.init(c), c, donate=True)
    assert torch.equal(c["w"], c0)
    torch.testing.assert_close(new["w"], c0 - 0.1)
    # Under vmap donation is ignored: the step is pure.
    stacked = {"w": torch.randn(3, 5)}
    w0 = stacked["w"].clone()
    adam = optim.adamw(1e-2)
    vmap(lambda g, s, p: optim.apply_gradients(adam, g, s, p, donate=True))(
        {"w": torch.randn(3, 5)}, vmap(adam.init)(stacked), stacked
    )
    assert torch.equal(stacked["w"], w0)
    # In a chain only the last transform's state is donated; the others run update as usual.
    params = {"w": torch.randn(5)}
    chained = optim.chain(optim.accumulate(optim.sgd(0.1), every_k=1), optim.adamw(1e-2))
    state = chained.init(params)
    acc_sum = state[0].grad_sum["w"].clone()
    p2, s2 = optim.apply_gradients(chained, {"w": torch.ones(5)}, state, params, donate=True)
    assert torch.equal(state[0].grad_sum["w"], acc_sum) and p2["w"].data_ptr() == params["w"].data_ptr()


def test_without_torchs_fused_kernels_apply_gradients_is_update_then_apply(monkeypatch):
    # They are private torch ops: a torch without them must still step, purely.
    import sys

    monkeypatch.delattr(torch, "_fused_adamw_")
    monkeypatch.setattr(sys.modules["fddp.optim._sgd"], "_FUSED_SGD", None)
    params = _params(_model())
    grads = {k: torch.randn_like(v) for k, v in params.items()}
    for opt in (optim.adamw(1e-2), optim.sgd(0.1, momentum=0.9)):
        state = opt.init(params)
        new, _ = optim.apply_gradients(opt, grads, state, params, donate=True)
        u, _ = opt.update(grads, state, params)
        ref = optim.apply_updates(params, u)
        for k in params:
            torch.testing.assert_close(new[k], ref[k], rtol=1e-6, atol=1e-7)
            assert new[k].data_ptr() != params[k].data_ptr(), "updated in place without the fused kernel"


# --- the fused step is part of the optimizer's value: wrappers keep it, and fast_path says why not -------


def _logged(inner, calls: list, forward_extra: bool):
    """A user's wrapper that counts steps; with ``forward_extra`` it forwards update's extra arguments."""

    def update(grads, state, params=None, **extra_args):
        calls.append(1)
        return inner.update(grads, state, params, **(extra_args if forward_extra else {}))

    make = optim.GradientTransformationExtraArgs if forward_extra else optim.GradientTransformation
    return make(inner.init, update)


def test_a_wrapper_that_forwards_extra_args_keeps_the_fused_step(monkeypatch):
    fused_steps: list = []  # which path ran is counted, not read off the values: on some CPUs the two round alike

    def counted(*args, **kwargs):
        fused_steps.append(1)
        return sgd_applied(*args, **kwargs)

    sgd_applied = _sgd._applied
    monkeypatch.setattr(_sgd, "_applied", counted)
    params = _params(_model())
    g = grad(lambda p: functional_call(_model(), p, (_batch()[0],)).square().mean())(params)
    opt = optim.sgd(0.05, momentum=0.9)
    state = opt.init(params)
    state = optim.apply_gradients(opt, g, state, params)[1]  # a momentum buffer to mix with
    fused_steps.clear()
    fused, _ = optim.apply_gradients(opt, g, state, params)
    updates, _ = opt.update(g, state, params)
    pure = optim.apply_updates(params, updates)
    assert len(fused_steps) == 1
    calls: list = []
    fused_steps.clear()
    kept, _ = optim.apply_gradients(_logged(opt, calls, True), g, state, params)
    assert calls == [1] and len(fused_steps) == 1, "the wrapper lost the fused step"
    assert all(torch.equal(kept[k], fused[k]) for k in params)
    assert "sgd: the step written straight into new flat buffers" in optim.fast_path(_logged(opt, [], True), g, state, params)
    fused_steps.clear()
    lost, _ = optim.apply_gradients(_logged(opt, calls, False), g, state, params)
    # A plain GradientTransformation: update + apply_updates, no fused step.
    assert not fused_steps and all(torch.equal(lost[k], pure[k]) for k in params)
    assert "plain GradientTransformation" in optim.fast_path(_logged(opt, [], False), g, state, params)
    # chain keeps it too, for its last transformation.
    chained = optim.chain(optim.clip_by_global_norm(1e9), opt)
    fused_steps.clear()
    c, _ = optim.apply_gradients(chained, g, (chained.init(params)[0], state), params)
    assert len(fused_steps) == 1 and all(torch.equal(c[k], fused[k]) for k in params)


def test_a_tree_map_over_the_gradients_is_read_by_copy_and_fast_path_names_the_leaf():
    fddp.init()
    params = _params(_model())
    loss = lambda p: functional_call(_model(), p, (_batch()[0],)).square().mean()  # noqa: E731
    grads = fddp.grad(loss)(params)  # views of the sync's buckets, laid out with their plan
    opt = optim.adamw(1e-3)
    state = opt.init(params)
    params, state = optim.apply_gradients(opt, grads, state, params)  # params and state now in that layout
    grads = fddp.grad(loss)(params)
    why = optim.fast_path(opt, grads, state, params)
    assert "in the layout the inputs came in" in why and "copied" not in why, why
    mapped = optree.tree_map(lambda t: t * 1.0, grads)
    why = optim.fast_path(opt, mapped, state, params)
    assert "grads: copied into flat buffers" in why and "'0.bias'" in why and "tree_map" in why, why
    # Either way the step is the same, to the bit.
    a, _ = optim.apply_gradients(opt, grads, state, params)
    b, _ = optim.apply_gradients(opt, mapped, state, params)
    assert all(torch.equal(a[k], b[k]) for k in a)
