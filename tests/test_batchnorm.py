"""fddp.sync_batchnorm against the batch it stands for: one process, plain BatchNorm, every rank's data.

torch's ``nn.SyncBatchNorm`` runs on CUDA only (its kernels have no CPU version), so on the CPU
the reference is the definition: SyncBatchNorm over ranks holding slices of a batch equals
BatchNorm over the whole batch in one process, in outputs, gradients (of the mean loss over the
whole batch, as torch DDP averages them) and running statistics, and the running statistics are
the same on every rank. Float64, so that the two reductions' orders differ far below the
tolerance. ``tests/cuda_syncbn.py`` compares with torch's own SyncBatchNorm under DDP on a GPU
(``test_equals_torch_sync_batchnorm_under_ddp_on_cuda``).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fddp
from dist import run
from fddp import batchnorm

HERE = Path(__file__).resolve().parent


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.BatchNorm1d(6, momentum=None),
    ).double()  # fmt: skip


SIZES = (3, 5, 4)  # uneven per-rank batches: the statistics weigh each rank by its count


def _data(world: int, step: int):
    """Every rank's batch of one step, and the targets: the same tensors on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    n = sum(SIZES[:world])
    return torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64), torch.randn(n, 6, generator=g, dtype=torch.float64)


def _slice(world: int, rank: int) -> slice:
    start = sum(SIZES[:rank])
    return slice(start, start + SIZES[rank])


def _loss(out: torch.Tensor, y: torch.Tensor, world: int) -> torch.Tensor:
    # Each rank's sum, scaled so that the mean over ranks (what DDP averages) is the whole batch's mean.
    return (out - y).pow(2).sum() * (world / sum(SIZES[:world]))


def _reference(world: int, steps: int) -> list[dict]:
    """Plain BatchNorm over the whole batch, one process: outputs, gradients, running statistics per step."""
    model = _model()
    out = []
    for step in range(steps):
        x, y = _data(world, step)
        model.zero_grad()
        pred = model(x)
        ((pred - y).pow(2).sum() / x.shape[0]).backward()
        out.append({
            "out": pred.detach(),
            "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
            "buffers": {k: b.clone() for k, b in model.named_buffers()},
        })  # fmt: skip
        with torch.no_grad():  # the same plain SGD step on both sides
            for p in model.parameters():
                p -= 0.1 * p.grad
    return out


def _worker(steps: int) -> dict:
    rank, world = fddp.rank(), fddp.world_size()
    model = fddp.sync_batchnorm(_model())
    apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
    params, buffers = fddp.broadcast(params), fddp.broadcast(buffers)
    result: dict = {"steps": []}
    # torch.func.grad then ddp_step on one copy, fddp.grad_and_value on another: the same numbers.
    p_gv, b_gv = params, buffers
    for step in range(steps):
        x, y = _data(world, step)
        x, y = x[_slice(world, rank)], y[_slice(world, rank)]

        def loss_fn(p, b):
            out, new_b = apply_fn(p, b, x)
            return _loss(out, y, world), (out, new_b)

        local, (out, new_buffers) = torch.func.grad(loss_fn, has_aux=True)(params, buffers)
        grads = fddp.ddp_step(params, local)
        (grads_gv, (_, (out_gv, new_gv))) = fddp.grad_and_value(loss_fn, has_aux=True)(p_gv, b_gv)
        result["steps"].append(
            {"out": out, "grads": grads, "buffers": new_buffers, "out_gv": out_gv, "grads_gv": grads_gv, "buffers_gv": new_gv}
        )
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}
        p_gv = {k: v - 0.1 * grads_gv[k] for k, v in p_gv.items()}
        buffers, b_gv = new_buffers, new_gv
    # fddp.functionalize: the layers update the module's own buffers, alike on every rank, so the
    # several-rank check on buffer writes lets them pass.
    plain = fddp.sync_batchnorm(_model())
    plain_fn, plain_params = fddp.functionalize(plain)
    x, _ = _data(world, 0)
    plain_fn(plain_params, x[_slice(world, rank)])
    result["module_buffers"] = {k: b.clone() for k, b in plain.named_buffers()}
    # A rank out of step (rank 0 skips a forward, its next call is another function): every rank
    # raises MismatchError, none hangs; then they go on in step.
    try:
        if rank == 0:
            fddp.ddp_step(params, params)
        else:
            apply_fn(params, buffers, x[_slice(world, rank)])
    except fddp.MismatchError as e:
        result["mismatch"] = str(e)
    apply_fn(params, buffers, x[_slice(world, rank)])
    return result


@pytest.mark.parametrize("world", [2, 3])
def test_equals_batchnorm_over_the_whole_batch(world):
    steps = 2
    results = run(_worker, world, steps, timeout=180)
    reference = _reference(world, steps)
    tol = dict(rtol=1e-10, atol=1e-12)
    for rank, r in enumerate(results):
        for step, (mine, ref) in enumerate(zip(r["steps"], reference)):
            where = f"rank {rank} step {step}"
            for key in ("out", "out_gv"):
                torch.testing.assert_close(mine[key], ref["out"][_slice(world, rank)], **tol, msg=lambda m: f"{where} {key}: {m}")
            for key in ("grads", "grads_gv"):
                for k, g in ref["grads"].items():
                    torch.testing.assert_close(mine[key][k], g, **tol, msg=lambda m: f"{where} {key} {k}: {m}")
            for key in ("buffers", "buffers_gv"):
                for k, b in ref["buffers"].items():
                    torch.testing.assert_close(mine[key][k], b, **tol, msg=lambda m: f"{where} {key} {k}: {m}")
        for k, b in reference[0]["buffers"].items():
            torch.testing.assert_close(r["module_buffers"][k], b, **tol)
        assert "ranks are at different fddp calls" in r["mismatch"] and "sync_batchnorm" in r["mismatch"], r["mismatch"]
    # The running statistics are the same bits on every rank, with no sync_buffers.
    for r in results[1:]:
        for a, b in zip(r["steps"], results[0]["steps"]):
            assert all(torch.equal(a["buffers"][k], b["buffers"][k]) for k in b["buffers"])


def test_conversion_keeps_parameters_buffers_and_mode():
    model = _model()
    model[1].running_mean.add_(1.0)
    model[5].eval()
    weight, mean = model[1].weight, model[1].running_mean
    converted = fddp.sync_batchnorm(model)
    assert converted is model
    assert [type(m).__name__ for m in (model[1], model[5])] == ["SyncBatchNorm", "SyncBatchNorm"]
    assert model[1].weight is weight and model[1].running_mean is mean and not model[5].training
    assert model[5].momentum is None and model[1].layer_name == "1"
    bn = fddp.sync_batchnorm(nn.BatchNorm1d(3, affine=False, track_running_stats=False))
    assert isinstance(bn, fddp.SyncBatchNorm) and bn.weight is None and bn.running_mean is None
    # Alone (one process), it is plain BatchNorm, to the bit.
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64)
    ref = copy.deepcopy(_model())
    assert torch.equal(fddp.sync_batchnorm(_model())(x), ref(x))


def test_the_statistics_and_their_backward_equal_batch_norms_on_one_rank():
    # sync_batch_norm itself (the path several ranks take), on a one-rank group: the definition, and
    # its gradients against numerical differentiation.
    fddp.init()
    x = torch.randn(6, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    ref_rm, ref_rv = rm.clone(), rv.clone()
    out = batchnorm.sync_batch_norm(x, w, b, rm, rv, 1e-5, 0.1, None)
    ref = torch.nn.functional.batch_norm(x, ref_rm, ref_rv, w, b, True, 0.1, 1e-5)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close((rm, rv), (ref_rm, ref_rv), rtol=1e-12, atol=1e-12)
    dy = torch.randn_like(out)
    mine = torch.autograd.grad(out, (x, w, b), dy)
    theirs = torch.autograd.grad(ref, (x, w, b), dy)
    for a, t in zip(mine, theirs):
        torch.testing.assert_close(a, t, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, w, b: batchnorm.sync_batch_norm(x, w, b, None, None, 1e-5, 0.1, None), (x, w, b))
    # Under torch.func.grad too.
    f = lambda w: batchnorm.sync_batch_norm(x.detach(), w, b.detach(), None, None, 1e-5, 0.1, None).pow(3).sum()  # noqa: E731
    g = lambda w: torch.nn.functional.batch_norm(x.detach(), None, None, w, b.detach(), True, 0.1, 1e-5).pow(3).sum()  # noqa: E731
    torch.testing.assert_close(torch.func.grad(f)(w.detach()), torch.func.grad(g)(w.detach()), rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="cannot run inside torch.func.vmap"):
        torch.func.vmap(lambda x: batchnorm.sync_batch_norm(x, None, None, None, None, 1e-5, 0.1, None))(x.detach()[None])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's SyncBatchNorm runs on CUDA only (tests/cuda_syncbn.py runs on a GPU)")
@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 3])
def test_equals_torch_sync_batchnorm_under_ddp_on_cuda(world, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(HERE / "cuda_syncbn.py")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count("sync_batchnorm equals torch's SyncBatchNorm") == world, proc.stdout
