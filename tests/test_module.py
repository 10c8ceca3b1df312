"""functionalize: a drop-in for the module's forward; functionalize_with_buffers stays pure."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fddp
from dist import run
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


# --- frozen parameters: no gradient, no update, no bytes sent (torch's meaning, DDP's behaviour) ------


def frozen_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    model[2].requires_grad_(False)
    return model


def _frozen_worker(steps: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = fddp.rank()
    ddp = DDP(frozen_model())  # DDP leaves parameters with requires_grad=False out of its buckets
    torch_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=True)
    model = frozen_model()
    frozen_before = model[2].weight.detach().clone()
    apply_fn, params = fddp.functionalize(model)
    params = fddp.broadcast(params)
    opt = fddp.optim.adamw(lr=1e-2)
    state = opt.init(params)

    def loss_fn(p, x, y):
        return torch.nn.functional.cross_entropy(apply_fn(p, x), y)

    sent = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
        torch_opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        torch_opt.step()
        grads, _, info = fddp.grad_and_value(loss_fn, return_info=True)(params, x, y)
        params, state = fddp.optim.apply_gradients(opt, grads, state, params)
        sent.append(info.bytes_sent)
    ours = {**{k: v for k, v in model.named_parameters() if not v.requires_grad}, **params}
    theirs = {k: v.detach() for k, v in ddp.module.named_parameters()}
    return ours, theirs, sent, torch.equal(model[2].weight, frozen_before)


def test_frozen_parameters_are_not_trained_or_sent_as_under_ddp():
    trainable_bytes = sum(p.numel() * p.element_size() for p in frozen_model().parameters() if p.requires_grad)
    for ours, theirs, sent, frozen_kept in run(_frozen_worker, 2, 4):
        assert sorted(ours) == sorted(theirs)
        for k in theirs:  # grads, all-reduce arithmetic and AdamW(fused=True): the same kernels
            assert torch.equal(ours[k], theirs[k]), f"{k} differs from torch DDP + AdamW(fused=True)"
        assert frozen_kept, "the frozen layer changed"
        assert sent == [trainable_bytes] * 4, (sent, trainable_bytes)


def test_functionalize_leaves_frozen_parameters_in_the_module():
    model = frozen_model()
    apply_fn, params = fddp.functionalize(model)
    assert list(params) == ["0.weight", "0.bias", "4.weight", "4.bias"]
    x = torch.randn(3, 8)
    assert torch.equal(apply_fn(params, x), model(x))
    grads = torch.func.grad(lambda p: apply_fn(p, x).sum())(params)
    assert list(grads) == list(params)
    # Frozen values are read from the module at call time: a load_state_dict is seen.
    with torch.no_grad():
        model[2].weight.mul_(2)
    assert torch.equal(apply_fn(params, x), model(x))
    # A subset of names goes through functional_call and takes the rest, frozen included, from the module.
    assert torch.equal(apply_fn({"4.bias": params["4.bias"]}, x), model(x))


def test_trainable_filter_picks_the_parameters_like_equinox_partition():
    model = make_model("mlp")
    apply_fn, params = fddp.functionalize(model, trainable=lambda name, p: name.startswith("0."))
    assert list(params) == ["0.weight", "0.bias"]
    x, _ = make_batch("mlp", seed=0)
    assert torch.equal(apply_fn(params, x), model(x))
    # The left-out parameters still require grad in the module, but no graph reaches them.
    apply_fn({k: v.detach().requires_grad_() for k, v in params.items()}, x).sum().backward()
    assert all(p.grad is None for name, p in model.named_parameters() if not name.startswith("0."))
    with pytest.raises(TypeError, match="trainable must be a function"):
        fddp.functionalize(model, trainable="0.weight")


# --- load_into: the trained values back in the module, tied weights and buffers included ---------------


class TiedLM(nn.Module):
    """A tiny language model whose output layer shares the embedding's weight (as GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.body = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(idx)))


def test_load_into_writes_params_and_buffers_back_and_keeps_weights_tied():
    model = TiedLM()
    apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
    assert "head.weight" not in params  # a tied weight is one leaf
    with pytest.raises(RuntimeError, match="head.weight"):
        copy.deepcopy(model).load_state_dict(params)  # why load_into exists
    opt = fddp.optim.adamw(lr=0.1)
    state = opt.init(params)
    idx = torch.randint(0, 11, (16,), generator=torch.Generator().manual_seed(0))

    def loss_fn(p, b):
        logits, new_b = apply_fn(p, b, idx)
        return torch.nn.functional.cross_entropy(logits, idx), new_b

    for _ in range(3):
        grads, buffers = torch.func.grad(loss_fn, has_aux=True)(params, buffers)
        params, state = fddp.optim.apply_gradients(opt, grads, state, params)
    assert fddp.load_into(model, params, buffers) is model
    assert model.head.weight is model.emb.weight
    assert torch.equal(model.head.weight, params["emb.weight"])
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    assert int(model.body[1].num_batches_tracked) == 3
    model.eval()
    assert torch.equal(model(idx), apply_fn(params, buffers, idx)[0])
    # The module's state_dict has every name again, tied ones included, and loads into a fresh model.
    fresh = TiedLM()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.head.weight, params["emb.weight"])


def test_load_into_errors_name_the_leaf_and_leave_the_module_alone():
    model = TiedLM()
    before = copy.deepcopy(model.state_dict())
    good = {"emb.weight": torch.zeros(11, 8)}
    with pytest.raises(KeyError, match=r"params\['emb.wieght'\]: TiedLM has no parameter of that name \(it has emb.weight"):
        fddp.load_into(model, {**good, "emb.wieght": torch.zeros(11, 8)})
    with pytest.raises(ValueError, match=r"params\['body.0.bias'\]: expected shape \(8,\) \(the module's\), got \(9,\)"):
        fddp.load_into(model, {**good, "body.0.bias": torch.zeros(9)})
    with pytest.raises(KeyError, match=r"buffers\['running_mean'\]: TiedLM has no buffer"):
        fddp.load_into(model, good, {"running_mean": torch.zeros(8)})
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was written although the call failed"
    # Either name of a tied weight works.
    fddp.load_into(model, {"head.weight": torch.ones(11, 8)})
    assert torch.equal(model.emb.weight, torch.ones(11, 8))


# --- donation never writes into the module -------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: fddp.optim.adamw(1e-2), lambda: fddp.optim.sgd(0.1, momentum=0.9)], ids=["adamw", "sgd"])
def test_donating_functionalized_params_copies_them_once_and_never_writes_the_module(make):
    model = make_model("mlp")
    before = copy.deepcopy(model.state_dict())
    apply_fn, params = fddp.functionalize(model)
    x, y = make_batch("mlp", seed=0)
    opt = make()
    state = opt.init(params)
    loss = lambda p: torch.nn.functional.cross_entropy(apply_fn(p, x), y)  # noqa: E731
    new, state = fddp.optim.apply_gradients(opt, torch.func.grad(loss)(params), state, params, donate=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"donation wrote into the module's {k}"
    assert all(new[k].data_ptr() != params[k].data_ptr() for k in params)
    # The copies are the caller's own: the next donated step updates them in place.
    again, _ = fddp.optim.apply_gradients(opt, torch.func.grad(loss)(new), state, new, donate=True)
    assert all(again[k] is new[k] for k in new)


# --- functionalize_with_buffers: the slot-swap fast path, copies only of the buffers a forward writes ---


class WithConstants(nn.Module):
    """BatchNorm (writes its statistics in training mode) next to constant buffers (never written)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("position_ids", torch.arange(5).unsqueeze(0), persistent=False)
        self.register_buffer("mask", torch.ones(5, 5).tril())
        self.pos = nn.Embedding(5, 4)
        self.bn = nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x + self.pos(self.position_ids).sum(-1)) @ self.mask


def test_functionalize_with_buffers_swaps_slots_and_copies_only_written_buffers(monkeypatch):
    model = WithConstants()
    reference = copy.deepcopy(model)
    apply_fn, params, buffers = fddp.functionalize_with_buffers(model)

    def no_walk(*args, **kwargs):
        raise AssertionError("functional_call's walk on the fast path")

    monkeypatch.setattr("fddp.module.functional_call", no_walk)
    before = {k: v.clone() for k, v in buffers.items()}
    for step in range(3):
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        out, new = apply_fn(params, buffers, x)
        assert torch.equal(out, reference(x))
        for k, v in reference.named_buffers():
            assert torch.equal(new[k], v), k
        for k in buffers:
            assert torch.equal(buffers[k], before[k]), f"input buffer {k} was modified"
        if step:  # learnt on the first call: the constants are passed through, not copied
            assert new["position_ids"] is buffers["position_ids"] and new["mask"] is buffers["mask"]
        assert new["bn.running_mean"] is not buffers["bn.running_mean"]
        buffers, before = new, {k: v.clone() for k, v in new.items()}
    # In eval mode BatchNorm only reads its statistics: after the first eval call nothing is copied.
    model.eval()
    reference.eval()
    for _ in range(2):
        out, new = apply_fn(params, buffers, x)
        assert torch.equal(out, reference(x))
    assert all(new[k] is buffers[k] for k in buffers)
    assert all(a is b for a, b in zip(model.buffers(), reference.buffers())) is False  # separate modules
    for k, v in model.named_buffers():  # the module's own buffers were never touched
        assert torch.equal(v, dict(WithConstants().named_buffers())[k]), k


class SometimesWrites(nn.Module):
    """Writes its buffer in place only on some calls (a Python counter): the first call learns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(3))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % 2 == 0:
            self.total.add_(x)
        return x * self.total


def test_a_buffer_written_only_on_later_calls_never_changes_the_callers_tensor():
    apply_fn, params, buffers = fddp.functionalize_with_buffers(SometimesWrites())
    x = torch.ones(3)
    out, new = apply_fn(params, buffers, x)  # call 1: no write
    assert torch.equal(new["total"], torch.zeros(3)) and new["total"] is not buffers["total"]
    out, new = apply_fn(params, new, x)  # call 2: writes the buffer passed uncopied
    assert torch.equal(out, torch.ones(3)) and torch.equal(new["total"], torch.ones(3))
    assert torch.equal(buffers["total"], torch.zeros(3))
    shared = new
    out, new2 = apply_fn(params, shared, x)  # call 3: no write
    out, new3 = apply_fn(params, new2, x)  # call 4: writes, into a copy now
    assert torch.equal(new3["total"], 2 * torch.ones(3)) and torch.equal(new2["total"], torch.ones(3))
    assert torch.equal(shared["total"], torch.ones(3))


# --- functionalize on several ranks: a forward that writes floating-point buffers is refused ---------------


def bn_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 3))


class Counts(nn.Module):
    """Writes only an integer buffer (a counter: ranks that step together agree on it) and reads a float mask."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([1.0, float("nan"), 0.0]))  # a NaN that is never written

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.lin(x) * self.mask.nan_to_num()


def _bn_functionalize_worker() -> dict:
    model = bn_cnn()
    before = {k: v.clone() for k, v in model.named_buffers()}
    apply_fn, params = fddp.functionalize(model)
    params = fddp.broadcast(params)
    x = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(fddp.rank()))
    y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(fddp.rank()))

    def loss_fn(p, x, y):
        return F.cross_entropy(apply_fn(p, x), y)

    out = {}
    for name, call in (
        ("grad_and_value", lambda: fddp.grad_and_value(loss_fn)(params, x, y)),  # the first call: learnt, undone
        ("again", lambda: fddp.grad_and_value(loss_fn)(params, x, y)),  # refused before the forward runs
        ("torch.func", lambda: fddp.ddp_step(params, torch.func.grad(loss_fn)(params, x, y))),
    ):
        try:
            call()
        except RuntimeError as e:
            out[name] = str(e)
    out["untouched"] = all(torch.equal(before[k], v) for k, v in model.named_buffers())
    model.eval()  # BatchNorm only reads its statistics: nothing to refuse
    with torch.no_grad():
        out["eval"] = apply_fn(params, x)
    counts = Counts()
    apply_counts, counts_params = fddp.functionalize(counts)
    fddp.grad_and_value(lambda p: apply_counts(p, torch.ones(2, 3)).sum())(counts_params)
    out["counts"] = int(counts.seen)
    return out


def test_functionalize_refuses_buffers_a_forward_writes_on_every_rank():
    for out in run(_bn_functionalize_worker, 2):
        for name in ("grad_and_value", "again", "torch.func"):
            msg = out.get(name, "no error")
            assert msg.startswith("fddp.functionalize: the forward writes the module's floating-point buffers "
                                  "'1.running_mean', '1.running_var' in training mode"), (name, msg)
            assert "with 2 ranks each would keep its own" in msg and "fddp.functionalize_with_buffers(model)" in msg
            assert "fddp.sync_buffers(buffers)" in msg and "BatchNorm and buffers" in msg
        assert out["untouched"], "the refused forward left its writes in the module"
        assert out["eval"].shape == (8, 3)
        assert out["counts"] == 1  # an integer counter and a float buffer only read: no error


def test_functionalize_writes_buffers_in_one_process_as_torch_does():
    model, reference = bn_cnn(), bn_cnn()
    apply_fn, params = fddp.functionalize(model)
    x = torch.randn(8, 1, 8, 8)
    for _ in range(2):
        assert torch.equal(apply_fn(params, x), reference(x))
    for k, v in reference.named_buffers():
        assert torch.equal(dict(model.named_buffers())[k], v), k
