"""What a second collective costs a call: the floor under fddp's header, whichever way it travels.

    torchrun --standalone --nproc-per-node=2 benchmarks/round_trips.py --repeats 300

A call of fddp's sends a small header (16 int64) as well as its gradients' bucket. This times, after
a barrier each time, the ways the two could travel, against one all-reduce of the bucket alone
(torch DDP's one collective for a small model):

    one          the bucket alone: one all-reduce of 136 float32 (the benchmark MLP's 34 leaves of 4)
    sequential   the header, waited for, then the bucket (fddp's order without early buckets)
    concurrent   both issued at once on the one group, then both waited for (fddp's early buckets)
    side group   the header on a second gloo group of the same ranks, the bucket on the first, at once

Each row is the median over ``--repeats`` of rank 0's time, the rows interleaved within every repeat
so that they share the machine's noise; the last column is the median of each repeat's ratio to
``one``. Prints the table and writes ``benchmarks/results/round_trips.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--floats", type=int, default=136, help="the bucket's size in float32 values")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "round_trips.json"))
    args = parser.parse_args()
    dist.init_process_group("gloo")
    side = dist.new_group(backend="gloo")
    header, bucket = torch.zeros(16, dtype=torch.int64), torch.zeros(args.floats)

    def both(header_group: dist.ProcessGroup | None) -> None:
        works = [dist.all_reduce(header, async_op=True, group=header_group), dist.all_reduce(bucket, async_op=True)]
        for w in works:
            w.wait()

    rows = {
        "one": lambda: dist.all_reduce(bucket),
        "sequential": lambda: (dist.all_reduce(header), dist.all_reduce(bucket)),
        "concurrent": lambda: both(None),
        "side group": lambda: both(side),
    }
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, call in rows.items():
            dist.barrier()
            t = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t) * 1e6)
    if dist.get_rank() == 0:
        print(f"rank 0, {dist.get_world_size()} gloo ranks, median of {args.repeats} (us)   median   ratio to one")
        for name, ts in times.items():
            ratio = statistics.median(t / o for t, o in zip(ts, times["one"]))
            print(f"  {name:<12}{statistics.median(ts):>36.0f}{ratio:>15.2f}")
        record = {"args": vars(args), "world": dist.get_world_size(), "load": os.getloadavg(), "times_us": times}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f)
        print(f"wrote {args.out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
