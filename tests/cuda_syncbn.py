"""fddp.sync_batchnorm against torch's nn.SyncBatchNorm under torch DDP, on a GPU (launched under torchrun).

torch's SyncBatchNorm has CUDA kernels only, so this runs where there is a GPU: every rank on
cuda:0 (one GPU is enough) in a gloo group, which carries CUDA tensors and which torch's
SyncBatchNorm supports. Each step compares, per rank: the outputs, the averaged gradients (DDP's
``.grad`` against fddp's ``grad_and_value``) and the running statistics (the module's buffers
against the ``new_buffers`` of ``functionalize_with_buffers``), in float64. Prints one line per
rank that passes; tests/test_batchnorm.py launches it with 2 and 3 ranks.
"""

from __future__ import annotations

import copy
import datetime

import torch
import torch.distributed as dist
from torch import nn

import fddp

SIZES = (3, 5, 4)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    fddp.init()  # adopts the group
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 6), nn.BatchNorm1d(6, momentum=None)
    ).double().to(device)  # fmt: skip
    ddp = nn.parallel.DistributedDataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(base)), device_ids=[0])
    apply_fn, params, buffers = fddp.functionalize_with_buffers(fddp.sync_batchnorm(copy.deepcopy(base)))
    params, buffers = fddp.broadcast(params), fddp.broadcast(buffers)
    n = sum(SIZES[:world])
    start = sum(SIZES[:rank])
    tol = dict(rtol=1e-9, atol=1e-11)
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(n, 3, 6, 6, generator=g, dtype=torch.float64)[start : start + SIZES[rank]].to(device)
        y = torch.randn(n, 6, generator=g, dtype=torch.float64)[start : start + SIZES[rank]].to(device)
        scale = world / n  # each rank's sum, so that DDP's mean over ranks is the whole batch's mean

        ddp.zero_grad()
        out_t = ddp(x)
        ((out_t - y).pow(2).sum() * scale).backward()

        def loss_fn(p, b):
            out, new_b = apply_fn(p, b, x)
            return (out - y).pow(2).sum() * scale, (out, new_b)

        grads, (_, (out, buffers)) = fddp.grad_and_value(loss_fn, has_aux=True)(params, buffers)
        torch.testing.assert_close(out, out_t.detach(), **tol, msg=lambda m: f"rank {rank} step {step} output: {m}")
        for k, p in ddp.module.named_parameters():
            torch.testing.assert_close(grads[k], p.grad, **tol, msg=lambda m: f"rank {rank} step {step} grad {k}: {m}")
        for k, b in ddp.module.named_buffers():
            torch.testing.assert_close(buffers[k], b, **tol, msg=lambda m: f"rank {rank} step {step} buffer {k}: {m}")
        with torch.no_grad():
            for p in ddp.module.parameters():
                p -= 0.1 * p.grad
        params = {k: v - 0.1 * grads[k] for k, v in params.items()}
    fddp.verify_replicas(buffers)
    print(f"rank {rank}: sync_batchnorm equals torch's SyncBatchNorm under DDP on {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
