"""Muon on ZeRO's shards against replicated Muon and against AdamW on shards: bytes, state and step time.

Run with ``torchrun --standalone --nproc-per-node=2 benchmarks/muon.py`` (CPU, gloo). The model is a
small GPT (``--width``, ``--layers``): its blocks' matrices take Muon (``fddp.optim.muon``), the
embeddings, head, biases and norms AdamW; the AdamW modes step every leaf with AdamW. Each rank
trains on its own batch. The modes run interleaved within every repeat, so they share the
machine's noise (2 shared cores: other processes run too, so the times are noisy; compare the
ratios of one run, not times across runs); a mode's time is the median over repeats of its mean
step time (the slowest rank's). Prints a table and writes ``benchmarks/results/muon.json``.

Modes (a step: gradients, their sync, the optimizer, and for shards the gather of the parameters):
    muon_replicated  ddp_step (all-reduce) + Muon on the whole tree: every rank orthogonalises
                     every matrix
    muon_zero1       ddp_step + fddp.zero.shard of the mean + Muon on the shards + zero.gather
    muon_zero2       ddp_step(compression=ReduceScatter()) + Muon on the shards + zero.gather
    adamw_zero1      as muon_zero1, AdamW (torch's fused kernel) on every leaf
    adamw_zero2      as muon_zero2, AdamW on every leaf

``optimizer ms`` is the part of the step inside ``apply_gradients`` (Muon's exchange included).
``opt state MB`` is the optimizer state a rank keeps: on shards ``multi_transform`` (which ``muon``
is) keeps each group's state over the whole shards, so Muon's momentum and AdamW's two moments
each take 1/N of every value.

Bytes are what one rank sends per step, counted at torch.distributed's collectives as a ring or
pairwise algorithm sends them: an all-reduce of S bytes 2 (N-1)/N S, a reduce-scatter or
all-gather of a full buffer of S bytes (N-1)/N S, an all-to-all the bytes addressed to the other
ranks; fddp's agreement headers included. ``muon exchange`` is the all-to-alls' part: each
matrix's pieces to its owner and the orthogonalised pieces back, in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fddp
from fddp.sync import _comm

MODES = ("muon_replicated", "muon_zero1", "muon_zero2", "adamw_zero1", "adamw_zero2")


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.tok(idx))))


class Bytes:
    """Bytes this rank sends, counted at torch.distributed's collectives (see the module's docstring)."""

    def __init__(self) -> None:
        self.total = 0
        self.exchange = 0
        self.originals = {}

    def install(self) -> None:
        n = dist.get_world_size()

        def size(t) -> int:
            return t.numel() * t.element_size()

        counters = {
            "all_reduce": lambda t, *a, **k: 2 * (n - 1) * size(t) // n,
            "reduce_scatter_tensor": lambda out, inp, *a, **k: (n - 1) * size(inp) // n,
            "all_gather_into_tensor": lambda out, inp, *a, **k: (n - 1) * size(out) // n,
            "all_to_all_single": None,
        }
        for name, count in counters.items():
            fn = getattr(dist, name)
            self.originals[name] = fn
            setattr(dist, name, self._wrap(name, fn, count, n))
        # fddp's Comm binds its gather and reduce-scatter at import (gloo's reduce-scatter is an all-reduce).
        _comm._all_gather_single = self._wrap("all_gather_into_tensor", _comm._all_gather_single, counters["all_gather_into_tensor"], n)
        _comm._reduce_scatter_single = self._wrap(
            "reduce_scatter_tensor", _comm._reduce_scatter_single, counters["reduce_scatter_tensor"], n
        )

    def _wrap(self, name, fn, count, n):
        def counted(*args, **kwargs):
            if name == "all_to_all_single":
                inp = args[1]
                splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
                me = dist.get_rank(kwargs.get("group"))
                sent = (sum(splits) - splits[me]) * inp.element_size()
                self.exchange += sent
                self.total += sent
            else:
                self.total += count(*args, **kwargs)
            return fn(*args, **kwargs)

        return counted


def held_bytes(tree) -> int:
    """Bytes of the distinct buffers behind the tree's tensors (views of one buffer count once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in optree.tree_leaves(tree)}.values())


def make_mode(mode: str, args, apply_fn, params0: dict):
    hidden = fddp.optim.by_path(lambda path, p: p.ndim == 2 and path.startswith("blocks."))
    if mode.startswith("muon"):
        opt = fddp.optim.muon(0.02, mask=hidden, fallback=fddp.optim.adamw(3e-4))
    else:
        opt = fddp.optim.adamw(3e-4)
    grad = torch.func.grad(lambda p, x, y: F.cross_entropy(apply_fn(p, x).flatten(0, 1), y.flatten()))
    sharded = not mode.endswith("replicated")
    params = {k: v.clone() for k, v in params0.items()}
    box = {"params": params, "shards": fddp.zero.shard(params) if sharded else None}
    box["state"] = opt.init(box["shards"] if sharded else params)

    box["opt_s"] = 0.0

    def step(x, y):
        g = grad(box["params"], x, y)
        if not sharded:
            grads = fddp.ddp_step(box["params"], g)
            t0 = time.perf_counter()
            box["params"], box["state"] = fddp.optim.apply_gradients(opt, grads, box["state"], box["params"])
            box["opt_s"] += time.perf_counter() - t0
            return
        if mode.endswith("zero1"):
            grads = fddp.zero.shard(fddp.ddp_step(box["params"], g))
        else:
            grads = fddp.ddp_step(box["params"], g, compression=fddp.zero.ReduceScatter())
        t0 = time.perf_counter()
        box["shards"], box["state"] = fddp.optim.apply_gradients(opt, grads, box["state"], box["shards"])
        box["opt_s"] += time.perf_counter() - t0
        box["params"] = fddp.zero.gather(box["shards"]).wait()

    return step, box


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "muon.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    torch.manual_seed(0)
    model = GPT(args.vocab, args.width, args.layers)
    apply_fn, params0 = fddp.functionalize(model)
    params0 = fddp.broadcast({k: v.detach().clone() for k, v in params0.items()})
    values = sum(v.numel() for v in params0.values())
    matrices = sum(v.numel() for k, v in params0.items() if v.ndim == 2 and k.startswith("blocks."))
    counter = Bytes()
    counter.install()
    gen = torch.Generator().manual_seed(1000 + rank)

    def batch():
        ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen)
        return ids[:, :-1], ids[:, 1:]

    modes = {m: make_mode(m, args, apply_fn, params0) for m in args.modes}
    record = {m: {"ms": [], "opt_ms": [], "bytes": 0, "exchange": 0} for m in modes}
    for m, (step, box) in modes.items():  # warm up: plans, agreements, pools
        for _ in range(2):
            step(*batch())
        counter.total = counter.exchange = 0
        step(*batch())
        record[m]["bytes"], record[m]["exchange"] = counter.total, counter.exchange
        record[m]["state_bytes"] = held_bytes(box["state"])
    for _ in range(args.repeats):
        for m, (step, box) in modes.items():
            dist.barrier()
            box["opt_s"] = 0.0
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(*batch())
            ms = torch.tensor([(time.perf_counter() - t0) * 1e3 / args.steps, box["opt_s"] * 1e3 / args.steps])
            dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank's
            record[m]["ms"].append(float(ms[0]))
            record[m]["opt_ms"].append(float(ms[1]))
    base = statistics.median(record["muon_replicated"]["ms"]) if "muon_replicated" in record else None
    for r in record.values():
        r["median_ms"] = statistics.median(r["ms"])
        r["median_opt_ms"] = statistics.median(r["opt_ms"])
        r["ratio_to_muon_replicated"] = r["median_ms"] / base if base else None
    if rank == 0:
        print(f"GPT width {args.width}, {args.layers} blocks: {values:,} values, {matrices:,} in Muon's matrices; "
              f"{world} gloo ranks, {args.repeats} repeats of {args.steps} steps, median (noisy: shared cores)")  # fmt: skip
        print(f"{'mode':<17}{'step ms':>9}{'x replicated':>14}{'optimizer ms':>14}{'sent MB/step':>14}{'muon exchange MB':>18}"
              f"{'opt state MB':>14}")  # fmt: skip
        for m, r in record.items():
            ratio = f"{r['ratio_to_muon_replicated']:.2f}" if r["ratio_to_muon_replicated"] else "-"
            print(f"{m:<17}{r['median_ms']:>9.1f}{ratio:>14}{r['median_opt_ms']:>14.1f}{r['bytes'] / 1e6:>14.2f}"
                  f"{r['exchange'] / 1e6:>18.2f}{r['state_bytes'] / 1e6:>14.2f}")  # fmt: skip
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        meta = {"world": world, "values": values, "muon_values": matrices, "args": vars(args), "load_avg": os.getloadavg()}
        with open(args.out, "w") as f:
            json.dump({**meta, "results": record}, f, indent=1)
    fddp.shutdown()


if __name__ == "__main__":
    main()
