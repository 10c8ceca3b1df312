"""What fddp's per-call agreement costs by itself: the head, and steady-state calls against a raw all-reduce.

    torchrun --standalone --nproc-per-node=2 benchmarks/agreement.py
    torchrun --standalone --nproc-per-node=3 benchmarks/agreement.py

Every fddp call that communicates sends one fixed-size head (``fddp/_dist/_header.py``: 512
float64, 4 KiB); a plain mean or ``psum`` whose values fit rides in it. This times, on each rank,
``--repeats`` calls of each row after a barrier, interleaved round by round (``--rounds``), and
reports the median per call in µs (the slowest rank's), and each fddp row's time over the raw
all-reduce of the same values in the same round (the median over rounds):

    agreement head            fddp._dist.agree on the default group (a head alone, blocking)
    all_reduce, 8 floats      torch.distributed.all_reduce of a small tensor (32 bytes: at these
                              sizes a gloo all-reduce costs its latency, not its bytes)
    all_reduce, 40 floats     the same values as the tiny tree below, in one raw all-reduce
    ddp_step, 10 x 4 floats   fddp.ddp_step on a tree of 10 leaves of 4 floats (steady state)
    psum, 10 x 4 floats       fddp.psum of the same tree
    one-rank all_reduce       the same on a group of this rank alone: the hand-off to gloo's
                              thread that every collective pays, with no peer (what
                              benchmarks/overhead.py's one-rank ddp_step pays per bucket)
    all_reduce after 50 µs of host work, ... after 100 µs
                              the raw all-reduce of 40 floats, each call after a busy wait of that
                              long: what host work between collectives costs in wall time by itself
                              (the floor under any fddp call's ratio: a call's own Python is such
                              host work)

What the agreement costs inside a training step (where a rank also waits for a peer that is a
little behind) is benchmarks/step.py's ``*_noagree`` modes against their twins. Prints a table and
writes ``benchmarks/results/agreement.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import fddp
import fddp._dist


def _busy(seconds: float) -> None:
    """Host work that takes ``seconds``: a spin, as a call's Python would be (no sleep, no syscall)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def rows(alone: dist.ProcessGroup) -> dict[str, object]:
    header_rows = [("benchmark", "agreement", None)]
    digest = fddp._dist.digest(header_rows)
    small, mine, forty = torch.zeros(8), torch.zeros(8), torch.zeros(40)
    tree = {f"l{i}": torch.full((4,), float(i)) for i in range(10)}
    return {
        "agreement head": lambda: fddp._dist.agree(None, "benchmark", header_rows, signature=digest),
        "all_reduce, 8 floats": lambda: dist.all_reduce(small),
        "all_reduce, 40 floats": lambda: dist.all_reduce(forty),
        "ddp_step, 10 x 4 floats": lambda: fddp.ddp_step(tree, tree),
        "psum, 10 x 4 floats": lambda: fddp.psum(tree),
        "one-rank all_reduce": lambda: dist.all_reduce(mine, group=alone, async_op=True).wait(),
        "all_reduce after 50 µs of host work": lambda: (_busy(50e-6), dist.all_reduce(forty)),
        "all_reduce after 100 µs of host work": lambda: (_busy(100e-6), dist.all_reduce(forty)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=540)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "agreement.json"))
    args = parser.parse_args()
    fddp.init()
    world, rank = fddp.world_size(), fddp.rank()
    if world < 2:
        raise SystemExit("benchmarks/agreement.py: run it on 2 or more ranks (torchrun --nproc-per-node=2)")
    alone = [dist.new_group([r]) for r in range(world)][rank]
    load_before = os.getloadavg()
    calls = rows(alone)
    for f in calls.values():  # warm up: the first agreement on a signature is the new-tree one
        for _ in range(20):
            f()
    times: dict[str, list[float]] = {name: [] for name in calls}
    per_round: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, f in calls.items():
            dist.barrier()
            ts = []
            for _ in range(args.repeats // args.rounds):
                t0 = time.perf_counter()
                f()
                ts.append(time.perf_counter() - t0)
            times[name] += ts
            per_round[name].append(statistics.median(ts))
    raw = per_round["all_reduce, 40 floats"]
    ratios = {}
    compared = ("ddp_step, 10 x 4 floats", "psum, 10 x 4 floats", *(f"all_reduce after {us} µs of host work" for us in (50, 100)))
    for name in compared:
        t = torch.tensor([statistics.median(a / b for a, b in zip(per_round[name], raw))])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ratios[name] = t.item()
    medians = {}
    for name, ts in times.items():
        t = torch.tensor([statistics.median(ts) * 1e6])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        medians[name] = t.item()
    if rank == 0:
        print(f"{world} gloo ranks, torch {torch.__version__}, median µs per call of {args.repeats} (the slowest rank's)")
        for name, us in medians.items():
            print(f"  {name:<38}{us:9.1f}")
        for name, x in ratios.items():
            print(f"  {name} / all_reduce, 40 floats: {x:.2f}x (median over {args.rounds} rounds)")
        record = {
            "torch": torch.__version__,
            "world": world,
            "args": vars(args),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "median_us": medians,
            "ratio_to_raw_all_reduce": ratios,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        print(f"wrote {args.out}")
    fddp.shutdown()


if __name__ == "__main__":
    main()
