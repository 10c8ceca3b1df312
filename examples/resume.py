"""Survive a killed worker: checkpoint often, and resume exactly where the run left off.

    torchrun --standalone --nproc-per-node=2 --max-restarts=2 examples/resume.py --ckpt-dir runs/resume

Kill any worker at any moment: torchrun restarts the group (``--max-restarts``), or you run the same
command again, and training continues from the newest checkpoint. The run then ends with bitwise
the same parameters as one that was never interrupted, because a checkpoint holds everything the
next step depends on:

* the parameters and the optimizer state;
* the step count. The data order follows from it: epoch ``e`` visits the samples in the order of a
  permutation drawn from a generator seeded with ``(seed, e)``, so any position in any epoch can be
  found again without storing a sampler;
* every rank's RNG state (dropout's here). The ranks draw different dropout masks, so rank 0
  gathers all the states before it writes.

Checkpoints are written atomically by rank 0 (``fddp.checkpoint.save_step``), so a kill during a
write leaves the previous one intact. Every rank reads the checkpoint directory, so it must be on
one machine or a shared file system, and a resumed run needs the same number of ranks.

The data are synthetic (a random linear teacher labels Gaussian inputs), so the example runs
anywhere in a few seconds; ``--out`` saves the final parameters for comparison.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fddp
import fddp.checkpoint as ckpt
import fddp.optim


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Checkpoint and resume data-parallel training with fddp.")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps in the whole run")
    p.add_argument("--batch-size", type=int, default=32, help="global batch, split evenly over the ranks")
    p.add_argument("--ckpt-dir", default="runs/resume")
    p.add_argument("--ckpt-every", type=int, default=5, help="write a checkpoint every this many steps")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="save the final parameters here")
    return p.parse_args()


def make_data(seed: int, n: int = 512, dim: int = 16, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``n`` Gaussian inputs and the labels a fixed random linear teacher gives them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    return x, (x @ torch.randn(dim, classes, generator=g)).argmax(1)


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> torch.Tensor:
    """Return the sample indices of global batch ``step``: a pure function of the step, so a resumed
    run sees the same batches in the same order. A last partial batch of each epoch is dropped."""
    per_epoch = n // batch_size
    epoch, i = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    return order[i * batch_size : (i + 1) * batch_size]


def gather_rng_states() -> list[torch.Tensor]:
    """Return every rank's torch RNG state, indexed by rank (one all-gather)."""
    mine = torch.get_rng_state()
    states = [torch.empty_like(mine) for _ in range(fddp.world_size())]
    dist.all_gather(states, mine)
    return states


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of the world size {world}")
    x_all, y_all = make_data(args.seed)

    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    apply_fn, params = fddp.functionalize(model)
    opt = fddp.optim.adam(lr=args.lr)
    opt_state = opt.init(params)
    torch.manual_seed(args.seed + 1 + rank)  # each rank its own dropout masks
    start = 0

    path = ckpt.latest(args.ckpt_dir)
    if path is not None:
        # `like` checks the file against what this run expects and restores the exact types.
        like = {"params": params, "opt_state": opt_state, "step": 0, "rng": [torch.get_rng_state()] * world}
        saved = ckpt.load(path, like=like)
        params, opt_state, start = saved["params"], saved["opt_state"], saved["step"]
        torch.set_rng_state(saved["rng"][rank])
        fddp.verify_replicas(params)  # every rank loaded the same file: cheap to make sure
        if fddp.is_main():
            print(f"resumed from step {start} of {args.steps} ({path})", flush=True)

    def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(apply_fn(p, x), y)

    local = args.batch_size // world
    for step in range(start, args.steps):
        idx = batch_indices(step, len(x_all), args.batch_size, args.seed)[rank * local : (rank + 1) * local]
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x_all[idx], y_all[idx])
        grads = fddp.ddp_step(params, grads)
        params, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, params)
        if (step + 1) % args.ckpt_every == 0 or step + 1 == args.steps:
            state = {"params": params, "opt_state": opt_state, "step": step + 1, "rng": gather_rng_states()}
            ckpt.save_step(args.ckpt_dir, step + 1, state, keep=2)
            if fddp.is_main():
                print(f"step {step + 1}: loss {loss.item():.4f} (rank 0's batch), checkpoint written", flush=True)

    if args.out and fddp.is_main():
        ckpt.save(args.out, params)
    fddp.shutdown()  # every rank together: none leaves while another still communicates or writes


if __name__ == "__main__":
    main()
