"""ZeRO with fddp: each rank keeps 1/N of the gradients and of AdamW's state; checkpoints reshard.

    torchrun --standalone --nproc-per-node=2 examples/zero.py --save-at 50
    python examples/zero.py --resume runs/zero/ckpt-00000050 --out-dir runs/zero-1   # on 1 process

A digit classifier (scikit-learn's bundled digits, no download) trained with AdamW and gradient
clipping. Against the replicated loop of examples/train_digits.py four lines change: the
parameters are sharded (``fddp.zero.shard``), the optimizer starts from the shards, the gradients
come back as this rank's shard (``compression=fddp.zero.ReduceScatter()``), and after each step
the new shards are gathered into the full parameters the next forward needs. The global batch of
each step is the same whatever the number of processes (each rank takes its slice), so a run saved
on 2 processes and resumed on 1 continues as the 2-process run would, up to float rounding.

Writes ``<out-dir>/metrics.json`` (the loss of every step, the test accuracy, the optimizer state's
bytes on this rank), ``<out-dir>/curves.png`` and, with ``--save-at``, a sharded checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")  # render to a file; there may be no display
import matplotlib.pyplot as plt
import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import fddp
import fddp.checkpoint as ckpt


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="ZeRO-sharded digit classification with fddp.")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split evenly over the ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--save-at", type=int, default=None, help="write a sharded checkpoint after this step")
    p.add_argument("--resume", default=None, help="a checkpoint directory written by --save-at, on any number of ranks")
    p.add_argument("--out-dir", default="runs/zero")
    return p.parse_args()


def state_bytes(tree) -> int:
    """Bytes of the distinct buffers behind a tree's tensors (views of one buffer count once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in optree.tree_leaves(tree)}.values())


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world} processes")
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    x_train, x_test = torch.tensor(x_train, dtype=torch.float32), torch.tensor(x_test, dtype=torch.float32)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    apply_fn, params = fddp.functionalize(model)
    params = fddp.broadcast(params)
    schedule = fddp.optim.warmup_cosine_decay(0.0, args.lr, warmup_steps=10, decay_steps=args.steps)
    opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(schedule, weight_decay=1e-4))

    shards = fddp.zero.shard(params)  # this rank's slice of every bucket of the parameters
    opt_state = opt.init(shards)  # and of the optimizer state: 1/N of it
    start, history = 0, []  # history: this run's steps
    if args.resume:  # saved on any number of ranks; each rank reads the pieces its shards cover
        state = ckpt.load_sharded(args.resume, {"params": shards, "opt": opt_state, "step": 0})
        shards, opt_state, start = state["params"], state["opt"], state["step"]
        params = fddp.zero.gather(shards).wait()

    def loss_fn(params, x, y):
        return F.cross_entropy(apply_fn(params, x), y)

    step_fn = fddp.grad_and_value(loss_fn, compression=fddp.zero.ReduceScatter())  # grads: this rank's shard
    per_rank = args.batch_size // world
    for step in range(start, args.steps):
        # The step's global batch, the same for any number of ranks; this rank takes its slice.
        batch = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(step))[: args.batch_size]
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        grads, loss = step_fn(params, x_train[mine], y_train[mine])
        shards, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, shards)
        pending = fddp.zero.gather(shards)  # all-gathers in flight while we log
        if world > 1:
            dist.all_reduce(loss)  # the global batch's loss: the mean of the ranks' equal slices
        history.append({"step": step + 1, "loss": loss.item() / world})
        params = pending.wait()
        if args.save_at == step + 1:  # every rank writes its own pieces
            ckpt.save_sharded(os.path.join(args.out_dir, f"ckpt-{step + 1:08d}"), {"params": shards, "opt": opt_state, "step": step + 1})

    fddp.verify_replicas(params)  # the gathered parameters are bitwise identical on every rank
    with torch.no_grad():
        test_acc = (apply_fn(params, x_test).argmax(1) == y_test).float().mean().item()
    replicated = state_bytes(opt.init(params))
    if fddp.is_main():
        os.makedirs(args.out_dir, exist_ok=True)
        metrics = {"world_size": world, "history": history, "test_acc": test_acc,
                   "state_bytes": state_bytes(opt_state), "replicated_state_bytes": replicated}  # fmt: skip
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump(metrics, f, indent=1)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([h["step"] for h in history], [h["loss"] for h in history])
        ax.set(xlabel="step", ylabel="cross-entropy", yscale="log", title=f"ZeRO on {world} process(es)")
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, "curves.png"), dpi=120)
        print(f"test accuracy {test_acc:.4f} after {args.steps} steps on {world} process(es); optimizer state "
              f"{metrics['state_bytes'] / 1e3:.0f} kB on this rank, {replicated / 1e3:.0f} kB replicated", flush=True)  # fmt: skip
        print(f"metrics in {args.out_dir}/metrics.json, curves in {args.out_dir}/curves.png", flush=True)
    fddp.shutdown()  # every rank together, before the interpreter exits


if __name__ == "__main__":
    main()
