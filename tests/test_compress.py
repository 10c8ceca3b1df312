"""Compression: bf16/fp16 and PowerSGD against torch's own DDP comm hooks; bytes; accuracy; checkpoints."""

from __future__ import annotations

import collections
import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

import fddp
import fddp.checkpoint as ckpt
from dist import run
from fddp.buckets import LeafSpec, flatten, make_plan, unflatten
from fddp.comm import tree_leaves_with_paths
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
            for n, ref in rows[0]["torch"].items():
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
    paths, leaves, _ = tree_leaves_with_paths(params, "test")
    plan = make_plan(tuple(LeafSpec.of(p) for p in leaves), bucket_cap_mb, bucket_cap_mb)
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
            flats = flatten(plan, tree_leaves_with_paths(local, "test")[1])
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
    for rank, (rows, plan_layout, state) in enumerate(outs):
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
