"""Training semantics: no-sync accumulation, weighted means for uneven inputs, Join, buffers, unused parameters.

References: single-process full-batch training written with torch's own autograd and torch.optim,
and torch DDP (``broadcast_buffers=True``, ``find_unused_parameters=True``).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad

import fddp
import fddp._dist
import fddp.optim
from dist import count_calls, run
from fddp import SyncInfo
from fddp.sync import plan_of as plan_for
from models import make_model

COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv",
    "broadcast_object_list", "reduce", "gather", "scatter",
)  # fmt: skip
CAP = dict(bucket_cap_mb=0.002, first_bucket_mb=0.001)  # several buckets for the small MLP


def count_collectives():
    """Record the name of every torch.distributed collective issued while the block runs.

    fddp's per-call agreement header (``fddp._dist``) is not one of the call's data collectives:
    it is counted apart, in ``calls.headers``.
    """
    return count_calls(COLLECTIVES, lambda name, _: name)


def num_buckets(tree: dict, cap_mb: float = CAP["bucket_cap_mb"], first_mb: float = CAP["first_bucket_mb"]) -> int:
    return len(plan_for(tree, cap_mb, first_mb).buckets)


def batch(seed: int, n: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g, dtype=dtype), torch.randint(0, 4, (n,), generator=g)


def mean_loss(apply_fn, params, x, y):
    return F.cross_entropy(apply_fn(params, x), y)  # NaN for an empty batch: the mean of nothing


def full_batch_grads(model: nn.Module, batches: list) -> dict:
    """The reference: one process, torch autograd, the mean loss over the union of all batches."""
    model = copy.deepcopy(model)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    F.cross_entropy(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


# --- accumulation: k-1 of k micro-steps communicate nothing, and the window is one large batch ---------

MICRO_SIZES = {0: [3, 5, 0, 7], 1: [2, 6, 4, 1]}  # uneven, with an empty micro-batch (NaN gradient)


def micro_batches(rank: int, window: int) -> list:
    return [batch(1000 * window + 10 * rank + i, n) for i, n in enumerate(MICRO_SIZES[rank])]


def _accumulate_worker():
    rank = fddp.rank()
    apply_fn, params = fddp.functionalize(make_model("mlp").double())
    out = []
    for window, weighted in enumerate([True, False]):
        acc, calls = fddp.GradAccumulator(), []
        mbs = micro_batches(rank, window) if weighted else [batch(50 + rank + 2 * i, 4) for i in range(4)]
        for i, (x, y) in enumerate(mbs):
            with count_collectives() as c:
                g = grad(lambda p: mean_loss(apply_fn, p, x, y))(params)
                acc = fddp.accumulate_grads(acc, g, weight=len(x) if weighted else None)
                if i == len(mbs) - 1:
                    grads = fddp.ddp_step(params, acc.mean(), weight=acc.weight if weighted else None, **CAP)
            calls.append((len(c), c.headers))
        out.append((grads, calls))
    return out, num_buckets(params)


def test_accumulation_equals_large_batch_and_skips_sync():
    results = run(_accumulate_worker, 2)
    model = make_model("mlp").double()
    weighted_ref = full_batch_grads(model, micro_batches(0, 0) + micro_batches(1, 0))
    equal_ref = full_batch_grads(model, [batch(50 + r + 2 * i, 4) for r in range(2) for i in range(4)])
    for (windows, buckets), other in zip(results, reversed(results)):
        (weighted, calls0), (plain, calls1) = windows
        # Only the sync communicates: one collective per bucket, after the one agreement on the call; the
        # first sync of a tree also compares the parameters' checksums (once; weight and plain differ in signature).
        assert calls0 == [(0, 0)] * 3 + [(buckets + 1, 1)] and calls1 == [(0, 0)] * 3 + [(buckets + 1, 1)], (calls0, calls1)
        assert buckets >= 3
        for k in weighted_ref:
            torch.testing.assert_close(weighted[k], weighted_ref[k], rtol=1e-12, atol=1e-14, msg=k)
            torch.testing.assert_close(plain[k], equal_ref[k], rtol=1e-12, atol=1e-14, msg=k)
            assert torch.equal(weighted[k], other[0][0][0][k])


def _overlapped_worker():
    """The window's last micro-batch through grad_and_value(accumulated=): its buckets go out in
    its backward, and the result is the sum-then-ddp_step result, to the bit."""
    from dist import count_all_reduces

    rank = fddp.rank()
    apply_fn, params = fddp.functionalize(make_model("mlp").double())
    params = fddp.broadcast(params)
    step = fddp.grad_and_value(lambda p, x, y: mean_loss(apply_fn, p, x, y), **CAP)
    out = []
    sharded = fddp.grad_and_value(lambda p, x, y: mean_loss(apply_fn, p, x, y), compression=fddp.zero.ReduceScatter(), **CAP)
    for window, weighted in enumerate([True, False, True]):
        mbs = micro_batches(rank, window) if weighted else [batch(50 + rank + 2 * i, 4) for i in range(4)]
        acc = fddp.GradAccumulator()
        for x, y in mbs[:-1]:
            acc = fddp.accumulate_grads(acc, grad(lambda p: mean_loss(apply_fn, p, x, y))(params), weight=len(x) if weighted else None)
        (x, y) = mbs[-1]
        whole = fddp.accumulate_grads(acc, grad(lambda p: mean_loss(apply_fn, p, x, y))(params), weight=len(x) if weighted else None)
        stage2 = window == 2  # the docs' stage-2 recipe: the window reduce-scattered
        options = dict(compression=fddp.zero.ReduceScatter()) if stage2 else {}
        reference = fddp.ddp_step(params, whole.mean(), weight=whole.weight if weighted else None, **options, **CAP)
        with count_all_reduces() as calls:
            overlapped, _ = (sharded if stage2 else step)(params, x, y, weight=len(x) if weighted else None, accumulated=acc)
        if stage2:
            reference, overlapped = dict(enumerate(reference.shards)), dict(enumerate(overlapped.shards))
        out.append((reference, overlapped, list(calls)))
    return out, num_buckets(params)


def test_the_last_micro_batch_reduces_the_window_in_its_backward():
    for results, buckets in run(_overlapped_worker, 2):
        for window, (reference, overlapped, calls) in enumerate(results):
            # every bucket's collective inside backward (stage 2's too: on gloo a reduce-scatter is an all-reduce)
            assert len(calls) == buckets and all(in_backward for _, in_backward in calls), (window, calls)
            for k in reference:
                assert torch.equal(overlapped[k], reference[k]), k


def test_accumulator_unit():
    ones, nan = torch.ones(2, dtype=torch.float64), torch.full((2,), float("nan"), dtype=torch.float64)
    g1 = {"w": ones, "u": None}
    acc = fddp.accumulate_grads(fddp.GradAccumulator(), g1, weight=3)
    acc = fddp.accumulate_grads(acc, {"w": 5 * ones, "u": None}, weight=1)
    acc = fddp.accumulate_grads(acc, {"w": nan, "u": nan}, weight=0)  # empty micro-batch
    acc = fddp.accumulate_grads(acc, {"w": nan, "u": None}, weight=torch.tensor(0))
    acc = fddp.accumulate_grads(acc, {"w": 2 * ones, "u": None}, weight=torch.tensor(4.0))
    assert acc.count == 5 and float(acc.weight) == 8.0 and acc.grad_sum["u"] is None
    assert torch.equal(acc.mean()["w"], (3 + 5 + 8) / 8 * ones) and acc.mean()["u"] is None
    assert torch.equal(g1["w"], ones)  # inputs untouched
    # unweighted: a plain mean over the micro-batches; an empty window or weight 0 only: None (read as zeros)
    plain = fddp.accumulate_grads(fddp.accumulate_grads(fddp.GradAccumulator(), {"w": ones}), {"w": 2 * ones})
    assert torch.equal(plain.mean()["w"], 1.5 * ones) and fddp.GradAccumulator().mean() is None
    zero = fddp.accumulate_grads(fddp.GradAccumulator(), {"w": nan, "u": ones}, weight=0)
    assert zero.mean() == {"w": None, "u": None} and zero.count == 1 and float(zero.weight) == 0
    with pytest.raises(ValueError, match="structure"):
        fddp.accumulate_grads(acc, {"w": ones})
    with pytest.raises(ValueError, match=r"'w' has shape \(3,\).*\(2,\)"):
        fddp.accumulate_grads(acc, {"w": torch.ones(3), "u": None})
    with pytest.raises(ValueError, match=">= 0"):
        fddp.accumulate_grads(acc, g1, weight=-1)
    with pytest.raises(TypeError, match="'u'.*float"):
        fddp.accumulate_grads(acc, {"w": ones, "u": 1.0})


# --- weighted means: exact global averages for uneven (and empty) per-rank batches -------------------

SIZES = [5, 0, 11]


def _weighted_worker(empty_as_none: bool, compression: str | None):
    rank = fddp.rank()
    apply_fn, params = fddp.functionalize(make_model("mlp").double() if compression is None else make_model("mlp"))
    x, y = batch(rank, SIZES[rank], next(iter(params.values())).dtype)
    g = grad(lambda p: mean_loss(apply_fn, p, x, y))(params)  # NaN on the empty rank
    if SIZES[rank] == 0 and empty_as_none:
        g = None
    opts = dict(CAP, weight=len(x), compression=compression)
    fddp.ddp_step(params, g, **opts)  # signature check out of the count
    with count_collectives() as calls:
        out, info = fddp.ddp_step(params, g, return_info=True, **opts)
    plain = fddp.ddp_step(params, {k: v.nan_to_num() for k, v in g.items()} if g is not None else None, **CAP)
    return out, float(info.weight), calls, num_buckets(params), plain


@pytest.mark.parametrize("empty_as_none, compression", [(False, None), (True, None), (False, "bf16")])
def test_weighted_mean_equals_full_batch(empty_as_none, compression):
    results = run(_weighted_worker, 3, empty_as_none, compression)
    dtype = torch.float64 if compression is None else torch.float32
    model = make_model("mlp").to(dtype)
    ref = full_batch_grads(model, [batch(r, n, dtype) for r, n in enumerate(SIZES)])
    for out, wsum, calls, buckets, _plain in results:
        assert wsum == sum(SIZES)
        # The weight rides in bucket 0 (float32/64): no extra collective. A bf16 bucket 0 cannot carry
        # it exactly, so then it travels alone.
        assert calls == ["all_reduce"] * (buckets + (compression is not None)), calls
        for k in ref:
            if compression is None:
                torch.testing.assert_close(out[k], ref[k], rtol=1e-12, atol=1e-14, msg=k)
            else:  # each rank rounds w_r / n * g_r once to bf16 (2**-9 relative), gloo sums in bf16
                assert rel_error(out[k], ref[k]) < 1e-2, (k, rel_error(out[k], ref[k]))
            assert torch.equal(out[k], results[0][0][k])
    # DDP's mean of per-rank means is not the global mean here: the reference tells them apart.
    assert all(rel_error(results[0][4][k], ref[k]) > 0.1 for k in ref)


def rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.to(ref.dtype) - ref).norm() / ref.norm())


def _half_precision_weight_worker():
    rank = fddp.rank()
    # fp16: w_r * g_r / n = 2048 * 40 would overflow (65504); the mean of 20 and 60 does not.
    big = torch.tensor(4096.0, dtype=torch.float64)
    g = {"a": torch.full((4,), 20.0 + 40 * rank)}
    fp16 = fddp.ddp_step({"a": torch.zeros(4)}, g, weight=big, compression="fp16")
    # A float32 bucket 0 carries the weight; the bfloat16 bucket after it must wait for the sum.
    params = {"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2)}
    g = {"a": torch.full((3,), 4.0 + 4 * rank, dtype=torch.bfloat16), "b": torch.full((2,), 1.0 + rank)}
    mixed, info = fddp.ddp_step(params, g, weight=1 + 2 * rank, return_info=True)  # w = 1, 3: exact in bf16
    empty = fddp.ddp_step({}, {}, weight=1 + rank, return_info=True)[1]  # no buckets: the weight travels alone
    return fp16, big, mixed, info.collectives, (float(empty.weight), empty.collectives)


def test_weight_travel_paths():
    for fp16, big, mixed, collectives, empty in run(_half_precision_weight_worker, 2):
        assert empty == (3.0, 1)
        assert torch.equal(fp16["a"], torch.full((4,), 40.0))
        assert float(big) == 4096.0  # the caller's weight tensor is not reduced in place
        assert torch.equal(mixed["a"], torch.full((3,), 7.0, dtype=torch.bfloat16))  # (1*4 + 3*8) / 4
        assert torch.equal(mixed["b"], torch.full((2,), 1.75)) and collectives == 2  # (1*1 + 3*2) / 4


# --- Join: uneven loaders, 3 batches against 7 ----------------------------------------------------

SHARDS = {0: [4, 6, 2], 1: [5, 3, 8, 1, 4, 6, 2]}
LR = 0.01


def shard(rank: int) -> list:
    return [batch(100 * rank + i, n) for i, n in enumerate(SHARDS[rank])]


def _join_worker():
    apply_fn, params = fddp.functionalize(make_model("mlp").double())
    opt = fddp.optim.adam(LR)
    state = opt.init(params)
    batches = fddp.Join(shard(fddp.rank()))
    calls, exhausted = [], []
    for b in batches:
        exhausted.append(batches.exhausted)
        g, n = (None, 0) if b is None else (grad(lambda p: mean_loss(apply_fn, p, *b))(params), len(b[0]))
        with count_collectives() as c:
            grads, info = fddp.ddp_step(params, g, weight=n, return_info=True, **CAP)
        calls.append((len(c), c.headers))
        if batches.done(info):
            break
        updates, state = opt.update(grads, state, params)
        params = fddp.optim.apply_updates(params, updates)
    assert next(batches, "stopped") == "stopped"  # iteration ends after a True verdict
    return params, calls, exhausted, num_buckets(params)


def test_uneven_loaders_join():
    results = run(_join_worker, 2, timeout=60)
    # Reference: one process, torch.optim.Adam, each step on the union of the batches ranks still had.
    model = make_model("mlp").double()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for t in range(max(len(s) for s in SHARDS.values())):
        opt.zero_grad()
        x, y = (torch.cat(z) for z in zip(*[shard(r)[t] for r in SHARDS if t < len(SHARDS[r])]))
        F.cross_entropy(model(x), y).backward()
        opt.step()
    (p0, calls0, ex0, buckets), (p1, calls1, ex1, _) = results
    # 7 steps and the all-empty one: one collective per bucket after each call's agreement, no extras
    # but the first call's comparison of the parameters' checksums.
    assert calls0 == calls1 == [(buckets + 1, 1)] + [(buckets, 1)] * 7
    assert ex0 == [False] * 3 + [True] * 5 and ex1 == [False] * 7 + [True]
    for k, ref in model.named_parameters():
        assert torch.equal(p0[k], p1[k]), f"replicas differ at {k}"
        torch.testing.assert_close(p0[k], ref.detach(), rtol=1e-10, atol=1e-12, msg=k)


def test_join_unit():
    batches = fddp.Join([1, 2])
    assert [next(batches), next(batches), next(batches), next(batches)] == [1, 2, None, None]
    assert batches.exhausted
    assert not batches.done(SyncInfo(None, torch.tensor(3.0, dtype=torch.float64), 0, 1))
    assert next(batches) is None
    assert batches.done(SyncInfo(None, torch.tensor(0.0, dtype=torch.float64), 0, 1))
    assert list(batches) == []
    with pytest.raises(ValueError, match="weight=n, return_info=True"):
        fddp.Join([]).done(SyncInfo(None, None, 0, 1))


def _weight_mismatch_worker():
    params = {"w": torch.zeros(3)}
    try:
        fddp.ddp_step(params, params, weight=2 if fddp.rank() == 0 else None)
    except fddp.MismatchError as e:
        return str(e)


def test_weight_on_some_ranks_only_raises_everywhere():
    for msg in run(_weight_mismatch_worker, 2, timeout=60):
        assert msg is not None and "Option weight: rank 0 has a weight, rank 1 has no weight" in msg, msg


# --- buffers ------------------------------------------------------------------------------------------


# torch 2.13 renamed DDP's broadcast_buffers (deprecated) to forward_sync_buffers: the same broadcast.
_ddp_args = inspect.signature(nn.parallel.DistributedDataParallel).parameters
BROADCAST_BUFFERS = {"forward_sync_buffers" if "forward_sync_buffers" in _ddp_args else "broadcast_buffers": True}


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


def _batchnorm_ddp_worker(steps: int):
    rank = fddp.rank()
    ddp = nn.parallel.DistributedDataParallel(bn_model(), **BROADCAST_BUFFERS)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    apply_fn, params, buffers = fddp.functionalize_with_buffers(bn_model())
    opt = fddp.optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)

    def loss_fn(p, b, x, y):
        out, new_buffers = apply_fn(p, b, x)
        return F.cross_entropy(out, y), new_buffers

    for step in range(steps):
        x, y = batch(1000 * step + rank, 6 + 2 * rank, torch.float32)
        torch_opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        torch_opt.step()
        buffers = fddp.sync_buffers(buffers, "broadcast")  # DDP broadcasts rank 0's at each forward
        g, buffers = grad(loss_fn, has_aux=True)(params, buffers, x, y)
        updates, state = opt.update(fddp.ddp_step(params, g), state, params)
        params = fddp.optim.apply_updates(params, updates)
    ref_params = {k: v.detach() for k, v in ddp.module.named_parameters()}
    return params, buffers, ref_params, dict(ddp.module.named_buffers())


def test_batchnorm_broadcast_matches_ddp():
    results = run(_batchnorm_ddp_worker, 2, 20)
    for params, buffers, ref_params, ref_buffers in results:
        for k in ref_params:  # float32 after 20 steps; observed max difference 1.2e-7
            torch.testing.assert_close(params[k], ref_params[k], rtol=0, atol=1e-6, msg=k)
        for k in ref_buffers:
            torch.testing.assert_close(buffers[k], ref_buffers[k], rtol=0, atol=1e-6, msg=k)
        assert int(buffers["1.num_batches_tracked"]) == 20
    # The last forward is local: the ranks' running statistics differ, as under DDP.
    assert not torch.equal(results[0][1]["1.running_mean"], results[1][1]["1.running_mean"])


def rank_buffers(rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    return {
        "f32": torch.randint(-9, 10, (5,), generator=g).float(),
        "f64": torch.randint(-9, 10, (2, 3), generator=g).double(),
        "bf16": torch.randint(-9, 10, (4,), generator=g).to(torch.bfloat16),
        "count": torch.tensor(10 + rank),
        "flag": torch.tensor([rank == 1, False]),
        "big": torch.randint(-9, 10, (1000,), generator=g).float(),  # makes a second float32 bucket
    }


def _sync_buffers_worker():
    mine = rank_buffers(fddp.rank())
    before = copy.deepcopy(mine)
    out = {}
    for mode in ("mean", "broadcast"):
        fddp.sync_buffers(mine, mode, src=1, bucket_cap_mb=0.002)  # the signature check, once per mode
        with count_collectives() as calls:
            out[mode] = fddp.sync_buffers(mine, mode, src=1, bucket_cap_mb=0.002)
        out[mode + "_calls"] = calls
    assert all(torch.equal(mine[k], before[k]) for k in mine), "sync_buffers modified its input"
    return out, num_buckets(mine, 0.002, 0.002)


def test_sync_buffers_modes():
    world = 3
    results = run(_sync_buffers_worker, world)
    per_rank = [rank_buffers(r) for r in range(world)]
    for out, buckets in results:
        assert out["mean_calls"] == ["all_reduce"] * buckets and out["broadcast_calls"] == ["broadcast"] * buckets
        for k, ref in per_rank[1].items():
            assert torch.equal(out["broadcast"][k], ref), k
        for k in ("f32", "f64", "big"):  # sums of integers are exact, then one rounded division
            assert torch.equal(out["mean"][k], sum(b[k] for b in per_rank) / world), k
        exact = sum(b["bf16"].double() for b in per_rank) / world  # bf16: divided before the sum
        torch.testing.assert_close(out["mean"]["bf16"].double(), exact, rtol=1e-2, atol=1e-2)
        assert out["mean"]["count"].dtype == torch.int64 and int(out["mean"]["count"]) == 10 + world - 1
        assert out["mean"]["flag"].tolist() == [True, False]
        for k in per_rank[0]:
            assert torch.equal(out["mean"][k], results[0][0]["mean"][k]), k


def test_sync_buffers_rejects_unknown_mode():
    with pytest.raises(ValueError, match="'broadcast' or 'mean', got 'sum'"):
        fddp.sync_buffers({"b": torch.zeros(1)}, "sum")


def test_functional_forward_returns_new_buffers():
    model = bn_model()
    apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
    before = copy.deepcopy(buffers)
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8)
    out, new = apply_fn(params, buffers, x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)
    for k, b in reference.named_buffers():
        assert torch.equal(new[k], b), k  # torch's own in-place update, on a copy
        assert torch.equal(buffers[k], before[k]) and torch.equal(dict(model.named_buffers())[k], before[k])


# --- unused parameters ------------------------------------------------------------------------------


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.a, self.b, self.never = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, branch: str) -> torch.Tensor:
        return getattr(self, branch)(torch.tanh(self.trunk(x)))


def _unused_worker(mode: str, steps: int):
    rank = fddp.rank()
    branch = "ab"[rank]  # each rank leaves one branch unused, and both leave "never" unused
    ddp = nn.parallel.DistributedDataParallel(Branchy(), find_unused_parameters=True)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    apply_fn, params = fddp.functionalize(Branchy())
    opt = fddp.optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)
    first = None
    for step in range(steps):
        x, y = batch(10 * step + rank, 6, torch.float32)
        torch_opt.zero_grad()
        F.cross_entropy(ddp(x, branch), y).backward()
        torch_opt.step()
        g = grad(lambda p: F.cross_entropy(apply_fn(p, x, branch), y))(params)  # zeros where unused
        if mode == "none":
            g = {k: v if k.split(".")[0] in ("trunk", branch) else None for k, v in g.items()}
        grads = fddp.ddp_step(params, g)
        if first is None:
            first = grads, {k: p.grad for k, p in ddp.module.named_parameters()}
        updates, state = opt.update(grads, state, params)
        params = fddp.optim.apply_updates(params, updates)
    return first, params, {k: p.detach() for k, p in ddp.module.named_parameters()}


@pytest.mark.parametrize("mode", ["func", "none"])
def test_unused_parameters_match_ddp(mode):
    results = run(_unused_worker, 2, mode, 5)
    for (grads, ddp_grads), params, ddp_params in results:
        for k, ref in ddp_grads.items():
            # DDP leaves the grad of a parameter unused on every rank as None; fddp returns zeros.
            ref = torch.zeros_like(grads[k]) if ref is None else ref
            # Exact: with 2 ranks, DDP's a/2 + b/2 and fddp's (a + b)/2 round the same way.
            torch.testing.assert_close(grads[k], ref, rtol=0, atol=0, msg=k)
        for k, ref in ddp_params.items():  # observed max difference after 5 steps: 6e-8
            torch.testing.assert_close(params[k], ref, rtol=0, atol=1e-6, msg=k)
            assert torch.equal(params[k], results[0][1][k])
        assert not torch.equal(grads["a.weight"], torch.zeros_like(grads["a.weight"]))

