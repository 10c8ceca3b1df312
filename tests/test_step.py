"""ddp_step: exact means, torch DDP as the oracle, collective counts, purity, composition, errors."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch.func import functional_call, grad, grad_and_value, stack_module_state, vmap

import fddp
from dist import RankError, count_all_reduces, run
from fddp._layout import plan as make_plan
from fddp._tree import LeafSpec
from fddp.sync import plan_of as plan_for
from models import make_batch, make_model

DTYPES = {"a": torch.float32, "b": torch.float64, "c": torch.bfloat16, "d": torch.float32}
SHAPES = {"a": (3, 5), "b": (7,), "c": (4, 2, 3), "d": ()}


def int_grads(rank: int) -> dict:
    """Integer-valued gradients: their sums are exact in every dtype, so the mean is exactly known."""
    g = torch.Generator().manual_seed(100 + rank)
    return {k: torch.randint(-8, 9, SHAPES[k], generator=g).to(DTYPES[k]) for k in SHAPES}


def _mean_worker():
    params = {k: torch.zeros(SHAPES[k], dtype=DTYPES[k]) for k in SHAPES}
    grads = int_grads(fddp.rank())
    before = copy.deepcopy(grads)
    out = fddp.ddp_step(params, grads, bucket_cap_mb=1e-4, first_bucket_mb=1e-5)
    assert all(torch.equal(grads[k], before[k]) for k in grads), "ddp_step modified its input"
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mean_is_exact(world):
    outs = run(_mean_worker, world)
    per_rank = [int_grads(r) for r in range(world)]
    for k in SHAPES:
        exact_sum = sum(g[k].double() for g in per_rank)
        if DTYPES[k] == torch.bfloat16:  # divided before the sum: rounding of each g/world
            torch.testing.assert_close(outs[0][k], (exact_sum / world).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
        else:  # sum of integers is exact, then one correctly rounded division
            ref = exact_sum.to(DTYPES[k]) / world
            assert torch.equal(outs[0][k], ref), k
        assert outs[0][k].dtype == DTYPES[k] and outs[0][k].shape == SHAPES[k]
        for r in range(1, world):
            assert torch.equal(outs[r][k], outs[0][k])


def _loss(apply_fn, params, x, y):
    return F.cross_entropy(apply_fn(params, x), y)


def _ddp_oracle_worker(name: str, steps: int, lr: float):
    rank = fddp.rank()
    model = make_model(name)
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    apply_fn, params = fddp.functionalize(make_model(name))
    params = fddp.broadcast(params)
    first = None
    for step in range(steps):
        x, y = make_batch(name, seed=1000 * step + rank)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        grads = fddp.ddp_step(params, grad(lambda p: _loss(apply_fn, p, x, y))(params))
        if first is None:
            first = {n: (p.grad.clone(), grads[n].clone()) for n, p in ddp.module.named_parameters()}
        opt.step()
        params = {k: torch.add(p, grads[k], alpha=-lr) for k, p in params.items()}
    final = {n: (p.detach().clone(), params[n]) for n, p in ddp.module.named_parameters()}
    return first, final


@pytest.mark.parametrize("name", ["mlp", "conv", "transformer"])
def test_matches_torch_ddp(name):
    results = run(_ddp_oracle_worker, 2, name, 20, 0.1)
    for first, final in results:
        for n, (ddp_grad, fddp_grad) in first.items():
            torch.testing.assert_close(fddp_grad, ddp_grad, rtol=0, atol=1e-6, msg=f"grad {n}")
        for n, (ddp_param, fddp_param) in final.items():
            torch.testing.assert_close(fddp_param, ddp_param, rtol=0, atol=1e-5, msg=f"param {n} after 20 steps")
    for n in results[0][1]:
        assert torch.equal(results[0][1][n][1], results[1][1][n][1]), f"replicas differ at {n}"


def _count_worker(cap_mb: float, first_mb: float):
    apply_fn, params = fddp.functionalize(make_model("mlp"))
    x, y = make_batch("mlp", seed=fddp.rank())
    grads = grad(lambda p: _loss(apply_fn, p, x, y))(params)
    fddp.ddp_step(params, grads, bucket_cap_mb=cap_mb, first_bucket_mb=first_mb)  # signature check
    with count_all_reduces() as calls:
        fddp.ddp_step(params, grads, bucket_cap_mb=cap_mb, first_bucket_mb=first_mb)
    return len(calls), len(plan_for(params, cap_mb, first_mb).buckets), sum(n for n, _ in calls)


def test_one_collective_per_bucket():
    n_values = sum(p.numel() for p in make_model("mlp").parameters())
    small = run(_count_worker, 2, 0.004, 0.001)
    big = run(_count_worker, 2, 100.0, 100.0)
    # The model's buckets are too large for the call's head: one collective per bucket, after a
    # head of their own (counted apart, fddp._dist's "The data rides in the head").
    for calls, buckets, values in small:
        assert calls == buckets and buckets >= 3 and values == n_values
    for calls, buckets, values in big:
        assert calls == buckets == 1 and values == n_values


def _replica_worker(steps: int):
    apply_fn, params = fddp.functionalize(make_model("mlp", seed=fddp.rank()))  # different init per rank
    params = fddp.broadcast(params, src=1)
    for step in range(steps):
        x, y = make_batch("mlp", seed=7 * step + fddp.rank())
        grads = fddp.ddp_step(params, grad(lambda p: _loss(apply_fn, p, x, y))(params), bucket_cap_mb=0.002)
        params = {k: p - 0.05 * grads[k] for k, p in params.items()}
    return params


def test_replicas_stay_bitwise_identical():
    outs = run(_replica_worker, 3, 30)
    ref = dict(make_model("mlp", seed=1).named_parameters())
    for k in outs[0]:
        assert not torch.equal(outs[0][k], ref[k].detach())  # training moved them
        assert torch.equal(outs[0][k], outs[1][k]) and torch.equal(outs[0][k], outs[2][k])


def _broadcast_worker():
    # three float leaves share one bucket; the int64 leaf travels in its own
    tree = {"w": torch.full((3, 4), float(fddp.rank())), "n": {"b": torch.arange(5) + fddp.rank()},
            "v": [torch.full((2,), float(fddp.rank())), torch.zeros(7) + fddp.rank()]}
    before = copy.deepcopy(tree)
    fddp.broadcast(tree, src=1)  # the first call of a tree compares signatures (an all-reduce)
    sent, original = [], tdist.broadcast
    tdist.broadcast = lambda t, *a, **k: sent.append(t.numel()) or original(t, *a, **k)
    try:
        out = fddp.broadcast(tree, src=1)
    finally:
        tdist.broadcast = original
    assert torch.equal(tree["w"], before["w"]) and torch.equal(tree["n"]["b"], before["n"]["b"])
    return out, sorted(sent)


def test_broadcast_takes_src_values_in_one_collective_per_bucket():
    for out, sent in run(_broadcast_worker, 3):
        assert torch.equal(out["w"], torch.ones(3, 4)) and torch.equal(out["n"]["b"], torch.arange(5) + 1)
        assert torch.equal(out["v"][0], torch.ones(2)) and torch.equal(out["v"][1], torch.ones(7))
        assert sent == [5, 12 + 2 + 7], sent


# --- composition with torch.func ------------------------------------------------------------


def _compose_worker():
    rank = fddp.rank()
    apply_fn, params = fddp.functionalize(make_model("mlp"))
    x, y = make_batch("mlp", seed=rank)
    out = {}
    # grad_and_value with has_aux, then ddp_step
    g, (loss, logits) = grad_and_value(lambda p: (_loss(apply_fn, p, x, y), apply_fn(p, x)), has_aux=True)(params)
    out["local"] = g
    out["synced"] = fddp.ddp_step(params, g)
    # per-sample gradients, averaged locally, then synced
    per_sample = vmap(grad(lambda p, xi, yi: _loss(apply_fn, p, xi[None], yi[None])), in_dims=(None, 0, 0))(params, x, y)
    local_mean = {k: v.mean(0) for k, v in per_sample.items()}
    out["per_sample"] = fddp.ddp_step(params, local_mean)
    out["per_sample_local"] = local_mean
    # an ensemble of 3 models stacked on a leading dimension
    models = [make_model("mlp", seed=s) for s in range(3)]
    stacked = {k: v.detach() for k, v in stack_module_state(models)[0].items()}
    base = copy.deepcopy(models[0]).to("meta")

    def ensemble_loss(p):
        logits = vmap(lambda pi: functional_call(base, pi, (x,)))(p)
        return sum(F.cross_entropy(logits[i], y) for i in range(3))

    g_ens = grad(ensemble_loss)(stacked)
    out["ensemble_local"] = g_ens
    out["ensemble"] = fddp.ddp_step(stacked, g_ens)
    return out


def test_composes_with_torch_func():
    outs = run(_compose_worker, 2)
    for local, synced in [("local", "synced"), ("per_sample_local", "per_sample"), ("ensemble_local", "ensemble")]:
        for k in outs[0][synced]:
            ref = (outs[0][local][k] + outs[1][local][k]) / 2
            torch.testing.assert_close(outs[0][synced][k], ref, rtol=0, atol=1e-7)
            assert torch.equal(outs[0][synced][k], outs[1][synced][k])
    # per-sample means equal the batch gradient, up to rounding
    for k in outs[0]["synced"]:
        torch.testing.assert_close(outs[0]["per_sample"][k], outs[0]["synced"][k], rtol=1e-4, atol=1e-6)
    assert outs[0]["ensemble"]["0.weight"].shape[0] == 3


def test_none_grads_count_as_zero():
    outs = run(_none_worker, 2)
    assert torch.equal(outs[0]["a"], torch.full((3,), 0.5)) and torch.equal(outs[1]["a"], outs[0]["a"])
    assert torch.equal(outs[0]["b"], torch.full((2,), 1.5))


def _none_worker():
    params = {"a": torch.zeros(3), "b": torch.zeros(2)}
    grads = {"a": torch.ones(3) if fddp.rank() == 0 else None, "b": torch.full((2,), 1.0 + 1.0 * fddp.rank())}
    return fddp.ddp_step(params, grads)


# --- errors -----------------------------------------------------------------------------------


def _mismatch_worker(kind: str):
    rank = fddp.rank()
    tree = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    if rank == 1:
        if kind == "shape":
            tree["w"] = torch.zeros(4, 4)
        elif kind == "dtype":
            tree["b"] = torch.zeros(3, dtype=torch.float64)
        elif kind == "structure":
            tree["extra"] = torch.zeros(1)
    try:
        if kind == "broadcast":
            fddp.broadcast({"x": torch.zeros(2 + rank)})
        else:
            fddp.ddp_step(tree, tree)
    except fddp.MismatchError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("shape", ["'w'", "shape=(4, 3)", "shape=(4, 4)"]),
        ("dtype", ["'b'", "torch.float32", "torch.float64"]),
        ("structure", ["extra"]),
        ("broadcast", ["'x'", "shape=(2,)", "shape=(3,)"]),
    ],
)
def test_rank_mismatch_raises_on_every_rank(kind, expected):
    messages = run(_mismatch_worker, 2, kind, timeout=60)
    for msg in messages:
        assert msg is not None, "no MismatchError raised"
        for part in expected:
            assert part in msg, (part, msg)
    assert messages[0] == messages[1]


def _local_error_worker(kind: str):
    params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    grads = {
        "structure": {"w": torch.zeros(2, 2)},
        "non_tensor": {"w": torch.zeros(2, 2), "b": 1.0},
        "device": {"w": torch.zeros(2, 2), "b": torch.zeros(2, device="meta")},
        "shape": {"w": torch.zeros(2, 3), "b": torch.zeros(2)},
    }[kind]
    try:
        fddp.ddp_step(params, grads)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("structure", ["same tree structure", "params", "grads"]),
        ("non_tensor", ["TypeError", "'b'", "float"]),
        ("device", ["'b'", "device cpu", "device meta"]),
        ("shape", ["'w'", "(2, 2)", "(2, 3)"]),
    ],
)
def test_bad_grads_rejected_locally(kind, expected):
    for msg in run(_local_error_worker, 2, kind):
        assert msg is not None
        for part in expected:
            assert part in msg, (part, msg)


def test_params_with_non_tensor_leaf_rejected():
    msg = run(_non_tensor_param_worker, 1)[0]
    assert "TypeError" in msg and "'lr'" in msg and "float" in msg


def _non_tensor_param_worker():
    try:
        fddp.ddp_step({"w": torch.zeros(2), "lr": 0.1}, {"w": torch.zeros(2), "lr": None})
    except TypeError as e:
        return f"TypeError: {e}"


def test_single_process_world_and_uninitialised_error():
    script = textwrap.dedent(
        """
        import torch, fddp
        try:
            fddp.ddp_step({"w": torch.ones(2)}, {"w": torch.ones(2)})
        except RuntimeError as e:
            assert "fddp.init()" in str(e) and "torchrun" in str(e), e
        else:
            raise AssertionError("no error before init")
        fddp.init(); fddp.init()  # idempotent
        assert (fddp.rank(), fddp.world_size(), fddp.is_main()) == (0, 1, True)
        g = fddp.ddp_step({"w": torch.ones(2)}, {"w": torch.full((2,), 3.0)})
        assert torch.equal(g["w"], torch.full((2,), 3.0))
        print("ok")
        """
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_a_failing_rank_fails_fast():
    with pytest.raises(RankError, match="boom on rank 1"):
        run(_failing_worker, 2, timeout=60)


def _failing_worker():
    if fddp.rank() == 1:
        raise ValueError("boom on rank 1")
    fddp.ddp_step({"w": torch.zeros(2)}, {"w": torch.zeros(2)})  # rank 0 waits for a peer that is gone


def _subgroup_worker():
    rank = fddp.rank()
    # new_group must be called by every rank, in the same order, for every group
    groups = [tdist.new_group([0, 1]), tdist.new_group([2, 3])]
    group = groups[rank // 2]
    tree = {"w": torch.full((3,), float(rank))}
    grads = fddp.ddp_step(tree, tree, group=group)
    mismatch = None
    other = {"w": torch.zeros(5)} if rank != 3 else {"w": torch.zeros(4)}
    try:
        fddp.ddp_step(other, other, group=group)
    except fddp.MismatchError as e:
        mismatch = str(e)
    return grads["w"], fddp.broadcast(tree, src=1, group=group)["w"], mismatch


def test_subgroups():
    outs = run(_subgroup_worker, 4)
    for r, (mean, bcast, mismatch) in enumerate(outs):
        pair = [2 * (r // 2), 2 * (r // 2) + 1]
        assert torch.equal(mean, torch.full((3,), sum(pair) / 2))
        assert torch.equal(bcast, torch.full((3,), float(pair[1])))  # src is a rank *within* the group
        # the mismatch lives in group {2, 3} only; group {0, 1} agrees
        assert (mismatch is not None) == (r >= 2)


def test_buckets_follow_definition_order_not_sorted_keys():
    # optree sorts dict keys ('layers.10' < 'layers.2', 'bias' < 'weight'); the plan must follow the
    # module's order, so the first bucket holds the last layer, whose gradients backward makes first.
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])
    _, params = fddp.functionalize(model)
    from fddp._tree import definition_order

    order = definition_order(params)
    paths = sorted(params)  # optree's flatten order for a dict
    assert [paths[i] for i in order] == list(params)
    specs = tuple(LeafSpec.of(params[p]) for p in paths)
    plan = make_plan(specs, bucket_cap_mb=0.01, first_bucket_mb=0.01, order=order)
    first = [paths[i] for i in plan.buckets[0].indices]
    assert first == ["11.bias", "11.weight"], first
    last = [paths[i] for i in plan.buckets[-1].indices]
    assert last[-1] == "0.weight", last


def test_definition_order_of_a_flat_dict_is_cached_per_key_order():
    # A flat dict of tensors takes a cached path keyed by its keys; it must agree with the walk
    # over the tree, and two dicts with the same keys in other orders must not share an entry.
    from fddp._tree import _definition_order, definition_order

    t = torch.zeros(1)
    for keys in (["b", "a", "c"], ["a", "b", "c"], ["c", "a", "b"], ["layers.10", "layers.2"], []):
        tree = {k: t for k in keys}
        assert definition_order(tree) == _definition_order(tree), keys
    assert definition_order({"b": t, "a": t}) == (1, 0)
    assert definition_order({"a": t, "b": t}) is None
    nested = {"b": {"y": t, "x": t}, "a": t}  # not flat: walked, not cached
    assert definition_order(nested) == _definition_order(nested) == (2, 1, 0)
