"""Gradient accumulation over uneven shards: exact large-batch steps, no hang, no extra collective.

    torchrun --standalone --nproc-per-node=2 examples/uneven_accumulate.py
    python examples/uneven_accumulate.py --epochs 3     # the same script in one process

Each rank holds a shard of a different size (rank r gets a share proportional to r + 1) and cuts it
into micro-batches, the last one shorter. Gradients are summed locally over ``--accum``
micro-batches, weighted by their sample counts, and synchronised once per window with
``ddp_step(..., weight=...)``: every update is the gradient of the mean loss over all the samples
of the window, on every rank, whatever the shard and batch sizes. A rank whose shard runs out keeps
taking part with weight 0 (``fddp.Join``) until the ranks learn, from the weight sum of the same
all-reduce, that nobody has data left; then all leave the epoch together.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad

import fddp
import fddp.optim


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Accumulation over uneven shards with fddp.")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--samples", type=int, default=3000, help="size of the whole training set")
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per synchronised step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic 4-class problem every rank can regenerate: labels from a random two-layer teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w1, w2 = torch.randn(16, 32, generator=g), torch.randn(32, 4, generator=g)
    return x, torch.tanh(x @ w1).matmul(w2).argmax(1)


def uneven_shard(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's contiguous share, proportional to r + 1: shard sizes differ on purpose."""
    bounds = [len(x) * sum(range(1, r + 1)) // sum(range(1, world + 1)) for r in range(world + 1)]
    return x[bounds[rank] : bounds[rank + 1]], y[bounds[rank] : bounds[rank + 1]]


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    x_all, y_all = make_data(args.samples, args.seed)
    x, y = uneven_shard(x_all, y_all, rank, world)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    apply_fn, params = fddp.functionalize(model)
    params = fddp.broadcast(params)  # one initialisation, rank 0's, everywhere
    opt = fddp.optim.adamw(lr=args.lr)
    state = opt.init(params)

    def loss_fn(p, xb, yb):
        return F.cross_entropy(apply_fn(p, xb), yb)  # a mean over the micro-batch

    print(f"rank {rank}: {len(x)} samples, {-(-len(x) // args.micro_batch)} micro-batches per epoch", flush=True)
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1000 * epoch + rank))
        micro_batches = [(x[i], y[i]) for i in order.split(args.micro_batch)]
        batches = fddp.Join(micro_batches)  # then None until every rank is out of data
        acc, steps = fddp.GradAccumulator(), 0
        for i, mb in enumerate(batches):
            if mb is not None:  # local work only: nothing is sent
                g = grad(loss_fn)(params, *mb)
                acc = fddp.accumulate_grads(acc, g, weight=len(mb[0]))
            if (i + 1) % args.accum:  # k-1 of every k micro-steps end here, on every rank alike
                continue
            grads, info = fddp.ddp_step(params, acc.mean(), weight=acc.weight, return_info=True)
            acc = fddp.GradAccumulator()
            if batches.done(info):  # the weight sum was 0: no rank had data; leave before updating
                break
            params, state = fddp.optim.apply_gradients(opt, grads, state, params)
            steps += 1
        with torch.no_grad():  # the loss over the whole training set, which every rank can compute
            full = loss_fn(params, x_all, y_all).item()
        if fddp.is_main():
            print(f"epoch {epoch + 1:3d}  steps {steps:3d}  loss {full:.4f}", flush=True)
    fddp.shutdown()  # every rank together: none leaves while another still communicates


if __name__ == "__main__":
    main()
