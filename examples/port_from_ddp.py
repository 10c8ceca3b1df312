"""The same training loop written with torch DDP and with fddp, run side by side.

    torchrun --standalone --nproc-per-node=2 examples/port_from_ddp.py

``train_ddp`` is a textbook ``DistributedDataParallel`` loop; ``train_fddp`` is its port. The
numbered comments pair the lines that correspond. Both start from the same initialisation, see the
same batches and use the same SGD arithmetic, so their losses agree to float rounding: the script
prints them next to each other and the largest parameter difference at the end.

Writes ``<out-dir>/metrics.json`` and ``<out-dir>/curves.png`` (both loss curves, and their difference).
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fddp
import fddp.optim


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def make_loader(dataset: TensorDataset, batch_size: int, epoch: int) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(), seed=0)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def train_ddp(args: argparse.Namespace, dataset: TensorDataset) -> tuple[list[float], dict]:
    model = DDP(make_model(args.seed))  # 1. wrap the module (DDP broadcasts rank 0's weights)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)  # 2. optimizer
    losses = []
    for epoch in range(args.epochs):
        for x, y in make_loader(dataset, args.batch_size, epoch):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)  # 3. forward
            loss.backward()  # 4. backward; hooks all-reduce the gradients into .grad
            opt.step()  # 5. in-place update
            losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.module.named_parameters()}


def train_fddp(args: argparse.Namespace, dataset: TensorDataset) -> tuple[list[float], dict]:
    apply_fn, params = fddp.functionalize(make_model(args.seed))  # 1. a pure function and a dict of tensors
    params = fddp.broadcast(params)  #                                 ... with rank 0's values everywhere
    opt = fddp.optim.sgd(lr=args.lr, momentum=0.9, weight_decay=1e-4)  # 2. optimizer: pure init/update
    opt_state = opt.init(params)

    def loss_fn(params, x, y):
        return F.cross_entropy(apply_fn(params, x), y)  # 3. forward

    losses = []
    for epoch in range(args.epochs):
        for x, y in make_loader(dataset, args.batch_size, epoch):
            grads, loss = fddp.grad_and_value(loss_fn)(params, x, y)  # 4. backward, averaged over the ranks
            params, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, params)  # 5. new values, nothing in place
            losses.append(loss.item())
    return losses, params


def plot(ddp_losses: list[float], fddp_losses: list[float], max_diff: float, args: argparse.Namespace, path: str) -> None:
    """Both loss curves, and below them how far apart they are at each step."""
    steps = range(1, len(ddp_losses) + 1)
    fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(2, 1))
    ax.plot(steps, ddp_losses, lw=3, alpha=0.45, color="tab:blue", label="torch DDP")
    ax.plot(steps, fddp_losses, lw=1, color="tab:orange", label="fddp")
    ax.set(ylabel="train cross-entropy\n(rank 0's batch)", yscale="log", title="the same loop, ported: the curves coincide")
    ax.legend()
    diff = [abs(a - b) for a, b in zip(ddp_losses, fddp_losses)]
    ax_diff.plot(steps, [d if d > 0 else float("nan") for d in diff], marker=".", lw=0.8, color="tab:red")
    exact = [s for s, d in zip(steps, diff) if d == 0]
    ax_diff.plot(exact, [1e-9] * len(exact), "|", color="tab:green", label="equal to the bit (0, drawn at the bottom)")
    ax_diff.set(xlabel="step", ylabel="|fddp - DDP| loss", yscale="log", ylim=(5e-10, 1e-3))
    ax_diff.set_title(f"their difference: float rounding (largest parameter difference at the end: {max_diff:.1e})", fontsize=9)
    ax_diff.legend(loc="upper left", fontsize=8)
    for a in (ax, ax_diff):
        a.grid(alpha=0.3)
    fig.suptitle(
        f"{dist.get_world_size()} process(es), SGD lr {args.lr:g}, momentum 0.9, weight decay 1e-4, "
        f"{args.batch_size} samples per rank per step, {args.epochs} epoch(s)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description="torch DDP and fddp, side by side.")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/port_from_ddp")
    args = p.parse_args()

    fddp.init()  # replaces dist.init_process_group(...); torchrun's environment, or one process
    x, y = load_digits(return_X_y=True)
    dataset = TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))

    ddp_losses, ddp_params = train_ddp(args, dataset)
    # DDP's reducer sits in reference cycles; free it now, while the process group is alive, rather
    # than during interpreter shutdown (where tearing down its pending gloo work can abort).
    gc.collect()
    fddp_losses, fddp_params = train_fddp(args, dataset)
    max_diff = max((ddp_params[k] - fddp_params[k]).abs().max().item() for k in ddp_params)

    if fddp.is_main():
        print(f"{'step':>5} {'DDP loss':>10} {'fddp loss':>10} {'|diff|':>9}")
        every = max(1, len(ddp_losses) // 10)
        for i in list(range(0, len(ddp_losses), every)) + [len(ddp_losses) - 1]:
            a, b = ddp_losses[i], fddp_losses[i]
            print(f"{i + 1:5d} {a:10.5f} {b:10.5f} {abs(a - b):9.2e}")
        print(f"{len(ddp_losses)} steps on {fddp.world_size()} process(es); largest parameter difference "
              f"after training: {max_diff:.2e}", flush=True)  # fmt: skip
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump({"ddp_loss": ddp_losses, "fddp_loss": fddp_losses, "max_param_diff": max_diff}, f)
        plot(ddp_losses, fddp_losses, max_diff, args, os.path.join(args.out_dir, "curves.png"))
        print(f"metrics in {args.out_dir}/metrics.json, curves in {args.out_dir}/curves.png", flush=True)
    fddp.shutdown()  # every rank together: none leaves while another still communicates or writes


if __name__ == "__main__":
    main()
