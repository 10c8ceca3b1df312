"""``fddp.optim.muon`` on ZeRO's shards (stages 1, 2 and 3) and under DiLoCo, on 2 and 3 gloo ranks.

References:

- on shards: the replicated fddp Muon (itself ``torch.optim.Muon`` to the bit, tests/test_muon.py)
  on the same gradients. Every rank's matrices go whole to their owner, which runs the replicated
  step's Newton-Schulz on the same values laid out the same way, and the elementwise lines are
  position-independent, so the parameters are equal to the bit, not to a tolerance;
- replicated on 2 ranks: torch DDP + ``torch.optim.Muon`` + ``AdamW(fused=True)``;
- DiLoCo with Muon as the inner optimizer: each rank's inner loop in torch (Muon + AdamW), the
  pseudo-gradients all-reduced with ``torch.distributed``, torch's Nesterov SGD as the outer step
  (one outer step, then an inner step from the merged parameters: a second outer step would add
  fddp's SGD momentum line, one rounding off torch's, ``fddp.optim.sgd``'s docstring).

The gradients of stage 2 (a reduce-scatter) and stage 3 (the gathers' backward) are the mean of
the ranks' gradients summed in another order than ``ddp_step``'s all-reduce on 3 ranks; to compare
the optimizer and nothing else, every rank draws the same batches there (a sum of equal values is
the same in any order), and on 2 ranks (a two-term sum, exact in any order) different ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from test_optim_sharded import trainable
from torch import nn

import fddp
from dist import run
from models import TinyGPT

STEPS, VOCAB, CONTEXT, WIDTH = 4, 32, 6, 32
CAPS = dict(bucket_cap_mb=0.004, first_bucket_mb=0.002)  # buckets cut through the matrices


def _model() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, WIDTH, 3 * WIDTH)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    same = fddp.world_size() > 2  # see the module's docstring
    g = torch.Generator().manual_seed(100 * step + (0 if same else rank))
    ids = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=g)
    return ids[:, :-1], ids[:, 1:].flatten()


def _opt(ns_steps: int = 5, ns_dtype: torch.dtype | None = torch.bfloat16):
    # Every matrix but the embedding to Muon (the head too: a matrix cut across ranks by the caps).
    hidden = fddp.optim.by_path(lambda path, p: p.ndim == 2 and not path.startswith("tok"))
    fallback = fddp.optim.adamw(3e-3, weight_decay=0.0)
    return fddp.optim.muon(0.02, mask=hidden, fallback=fallback, ns_steps=ns_steps, ns_dtype=ns_dtype)


def _fddp(mode: str) -> dict:
    f32 = mode.endswith("f32")  # Newton-Schulz in float32 (optax's dtype): the pieces travel in float32
    mode = mode.removesuffix(" f32")
    opt, rank = _opt(ns_dtype=None if f32 else torch.bfloat16), fddp.rank()
    apply_fn, params, shards, grad_fn = trainable(mode, _model(), CAPS)
    state = opt.init(shards)
    outer = fddp.diloco.diloco(3, fddp.optim.sgd(0.7, momentum=0.9, nesterov=True)) if mode == "diloco" else None
    outer_state = outer.init(params) if outer is not None else None
    for step in range(STEPS):
        g, _ = grad_fn(shards if mode == "zero3" else params, *_batch(step, rank))
        if mode == "replicated":
            grads = fddp.ddp_step(params, g)
        elif mode == "zero1":  # all-reduced whole, then this rank's slice
            grads = fddp.zero.shard(fddp.ddp_step(params, g), **CAPS)
        elif mode == "zero2":
            grads = fddp.ddp_step(params, g, compression=fddp.zero.ReduceScatter(), **CAPS)
        else:  # zero3: already the ranks' mean, sharded; diloco: local
            grads = g
        shards, state = fddp.optim.apply_gradients(opt, grads, state, shards)
        if mode in ("zero1", "zero2"):
            params = fddp.zero.gather(shards).wait()
        elif mode == "diloco":
            shards, outer_state = outer.step(shards, outer_state)
            params = shards
        else:
            params = shards
    full = fddp.zero.unshard(shards) if mode == "zero3" else params
    return {k: v.detach().clone() for k, v in full.items()}


def _torch(mode: str) -> dict:
    rank, model = fddp.rank(), _model()
    named = dict(model.named_parameters())
    hidden = [p for n, p in named.items() if p.ndim == 2 and not n.startswith("tok")]
    rest = [p for n, p in named.items() if not (p.ndim == 2 and not n.startswith("tok"))]
    muon, adamw = torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-3, weight_decay=0.0, fused=True)
    if mode == "diloco":
        net, snapshot = model, copy.deepcopy(model)
        outer = torch.optim.SGD(snapshot.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    else:
        net = nn.parallel.DistributedDataParallel(model)
    for step in range(STEPS):
        muon.zero_grad()
        adamw.zero_grad()
        F.cross_entropy(net(*_batch(step, rank)[:1]), _batch(step, rank)[1]).backward()
        muon.step()
        adamw.step()
        if mode == "diloco" and (step + 1) % 3 == 0:
            for s, p in zip(snapshot.parameters(), model.parameters()):
                delta = s.detach() - p.detach()
                tdist.all_reduce(delta)
                s.grad = delta / fddp.world_size()
            outer.step()
            with torch.no_grad():
                for s, p in zip(snapshot.parameters(), model.parameters()):
                    p.copy_(s)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(with_torch: bool) -> dict:
    out = {mode: _fddp(mode) for mode in ("replicated", "zero1", "zero2", "zero3", "diloco", "replicated f32", "zero3 f32")}
    if with_torch:
        out["torch replicated"] = _torch("replicated")
        out["torch diloco"] = _torch("diloco")
    # Ranks whose Muon differs (another ns_steps) are told so at the step, on every rank, before
    # any piece moves.
    apply_fn, params = fddp.functionalize(_model())
    shards = fddp.zero.shard(params, **CAPS)
    opt = _opt(ns_steps=5 if fddp.rank() == 0 else 4)
    try:
        fddp.optim.apply_gradients(opt, shards, opt.init(shards), shards)
        out["mismatch"] = None
    except fddp.MismatchError as e:
        out["mismatch"] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def runs(request):
    world = request.param
    return world, run(_worker, world, world == 2, timeout=600)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3", "zero3 f32"])
def test_muon_on_shards_equals_replicated_muon_to_the_bit(runs, mode):
    world, results = runs
    start = {k: v for k, v in _model().named_parameters()}
    ref = "replicated f32" if mode.endswith("f32") else "replicated"
    for r in results:
        assert max((r[ref][k] - v).abs().max().item() for k, v in start.items()) > 1e-3  # trained
        assert _equal(r[mode], r[ref]), (world, mode, {k: (r[mode][k] - r[ref][k]).abs().max().item() for k in start})
        assert _equal(r[mode], results[0][mode])  # every rank has the same parameters


def test_replicated_muon_on_two_ranks_equals_ddp_with_torch_muon(runs):
    world, results = runs
    if world != 2:
        pytest.skip("torch's DDP sums 3 ranks in gloo's order; the shards' comparison above covers 3 ranks")
    for r in results:
        assert _equal(r["replicated"], r["torch replicated"])


def test_muon_as_diloco_inner_optimizer_equals_torch(runs):
    world, results = runs
    if world != 2:
        pytest.skip("compared with torch on 2 ranks (the outer all-reduce's order on 3)")
    for r in results:
        assert _equal(r["diloco"], r["torch diloco"]), {k: (r["diloco"][k] - r["torch diloco"][k]).abs().max().item() for k in r["diloco"]}


def test_ranks_with_another_muon_raise_mismatch_on_every_rank(runs):
    world, results = runs
    for r in results:
        assert r["mismatch"] is not None and "optim.muon" in r["mismatch"] and "muon options" in r["mismatch"], r["mismatch"]
