"""Contrastive learning on the global batch: every rank's keys all-gathered, gradients flowing back.

    torchrun --standalone --nproc-per-node=2 examples/contrastive.py

Two noisy views of each digit (scikit-learn's bundled digits) are embedded by one encoder; each
view must pick its partner out of *every* rank's batch (InfoNCE, as SimCLR and CLIP train). Each
rank embeds its own batch, ``fddp.all_gather`` hands every rank all the keys, and the loss of a
rank's queries is taken against the global batch. The gather is differentiable: its transpose, a
reduce-scatter, sends each rank the cotangents of its own keys from every rank's loss, so the
gradient is the one-process gradient on the whole batch (tests/test_lax.py checks it in float64
against a one-process run). torch's own ``all_gather`` raises under ``torch.func.grad``; here the
step is ``fddp.grad_and_value`` (or ``torch.func.grad`` + ``fddp.ddp_step``: the same numbers).

Writes ``<out-dir>/metrics.json`` and ``<out-dir>/curves.png``: the loss, and how often a held-out
view finds its partner among 256 candidates.
"""

from __future__ import annotations

import argparse
import json
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


def info_nce(apply_fn, params, views_a: torch.Tensor, views_b: torch.Tensor, temperature: float = 0.2) -> torch.Tensor:
    """This rank's share of the global batch's symmetric InfoNCE loss (the mean over its pairs).

    Every rank's ``views_b`` embeddings are gathered, so each query meets the whole global batch;
    its partner is at this rank's offset. The mean over the ranks of this loss is the loss of the
    whole batch in one process, and so is the mean of the ranks' gradients (``fddp.ddp_step``).
    """
    za = F.normalize(apply_fn(params, views_a), dim=1)
    zb = F.normalize(apply_fn(params, views_b), dim=1)
    keys_b = fddp.all_gather(zb, tiled=True)  # (ranks * batch, dim), differentiable
    keys_a = fddp.all_gather(za, tiled=True)
    labels = torch.arange(len(za)) + fddp.rank() * len(za)  # each pair's place in the global batch
    loss_ab = F.cross_entropy(za @ keys_b.T / temperature, labels)
    loss_ba = F.cross_entropy(zb @ keys_a.T / temperature, labels)
    return (loss_ab + loss_ba) / 2


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """A view of each image: pixels dropped at random and noise added."""
    keep = (torch.rand(x.shape, generator=g) > 0.25).to(x.dtype)
    return x * keep + 0.1 * torch.randn(x.shape, generator=g)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Contrastive learning over the global batch with fddp.all_gather.")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64, help="pairs per rank")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/contrastive")
    return p.parse_args()


@torch.no_grad()
def retrieval_accuracy(apply_fn, params, x: torch.Tensor, seed: int) -> float:
    """How often a view's nearest other view (cosine) is its own partner, among ``len(x)`` pairs."""
    g = torch.Generator().manual_seed(seed)
    za = F.normalize(apply_fn(params, augment(x, g)), dim=1)
    zb = F.normalize(apply_fn(params, augment(x, g)), dim=1)
    return ((za @ zb.T).argmax(1) == torch.arange(len(x))).double().mean().item()


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    x, _ = load_digits(return_X_y=True)
    x = torch.tensor(x / 16, dtype=torch.float32)
    train, test = x[:-256], x[-256:]
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, args.dim))
    apply_fn, params = fddp.functionalize(model)
    params = fddp.broadcast(params)
    opt = fddp.optim.adamw(lr=args.lr, weight_decay=1e-4)
    state = opt.init(params)
    step_fn = fddp.grad_and_value(lambda p, a, b: info_nce(apply_fn, p, a, b))
    g = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank draws its own batches and views
    history = []
    for step in range(args.steps):
        idx = torch.randint(len(train), (args.batch_size,), generator=g)
        grads, loss = step_fn(params, augment(train[idx], g), augment(train[idx], g))
        params, state = fddp.optim.apply_gradients(opt, grads, state, params)
        mean_loss = fddp.pmean(loss.detach())  # the global batch's loss, for the log
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            acc = retrieval_accuracy(apply_fn, params, test, seed=123)
            history.append({"step": step, "loss": mean_loss.item(), "test_retrieval": acc})
            if rank == 0:
                print(f"step {step:4d}  loss {mean_loss.item():.3f}  held-out retrieval top-1 {acc:.3f}", flush=True)
    fddp.verify_replicas(params)
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump({"world_size": world, "global_batch": world * args.batch_size, "history": history}, f, indent=1)
        fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
        steps = [h["step"] for h in history]
        a.plot(steps, [h["loss"] for h in history], marker=".")
        a.set(xlabel="step", ylabel="InfoNCE loss (global batch)", title="training loss")
        b.plot(steps, [h["test_retrieval"] for h in history], marker=".", color="#1b7837")
        b.set(xlabel="step", ylabel="top-1 among 256", title="held-out view retrieval", ylim=(0, 1))
        for ax in (a, b):
            ax.grid(alpha=0.3)
        fig.suptitle(f"{world} ranks x {args.batch_size} pairs: keys all-gathered with gradients (fddp.all_gather)", fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out_dir, "curves.png"), dpi=110)
        plt.close(fig)
    fddp.shutdown()


if __name__ == "__main__":
    main()
