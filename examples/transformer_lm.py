"""Train a small transformer language model to do arithmetic, data-parallel, with fddp.

    torchrun --standalone --nproc-per-node=2 examples/transformer_lm.py

The text is generated: fixed-width additions such as ``37+45=082``. The model (a GPT-style
decoder, pre-norm, causal attention) learns to continue ``37+45=`` with the sum; the loss counts
only the three answer characters, the part that can be learned. Each optimizer step sums the
gradients of ``--accum`` micro-batches locally and averages over the ranks once, so the global
batch is ``micro_batch * accum * world_size`` sequences. The learning rate warms up linearly and
then follows a cosine (``fddp.optim.warmup_cosine_decay``), held in the optimizer's state
(``fddp.optim.inject_hyperparams``) so the log reads it back; gradients are clipped at a global
norm of 1, the norm logged (``clip_by_global_norm`` keeps it in its state); weight decay spares
biases and norms in every mode (``adamw(mask=...)``, torch's two param groups). Exact-match
accuracy on held-out problems is measured by greedy decoding.

With ``--fully-shard`` the parameters are sharded too (ZeRO stage 3, ``fddp.zero.fully_shard``):
each rank holds 1/N of the parameters, gradients and AdamW state, and gathers one unit at a time
inside the forward and backward passes (a block, for blocks of 0.5 MiB and more: ``--d-model 128``).
``--budget-mb`` sets a per-rank memory budget that the full training state (parameters,
gradients and AdamW's two moments: 16 bytes a value) exceeds, and the run checks that what each
rank holds, plus the gathered blocks at their peak, fits::

    torchrun --standalone --nproc-per-node=2 examples/transformer_lm.py --fully-shard \
        --d-model 128 --layers 4 --budget-mb 10 --steps 200

With ``--muon`` the blocks' matrices take Muon's step (``fddp.optim.muon``: momentum
orthogonalised by Newton-Schulz, torch.optim.Muon's arithmetic) at ``--muon-lr``, and the
embeddings, head, biases and norms AdamW's, both on the same warmup and cosine; with
``--fully-shard`` too, each matrix is orthogonalised whole by one rank and its pieces travel by
all-to-all::

    torchrun --standalone --nproc-per-node=2 examples/transformer_lm.py --muon --fully-shard --steps 300

Writes ``<out-dir>/metrics.json`` and ``<out-dir>/curves.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import optree
import torch
import torch.nn.functional as F
from torch import nn

import fddp
import fddp.optim

VOCAB = "0123456789+="
PROMPT_LEN, ANSWER_LEN = 6, 3  # "37+45=" then "082"
SEQ_LEN = PROMPT_LEN + ANSWER_LEN


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A small transformer LM trained data-parallel with fddp.")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--micro-batch", type=int, default=64, help="sequences per rank per micro-batch")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=60, help="warmup steps")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fully-shard", action="store_true", help="ZeRO stage 3: shard the parameters, gradients and AdamW state")
    p.add_argument("--budget-mb", type=float, default=None, help="with --fully-shard: the memory budget per rank, in MiB")
    p.add_argument("--muon", action="store_true", help="Muon for the blocks' matrices, AdamW for the rest")
    p.add_argument("--muon-lr", type=float, default=0.02, help="with --muon: Muon's peak learning rate")
    p.add_argument("--out-dir", default="runs/transformer_lm")
    return p.parse_args()


def encode(problems: torch.Tensor) -> torch.Tensor:
    """Turn rows ``(a, b)`` with ``0 <= a, b < 100`` into token ids of ``"aa+bb=sss"``."""
    a, b = problems[:, 0], problems[:, 1]
    digits = lambda n, width: [(n // 10**i) % 10 for i in reversed(range(width))]  # noqa: E731
    plus, eq = torch.full_like(a, VOCAB.index("+")), torch.full_like(a, VOCAB.index("="))
    return torch.stack([*digits(a, 2), plus, *digits(b, 2), eq, *digits(a + b, 3)], dim=1)


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(n, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(n, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(len(VOCAB), d), nn.Embedding(SEQ_LEN, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, len(VOCAB))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def report_memory(args: argparse.Namespace, apply_fn, shards, grads, opt_state, n_params: int, world: int) -> dict:
    """Memory per rank after the first step: what it holds, and the gathered units' peak in a step."""
    per_rank = {
        "params": held_bytes(shards),
        "grads": held_bytes(grads),
        "adamw_state": held_bytes(opt_state),
        "gathered_peak": apply_fn.counters.peak_bytes,  # the full units and gradient buffers alive at once
    }
    mib = 2**20
    full = 16 * n_params  # float32 parameters, gradients and AdamW's two moments, unsharded
    total = sum(per_rank.values())
    line = (f"rank {fddp.rank()}: params {per_rank['params'] / mib:.2f} MiB, grads {per_rank['grads'] / mib:.2f}, "
            f"AdamW state {per_rank['adamw_state'] / mib:.2f}, gathered units at their peak {per_rank['gathered_peak'] / mib:.2f}: "
            f"{total / mib:.2f} MiB per rank; unsharded, the training state alone is {full / mib:.2f} MiB\n")  # fmt: skip
    sys.stdout.write(line)  # one write, newline included: the ranks' lines do not interleave
    sys.stdout.flush()
    if args.budget_mb is not None:
        budget = args.budget_mb * mib
        if total > budget:
            raise SystemExit(f"rank {fddp.rank()}: {total / mib:.2f} MiB exceeds the budget of {args.budget_mb} MiB")
        if fddp.is_main():
            verdict = "exceeds" if full > budget else "fits in"
            print(f"the unsharded training state ({full / mib:.2f} MiB) {verdict} the budget of {args.budget_mb} MiB; "
                  f"sharded over {world} ranks it fits", flush=True)  # fmt: skip
    return {**per_rank, "total": total, "unsharded": full, "budget": None if args.budget_mb is None else args.budget_mb * mib}


def plot(history: dict[str, list], args: argparse.Namespace, world: int, path: str) -> None:
    """The loss with the learning rate on a second axis (one legend for both), and test accuracy."""
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    loss_line = ax_loss.plot(history["step"], history["loss"], lw=0.8, label="train loss (answer tokens)")
    ax_lr = ax_loss.twinx()
    lr_line = ax_lr.plot(history["step"], history["lr"], color="gray", ls="--", lw=1, label="learning rate (right axis)")
    ax_lr.set_ylabel("learning rate", color="gray")
    ax_lr.tick_params(axis="y", colors="gray")
    ax_loss.set(xlabel="step", ylabel="cross-entropy", yscale="log", title="training")
    lines = loss_line + lr_line
    ax_loss.legend(lines, [line.get_label() for line in lines], loc="upper right", fontsize=8)
    ax_loss.grid(alpha=0.3)
    ax_acc.plot(history["eval_step"], history["test_acc"], marker="o")
    ax_acc.set(xlabel="step", ylabel="exact match", ylim=(0, 1.02), title="held-out sums, greedy decoding")
    ax_acc.grid(alpha=0.3)
    fig.suptitle(
        f"GPT, {args.layers} blocks of width {args.d_model}, on {world} process(es): "
        f"{f'Muon peak lr {args.muon_lr:g} + ' if args.muon else ''}AdamW peak lr {args.lr:g} "
        f"(warmup {args.warmup}, cosine), global batch {args.micro_batch * args.accum * world} sequences "
        f"({args.accum} micro-batches of {args.micro_batch} per rank)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def held_bytes(*trees) -> int:
    """Bytes of the distinct buffers behind the trees' tensors (views of one buffer count once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in optree.tree_leaves(trees)}.values())


def main() -> None:
    args = parse_args()
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()

    # All 10,000 problems, split 90/10 with a fixed permutation (the same on every rank).
    grid = torch.cartesian_prod(torch.arange(100), torch.arange(100))
    perm = torch.randperm(len(grid), generator=torch.Generator().manual_seed(1234))
    train, test = grid[perm[:9000]], grid[perm[9000:]]
    # Each rank draws its own micro-batches: a generator seeded by (seed, rank).
    data_gen = torch.Generator().manual_seed(args.seed * 1000 + rank)

    torch.manual_seed(args.seed)
    model = GPT(args.d_model, args.layers, args.heads)
    n_params = sum(p.numel() for p in model.parameters())
    if args.fully_shard:
        # Units chosen by size (the blocks; the small embeddings and norm in the root): `params`
        # are this rank's shards, and apply_fn gathers each unit's parameters just before it runs.
        apply_fn, params = fddp.zero.fully_shard(model)
    else:
        apply_fn, params = fddp.functionalize(model)
        params = fddp.broadcast(params)
    lr = fddp.optim.warmup_cosine_decay(0.0, args.lr, warmup_steps=args.warmup, decay_steps=max(args.steps, args.warmup + 1))
    # Weight decay on the matrices only, not on biases and norms (torch's two param groups), in
    # every mode: on ZeRO-3's shards the mask labels the whole leaves each slice belongs to.
    decay = fddp.optim.by_path(lambda path, p: p.ndim >= 2)

    # Muon steps the blocks' matrices; the embeddings and the head (matrices too, but lookups and
    # a readout, which Muon's authors leave to AdamW) and every 1-D leaf go to AdamW.
    hidden = fddp.optim.by_path(lambda path, p: p.ndim == 2 and path.startswith("blocks."))

    def make_opt(lr):
        adamw = fddp.optim.adamw(lr=lr, weight_decay=0.1, mask=decay)
        if args.muon:  # the same schedule, scaled to Muon's peak
            adamw = fddp.optim.muon(lr * args.muon_lr / args.lr, weight_decay=0.1, mask=hidden, fallback=adamw)
        return fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), adamw)

    # The learning rate lives in the optimizer's state, where the loop reads it back for the log,
    # and so does the gradients' norm before clipping (what torch's clip_grad_norm_ returns).
    opt = fddp.optim.inject_hyperparams(make_opt)(lr=lr)
    opt_state = opt.init(params)  # for shards: 1/N of the state

    def loss_fn(params, seq):
        logits = apply_fn(params, seq[:, :-1])
        # Positions PROMPT_LEN-1 .. SEQ_LEN-2 predict the three answer digits.
        answer_logits = logits[:, PROMPT_LEN - 1 :]
        return F.cross_entropy(answer_logits.reshape(-1, len(VOCAB)), seq[:, PROMPT_LEN:].reshape(-1))

    @torch.no_grad()
    def complete(params, problems):
        seq = encode(problems)[:, :PROMPT_LEN]
        for _ in range(ANSWER_LEN):  # greedy decoding, one character at a time
            next_tok = apply_fn(params, seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, next_tok], dim=1)
        return seq

    def accuracy(params, problems):
        return (complete(params, problems) == encode(problems)).all(1).float().mean().item()

    if fddp.is_main():
        print(f"{n_params:,} parameters on {world} process(es); global batch "
              f"{args.micro_batch * args.accum * world} sequences", flush=True)  # fmt: skip
    # Sharded, the gradients come out of the gathers' backward already averaged over the ranks.
    grad_fn = fddp.grad_and_value(loss_fn) if args.fully_shard else torch.func.grad_and_value(loss_fn)
    history: dict[str, list] = {"step": [], "loss": [], "lr": [], "grad_norm": [], "eval_step": [], "test_acc": []}
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        acc, loss_sum = fddp.GradAccumulator(), 0.0
        for _ in range(args.accum):  # a no-sync window: local sums only, no communication
            batch = encode(train[torch.randint(len(train), (args.micro_batch,), generator=data_gen)])
            grads, loss = grad_fn(params, batch)
            acc = fddp.accumulate_grads(acc, grads)
            loss_sum += loss.item()
        # Replicated: one all-reduce per optimizer step. Sharded: each micro-batch's backward
        # reduce-scattered its gradients already; the mean of the shards is the step's.
        grads = acc.mean() if args.fully_shard else fddp.ddp_step(params, acc.mean())
        params, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, params)
        if args.fully_shard and step == 1:
            memory = report_memory(args, apply_fn, params, grads, opt_state, n_params, world)

        # The logged loss is rank 0's; the gradients above are the global batch's.
        history["step"].append(step)
        history["loss"].append(loss_sum / args.accum)
        history["lr"].append(float(opt_state.hyperparams["lr"]))  # the step just taken's
        history["grad_norm"].append(float(opt_state.inner_state[0].norm))  # chain's first state: the clip's
        if step % args.eval_every == 0 or step == args.steps:
            acc = accuracy(params, test)  # identical params on every rank: each checks the same set
            history["eval_step"].append(step)
            history["test_acc"].append(acc)
            if fddp.is_main():
                recent = history["loss"][-args.eval_every :]
                seqs_per_s = step * args.micro_batch * args.accum * world / (time.perf_counter() - t0)
                print(f"step {step:5d}  loss {sum(recent) / len(recent):.4f}  lr {history['lr'][-1]:.2e}  "
                      f"grad norm {history['grad_norm'][-1]:.3f}  test exact-match {acc:.3f}  "
                      f"{seqs_per_s:,.0f} sequences/s", flush=True)  # fmt: skip

    samples = ["".join(VOCAB[i] for i in row) for row in complete(params, test[:4])]  # every rank: sharded, it gathers
    if fddp.is_main():
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "metrics.json"), "w") as f:
            json.dump({"world_size": world, **history, **({"memory": memory} if args.fully_shard else {})}, f)
        plot(history, args, world, os.path.join(args.out_dir, "curves.png"))
        print(f"final test exact-match {history['test_acc'][-1]:.3f} after {args.steps} steps, "
              f"{time.perf_counter() - t0:.1f} s; samples: {' '.join(samples)}", flush=True)  # fmt: skip
        print(f"metrics in {args.out_dir}/metrics.json, curves in {args.out_dir}/curves.png", flush=True)
    fddp.shutdown()  # every rank together: none leaves while another still communicates or writes


if __name__ == "__main__":
    main()
