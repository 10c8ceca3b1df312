"""What verifying checkpoints costs: save and load with and without the CRC-32 checks, same run.

    flock /work/bench.lock python benchmarks/checkpoint.py --mb 100 --leaves 50 --repeats 5

One process, a tree of ``--leaves`` float32 tensors holding ``--mb`` MB in all (and a step count),
saved and loaded in ``--dir`` (default: a new temporary directory) as

    save / load                  fddp.checkpoint.save and load (a CRC-32 per tensor, computed at
                                 save, verified at load)
    save_sharded / load_sharded  the same tree sharded over a one-rank group (the CRC-32 of every
                                 .distcp piece read back after the write, verified as it is read)

each against the same call with the checks switched off (the checksum functions patched out), the
two interleaved in every repeat. The cost is the median of the verified runs over the median of
the unverified ones, in wall-clock time and in CPU time (this process, all threads: robust to
other load on the machine, blind to the checks' threads running in parallel). Loads read a file
just written, so from the page cache: the check is the whole extra cost there, and a smaller
share of a load from a cold disk. Prints a table and writes
``benchmarks/results/checkpoint.json`` with the load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed.checkpoint as dcp

import fddp
import fddp.checkpoint as ckpt
from fddp.checkpoint import _codec, _dcp
from floor import report


@contextlib.contextmanager
def unverified() -> Iterator[None]:
    """Switch the checks off: no checksums saved (so none verified), no piece read back or checked."""
    saved = (_codec._checksums, _dcp._stored_checksums, _dcp.Reader._slice_file)
    _codec._checksums = lambda leaves: [None] * len(leaves)
    _dcp._stored_checksums = lambda root, results: {}
    _dcp.Reader._slice_file = dcp.FileSystemReader._slice_file
    try:
        yield
    finally:
        _codec._checksums, _dcp._stored_checksums, _dcp.Reader._slice_file = saved


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and CPU seconds (this process, all threads) of one call."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


OPS = ("save", "load", "save_sharded", "load_sharded")


def measure(tree: dict, like: dict, shards_tree: dict, shards_like: dict, root: str, repeats: int) -> dict[str, dict[str, float]]:
    times: dict[tuple[str, str], dict[str, list[float]]] = {
        (v, clock): {k: [] for k in OPS} for v in ("verified", "unverified") for clock in ("wall", "cpu")
    }
    for r in range(repeats + 1):  # the first round warms up and is dropped
        for variant in ("verified", "unverified") if r % 2 == 0 else ("unverified", "verified"):
            with unverified() if variant == "unverified" else contextlib.nullcontext():
                path = os.path.join(root, f"{variant}-{r}.pt")
                directory = os.path.join(root, f"{variant}-{r}")
                row = {  # each lambda runs at once, in this iteration
                    "save": timed(lambda: ckpt.save(path, tree)),  # noqa: B023
                    "load": timed(lambda: ckpt.load(path, like=like)),  # noqa: B023
                    "save_sharded": timed(lambda: ckpt.save_sharded(directory, shards_tree)),  # noqa: B023
                    "load_sharded": timed(lambda: ckpt.load_sharded(directory, shards_like)),  # noqa: B023
                }
                os.remove(path)
                shutil.rmtree(directory)
            if r > 0:
                for k, (wall, cpu) in row.items():
                    times[(variant, "wall")][k].append(wall)
                    times[(variant, "cpu")][k].append(cpu)
    med = {key: {k: 1e3 * statistics.median(ts) for k, ts in rows.items()} for key, rows in times.items()}
    out = {}
    for clock in ("wall", "cpu"):
        out[f"{clock} verified"] = med[("verified", clock)]
        out[f"{clock} unverified"] = med[("unverified", clock)]
        out[f"{clock} ratio"] = {k: med[("verified", clock)][k] / med[("unverified", clock)][k] for k in OPS}
    out["wall spread"] = {k: 1e3 * (max(ts) - min(ts)) for k, ts in times[("verified", "wall")].items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=100.0)
    parser.add_argument("--leaves", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a new temporary directory)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "checkpoint.json"))
    args = parser.parse_args()
    load_before = os.getloadavg()
    fddp.init()  # one process: a one-rank group
    n = int(args.mb * 1e6 / 4 / args.leaves)
    g = torch.Generator().manual_seed(0)
    params = {f"layers.{i}.weight": torch.randn(n, generator=g) for i in range(args.leaves)}
    tree, like = {"params": params, "step": 1}, {"params": {k: torch.empty_like(v) for k, v in params.items()}, "step": 0}
    shards = fddp.zero.shard(params)
    shards_tree = {"params": shards, "step": 1}
    shards_like = {"params": fddp.zero.shard(like["params"]), "step": 0}
    root = tempfile.mkdtemp(prefix="fddp-ckpt-bench-", dir=args.dir)
    try:
        results = measure(tree, like, shards_tree, shards_like, root, args.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    fddp.shutdown()
    print(f"{args.leaves} float32 tensors, {4 * n * args.leaves / 1e6:.0f} MB in {root}; median of {args.repeats}; "
          f"load average before {load_before}, after {os.getloadavg()}")
    args.load_avg_before = load_before
    headings = {k: k.replace("unverified", "off").replace("verified", "on") for k in results}
    report(results, "median ms", headings, ".2f", args, "results_ms")


if __name__ == "__main__":
    main()
