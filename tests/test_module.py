"""functionalize: a drop-in for the module's forward; functionalize_with_buffers stays pure."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fddp
from models import make_batch, make_model


@pytest.mark.parametrize("name", ["mlp", "conv", "transformer"])
def test_apply_fn_equals_forward(name):
    model = make_model(name)
    apply_fn, params = fddp.functionalize(model)
    assert list(params) == [n for n, _ in model.named_parameters()]
    x, _ = make_batch(name, seed=0)
    assert torch.equal(apply_fn(params, x), model(x))
    assert all(not p.requires_grad for p in params.values())


def test_apply_fn_uses_given_params_and_kwargs():
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor, *, shift: float = 0.0) -> torch.Tensor:
            return x * self.w + shift

    apply_fn, params = fddp.functionalize(Scale())
    out = apply_fn({"w": torch.full((3,), 2.0)}, torch.ones(3), shift=1.0)
    assert torch.equal(out, torch.full((3,), 3.0))


def test_tied_weights_share_one_leaf():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4, bias=False)
            self.b = nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    model = Tied()
    apply_fn, params = fddp.functionalize(model)
    assert list(params) == ["a.weight"]
    x = torch.randn(2, 4)
    new = {"a.weight": torch.eye(4)}
    assert torch.equal(apply_fn(new, x), x)


@pytest.mark.parametrize("name", ["mlp", "conv", "transformer"])
def test_apply_fn_equals_functional_call_under_grad_and_vmap(name):
    # apply_fn swaps tensors into the module itself for the names functionalize returned; other
    # trees go through functional_call. Both must agree, inside torch.func transforms too.
    model = make_model(name)
    own = dict(model.named_parameters())
    apply_fn, params = fddp.functionalize(model)
    x, y = make_batch(name, seed=0)
    new = {k: v + 0.01 for k, v in params.items()}

    def loss(f, p):
        return torch.nn.functional.cross_entropy(f(p, x), y)

    reference = lambda p, x: torch.func.functional_call(model, p, (x,))  # noqa: E731
    for a, b in zip(torch.func.grad(lambda p: loss(apply_fn, p))(new).values(),
                    torch.func.grad(lambda p: loss(reference, p))(new).values()):
        assert torch.equal(a, b)
    stacked = {k: torch.stack([v, v * 2]) for k, v in new.items()}
    assert torch.equal(torch.func.vmap(apply_fn, (0, None))(stacked, x), torch.func.vmap(reference, (0, None))(stacked, x))
    # The module's own parameters are back in place afterwards, even after an error.
    with pytest.raises(RuntimeError):
        apply_fn(new, torch.randn(3, 3, 3, 3, 3))
    assert all(p is own[k] for k, p in model.named_parameters())
    # A subset of the names (the rest from the module) goes through functional_call.
    first = next(iter(params))
    assert torch.equal(apply_fn({first: new[first]}, x), reference({first: new[first]}, x))


def test_rejects_non_module():
    with pytest.raises(TypeError, match="expected a torch.nn.Module, got function"):
        fddp.functionalize(lambda x: x)


def test_buffers_are_returned_not_mutated():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    reference = copy.deepcopy(model)
    apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
    before = {k: v.clone() for k, v in buffers.items()}
    x = torch.randn(16, 3)
    out, new_buffers = apply_fn(params, buffers, x)
    # the reference module updates its own buffers in place: fddp returns the same values instead
    assert torch.equal(out, reference(x))
    for k, v in reference.named_buffers():
        assert torch.equal(new_buffers[k], v), k
        assert torch.equal(buffers[k], before[k]), f"input buffer {k} was modified"
    assert torch.equal(model[1].running_mean, before["1.running_mean"]), "the model's buffer was modified"


def test_buffers_work_under_torch_func_grad():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
    x = torch.randn(8, 3)

    def loss(p, b):
        out, nb = apply_fn(p, b, x)
        return out.pow(2).mean(), nb

    grads, new_buffers = torch.func.grad(loss, has_aux=True)(params, buffers)
    ref_model = copy.deepcopy(model)
    ref_model(x).pow(2).mean().backward()
    for k, p in ref_model.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-6, atol=1e-7)
    for k, v in ref_model.named_buffers():
        assert torch.equal(new_buffers[k], v), k
