"""Train an ensemble of classifiers at once with ``torch.func.vmap``, data-parallel with fddp.

    torchrun --standalone --nproc-per-node=2 examples/ensemble_vmap.py

``--members`` MLPs with different initialisations are stacked into one parameter tree
(``torch.func.stack_module_state``: every leaf gains a leading member dimension) and trained as
one: ``vmap`` runs every member on the same batch, one ``fddp.grad_and_value`` averages the whole
ensemble's gradients over the ranks in a few fused all-reduces, and ``vmap(opt.update)`` gives
each member its own optimizer step, including its own gradient clipping. torch DDP can train this
ensemble too (a module whose forward runs ``vmap(functional_call)`` over the stacked parameters,
wrapped in DDP and trained with ``.backward()``, gives bitwise the same parameters); what DDP cannot
do is run a ``torch.func`` transform over the step (``torch.func.grad`` of a loss that synchronises,
as in ``examples/meta_learning.py``): its hooks fire only inside ``.backward()``.

Data: scikit-learn's bundled digits, sharded over the ranks with ``DistributedSampler``.
Writes ``<out-dir>/metrics.json`` and ``<out-dir>/curves.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.func import stack_module_state, vmap
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import fddp
import fddp.optim


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="An ensemble trained with vmap, data-parallel with fddp.")
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split evenly over the ranks")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke tests)")
    p.add_argument("--out-dir", default="runs/ensemble")
    return p.parse_args()


def plot(history: list[dict], args: argparse.Namespace, world: int, path: str) -> None:
    """Each member's curves in its own colour, the ensemble's accuracy in black."""
    epochs = [h["epoch"] for h in history]
    colours = plt.get_cmap("tab10" if args.members <= 10 else "viridis")
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for i in range(args.members):
        colour = colours(i if args.members <= 10 else i / max(1, args.members - 1))
        ax_loss.plot(epochs, [h["member_loss"][i] for h in history], color=colour, lw=1, marker=".", label=f"member {i}")
        ax_acc.plot(epochs, [h["member_test_acc"][i] for h in history], color=colour, lw=1, marker=".")
    ax_acc.plot(epochs, [h["ensemble_test_acc"] for h in history], color="black", lw=2.5, label="ensemble")
    ax_loss.set(xlabel="epoch", ylabel="train cross-entropy", yscale="log", title="training loss of each member")
    ax_acc.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy: each member, and the ensemble")
    ax_loss.legend(fontsize=7, ncol=2)
    ax_acc.legend(loc="lower right")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"{args.members} MLPs trained in one vmap on {world} process(es): AdamW lr {args.lr:g}, clipped at norm 1, "
        f"global batch {args.batch_size}; ensemble = the average of the members' probabilities",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    train_set = TensorDataset(torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
    x_test, y_test = torch.tensor(x_test, dtype=torch.float32), torch.tensor(y_test)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler)

    torch.manual_seed(args.seed)
    members = [
        nn.Sequential(nn.Linear(64, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10)) for _ in range(args.members)
    ]
    apply_fn, _ = fddp.functionalize(members[0])  # the architecture; parameters come from `params`
    stacked, _ = stack_module_state(members)  # {"0.weight": [members, hidden, 64], ...}
    params = fddp.broadcast({name: p.detach() for name, p in stacked.items()})
    # Clipping is per member under vmap: one member's large gradient does not shrink the others'.
    opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(lr=args.lr))
    opt_state = vmap(opt.init)(params)
    update = vmap(opt.update)

    def loss_fn(params, x, y):
        logits = vmap(apply_fn, in_dims=(0, None))(params, x)  # [members, batch, 10]
        losses = vmap(F.cross_entropy, in_dims=(0, None))(logits, y)  # [members]
        # Members share no parameters, so the gradient of the sum is each member's own gradient.
        return losses.sum(), losses

    # Built once, outside the loop: the transform is a function of the loss, not of the batch.
    step_fn = fddp.grad_and_value(loss_fn, has_aux=True)

    history: list[dict] = []
    step, t0 = 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        loss_sum, batches = torch.zeros(args.members), 0
        for xb, yb in loader:
            # The whole ensemble's gradients, averaged over the ranks in a few fused all-reduces.
            grads, (_, losses) = step_fn(params, xb, yb)
            updates, opt_state = update(grads, opt_state, params)
            params = fddp.optim.apply_updates(params, updates)
            loss_sum += losses.detach()
            batches += 1
            step += 1
            if args.max_steps is not None and step >= args.max_steps:
                break
        loss_sum /= batches
        if world > 1:
            dist.all_reduce(loss_sum)  # every rank ran the same number of batches (the sampler pads)
            loss_sum /= world
        with torch.no_grad():
            probs = vmap(apply_fn, in_dims=(0, None))(params, x_test).softmax(-1)  # [members, test, 10]
            member_acc = (probs.argmax(-1) == y_test).float().mean(1)
            ensemble_acc = (probs.mean(0).argmax(-1) == y_test).float().mean().item()
        history.append({
            "epoch": epoch,
            "step": step,
            "member_loss": loss_sum.tolist(),
            "member_test_acc": member_acc.tolist(),
            "ensemble_test_acc": ensemble_acc,
        })  # fmt: skip
        if fddp.is_main():
            print(f"epoch {epoch:3d}  member loss {loss_sum.mean():.4f} (mean of {args.members})  "
                  f"member test acc {member_acc.min():.3f}..{member_acc.max():.3f}  "
                  f"ensemble test acc {ensemble_acc:.3f}  {time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
        if args.max_steps is not None and step >= args.max_steps:
            break

    if fddp.is_main():
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump({"world_size": world, "members": args.members, "history": history}, f, indent=1)
        plot(history, args, world, os.path.join(args.out_dir, "curves.png"))
        print(f"metrics in {args.out_dir}/metrics.json, curves in {args.out_dir}/curves.png", flush=True)
    fddp.shutdown()  # every rank together: none leaves while another still communicates or writes


if __name__ == "__main__":
    main()
