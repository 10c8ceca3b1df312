"""Train a handwritten-digit classifier data-parallel with fddp.

    torchrun --standalone --nproc-per-node=2 examples/train_digits.py
    python examples/train_digits.py              # the same script in one process

scikit-learn's bundled digits (1,797 images of 8x8 pixels, no download) are split 80/20 into a
training and a test set. Every rank reads its own shard of the training set through
``DistributedSampler``, computes gradients with ``torch.func``, averages them over the ranks with
fddp and takes the same AdamW step, so the parameters stay identical everywhere. After every epoch
a checkpoint is written; run the same command again and training resumes from the newest one
(``--fresh`` starts over).

Writes ``<out-dir>/metrics.json`` (one record per epoch), ``<out-dir>/curves.png`` and
``<out-dir>/ckpt/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from tqdm import tqdm

import fddp
import fddp.checkpoint as ckpt
import fddp.optim


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Data-parallel digit classification with fddp.")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64, help="global batch, split evenly over the ranks")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/digits")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (smoke tests)")
    p.add_argument("--fresh", action="store_true", help="delete earlier checkpoints and start over")
    p.add_argument("--compression", choices=["none", "bf16", "fp16", "powersgd"], default="none",
                   help="how gradients travel: full precision, half-precision buckets, or PowerSGD")  # fmt: skip
    p.add_argument("--powersgd-rank", type=int, default=1, help="PowerSGD's approximation rank")
    p.add_argument("--powersgd-start", type=int, default=46,
                   help="uncompressed steps before PowerSGD starts (46: two epochs of the default run)")  # fmt: skip
    return p.parse_args()


def load_data() -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    """Return the training set and the held-out test inputs and labels (a fixed, stratified split)."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)

    def tensors(x, y):
        return torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)

    return TensorDataset(*tensors(x_train, y_train)), *tensors(x_test, y_test)


def plot(history: list[dict], args: argparse.Namespace, world: int, path: str) -> None:
    import matplotlib  # here, not at the top: only rank 0 draws, and the import costs every rank

    matplotlib.use("Agg")  # render to a file; there may be no display
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.8))
    for split in ("train", "test"):
        ax_loss.plot(epochs, [h[f"{split}_loss"] for h in history], marker=".", label=split)
        ax_acc.plot(epochs, [h[f"{split}_acc"] for h in history], marker=".", label=split)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", yscale="log", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"digits MLP on {world} process(es): AdamW lr {args.lr:g} (cosine to 0 over {args.epochs} epochs), "
        f"weight decay {args.weight_decay:g}, global batch {args.batch_size}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    fddp.init()  # torchrun's environment, or a one-process world under plain python
    rank, world = fddp.rank(), fddp.world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by the {world} processes")
    ckpt_dir = os.path.join(args.out_dir, "ckpt")
    metrics_path = os.path.join(args.out_dir, "metrics.json")
    if args.fresh and fddp.is_main():
        shutil.rmtree(args.out_dir, ignore_errors=True)
    if world > 1:
        dist.barrier()  # nobody looks for checkpoints while rank 0 may still be deleting them

    train_set, x_test, y_test = load_data()
    # The sampler pads the data so every rank gets the same number of samples, hence the same
    # number of batches of the same sizes: the mean over ranks is the mean over the global batch.
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size // world, sampler=sampler)

    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(64, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, args.hidden), nn.ReLU(),
        nn.Linear(args.hidden, 10),
    )  # fmt: skip
    apply_fn, params = fddp.functionalize(model)
    params = fddp.broadcast(params)  # every rank starts from rank 0's initialisation
    # The learning rate follows a cosine from --lr down to zero over the whole run.
    lr = fddp.optim.cosine_decay(args.lr, decay_steps=args.epochs * len(loader))
    opt = fddp.optim.adamw(lr=lr, weight_decay=args.weight_decay)
    opt_state = opt.init(params)

    def loss_fn(params, x, y):
        logits = apply_fn(params, x)
        return F.cross_entropy(logits, y), logits

    # The transform is built once; with PowerSGD its state goes in with every call and comes back
    # in info. Residuals differ between ranks, so the checkpoint holds each rank's own (PerRank).
    compression = {"none": None, "bf16": "bf16", "fp16": "fp16"}.get(args.compression)
    if args.compression == "powersgd":
        compression = fddp.PowerSGD(rank=args.powersgd_rank, start_iter=args.powersgd_start)
    step_fn = fddp.grad_and_value(loss_fn, has_aux=True, compression=compression, return_info=True)
    comp_state = compression.init(params) if isinstance(compression, fddp.PowerSGD) else None

    # Resume: every rank reads the same file, so every rank holds the same state afterwards. The
    # RNG state saved is rank 0's; it is every rank's, since all seed alike and draw nothing apart.
    state = {"params": params, "opt_state": opt_state, "epoch": 0, "step": 0, "rng": torch.get_rng_state()}
    if comp_state is not None:  # each rank's own: the checkpoint becomes a directory, every rank writing its part
        state["powersgd"] = ckpt.PerRank(comp_state)
    history: list[dict] = []
    path = ckpt.latest(ckpt_dir)
    if path is not None:
        state = ckpt.load_step(path, like=state)  # checks every leaf's shape and dtype against `like`
        torch.set_rng_state(state["rng"])
        if comp_state is not None:  # this rank's own PowerSGD state, from the same epoch
            comp_state = state.pop("powersgd")
        with open(metrics_path) as f:
            history = [h for h in json.load(f)["history"] if h["epoch"] <= state["epoch"]]
        if fddp.is_main():
            print(f"resumed from {path} (epoch {state['epoch']}, step {state['step']})", flush=True)
    params, opt_state, step = state["params"], state["opt_state"], state["step"]

    finished = state["epoch"] >= args.epochs or (args.max_steps is not None and step >= args.max_steps)
    if fddp.is_main() and finished:
        print(f"nothing to train: the run in {args.out_dir} already finished (epoch {state['epoch']}, step {step}); "
              "raise --epochs to train on, or pass --fresh to start over", flush=True)  # fmt: skip
    elif fddp.is_main():
        print(f"training on {world} process(es): {len(train_set)} train / {len(y_test)} test samples, "
              f"{args.batch_size // world} per rank per step", flush=True)  # fmt: skip
    for epoch in range(state["epoch"] + 1, args.epochs + 1):
        if args.max_steps is not None and step >= args.max_steps:
            break
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples on this rank
        t0 = time.perf_counter()
        bar = tqdm(loader, desc=f"epoch {epoch}", leave=False, disable=None if fddp.is_main() else True)
        for x, y in bar:
            # Gradients averaged over the ranks; each bucket's all-reduce starts during backward.
            if comp_state is None:
                grads, (loss, logits), _ = step_fn(params, x, y)
            else:
                grads, (loss, logits), info = step_fn(params, x, y, compression_state=comp_state)
                comp_state = info.compression_state
            params, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, params)
            step += 1
            totals += torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)])
            bar.set_postfix(loss=f"{loss.item():.4f}")
            if args.max_steps is not None and step >= args.max_steps:
                break
        bar.close()
        if world > 1:
            dist.all_reduce(totals)  # sums over the ranks, for the log line
        seconds = time.perf_counter() - t0

        with torch.no_grad():  # params are identical on every rank, so each evaluates the whole test set
            logits = apply_fn(params, x_test)
            test_loss = F.cross_entropy(logits, y_test).item()
            test_acc = (logits.argmax(1) == y_test).float().mean().item()
        record = {
            "epoch": epoch,
            "step": step,
            "train_loss": totals[0].item() / totals[2].item(),
            "train_acc": totals[1].item() / totals[2].item(),
            "test_loss": test_loss,
            "test_acc": test_acc,
            "samples_per_s": totals[2].item() / seconds,
        }
        history.append(record)
        state = {"params": params, "opt_state": opt_state, "epoch": epoch, "step": step, "rng": torch.get_rng_state()}
        if comp_state is not None:
            state["powersgd"] = ckpt.PerRank(comp_state)  # every rank's own residuals, in the same checkpoint
        ckpt.save_step(ckpt_dir, epoch, state, keep=2)  # atomic: rank 0 writes (or every rank its part, with PerRank)
        if fddp.is_main():
            with open(metrics_path, "w") as f:
                json.dump({"world_size": world, "compression": args.compression, "history": history}, f, indent=1)
            print(f"epoch {epoch:3d}  loss {record['train_loss']:.4f}  train acc {record['train_acc']:.4f}  "
                  f"test loss {test_loss:.4f}  test acc {test_acc:.4f}  "
                  f"{record['samples_per_s']:,.0f} samples/s", flush=True)  # fmt: skip

    # Every rank must hold bitwise the same model and optimizer state; this raises on every rank if not.
    fddp.verify_replicas((params, opt_state))
    if fddp.is_main() and history:
        plot(history, args, world, os.path.join(args.out_dir, "curves.png"))
        print(f"final test accuracy {history[-1]['test_acc']:.4f} after {history[-1]['epoch']} epochs; "
              f"{time.perf_counter() - t_start:.1f} s; replicas identical on {world} process(es); "
              f"curves in {os.path.join(args.out_dir, 'curves.png')}", flush=True)  # fmt: skip
    fddp.shutdown()  # every rank together: none leaves while another still communicates or writes


if __name__ == "__main__":
    main()
