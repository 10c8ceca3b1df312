"""Compression: bf16/fp16 and PowerSGD against torch's own DDP comm hooks; bytes; accuracy; checkpoints."""

from __future__ import annotations

import collections
import copy
import os
import tempfile

import optree
import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import fddp
import fddp.checkpoint as ckpt
from dist import run
from fddp._layout import flatten, unflatten
from fddp._tree import paths as leaf_paths
from fddp.sync import plan_of as plan_for
from models import make_batch, make_model


def digits_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def random_batch(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "digits":
        g = torch.Generator().manual_seed(seed)
        return torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    return make_batch(name, seed, n=16)


def new_model(name: str) -> nn.Module:
    return digits_mlp() if name == "digits" else make_model(name)


def functionalize_in_ddp_order(model: nn.Module):
    """``fddp.functionalize`` with the parameters in an OrderedDict, which optree flattens in
    registration order (a plain dict flattens in sorted key order), so fddp's buckets hold the
    leaves in the same order as DDP's buckets (from step 1 on: DDP rebuilds them after step 0)."""
    apply_fn, params = fddp.functionalize(model)
    return apply_fn, collections.OrderedDict(params)


def _loss_grads(apply_fn, params, x, y):
    return torch.func.grad(lambda p: F.cross_entropy(apply_fn(p, x), y))(params)


# --- bf16 / fp16 against torch's compress hooks -----------------------------------------------


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _torch_bf16_hook(process_group, bucket):
    # DDP refuses a hook *named* bf16_compress_hook unless CUDA and NCCL are present; gloo reduces
    # bf16 on the CPU, so call torch's hook, unchanged, under another name.
    return default_hooks.bf16_compress_hook(process_group, bucket)


def _cast_worker(steps: int, lr: float):
    rank = fddp.rank()
    hooks = {"bf16": _torch_bf16_hook, "fp16": default_hooks.fp16_compress_hook}
    ddps = {}
    for name, hook in hooks.items():
        ddps[name] = nn.parallel.DistributedDataParallel(digits_mlp())
        ddps[name].register_comm_hook(None, hook)
    apply_fn, _ = functionalize_in_ddp_order(digits_mlp())
    out = []
    for step in range(steps):
        x, y = random_batch("digits", 100 * step + rank)
        row = {}
        for name, ddp in ddps.items():
            # Both reduce the gradients of the same parameters: DDP's, as training moves them.
            params = collections.OrderedDict((n, p.detach().clone()) for n, p in ddp.module.named_parameters())
            ddp.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            local = _loss_grads(apply_fn, params, x, y)
            exact = fddp.ddp_step(params, local)
            reduced, info = fddp.ddp_step(params, local, compression=name, return_info=True)
            as_object = fddp.ddp_step(params, local, compression=fddp.Cast(HALF[name]))
            assert all(torch.equal(as_object[k], reduced[k]) for k in reduced), "Cast(dtype) differs from its name"
            _, plain = fddp.ddp_step(params, local, return_info=True)
            row[name] = dict(
                torch={n: p.grad.clone() for n, p in ddp.module.named_parameters()},
                fddp=reduced,
                local=local,
                exact=exact,
                bytes=(info.bytes_sent, plain.bytes_sent),
            )
            with torch.no_grad():
                for p in ddp.module.parameters():
                    p -= lr * p.grad
        out.append(row)
    return out


def test_cast_equals_torch_compress_hooks_and_halves_bytes():
    # With 3 ranks, g / 3 rounds in bf16/fp16, and gloo's ring adds the three terms in an order that
    # depends on the element's position in the buffer; bitwise equality therefore shows the same
    # cast, the same division before the sum, and the same bucket layout. DDP's step-0 bucket
    # holds the parameters in forward order (it rebuilds them in backward order after step 0),
    # so step 0 is compared within the rounding bound only.
    world = 3
    outs = run(_cast_worker, world, 4, 0.1)
    # Each g_r / n and the sum are rounded once each (unit roundoff u), so
    # |fddp - exact| <= (n + 1) u mean_r |g_r|: about 2e-2 / 2.5e-3 for n = 3 (1e-2 / 1e-3 for n = 2).
    tol = {"bf16": (world + 1) * 2.0**-8, "fp16": (world + 1) * 2.0**-11}
    for step in range(4):
        for name in ("bf16", "fp16"):
            rows = [o[step][name] for o in outs]
            for n in rows[0]["torch"]:
                for r in range(world):
                    if step > 0:
                        assert torch.equal(rows[r]["fddp"][n], rows[r]["torch"][n]), (step, name, n, r)
                    assert torch.equal(rows[r]["fddp"][n], rows[0]["fddp"][n]), "replicas differ"
                scale = sum(row["local"][n].abs() for row in rows) / world
                err = (rows[0]["fddp"][n] - rows[0]["exact"][n]).abs()
                assert (err <= tol[name] * scale + 1e-7).all(), (name, n, (err / scale).max())
            # and the rounding is really there: compression is not a no-op
            assert any(not torch.equal(rows[0]["fddp"][n], rows[0]["exact"][n]) for n in rows[0]["exact"])
            sent, plain = rows[0]["bytes"]
            assert sent * 2 == plain == 4 * sum(p.numel() for p in digits_mlp().parameters())


# --- PowerSGD against torch's powerSGD_hook ---------------------------------------------------


class _HookBucket:
    """The part of ``dist.GradBucket`` that torch's ``powerSGD_hook`` reads, over a given buffer."""

    def __init__(self, index: int, count: int, buffer: torch.Tensor, shapes: list[tuple[int, ...]]):
        self._index, self._count, self._buffer, self._shapes = index, count, buffer, shapes

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def gradients(self) -> list[torch.Tensor]:
        sizes = [torch.Size(s).numel() for s in self._shapes]
        return [v.view(s) for v, s in zip(self._buffer.split(sizes), self._shapes)]


def _powersgd_oracle_worker(name: str, driver: str, config: dict, bucket_cap_mb: float, steps: int, lr: float):
    """Reduce the same local gradients with fddp and with torch's powerSGD_hook, step by step.

    driver "ddp": the hook registered on DDP (one bucket: with several, torch's hook chains its
    all-reduces in future callbacks, which on gloo can issue them in different orders on
    different ranks and abort). driver "hook": the hook called directly, bucket after bucket, on
    fddp's bucket buffers, the order DDP calls it in.
    """
    rank = fddp.rank()
    model = new_model(name)
    apply_fn, params = functionalize_in_ddp_order(copy.deepcopy(model))
    paths = leaf_paths(optree.tree_structure(params))
    plan = plan_for(params, bucket_cap_mb, bucket_cap_mb)
    plan_layout = [[paths[i] for i in b.indices] for b in plan.buckets]
    torch_state = powerSGD_hook.PowerSGDState(
        None,
        matrix_approximation_rank=config["rank"],
        start_powerSGD_iter=config["start_iter"],
        use_error_feedback=config["error_feedback"],
        warm_start=config["warm_start"],
        random_seed=config["seed"],
    )
    ddp, layouts = None, []
    if driver == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
        names = {id(p): n for n, p in model.named_parameters()}

        def hook(state, bucket):
            layouts.append([names[id(p)] for p in bucket.parameters()])
            return powerSGD_hook.powerSGD_hook(state, bucket)

        ddp.register_comm_hook(torch_state, hook)
    ps = fddp.PowerSGD(**config)
    state = ps.init(params)
    rows = []
    for step in range(steps):
        x, y = random_batch(name, 100 * step + rank)
        numel_before = torch_state.total_numel_after_compression
        local = _loss_grads(apply_fn, params, x, y)
        if ddp is not None:
            layouts.clear()
            ddp.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            ref = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
        else:
            flats = flatten(plan, optree.tree_leaves(local))
            for i, (b, flat) in enumerate(zip(plan.buckets, flats)):
                powerSGD_hook.powerSGD_hook(torch_state, _HookBucket(i, len(flats), flat, list(b.shapes))).wait()
            ref = dict(zip(paths, unflatten(plan, flats)))
        reduced, info = fddp.ddp_step(
            params,
            local,
            compression=ps,
            compression_state=state,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=bucket_cap_mb,
            return_info=True,
        )
        state = info.compression_state
        torch_numel = torch_state.total_numel_after_compression - numel_before
        rows.append(
            dict(
                torch=ref,
                fddp=reduced,
                bytes=(info.bytes_sent, 4 * torch_numel),
                collectives=info.collectives,
                torch_layout=list(layouts),
            )
        )
        if ddp is not None:
            with torch.no_grad():
                for p in ddp.module.parameters():
                    p -= lr * p.grad
        params = collections.OrderedDict((k, v - lr * reduced[k]) for k, v in params.items())
    return rows, plan_layout, state


@pytest.mark.parametrize(
    "name, driver, config, cap",
    [
        # torch's defaults but rank 2 and an early start: Gram-Schmidt, error feedback, warm start
        ("digits", "ddp", dict(rank=2, start_iter=3, error_feedback=True, warm_start=True, seed=0), 25.0),
        # rank 3 orthogonalises with QR; fresh random Q every step; no error feedback
        ("digits", "ddp", dict(rank=3, start_iter=2, error_feedback=False, warm_start=False, seed=5), 25.0),
        # conv kernels viewed as (out, in*kh*kw), some too small to compress; several buckets
        ("conv", "hook", dict(rank=1, start_iter=2, error_feedback=True, warm_start=True, seed=1), 0.002),
    ],
)
def test_powersgd_equals_torch_powersgd_hook(name, driver, config, cap):
    steps = 7
    outs = run(_powersgd_oracle_worker, 2, name, driver, config, cap, steps, 0.1)
    n_params = sum(p.numel() for p in new_model(name).parameters())
    for rows, plan_layout, state in outs:
        assert int(state.step) == steps
        assert (len(plan_layout) > 1) == (cap < 1)
        for step, row in enumerate(rows):
            if driver == "ddp" and step >= 1:  # DDP rebuilds its buckets after step 0, as fddp's
                assert row["torch_layout"] == plan_layout, (row["torch_layout"], plan_layout)
            for n, ref in row["torch"].items():
                assert torch.equal(row["fddp"][n], ref), (step, n, (row["fddp"][n] - ref).abs().max())
                assert torch.equal(row["fddp"][n], outs[0][0][step]["fddp"][n]), "replicas differ"
            sent, torch_bytes = row["bytes"]
            if step >= config["start_iter"]:  # torch counts the elements it sends once it compresses
                assert sent == torch_bytes < 4 * n_params / 2, (step, sent, torch_bytes)
                assert len(plan_layout) < row["collectives"] <= 3 * len(plan_layout)
            else:
                assert sent == 4 * n_params and row["collectives"] == len(plan_layout)


# --- PowerSGD training a digits classifier: accuracy, bytes, checkpoint and resume ------------


def digits_data() -> tuple[torch.Tensor, ...]:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes): 1437 to train, 360 to test."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    return x[perm[360:]], y[perm[360:]], x[perm[:360]], y[perm[:360]]


def _train(apply_fn, params, opt, opt_state, ps, ps_state, data, steps: range, batch: int = 64):
    """SGD steps on global batches of ``batch`` images, each rank taking every world-th one."""
    xtr, ytr = data[:2]
    rank, world = fddp.rank(), fddp.world_size()
    sent = []
    for step in steps:
        idx = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(step))[:batch][rank::world]
        grads = _loss_grads(apply_fn, params, xtr[idx], ytr[idx])
        grads, info = fddp.ddp_step(params, grads, compression=ps, compression_state=ps_state, return_info=True)
        ps_state = info.compression_state
        updates, opt_state = opt.update(grads, opt_state, params)
        params = fddp.optim.apply_updates(params, updates)
        sent.append((info.bytes_sent, info.collectives))
    return params, opt_state, ps_state, sent


def _accuracy(apply_fn, params, data) -> float:
    with torch.no_grad():
        return (apply_fn(params, data[2]).argmax(1) == data[3]).float().mean().item()


def _digits_worker(steps: int):
    data = digits_data()
    apply_fn, params = fddp.functionalize(digits_mlp())
    opt = fddp.optim.sgd(lr=0.1, momentum=0.9)
    out = {}
    for label, ps in [("none", None), ("powersgd", fddp.PowerSGD(rank=2, start_iter=10))]:
        ps_state = None if ps is None else ps.init(params)
        final, _, ps_state, sent = _train(apply_fn, params, opt, opt.init(params), ps, ps_state, data, range(steps))
        out[label] = dict(accuracy=_accuracy(apply_fn, final, data), sent=sent, params=final)
    return out


def test_powersgd_rank2_trains_digits_as_well_with_a_tenth_of_the_bytes():
    steps = 300
    outs = run(_digits_worker, 2, steps, timeout=120)
    # The analytic payload of one step, float32. Uncompressed: every value. PowerSGD rank 2:
    # 64x64 weights send (64 + 64) * 2 values each; the 10x64 head (10 + 64) * 2, since
    # (10 + 64) * 2 * min_compression_rate(2) < 640; the biases travel uncompressed.
    plain = 4 * (64 * 64 + 64 + 64 * 64 + 64 + 10 * 64 + 10)
    compressed = 4 * (2 * (64 + 64) * 2 + (10 + 64) * 2 + 64 + 64 + 10)
    ps, model_params = fddp.PowerSGD(rank=2), dict(digits_mlp().named_parameters())
    assert ps.expected_bytes(model_params) == compressed and ps.expected_bytes(model_params, compressed=False) == plain
    print(f"\ndigits MLP, bytes per step: uncompressed {plain}, PowerSGD rank 2 {compressed}, factor {plain / compressed:.2f}")
    for out in outs:
        assert out["none"]["sent"] == [(plain, 1)] * steps
        assert out["powersgd"]["sent"] == [(plain, 1)] * 10 + [(compressed, 3)] * (steps - 10)
    acc = {k: outs[0][k]["accuracy"] for k in ("none", "powersgd")}
    print(f"test accuracy after {steps} steps: uncompressed {acc['none']:.4f}, PowerSGD rank 2 {acc['powersgd']:.4f}")
    assert acc["none"] > 0.9  # a classifier that learned, so the comparison means something
    assert abs(acc["powersgd"] - acc["none"]) <= 0.01, acc
    for k in outs[0]["powersgd"]["params"]:
        assert torch.equal(outs[0]["powersgd"]["params"][k], outs[1]["powersgd"]["params"][k]), "replicas differ"
        assert not torch.equal(outs[0]["powersgd"]["params"][k], outs[0]["none"]["params"][k])


def _resume_worker(directory: str, first: int, more: int):
    data = digits_data()
    apply_fn, params = fddp.functionalize(digits_mlp())
    opt = fddp.optim.sgd(lr=0.1, momentum=0.9)
    ps = fddp.PowerSGD(rank=2, start_iter=5)
    params, opt_state, ps_state, _ = _train(apply_fn, params, opt, opt.init(params), ps, ps.init(params), data, range(first))
    # Error-feedback residuals differ between ranks, so every rank saves its own state: a group of
    # one makes each rank the writer of its file.
    own, _ = tdist.new_subgroups(group_size=1)
    path = os.path.join(directory, f"rank{fddp.rank()}.pt")
    tree = {"params": params, "opt": opt_state, "powersgd": ps_state}
    ckpt.save(path, tree, group=own)
    saved = copy.deepcopy(tree)
    cont = _train(apply_fn, params, opt, opt_state, ps, ps_state, data, range(first, first + more))[:3]
    assert _tree_equal(tree, saved), "training modified the state it was given"
    loaded = ckpt.load(path, like=tree)
    resumed = _train(apply_fn, loaded["params"], opt, loaded["opt"], ps, loaded["powersgd"], data, range(first, first + more))[:3]
    return cont, resumed, ps_state


def _tree_equal(a, b) -> bool:
    la, sa = optree.tree_flatten(a, none_is_leaf=True)
    lb, sb = optree.tree_flatten(b, none_is_leaf=True)
    return sa == sb and all((x is None and y is None) or torch.equal(x, y) for x, y in zip(la, lb))


def test_powersgd_state_checkpoints_and_training_resumes_bitwise():
    with tempfile.TemporaryDirectory() as d:
        outs = run(_resume_worker, 2, d, 12, 8)
    for cont, resumed, _ in outs:
        assert _tree_equal(cont, resumed)
    err0, err1 = (optree.tree_leaves(o[2].error) for o in outs)
    assert any(not torch.equal(a, b) for a, b in zip(err0, err1)), "residuals are per rank"
    assert int(outs[0][0][2].step) == 20


# --- the API: pure, validated, and the same compression decision as torch's --------------------


def test_compressed_shapes_follow_torch_should_compress():
    shapes = [(64, 64), (10, 64), (4, 128), (6, 1, 3, 3), (8, 6, 3, 3), (64,), (3, 3), (1, 100), (100, 1)]
    for rank in (1, 2, 4):
        for rate in (0.5, 2.0):
            ps = fddp.PowerSGD(rank=rank, min_compression_rate=rate)
            for shape in shapes:
                n, m = shape[0], torch.Size(shape[1:]).numel()
                r = min(n, m, rank)
                compress, _, _ = powerSGD_hook._should_compress(n, m, r, rate)
                assert (ps.compressed_shape(shape) is not None) == compress, (shape, rank, rate)
                assert ps.compressed_shape(shape) in (None, (n, m, r))
    assert fddp.PowerSGD().compressed_shape(()) is None  # a scalar travels uncompressed


def _api_worker():
    params = {"w": torch.zeros(16, 8), "b": torch.zeros(16)}
    g = torch.Generator().manual_seed(fddp.rank())
    grads = {"w": torch.randn(16, 8, generator=g), "b": torch.randn(16, generator=g)}
    ps = fddp.PowerSGD(rank=1, start_iter=0)
    state = ps.init(params)
    before = copy.deepcopy((grads, state))
    _, info = fddp.ddp_step(params, grads, compression=ps, compression_state=state, return_info=True)
    _, info = fddp.ddp_step(params, grads, compression=ps, compression_state=info.compression_state, return_info=True)
    pure = _tree_equal((grads, state), before)
    errors = {}
    calls = {
        "no_info": dict(compression=ps, compression_state=state),
        "no_state": dict(compression=ps, return_info=True),
        "weight": dict(compression=ps, compression_state=state, weight=3.0, return_info=True),
        "state_without_powersgd": dict(compression="bf16", compression_state=state),
        "unknown": dict(compression="int8"),
        "other_params": dict(compression=ps, compression_state=ps.init({"w": torch.zeros(8, 16), "b": torch.zeros(16)}), return_info=True),
    }
    for name, kwargs in calls.items():
        try:
            fddp.ddp_step(params, grads, **kwargs)
        except ValueError as e:
            errors[name] = str(e)
    return pure, info, errors


def test_powersgd_step_is_pure_and_bad_calls_raise():
    for pure, info, errors in run(_api_worker, 2):
        assert pure, "ddp_step modified its grads or the PowerSGD state it was given"
        assert int(info.compression_state.step) == 2 and info.compression_state.q["b"] is None
        assert info.compression_state.q["w"].shape == (8, 1)
        assert info.bytes_sent == 4 * (16 + (16 + 8)) and info.collectives == 3
        expected = {
            "no_info": ["return_info=True"],
            "no_state": ["compression_state=", "NoneType"],
            "weight": ["weight="],
            "state_without_powersgd": ["compression_state", "bf16"],
            "unknown": ["'int8'", "fddp.PowerSGD"],
            "other_params": ["'w'", "(16, 8)", "(8, 16)"],
        }
        for name, parts in expected.items():
            assert name in errors, f"{name}: no ValueError"
            for part in parts:
                assert part in errors[name], (name, part, errors[name])
