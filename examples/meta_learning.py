"""Learn the learning rate by differentiating through data-parallel training steps.

    torchrun --standalone --nproc-per-node=2 examples/meta_learning.py

Hypergradient descent on scikit-learn's digits: every outer step unrolls ``--inner`` SGD steps of
a small classifier, each synchronised with ``fddp.ddp_step`` *inside* ``torch.func.grad``, and
differentiates the validation loss after them with respect to the (log) learning rate. The
derivative flows back through every ``ddp_step``: as with JAX's ``lax.pmean``, the backward pass
averages the cotangents over the ranks (one bucketed all-reduce per inner step), so each rank holds
the derivative of the sum of all ranks' objectives with respect to its own copy of the learning
rate, and one more ``ddp_step`` averages those into the derivative of the mean objective. torch
DDP cannot do this: its all-reduce lives in autograd hooks that ``torch.func`` does not see, and
its result is not differentiable.

Each rank reads its own shard of every global batch, so the outer loop computes exactly what one
process computes on the full batches (``python examples/meta_learning.py``): the test suite runs
both and compares the learning-rate trajectories. Float64 keeps that comparison tight.

Writes ``<out-dir>/metrics.json`` and ``<out-dir>/curves.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import fddp
import fddp.optim


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Hypergradient descent on the learning rate, data-parallel with fddp.")
    p.add_argument("--outer-steps", type=int, default=60)
    p.add_argument("--inner", type=int, default=3, help="SGD steps unrolled per outer step")
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split evenly over the ranks")
    p.add_argument("--lr", type=float, default=0.05, help="the initial inner learning rate")
    p.add_argument("--meta-lr", type=float, default=0.1, help="Adam's step on log(lr)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/meta")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world} ranks")
    torch.set_default_dtype(torch.float64)
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0), torch.tensor(y)
    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(x), generator=gen)
    train, val = order[:1400], order[1400:]
    local = args.batch_size // world

    def shard(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mine = batch[rank * local : (rank + 1) * local]  # this rank's part of the global batch
        return x[mine], y[mine]

    torch.manual_seed(args.seed)
    apply_fn, params = fddp.functionalize(nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)))
    params = fddp.broadcast(params)
    meta = {"log_lr": torch.tensor(math.log(args.lr))}
    meta_opt = fddp.optim.adam(lr=args.meta_lr)
    meta_state = meta_opt.init(meta)

    def loss_fn(p: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(apply_fn(p, xb), yb)

    def unrolled(meta: dict, p: dict, batches: list, val_batch: tuple) -> tuple:
        lr = meta["log_lr"].exp()
        for xb, yb in batches:
            g = fddp.ddp_step(p, torch.func.grad(loss_fn)(p, xb, yb))  # averaged, and differentiable
            p = {k: p[k] - lr * g[k] for k in p}
        val_loss = loss_fn(p, *val_batch)
        return val_loss, (val_loss, p)

    history = {"lr": [], "val_loss": []}
    for step in range(args.outer_steps):
        picks = torch.randperm(len(train), generator=gen)[: args.batch_size * (args.inner + 1)]
        chunks = train[picks].split(args.batch_size)
        batches = [shard(c) for c in chunks[: args.inner]]
        val_batch = shard(val[torch.randperm(len(val), generator=gen)[: args.batch_size]])
        hypergrad, (val_loss, params) = torch.func.grad(unrolled, has_aux=True)(meta, params, batches, val_batch)
        # Each rank holds d(sum of the ranks' objectives)/d(its own log lr): their mean is the
        # derivative of the mean validation loss in the shared learning rate.
        hypergrad = fddp.ddp_step(meta, hypergrad)
        meta, meta_state = fddp.optim.apply_gradients(meta_opt, hypergrad, meta_state, meta)
        mean_val = fddp.ddp_step({"v": val_loss}, {"v": val_loss})["v"]  # for the log: every rank's shard
        history["lr"].append(float(meta["log_lr"].exp()))
        history["val_loss"].append(float(mean_val))
        if fddp.is_main() and (step % 10 == 0 or step == args.outer_steps - 1):
            print(f"outer step {step + 1:3d}  val loss {history['val_loss'][-1]:.4f}  lr {history['lr'][-1]:.4f}", flush=True)

    fddp.verify_replicas((params, meta))
    if fddp.is_main():
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump({"world_size": world, "args": vars(args), **history}, f, indent=1)
        plot(history, args, world, os.path.join(args.out_dir, "curves.png"))
        print(f"learning rate {args.lr:g} -> {history['lr'][-1]:.4f}; curves in {args.out_dir}/curves.png")
    fddp.shutdown()  # every rank together, before the interpreter exits


def plot(history: dict, args: argparse.Namespace, world: int, path: str) -> None:
    steps = range(1, len(history["lr"]) + 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, history["val_loss"], color="tab:blue", label="validation loss (mean over ranks)")
    ax.set_xlabel("outer step")
    ax.set_ylabel("validation loss", color="tab:blue")
    lr_ax = ax.twinx()
    lr_ax.plot(steps, history["lr"], color="tab:red", label="learned learning rate")
    lr_ax.set_ylabel("learning rate", color="tab:red")
    lines = ax.get_lines() + lr_ax.get_lines()
    # Below the axes: inside them, one of the two curves always crossed the legend.
    fig.legend(lines, [line.get_label() for line in lines], loc="lower center", ncol=2, frameon=False)
    fig.suptitle("Learning the learning rate through ddp_step")
    ax.set_title(f"{world} process(es), {args.inner} unrolled steps, batch {args.batch_size}, meta lr {args.meta_lr}", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
