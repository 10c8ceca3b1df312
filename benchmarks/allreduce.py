"""Latency and bandwidth of gloo's all-reduce across the test bed: a sweep of message sizes.

Two ways to run it:

    # the driver: makes each test bed (tools/cluster.py; needs root), launches itself on it with
    # one torchrun agent per host, and writes benchmarks/results/allreduce.json
    python benchmarks/allreduce.py --hosts 2,4 --rates 1gbit,10gbit

    # the worker, under any torchrun launch (one host or many); rank 0 writes --out
    torchrun --standalone --nproc-per-node=2 benchmarks/allreduce.py --out /tmp/ar.json

Each size is timed in blocks of back-to-back all-reduces of float32 tensors (enough of them that
a block lasts about 20 ms), after a barrier; a block's time is the slowest rank's mean, and each
size reports the median and minimum over ``--repeats`` blocks. ``benchmarks/costmodel.py`` fits an
alpha-beta model to the results and says how well it predicts them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB, 16 KiB, ..., 64 MiB
RESULTS = ROOT / "benchmarks" / "results" / "allreduce.json"


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = []
    for nbytes in args.sizes:
        x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)
        dist.all_reduce(x)  # warm up: connections, buffers
        single = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            single.append(time.perf_counter() - t0)
        first = torch.tensor([statistics.median(single)], dtype=torch.float64)
        dist.all_reduce(first, op=dist.ReduceOp.MAX)  # every rank must agree on the block size
        per_block = max(1, min(200, int(args.block_s / max(float(first), 1e-6))))
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(per_block):
                dist.all_reduce(x)
            t = torch.tensor([(time.perf_counter() - t0) / per_block], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
        sizes.append({
            "bytes": x.numel() * 4, "median_s": statistics.median(times), "min_s": min(times),
            "all_s": times, "per_block": per_block,
        })  # fmt: skip
        if rank == 0:
            s = sizes[-1]
            print(f"{s['bytes']:>10} B  median {1e3 * s['median_s']:9.3f} ms  min {1e3 * s['min_s']:9.3f} ms  "
                  f"({per_block} per block)", flush=True)  # fmt: skip
    if rank == 0 and args.out:
        meta = {
            "world_size": world,
            "nodes": int(os.environ.get("GROUP_WORLD_SIZE", 1)),
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            "torch": torch.__version__,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**meta, "sizes": sizes}, indent=1))
    dist.destroy_process_group()


def driver(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks import costmodel
    from tools.cluster import Cluster, format_rate, measure_tcp, parse_rate, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make a test bed here: {reason}")
    runs = []
    for rate in args.rates:
        for n in args.hosts:
            with Cluster(n, rate=rate) as c:
                print(f"\n{c.describe()}", flush=True)
                tcp = measure_tcp(c, 0, 1, nbytes=args.tcp_mb << 20)
                print(f"TCP node0 -> node1: {tcp / 1e9:.3f} Gbit/s", flush=True)
                out = Path(c.run_id).with_suffix(".json")
                out = Path("/tmp") / out.name
                worker_args = [str(Path(__file__).resolve()), "--out", str(out), "--repeats", str(args.repeats),
                               "--sizes", *map(str, args.sizes)]  # fmt: skip
                argvs = [c.torchrun(h, worker_args, nproc_per_node=args.nproc_per_node) for h in c.hosts]
                results = c.run_all(argvs, timeout=args.timeout)
                for r in results:
                    if r.returncode != 0:
                        raise SystemExit(f"{r.host.name} exited {r.returncode}:\n{r.output}")
                print(results[0].output.strip(), flush=True)
                data = json.loads(out.read_text())
                out.unlink()
                runs.append({"hosts": n, "rate": format_rate(parse_rate(rate)), "rate_bps": parse_rate(rate),
                             "tcp_bps": tcp, **data})  # fmt: skip
    record = {
        "what": "gloo all-reduce of float32 across the test bed (tools/cluster.py), one torchrun agent per host",
        "command": " ".join(["python", "benchmarks/allreduce.py", *sys.argv[1:]]),
        "runs": runs,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
        print(f"\nwrote {args.out}")
    print()
    print(costmodel.report(record))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=DEFAULT_SIZES, help="message sizes in bytes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block-s", type=float, default=0.02, help="aim for blocks of about this many seconds")
    p.add_argument("--out", default=None, help="JSON results (driver default: benchmarks/results/allreduce.json)")
    # driver only
    p.add_argument("--hosts", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--rates", type=lambda s: s.split(","), default=["1gbit", "10gbit"])
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--tcp-mb", type=int, default=64, help="MiB sent in the TCP check of each test bed")
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        worker(args)
    else:
        args.out = args.out or str(RESULTS)
        driver(args)


if __name__ == "__main__":
    main()
