"""Train a digit classifier with DiLoCo: every rank trains alone, the ranks meet every --every steps.

    torchrun --standalone --nproc-per-node=2 examples/diloco.py
    torchrun --standalone --nproc-per-node=2 examples/diloco.py --fragments 2 --delay 3 --mixing 0.5 --compression int8
    torchrun --standalone --nproc-per-node=2 examples/diloco.py --local-sgd

Each rank draws its own mini-batches from scikit-learn's digits and steps its own copy of an MLP
with AdamW, with no communication. ``outer.step`` after every inner step counts; every ``--every``
steps it averages the ranks' pseudo-gradients (the parameters at the last synchronisation minus
the current ones) and steps the global parameters with the outer optimizer (by default the
library's: SGD at learning rate 1, the ranks' mean; ``--outer-lr`` / ``--outer-momentum`` for
Nesterov SGD): one all-reduce per ``--every`` steps instead of one per step. ``--fragments`` / ``--delay`` / ``--mixing`` turn on
Streaming DiLoCo; ``--local-sgd`` averages the parameters instead. Halfway through, the outer state
is settled and checkpointed with ``fddp.checkpoint.save_step``: every rank's parameters, inner and
outer state go in as ``fddp.checkpoint.PerRank`` (they differ between synchronisations), so each
rank stores its own copy in one sharded checkpoint, ``<out-dir>/ckpt/ckpt-<step>``; the run loads it
back and goes on from what it loaded.

Writes ``<out-dir>/metrics.json``, ``<out-dir>/curves.png`` and the checkpoint, and prints their paths.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import fddp
import fddp.checkpoint as ckpt


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DiLoCo on the digits, with fddp.diloco.")
    p.add_argument("--steps", type=int, default=600, help="inner steps")
    p.add_argument("--every", type=int, default=20, help="inner steps between synchronisations (H)")
    p.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo: fragments (F)")
    p.add_argument("--delay", type=int, default=0, help="Streaming DiLoCo: steps each sync overlaps (tau)")
    p.add_argument("--mixing", type=float, default=0.0, help="Streaming DiLoCo: weight of the local values at a merge")
    p.add_argument("--compression", choices=["none", "bf16", "int8"], default="none")
    p.add_argument("--outer-lr", type=float, default=None, help="outer Nesterov SGD's learning rate (default: the library's outer step)")
    p.add_argument("--outer-momentum", type=float, default=0.9,
                   help="its momentum, with --outer-lr (the paper's 0.9 suits runs of hundreds of outer steps)")  # fmt: skip
    p.add_argument("--local-sgd", action="store_true", help="average the parameters (outer SGD, lr 1) instead")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="runs/diloco")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    os.makedirs(args.out_dir, exist_ok=True)
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    x_train, x_test = torch.tensor(x_train, dtype=torch.float32), torch.tensor(x_test, dtype=torch.float32)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
    data_gen = torch.Generator().manual_seed(1000 * args.seed + rank)  # each rank its own batches

    torch.manual_seed(args.seed)
    apply_fn, params = fddp.functionalize(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    params = fddp.broadcast(params)
    inner = fddp.optim.adamw(args.lr, weight_decay=1e-4)
    compression = {"none": None, "bf16": "bf16", "int8": fddp.Int8()}[args.compression]
    if args.local_sgd:
        outer = fddp.diloco.local_sgd(args.every, compression=compression)
    else:
        nesterov = None if args.outer_lr is None else fddp.optim.sgd(args.outer_lr, momentum=args.outer_momentum, nesterov=True)
        outer = fddp.diloco.diloco(args.every, nesterov, compression=compression, fragments=args.fragments,
                                   delay=args.delay, mixing=args.mixing)  # fmt: skip
    inner_state, outer_state = inner.init(params), outer.init(params)
    loss_fn = lambda p, xb, yb: F.cross_entropy(apply_fn(p, xb), yb)  # noqa: E731

    history: dict[str, list] = {"step": [], "test_loss": [], "test_acc": [], "bytes": []}
    sent = 0
    for step in range(1, args.steps + 1):
        i = torch.randint(len(x_train), (args.batch_size,), generator=data_gen)
        grads = torch.func.grad(loss_fn)(params, x_train[i], y_train[i])  # local: no communication
        params, inner_state = fddp.optim.apply_gradients(inner, grads, inner_state, params)
        params, outer_state, info = outer.step(params, outer_state, return_info=True)
        sent += info.bytes_sent
        if step == args.steps // 2:
            # A checkpoint mid-run, possibly with a fragment in flight: settle it into tensors, save
            # every rank's own view (PerRank), and carry on from what was loaded back (bitwise the same run).
            outer_state = outer.settle(outer_state)
            tree = {"step": step, "local": ckpt.PerRank({"params": params, "inner": inner_state, "outer": outer_state})}
            path = ckpt.save_step(os.path.join(args.out_dir, "ckpt"), step, tree, keep=1)
            loaded = ckpt.load_step(ckpt.latest(os.path.join(args.out_dir, "ckpt")), like=tree)["local"]  # this rank's
            params, inner_state, outer_state = loaded["params"], loaded["inner"], loaded["outer"]
            if fddp.is_main():
                print(f"step {step:4d}  checkpoint of every rank's state: {path} (loaded back, training goes on from it)", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            with torch.no_grad():  # the global model: the same on every rank
                logits = apply_fn(outer_state.snapshot, x_test)
            history["step"].append(step)
            history["test_loss"].append(float(F.cross_entropy(logits, y_test)))
            history["test_acc"].append(float((logits.argmax(1) == y_test).float().mean()))
            history["bytes"].append(sent)
            if fddp.is_main():
                print(f"step {step:4d}  test loss {history['test_loss'][-1]:.4f}  accuracy {history['test_acc'][-1]:.3f}  "
                      f"{sent / step / 1e3:.1f} kB sent per step", flush=True)  # fmt: skip

    if fddp.is_main():
        metrics, curves = os.path.join(args.out_dir, "metrics.json"), os.path.join(args.out_dir, "curves.png")
        with open(metrics, "w") as f:
            json.dump({"world_size": world, "args": vars(args), **history}, f)
        plot(history, args, world, curves)
        print(f"final test accuracy {history['test_acc'][-1]:.3f}; {sent / args.steps / 1e3:.1f} kB sent per inner step")
        print(f"wrote {metrics} and {curves}")
    fddp.shutdown()


def plot(history: dict, args: argparse.Namespace, world: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(9, 3.8))
    ax_loss.plot(history["step"], history["test_loss"], marker=".")
    ax_loss.set(xlabel="inner step", ylabel="test cross-entropy", yscale="log", title="global model, test loss")
    ax_acc.plot(history["step"], history["test_acc"], marker=".")
    ax_acc.set(xlabel="inner step", ylabel="accuracy", title="global model, test accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
    streaming = f"Streaming DiLoCo (F={args.fragments}, tau={args.delay})"
    kind = "local SGD" if args.local_sgd else "DiLoCo" if args.fragments == 1 else streaming
    fig.suptitle(f"{kind} on {world} process(es), H={args.every}, compression {args.compression}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
