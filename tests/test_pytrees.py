"""Every pytree torch.func accepts is one fddp accepts, returned in the same type.

A ``tensordict.TensorDict`` model trained on 2 ranks (``fddp.grad_and_value``, AdamW, a
checkpoint round trip in the middle) equals, to the bit, the same model trained from
``fddp.functionalize``'s plain dict: the arithmetic per element is the same, only the tree differs.
A NamedTuple and a dataclass registered with ``torch.utils._pytree.register_dataclass`` (after
``import fddp``, so adopted lazily) go through each entry on one rank, compared with the same
values in a plain dict.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree

import fddp
import fddp.checkpoint
import fddp.optim
import fddp.zero
from dist import run

tensordict = pytest.importorskip("tensordict")


class Pair(typing.NamedTuple):
    w: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class Layer:
    w: torch.Tensor
    b: torch.Tensor


torch_pytree.register_dataclass(Layer)


class Unregistered:
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + fddp.rank())  # each rank its own data
    return torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64)


def _train_worker(path: str, kind: str) -> dict:
    model = _model().double()
    if kind == "tensordict":
        params = tensordict.TensorDict.from_module(model).detach().clone()

        def loss(p, x, y):
            with p.to_module(model):
                return torch.nn.functional.mse_loss(model(x), y)
    else:
        apply_fn, params = fddp.functionalize(model)

        def loss(p, x, y):
            return torch.nn.functional.mse_loss(apply_fn(p, x), y)

    params = fddp.broadcast(params)
    step = fddp.grad_and_value(loss)  # built once, outside the loop
    opt = fddp.optim.adamw(lr=1e-2, weight_decay=0.1)
    state = opt.init(params)
    types = {"params": type(params).__name__, "state.exp_avg": type(state.exp_avg).__name__}
    for i in range(6):
        if i == 3:  # a checkpoint round trip mid-run: save, drop the values, load into fresh trees
            fddp.checkpoint.save(path, {"params": params, "opt": state, "step": i})
            fddp.broadcast(torch.zeros(1))  # every rank waits for rank 0's file
            like = {"params": torch_pytree.tree_map(torch.zeros_like, params), "opt": opt.init(params), "step": 0}
            loaded = fddp.checkpoint.load(path, like=like)
            types["loaded"] = type(loaded["params"]).__name__
            params, state = loaded["params"], loaded["opt"]
        grads, _ = step(params, *_batch(i))
        params, state = fddp.optim.apply_gradients(opt, grads, state, params)
    types["grads"] = type(grads).__name__
    flat = params.flatten_keys(".").to_dict() if kind == "tensordict" else params
    return {"types": types, "params": {k: v.clone() for k, v in flat.items()}}


def test_tensordict_model_trains_on_two_ranks_bitwise_as_a_plain_dict(tmp_path):
    td = run(_train_worker, 2, str(tmp_path / "td.pt"), "tensordict", timeout=120)
    plain = run(_train_worker, 2, str(tmp_path / "plain.pt"), "plain", timeout=120)
    assert td[0]["types"] == {"params": "TensorDict", "state.exp_avg": "TensorDict", "loaded": "TensorDict", "grads": "TensorDict"}
    assert plain[0]["types"]["params"] == "dict"
    for r in range(2):
        assert td[r]["params"].keys() == plain[r]["params"].keys()
        for k, v in plain[r]["params"].items():
            assert torch.equal(td[r]["params"][k], v), (r, k)
    for k, v in td[0]["params"].items():
        assert torch.equal(td[1]["params"][k], v), k  # the replicas agree
    moved = max((td[0]["params"][k] - _model().double().state_dict()[k]).abs().max().item() for k in td[0]["params"])
    assert moved > 1e-3  # six steps did train


def _loss(p, x):
    w, b = (p["w"], p["b"]) if isinstance(p, dict) else (p.w, p.b)
    return ((x @ w.T).tanh() + b).pow(2).sum()


def _entries(make, path: str) -> dict:
    """Each entry's result on ``make(w, b)`` and on ``{"w": w, "b": b}``: (type name, leaves)."""
    torch.manual_seed(0)
    w, b, x = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)

    def calls(p, path):
        opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(lr=0.1, weight_decay=0.1))
        g = torch.func.grad(_loss)(p, x)
        state = opt.init(p)
        updates, new_state = opt.update(g, state, p)
        shards = fddp.zero.shard(p)
        fddp.checkpoint.save(path, {"p": p, "opt": state})
        loaded = fddp.checkpoint.load(path, like={"p": p, "opt": state})
        fddp.checkpoint.save_sharded(path + ".sharded", {"p": shards, "opt": state})
        sharded = fddp.checkpoint.load_sharded(path + ".sharded", like={"p": shards, "opt": state})
        return {
            "broadcast": fddp.broadcast(p),
            "ddp_step": fddp.ddp_step(p, g),
            "grad_and_value": fddp.grad_and_value(_loss)(p, x)[0],
            "psum": fddp.psum(p),
            "pmean": fddp.pmean(p),
            "pmax": fddp.pmax(p),
            "all_gather": fddp.all_gather(p),
            "update": updates,
            "apply_updates": fddp.optim.apply_updates(p, updates),
            "adam state": new_state[1].exp_avg,
            "apply_gradients": fddp.optim.apply_gradients(opt, g, state, p)[0],
            "zero.unshard": fddp.zero.unshard(shards),
            "zero.gather": fddp.zero.gather(shards).wait(),
            "checkpoint.load": loaded["p"],
            "checkpoint.load state": loaded["opt"][1].exp_avg,
            "checkpoint.load_sharded": fddp.zero.unshard(sharded["p"]),
            "checkpoint.load_sharded state": sharded["opt"][1].exp_avg,
        }

    fddp.verify_replicas(make(w, b))
    ours, ref = calls(make(w, b), path), calls({"w": w, "b": b}, path + ".ref")
    out = {}
    for name, tree in ours.items():
        leaves = (tree.w, tree.b)
        expected = (ref[name]["w"], ref[name]["b"])
        out[name] = (type(tree).__name__, all(torch.equal(a, e) for a, e in zip(leaves, expected)))
    out["load without like"] = type(fddp.checkpoint.load(path)["p"]).__name__
    return out


@pytest.mark.parametrize("make", [Pair, Layer], ids=["namedtuple", "dataclass"])
def test_registered_containers_go_through_every_entry_in_their_own_type(make, tmp_path):
    out = run(_entries, 1, make, str(tmp_path / "c.pt"))[0]
    without_like = out.pop("load without like")
    assert out == {name: (make.__name__, True) for name in out}, out
    # A dataclass comes back from a file without `like` as a dict of its fields: no class is made from the file.
    assert without_like == ("Pair" if make is Pair else "dict")


def _fresh() -> Any:
    """An instance of a dataclass registered with torch just now, after every flatten fddp made so far."""

    @dataclasses.dataclass
    class Fresh:
        w: torch.Tensor
        b: torch.Tensor

    torch_pytree.register_dataclass(Fresh)
    return Fresh(torch.randn(3, dtype=torch.float64), torch.randn(2, dtype=torch.float64))


def _first_calls(path: str) -> dict:
    """Each entry as the first fddp call to meet a newly registered type: what it returns."""
    import fddp.diloco

    firsts = {
        "broadcast": fddp.broadcast,
        "ddp_step": lambda p: fddp.ddp_step(p, p),
        "psum": fddp.psum,
        "reduce_scatter": lambda p: fddp.reduce_scatter(p, tiled=True),
        "sync_buffers": fddp.sync_buffers,
        "adamw.init": lambda p: fddp.optim.adamw(lr=0.1).init(p).exp_avg,
        "muon.init": lambda p: fddp.optim.muon(lr=0.1).init(p),
        "apply_updates": lambda p: fddp.optim.apply_updates(p, p),
        "apply_if_finite": lambda p: fddp.apply_if_finite(True, p, p),
        "accumulate_grads": lambda p: fddp.accumulate_grads(fddp.GradAccumulator(), p).mean(),
        "diloco.init": lambda p: fddp.diloco.diloco(every=2).init(p).snapshot,
        "zero.shard": lambda p: fddp.zero.unshard(fddp.zero.shard(p)),
        "checkpoint.save": lambda p: fddp.checkpoint.load(fddp.checkpoint.save(path, p), like=p),
    }
    return {name: type(f(_fresh())).__name__ for name, f in firsts.items()}


def test_a_type_registered_after_the_last_flatten_is_adopted_by_any_entry(tmp_path):
    out = run(_first_calls, 1, str(tmp_path / "fresh.pt"))[0]
    assert out.pop("muon.init") == "MultiTransformState"
    assert out == dict.fromkeys(out, "Fresh"), out


def test_an_unregistered_container_is_refused_with_the_registration_to_make():
    with pytest.raises(TypeError, match=r"leaf '<root>' is Unregistered.*register_pytree_node"):
        fddp._tree.tensor_leaves(Unregistered(torch.ones(1)), "ddp_step")
    with pytest.raises(TypeError, match=r"leaf 'w' is Unregistered.*register_dataclass|leaf 'w' is Unregistered.*register_pytree_node"):
        fddp._tree.tensor_leaves({"w": Unregistered(torch.ones(1))}, "ddp_step")
