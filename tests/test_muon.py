"""``fddp.optim.muon`` against ``torch.optim.Muon`` (and ``torch.optim.AdamW`` for the other leaves), one process.

The reference is torch's own pair of optimizers, as its docs pair them: ``Muon`` on the 2-D
weights, ``AdamW(fused=True)`` on the rest, stepped on a small model's real gradients for 50
steps. ``apply_gradients`` runs torch's lines on the same values in the same order, so the
parameters are equal to the bit; ``update`` + ``apply_updates`` returns ``new - p``, exact where a
parameter stays within a factor two of its old value (Sterbenz), one rounding off elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz

import fddp
from fddp.optim._newton_schulz import orthogonalize

STEPS = 50


class Net(nn.Module):
    """An embedding (1-D leaves aside, a 2-D leaf the mask may leave to AdamW), two hidden matrices, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(20, 12)
        self.up = nn.Linear(12, 32)
        self.down = nn.Linear(32, 12, bias=False)
        self.head = nn.Linear(12, 20)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        return self.head(h + self.down(torch.tanh(self.up(h))))


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 20, (8,), generator=g), torch.randint(0, 20, (8,), generator=g)


def _hidden(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 2 and not name.startswith(("tok", "head"))


def _torch_run(muon_kwargs: dict, lrs: list[float] | None = None) -> dict:
    model = _model()
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named.items() if _hidden(n, p)], **muon_kwargs)
    adamw = torch.optim.AdamW([p for n, p in named.items() if not _hidden(n, p)], lr=3e-3, weight_decay=0.0, fused=True)
    for step in range(STEPS):
        if lrs is not None:
            muon.param_groups[0]["lr"] = lrs[step]
        muon.zero_grad()
        adamw.zero_grad()
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        muon.step()
        adamw.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fddp_run(opt, *, how: str = "apply", donate: bool = False) -> tuple[dict, object]:
    apply_fn, params = fddp.functionalize(_model())
    state = opt.init(params)
    grad = torch.func.grad(lambda p, x, y: F.cross_entropy(apply_fn(p, x), y))
    for step in range(STEPS):
        g = grad(params, *_batch(step))
        if how == "apply":
            params, state = fddp.optim.apply_gradients(opt, g, state, params, donate=donate)
        else:
            updates, state = opt.update(g, state, params)
            params = fddp.optim.apply_updates(params, updates)
    return params, state


def _opt(**kwargs):
    fallback = fddp.optim.adamw(3e-3, weight_decay=0.0)
    return fddp.optim.muon(mask=fddp.optim.by_path(_hidden), fallback=fallback, **kwargs)


CASES = [
    dict(lr=0.02),
    dict(lr=0.02, nesterov=False, weight_decay=0.0),
    dict(lr=0.01, momentum=0.9, weight_decay=0.05, adjust_lr_fn="match_rms_adamw"),
    dict(lr=0.02, ns_steps=3, ns_coefficients=(2.0, -1.5, 0.5), eps=1e-5),
]


@pytest.mark.parametrize("kwargs", CASES, ids=["default", "no-nesterov", "match-rms", "ns-options"])
@pytest.mark.parametrize("donate", [False, True], ids=["copy", "donated"])
def test_apply_gradients_equals_torch_muon_to_the_bit_over_50_steps(kwargs, donate):
    theirs = _torch_run(kwargs)
    ours, state = _fddp_run(_opt(**kwargs), donate=donate)
    moved = max((theirs[k] - v).abs().max().item() for k, v in _model().state_dict().items())
    assert moved > 1e-2  # it trained
    for k in theirs:
        assert torch.equal(ours[k], theirs[k]), (k, (ours[k] - theirs[k]).abs().max().item())
    assert int(state.inner_states["muon"].count) == STEPS
    assert set(state.inner_states["muon"].momentum_buffer) == {"up.weight", "down.weight"}


def test_update_then_apply_updates_is_torch_muon_up_to_one_rounding():
    """Each of 50 steps from torch's own state: ``p + (new - p)`` is torch's ``new`` within one rounding.

    A trajectory of ``update`` + ``apply_updates`` compared to torch's after 50 steps drifts apart
    through the model's gradients by far more than a rounding a step, by an amount that depends on
    the CPU's kernels (AVX-512, AVX2, scalar). So every step starts from the same state on both
    sides: ``apply_gradients`` (torch's lines, to the bit, tested above) carries the trajectory, and
    at each step ``update`` + ``apply_updates`` from that same state is compared to torch's next
    parameters. Muon's ``u = new - p`` rounds once (half an ulp of ``|new - p|``); AdamW's update
    (the fallback's leaves) is computed as an update, ``-lr * m / (sqrt(v) + eps)``, a few roundings
    of ``|new - p|`` (2 ulps seen); ``p + u`` rounds once more (half an ulp of ``|new|``). An ulp of
    ``x`` is at most ``eps * |x|``: the bound per element is ``4 * eps * (|new - p| + |new|)``.
    """
    model = _model()
    named = dict(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named.items() if _hidden(n, p)], lr=0.02)
    adamw = torch.optim.AdamW([p for n, p in named.items() if not _hidden(n, p)], lr=3e-3, weight_decay=0.0, fused=True)
    opt = _opt(lr=0.02)
    apply_fn, params = fddp.functionalize(_model())
    state = opt.init(params)
    grad = torch.func.grad(lambda p, x, y: F.cross_entropy(apply_fn(p, x), y))
    eps = torch.finfo(torch.float32).eps
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch(step)
        muon.zero_grad()
        adamw.zero_grad()
        F.cross_entropy(model(x), y).backward()
        muon.step()
        adamw.step()
        theirs = {n: p.detach() for n, p in model.named_parameters()}
        g = grad(params, x, y)
        updates, _ = opt.update(g, state, params)
        ours = fddp.optim.apply_updates(params, updates)
        for k in theirs:
            bound = 4 * eps * ((theirs[k] - params[k]).abs() + theirs[k].abs())
            err = (ours[k] - theirs[k]).abs()
            assert bool((err <= bound).all()), (step, k, float((err - bound).max()))
            worst = max(worst, float(err.max()))
        params, state = fddp.optim.apply_gradients(opt, g, state, params)
        for k in theirs:  # the carried trajectory is torch's, so the next step starts from the same state
            assert torch.equal(params[k], theirs[k]), (step, k)
    assert worst > 0.0  # some step rounded: the bound, not equality, is what is tested


def test_inject_hyperparams_changes_lr_between_steps_as_param_groups_do():
    lrs = [0.02 * (1 - step / STEPS) for step in range(STEPS)]
    theirs = _torch_run(dict(lr=0.02), lrs)
    opt = fddp.optim.inject_hyperparams(_opt)(lr=0.02)
    apply_fn, params = fddp.functionalize(_model())
    state = opt.init(params)
    grad = torch.func.grad(lambda p, x, y: F.cross_entropy(apply_fn(p, x), y))
    for step in range(STEPS):
        state = fddp.optim.set_hyperparams(state, lr=lrs[step])
        params, state = fddp.optim.apply_gradients(opt, grad(params, *_batch(step)), state, params)
    for k in theirs:
        assert torch.equal(params[k], theirs[k]), k


def test_a_schedule_equals_torch_given_the_same_lrs_to_the_bit():
    schedule = fddp.optim.linear(0.02, 0.0, STEPS)
    lrs = [float(schedule(torch.tensor(step))) for step in range(STEPS)]
    theirs = _torch_run(dict(lr=0.02), lrs)
    ours, _ = _fddp_run(_opt(lr=schedule))
    for k in theirs:  # on the CPU the schedule's float64 value is read as torch's Python float
        assert torch.equal(ours[k], theirs[k]), k


@pytest.mark.parametrize("shape", [(16, 8), (8, 24), (12, 12), (1, 5)])
def test_orthogonalize_is_torch_newton_schulz_to_the_bit(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    ours = orthogonalize(x)
    theirs = _zeropower_via_newtonschulz(x, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert torch.equal(ours, theirs)
    kept = x.clone()
    orthogonalize(x.bfloat16())  # out of place, where torch divides a bfloat16 input in place
    assert torch.equal(x, kept)


def test_float32_newton_schulz_orthogonalises_as_float64_does():
    """``ns_dtype=None`` (optax's choice: the input's dtype): against the same iteration in float64."""
    x = torch.randn(24, 10, generator=torch.Generator().manual_seed(4))
    ours = orthogonalize(x, dtype=None)
    theirs = orthogonalize(x.double(), dtype=None)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), theirs, rtol=1e-5, atol=1e-5)
    s = torch.linalg.svdvals(theirs)
    assert 0.6 < float(s.min()) and float(s.max()) < 1.3  # Keller Jordan's US'V^T, S' ~ U(0.5, 1.5)


def test_default_mask_is_every_2d_leaf_and_fallback_is_adamw():
    apply_fn, params = fddp.functionalize(_model())
    opt = fddp.optim.muon(0.02)
    state = opt.init(params)
    assert set(state.inner_states["muon"].momentum_buffer) == {"tok.weight", "up.weight", "down.weight", "head.weight"}
    assert set(state.inner_states["fallback"].exp_avg) == {"up.bias", "head.bias"}
    assert isinstance(state.inner_states["fallback"], fddp.optim.AdamState)


def test_a_mask_tree_prefix_picks_the_leaves():
    params = {"a": {"w": torch.ones(3, 4), "v": torch.ones(4, 4)}, "b": torch.ones(2, 2)}
    state = fddp.optim.muon(0.02, mask={"a": True, "b": False}).init(params)
    assert set(state.inner_states["muon"].momentum_buffer["a"]) == {"w", "v"}


def test_checkpoint_round_trip_resumes_to_the_bit(tmp_path):
    opt = _opt(lr=0.02)
    apply_fn, params = fddp.functionalize(_model())
    state = opt.init(params)
    grad = torch.func.grad(lambda p, x, y: F.cross_entropy(apply_fn(p, x), y))
    for step in range(3):
        params, state = fddp.optim.apply_gradients(opt, grad(params, *_batch(step)), state, params)
    path = fddp.checkpoint.save(tmp_path / "c.pt", {"params": params, "opt": state})
    loaded = fddp.checkpoint.load(path, like={"params": params, "opt": opt.init(params)})
    assert isinstance(loaded["opt"].inner_states["muon"], fddp.optim.MuonState)
    a, b = (params, state), (loaded["params"], loaded["opt"])
    for step in range(3, 6):
        a = fddp.optim.apply_gradients(opt, grad(a[0], *_batch(step)), a[1], a[0])
        b = fddp.optim.apply_gradients(opt, grad(b[0], *_batch(step)), b[1], b[0])
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k


def test_errors_say_what_was_expected():
    params = {"w": torch.ones(3, 4), "k": torch.ones(2, 3, 3)}
    with pytest.raises(ValueError, match=r"leaf 'k' has shape \(2, 3, 3\).*2-D"):
        opt = fddp.optim.muon(0.02, mask=True)
        opt.update({"w": torch.ones(3, 4), "k": torch.ones(2, 3, 3)}, opt.init(params), params)
    with pytest.raises(ValueError, match="adjust_lr_fn='rms'"):
        fddp.optim.muon(adjust_lr_fn="rms")
    with pytest.raises(ValueError, match="momentum=1.0"):
        fddp.optim.muon(momentum=1.0)
    with pytest.raises(TypeError, match="fallback must be a GradientTransformation"):
        fddp.optim.muon(fallback=torch.optim.AdamW)
    with pytest.raises(ValueError, match=r"leaf 'w' has the label 'yes'"):
        fddp.optim.muon(mask={"w": "yes", "k": False}).init(params)
    with pytest.raises(ValueError, match="params are required"):
        opt = fddp.optim.muon(0.02, mask={"w": True, "k": False}, fallback=fddp.optim.sgd(0.1))
        opt.update({"w": torch.ones(3, 4), "k": torch.ones(2, 3, 3)}, opt.init(params))


def test_without_params_and_decay_the_update_is_the_scaled_orthogonal_step():
    w = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    opt = fddp.optim.muon(0.1, weight_decay=0.0, nesterov=False, momentum=0.0, mask=True)
    updates, _ = opt.update({"w": w}, opt.init({"w": w}))
    expected = -0.1 * math.sqrt(2) * _zeropower_via_newtonschulz(w, (3.4445, -4.7750, 2.0315), 5, 1e-7).float()
    torch.testing.assert_close(updates["w"], expected, rtol=1e-6, atol=1e-7)
