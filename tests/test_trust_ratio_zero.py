"""LAMB and LARS on ZeRO's shards (stages 1, 2 and 3) against the replicated step, on 2 and 3 gloo ranks.

The trust ratio needs each parameter's whole norm; on shards each rank sums its pieces' squares in
float64, per parameter, and one all-reduce adds them up (``fddp.optim._by_leaf``). The replicated
step takes the same float64 sum over the whole parameter, so the two norms agree to float64
rounding, and the float32 ratios, hence the parameters, to the bit (a difference would need a
ratio within 1e-16 relative of a float32 rounding boundary). Everything else is elementwise.

As in tests/test_muon_zero.py, stage 2's and 3's gradients are sums in another order than
``ddp_step``'s on 3 ranks, so there every rank draws the same batches (equal terms sum alike in
any order); on 2 ranks (a two-term sum, exact in any order) different ones.
"""

from __future__ import annotations

import pytest
import torch
from test_optim_sharded import trainable
from torch import nn

import fddp
from dist import run
from models import TinyGPT

STEPS, VOCAB, CONTEXT, WIDTH = 3, 32, 6, 32
CAPS = dict(bucket_cap_mb=0.004, first_bucket_mb=0.002)  # buckets cut through the matrices
MATRICES = fddp.optim.by_path(lambda path, p: p.ndim >= 2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, WIDTH, 3 * WIDTH)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    same = fddp.world_size() > 2  # see the module's docstring
    g = torch.Generator().manual_seed(100 * step + (0 if same else rank))
    ids = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=g)
    return ids[:, :-1], ids[:, 1:].flatten()


OPTS = {
    "lamb": lambda: fddp.optim.lamb(1e-2, weight_decay=0.1, mask=MATRICES),
    "lars": lambda: fddp.optim.lars(
        0.5, weight_decay=1e-3, nesterov=True, trust_coefficient=0.02, mask=MATRICES, trust_ratio_mask=MATRICES
    ),
    "chain": lambda: fddp.optim.chain(fddp.optim.scale_by_trust_ratio(trust_coefficient=0.1), fddp.optim.adamw(1e-2)),
}


def _fddp(name: str, mode: str) -> dict:
    opt, rank = OPTS[name](), fddp.rank()
    apply_fn, params, shards, grad_fn = trainable(mode, _model(), CAPS)
    state = opt.init(shards)
    for step in range(STEPS):
        g, _ = grad_fn(shards if mode == "zero3" else params, *_batch(step, rank))
        if mode == "replicated":
            grads = fddp.ddp_step(params, g)
        elif mode == "zero1":
            grads = fddp.zero.shard(fddp.ddp_step(params, g), **CAPS)
        elif mode == "zero2":
            grads = fddp.ddp_step(params, g, compression=fddp.zero.ReduceScatter(), **CAPS)
        else:
            grads = g
        shards, state = fddp.optim.apply_gradients(opt, grads, state, shards)
        params = fddp.zero.gather(shards).wait() if mode in ("zero1", "zero2") else shards
    full = fddp.zero.unshard(shards) if mode == "zero3" else params
    return {k: v.detach().clone() for k, v in full.items()}


def _worker() -> dict:
    out = {(name, mode): _fddp(name, mode) for name in OPTS for mode in ("replicated", "zero1", "zero2", "zero3")}
    # Adafactor's factored moments need whole matrices: refused on shards, with the way out.
    shards = fddp.zero.shard(fddp.functionalize(_model())[1], **CAPS)
    try:
        fddp.optim.adafactor().init(shards)
        out["adafactor"] = None
    except TypeError as e:
        out["adafactor"] = str(e)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def runs(request):
    return request.param, run(_worker, request.param, timeout=600)


def test_adafactor_refuses_shards(runs):
    for r in runs[1]:
        assert r["adafactor"] is not None and "whole matrices" in r["adafactor"] and "elementwise optimizer" in r["adafactor"]


@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("name", list(OPTS))
def test_on_shards_equals_replicated_to_the_bit(runs, name, mode):
    world, results = runs
    start = dict(_model().named_parameters())
    for r in results:
        ref, got = r[(name, "replicated")], r[(name, mode)]
        assert max((ref[k] - v).abs().max().item() for k, v in start.items()) > 1e-4  # trained
        diffs = {k: (got[k] - ref[k]).abs().max().item() for k in start if not torch.equal(got[k], ref[k])}
        assert not diffs, (world, name, mode, diffs)
        assert all(torch.equal(got[k], results[0][(name, mode)][k]) for k in start)  # every rank alike
