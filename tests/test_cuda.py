"""The GPU path: every fddp path that has CUDA- or NCCL-specific code, run on a GPU when there is one.

Marked ``cuda`` and skipped, with the reason, on a machine without CUDA; ``tools/gpu_check.sh``
runs them all (``pytest -m cuda``) and says what ran and what was skipped. What they compare with:

- the optimizers' fused kernels: ``fddp.optim.apply_gradients`` on CUDA against
  ``torch.optim.*(fused=True)`` on CUDA, to the bit (in this process, no group needed);
- the process-group paths (``tests/cuda_checks.py``, launched once under torchrun with one rank
  per GPU, at most two): a one-rank (or two-rank) NCCL group from ``fddp.init``, CUDA buckets
  against torch DDP, ``fddp.Cast`` against torch's bf16/fp16 compress hooks, PowerSGD on CUDA
  against the CPU, ZeRO's reduce-scatter against the replicated path, broadcast/sync_buffers/
  verify_replicas, a pure-NCCL group, a compiled step against eager, weighted ddp_steps (no host
  sync, torch.distributed's weighted sums to the bit), and rmsprop, adagrad, nadam, radam and
  adafactor's steady steps (no host sync, torch.optim's numbers to float rounding).

``test_cuda_checks_run_on_cpu`` runs the same checks on two gloo ranks on the CPU in every suite
run, so the code a GPU machine runs is not run there for the first time.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cuda_checks
from fddp import optim

HERE = Path(__file__).resolve().parent
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (tools/gpu_check.sh runs these on a GPU machine)")


def _launch(device: str, nproc: int, out: Path) -> dict[int, dict]:
    """Run tests/cuda_checks.py under torchrun; return each rank's report."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / "cuda_checks.py"), "--device", device, "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)}


def _outcome(reports: dict[int, dict], name: str) -> None:
    """Fail with every rank's traceback, skip with the check's reason, or pass."""
    results = {r: rep["results"][name] for r, rep in reports.items()}
    failed = {r: res for r, res in results.items() if res != "ok" and not res.startswith("skipped: ")}
    assert not failed, "\n".join(f"rank {r}:\n{res}" for r, res in failed.items())
    if all(res.startswith("skipped: ") for res in results.values()):
        pytest.skip(results[0].removeprefix("skipped: "))


@pytest.fixture(scope="module")
def cuda_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    nproc = min(2, torch.cuda.device_count())  # a one-rank NCCL group on one GPU; two ranks when there are two
    return _launch("cuda", nproc, tmp_path_factory.mktemp("cuda"))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(cuda_checks.CHECKS))
def test_on_cuda(name: str, cuda_reports: dict[int, dict]) -> None:
    assert all(rep["device"].startswith("cuda") for rep in cuda_reports.values()), cuda_reports
    _outcome(cuda_reports, name)


def test_cuda_checks_run_on_cpu(tmp_path: Path) -> None:
    """The same checks on two gloo ranks: the GPU machine's code, exercised on every CPU run."""
    reports = _launch("cpu", 2, tmp_path)
    skipped = []
    for name in cuda_checks.CHECKS:
        try:
            _outcome(reports, name)
        except pytest.skip.Exception:
            skipped.append(name)
    # Exactly the checks that need a GPU are skipped: a check that silently skips is a defect.
    gpu_only = [
        "powersgd_on_the_device_matches_the_cpu", "a_pure_nccl_group_carries_fddps_own_collectives", "no_host_sync_per_step",
        "known_calls_are_checked_in_a_batch", "the_host_runs_ahead_of_a_busy_gpu", "sharded_steps_never_sync_the_host",
        "loss_scaling_and_plain_sgd_never_sync_the_host",
        "compiled_step_matches_eager",
    ]  # fmt: skip
    assert skipped == gpu_only, skipped


# --- the fused optimizer kernels on CUDA, against torch.optim(fused=True) ---------------------


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10)
    )


FUSED = {
    # (fddp optimizer, torch optimizer with fused=True, donate): apply_gradients runs torch's fused
    # kernels (donated: in place; otherwise on new buffers), so the two agree to the bit.
    "adamw": (lambda: optim.adamw(1e-2, betas=(0.8, 0.99), weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1, fused=True), False),
    "adamw_donated": (lambda: optim.adamw(1e-2, weight_decay=0.1),
                      lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), True),
    "adam_l2_amsgrad": (lambda: optim.adam(1e-2, weight_decay=0.1, amsgrad=True),
                        lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, amsgrad=True, fused=True), False),
    "adamw_schedule": (lambda: optim.adamw(optim.linear(1e-2, 1e-2, 10)),
                       lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True), False),
    # Plain SGD takes no fused kernel in fddp: p - lr * g with torch.add, torch.optim.SGD's arithmetic.
    "sgd": (lambda: optim.sgd(0.05), lambda ps: torch.optim.SGD(ps, lr=0.05), False),
    # Donated SGD with momentum runs torch's fused SGD kernel in place (the pure path rounds
    # g + m * b once, where torch rounds twice: see apply_gradients' docstring).
    "sgd_momentum_donated": (lambda: optim.sgd(0.05, momentum=0.9, weight_decay=1e-2),
                             lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2, fused=True), True),
}  # fmt: skip


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", list(FUSED))
def test_apply_gradients_on_cuda_equals_torch_fused(name: str) -> None:
    make_fddp, make_torch, donate = FUSED[name]
    model = _model().cuda()
    ref = copy.deepcopy(model)
    topt = make_torch(ref.parameters())
    opt = make_fddp()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = opt.init(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, y = torch.randn(32, 1, 8, 8, generator=g).cuda(), torch.randint(0, 10, (32,), generator=g).cuda()
        loss = lambda p: torch.nn.functional.cross_entropy(torch.func.functional_call(model, p, (x,)), y)  # noqa: E731
        grads = torch.func.grad(loss)(params)
        params, state = optim.apply_gradients(opt, grads, state, params, donate=donate)
        topt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        topt.step()
    for k, p in ref.named_parameters():
        assert params[k].is_cuda
        assert torch.equal(params[k], p.detach()), f"{name}: {k} differs by {(params[k] - p).abs().max().item():.3g}"
