"""What the control plane costs a step, measured on the test bed against fddp.scaling's model.

    python benchmarks/control_plane.py --hosts 4 --rate 1gbit      # needs root (tools/cluster.py)
    python benchmarks/control_plane.py project                     # the model alone, 2 ... 256 ranks

Every fddp call that communicates sends one head first (a 4 KiB float64 all-reduce) and the host
waits for it; a plain mean of at most 470 values rides in it. A step that also calls
``fddp.pmean`` ``K`` times (a global batch norm per layer, say) pays ``K`` more heads, one after
another. ``fddp.scaling.predict_step(..., calls=K)`` predicts that cost; this checks it.

The run makes a test bed of ``--hosts`` hosts, one rank each (gloo, links capped at ``--rate``
both ways), and times, interleaved round by round (``--rounds`` blocks of ``--steps`` steps per
row; a block's time is the slowest rank's), a step that is ``K`` calls of ``fddp.pmean`` on a
16-value tensor and then one ``fddp.ddp_step`` of a 257 KiB tree (one bucket), for each ``K`` of
``--calls``; the same step with ``K`` raw ``dist.all_reduce`` of a 4 KiB tensor (what a head is
on the wire, without fddp around it); and ``K = 0`` with ``fddp.set_checks(agreement=False)``
(the ddp_step without its own head). The model's link is ``fddp.scaling.measure_link`` on the same
bed. Per row: the median step (ms) and its spread over the rounds; per ``K``: the increase per
call over ``K = 0`` (paired within each round, median and spread) next to the model's head.
Writes ``benchmarks/results/control_plane_<hosts>x1_<rate>.json`` and prints the table.

``project`` prints the model's head per call and per step (``K`` calls, plus the step's own, all
exposed as in a ``ddp_step``) for 2 ... 256 ranks on a ring and a tree, at 25 µs a message step
(TCP over 10-100 GbE) and at each measured bed's link; with ``--resnet``, ResNet-50's overlapped
step (benchmarks/scaling.py's projection) with and without its heads. Writes
``benchmarks/results/control_plane_projection.json``.
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
RESULTS = ROOT / "benchmarks" / "results"
WORLDS = (2, 4, 8, 16, 32, 64, 128, 256)
PROJECTED_CALLS = (0, 8, 32, 53)  # 53: ResNet-50's batch-norm layers, each one fddp.pmean
PROJECTION_LATENCY_US = 25.0  # benchmarks/scaling.py's: TCP/IP over 10-100 GbE


# ------------------------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """Under torchrun on the test bed: measure the link, time the rows, predict them."""
    import torch
    import torch.distributed as dist

    import fddp
    from fddp.scaling import predict_step
    from fddp.sync import Timeline

    torch.set_num_threads(1)
    fddp.init()
    world, rank = fddp.world_size(), fddp.rank()
    link = fddp.scaling.measure_link()
    g = torch.Generator().manual_seed(rank)
    params = {"b": torch.zeros(256), "w": torch.zeros(256, 256)}  # 257 KiB: one bucket, too big to ride
    grads = {k: torch.randn(v.shape, generator=g) for k, v in params.items()}
    stats = [torch.randn(16, generator=g) for _ in range(max(args.calls))]  # a batch norm's mean (16 channels)
    raw = torch.zeros(512, dtype=torch.float64)  # a head's size: 4 KiB

    def fddp_step(k: int):
        def step() -> None:
            for t in stats[:k]:
                fddp.pmean(t)
            fddp.ddp_step(params, grads)

        return step

    def raw_step(k: int):
        def step() -> None:
            for _ in range(k):
                dist.all_reduce(raw)
            fddp.ddp_step(params, grads)

        return step

    rows = {f"K={k} pmean": fddp_step(k) for k in args.calls}
    rows.update({f"K={k} raw 4 KiB": raw_step(k) for k in args.calls if k})
    rows["K=0 no head"] = fddp_step(0)
    checks = {name: name != "K=0 no head" for name in rows}

    def block(name: str, steps: int) -> float:
        fddp.set_checks(agreement=checks[name])
        f = rows[name]
        f()  # the first call after a switch of the agreement sends a head, saying so
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            f()
        return (time.perf_counter() - t0) / steps

    for name in rows:  # warm up: first calls agree on new trees
        block(name, 3)
    names = list(rows)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        measured = {name: block(name, args.steps) for name in order}
        t = torch.tensor([measured[n] for n in names], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's block
        for name, s in zip(names, t.tolist()):
            times[name].append(s)
    fddp.set_checks(agreement=True)

    # The host's own work per fddp call (building, sending and reading the head; the tree's
    # flatten and the result), as this thread's CPU time: a pmean's less a raw all-reduce's.
    def cpu_per_call(f, n: int = 60) -> float:
        dist.barrier()
        t0 = time.thread_time()
        for _ in range(n):
            f()
        return (time.thread_time() - t0) / n

    cpu = torch.tensor([cpu_per_call(lambda: fddp.pmean(stats[0])), cpu_per_call(lambda: dist.all_reduce(raw))], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    per_call = max(0.0, float(cpu[0] - cpu[1]))

    # The model: ddp_step hands every value over at once (a timeline of zeros: nothing to hide
    # the head behind), the step's own head plus K more.
    at_once = Timeline(0.0, (0.0, 0.0), (), (), (), 0.0)
    predicted = {k: predict_step(params, at_once, link, world, calls=k) for k in args.calls}
    with_host = {k: predict_step(params, at_once, link, world, calls=k, per_call=per_call) for k in args.calls}
    if rank == 0:
        record = {
            "command": " ".join(["python", "benchmarks/control_plane.py", *args.argv]),
            "world": world,
            "torch": torch.__version__,
            "link": {"latency_s": link.latency, "bandwidth_Bps": link.bandwidth},
            "steps": args.steps,
            "rounds": args.rounds,
            "rows_s": times,
            "cpu_per_call_s": {"pmean": float(cpu[0]), "raw all_reduce 4 KiB": float(cpu[1]), "per_call": per_call},
            "model_with_per_call": {str(k): p.control for k, p in with_host.items()},
            "model": {
                str(k): {
                    "head_s": p.head,
                    "control_s": p.control,
                    "collectives": p.collectives,
                    "host_waits": p.host_waits,
                    "step_s": p.step,
                }
                for k, p in predicted.items()
            },
        }
        Path(args.worker_out).write_text(json.dumps(record, indent=1))
    fddp.shutdown()


# ------------------------------------------------------------------------------------------- driver


def _median_spread(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def summarize(record: dict) -> dict:
    """Per K: the measured increase per call over K = 0 (paired within each round) and the model's."""
    rows = record["rows_s"]
    base = rows["K=0 pmean"]
    out = {}
    for k in sorted(int(x) for x in record["model"]):
        if k == 0:
            continue
        m = record["model"][str(k)]
        per_call = [(a - b) / k for a, b in zip(rows[f"K={k} pmean"], base)]
        raw = [(a - b) / k for a, b in zip(rows[f"K={k} raw 4 KiB"], base)]
        out[str(k)] = {
            "measured_per_call_s": _median_spread(per_call),
            "raw_all_reduce_per_call_s": _median_spread(raw),
            "model_per_call_s": (m["control_s"] - record["model"]["0"]["control_s"]) / k,
            "model_head_s": m["head_s"],
            "model_with_per_call_per_call_s": (record["model_with_per_call"][str(k)] - record["model_with_per_call"]["0"]) / k,
            "collectives": m["collectives"],
            "host_waits": m["host_waits"],
        }
    own = [a - b for a, b in zip(base, rows["K=0 no head"])]
    out["own head"] = {
        "measured_s": _median_spread(own),
        "model_s": record["model"]["0"]["control_s"],
        "model_with_per_call_s": record["model_with_per_call"]["0"],
    }
    return out


def table(record: dict) -> str:
    c = record["cluster"]
    lines = [
        f"{c['hosts']} hosts x 1 rank (gloo), links {c['rate']} each way; link fitted by fddp.scaling.measure_link: "
        f"latency {record['link']['latency_s'] * 1e6:.1f} us a message step, {record['link']['bandwidth_Bps'] * 8 / 1e9:.3f} Gbit/s; "
        f"{record['rounds']} rounds x {record['steps']} steps, the slowest rank's; torch {record['torch']}; load average before "
        f"{', '.join(f'{x:.2f}' for x in record['load_avg']['before'])}, "
        f"after {', '.join(f'{x:.2f}' for x in record['load_avg']['after'])} on {record['load_avg']['cpus']} CPUs",
        "",
        f"  {'row':<16}{'median ms':>10}{'min ms':>9}{'max ms':>9}",
    ]
    for name, xs in record["rows_s"].items():
        med, lo, hi = _median_spread(xs)
        lines.append(f"  {name:<16}{med * 1e3:10.3f}{lo * 1e3:9.3f}{hi * 1e3:9.3f}")
    lines += [
        "",
        f"  {'K':>3}{'collectives':>12}{'host waits':>11}{'pmean us/call (min-max)':>28}{'raw 4 KiB us/call':>27}"
        f"{'model us/call':>15}{'+ host us/call':>16}",
    ]
    for k, s in record["summary"].items():
        if k == "own head":
            continue
        m, lo, hi = s["measured_per_call_s"]
        rm, rlo, rhi = s["raw_all_reduce_per_call_s"]
        lines.append(
            f"  {k:>3}{s['collectives']:12d}{s['host_waits']:11d}{m * 1e6:>12.0f} ({lo * 1e6:.0f}-{hi * 1e6:.0f})".ljust(54)
            + f"{rm * 1e6:>12.0f} ({rlo * 1e6:.0f}-{rhi * 1e6:.0f})".ljust(27)
            + f"{s['model_per_call_s'] * 1e6:>15.0f}{s['model_with_per_call_per_call_s'] * 1e6:>16.0f}"
        )
    own = record["summary"]["own head"]
    m, lo, hi = own["measured_s"]
    lines.append(
        f"\n  ddp_step's own head (K=0 pmean - K=0 no head): {m * 1e6:.0f} us ({lo * 1e6:.0f}-{hi * 1e6:.0f}), "
        f"model {own['model_s'] * 1e6:.0f} us, + host {own['model_with_per_call_s'] * 1e6:.0f} us\n"
        f"  host CPU per call (this thread, the slowest rank): pmean {record['cpu_per_call_s']['pmean'] * 1e6:.0f} us, "
        f"raw all_reduce {record['cpu_per_call_s']['raw all_reduce 4 KiB'] * 1e6:.0f} us: per_call = "
        f"{record['cpu_per_call_s']['per_call'] * 1e6:.0f} us"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    from tools.cluster import Cluster, format_rate, parse_rate, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make a test bed here: {reason}")
    rate = format_rate(parse_rate(args.rate))
    out = Path(args.out_dir) / f"control_plane_{args.hosts}x1_{rate}.json"
    tmp = out.with_suffix(".worker.tmp")
    load_before = os.getloadavg()
    argv = [str(Path(__file__).resolve()), "worker", "--worker-out", str(tmp), "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--calls", *map(str, args.calls), "--argv", *sys.argv[1:]]  # fmt: skip
    with Cluster(args.hosts, rate=args.rate) as c:
        print(c.describe(), flush=True)
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
        results = c.run_all([c.torchrun(h, argv) for h in c.hosts], timeout=args.timeout, envs=[{**c.env(h), **env} for h in c.hosts])
        for r in results:
            if r.returncode != 0:
                raise SystemExit(f"the worker on {r.host.name} exited {r.returncode}:\n{r.output}")
    record = json.loads(tmp.read_text())
    tmp.unlink()
    record["cluster"] = {
        "hosts": args.hosts,
        "rate": rate,
        "topology": "hosts on one bridge, tbf on both ends of each veth (tools/cluster.py)",
    }
    record["load_avg"] = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    record["summary"] = summarize(record)
    out.write_text(json.dumps(record, indent=1))
    print(table(record))
    print(f"\nwrote {out}")
    return record


def resnet_projection(args: argparse.Namespace) -> dict:
    """ResNet-50's overlapped step (``grad_and_value``) with and without its heads: its own, and one
    ``fddp.pmean`` per batch-norm layer (53). The timeline and the links are benchmarks/scaling.py's
    projection's (measured here on small images, stretched to ``--resnet-ms``; 25 µs a message step,
    96% of the line rate); the bucket cap is chosen as ``fddp.scaling.choose_bucket_cap`` does."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scaling as bench

    from fddp.scaling import Link, choose_bucket_cap

    params, timeline, after, how = bench.resnet_timeline(args.resnet_ms / 1e3, 64, 4, 5)
    per_bucket = how["per_bucket_s"]
    rows = []
    for rate in bench.RATES_GBIT:
        for algorithm in ("ring", "tree"):
            link = Link(PROJECTION_LATENCY_US * 1e-6, rate * 1e9 / 8 * 0.96, algorithm)
            for world in WORLDS:
                for calls in (0, 53):
                    choice = choose_bucket_cap(params, timeline, link, world, after=after, per_bucket=per_bucket, calls=calls)
                    p = choice.predictions[choice.bucket_cap_mb]
                    rows.append({
                        "rate_gbit": rate, "algorithm": algorithm, "world": world, "calls": calls,
                        "bucket_cap_mb": choice.bucket_cap_mb, "step_s": p.step, "efficiency": p.efficiency,
                        "efficiency_without_heads": p.compute / (p.step - p.control), "control_s": p.control,
                        "collectives": p.collectives, "host_waits": p.host_waits,
                    })  # fmt: skip
    print(f"\nResNet-50, {args.resnet_ms:g} ms a step: efficiency without heads / with its own / with 53 pmean calls more")
    for rate in bench.RATES_GBIT:
        for algorithm in ("ring", "tree"):
            cells = []
            for world in (8, 64, 256):
                own, bn = (
                    next(r for r in rows if (r["rate_gbit"], r["algorithm"], r["world"], r["calls"]) == (rate, algorithm, world, k))
                    for k in (0, 53)
                )
                cells.append(f"{world}: {own['efficiency_without_heads']:.2f} / {own['efficiency']:.2f} / {bn['efficiency']:.2f}")
            print(f"  {rate:>3} Gbit/s {algorithm:<5}" + "   ".join(cells))
    return {"resnet_ms": args.resnet_ms, "compute": how, "rows": rows}


def project(args: argparse.Namespace) -> dict:
    """The model's head per call and per step at 2 ... 256 ranks, ring and tree."""
    import torch

    from fddp.scaling import Link, predict_step
    from fddp.sync import Timeline

    # A head is latency-bound: the control link's bandwidth hardly matters (4 KiB at 10 Gbit/s: 3 us).
    links = {"25 us a message step, 10 Gbit/s (TCP over 10-100 GbE)": (PROJECTION_LATENCY_US * 1e-6, 10e9 / 8)}
    for bed in sorted(RESULTS.glob("control_plane_*x1_*.json")):
        rec = json.loads(bed.read_text())
        alpha, bandwidth = rec["link"]["latency_s"], rec["link"]["bandwidth_Bps"]
        bed_name = f"the test bed: {rec['cluster']['hosts']} hosts, {rec['cluster']['rate']}"
        label = f"{alpha * 1e6:.0f} us a message step, {bandwidth * 8 / 1e9:.2f} Gbit/s ({bed_name})"
        links[label] = (alpha, bandwidth)
    # The data plane does not matter here: one bucket too large to ride in the head, all there at once (ddp_step).
    params = {"w": torch.zeros(1024)}
    at_once = Timeline(0.0, (0.0,), (), (), (), 0.0)
    rows = []
    for label, (alpha, bandwidth) in links.items():
        for algorithm in ("ring", "tree"):
            link = Link(alpha, bandwidth, algorithm)
            for world in WORLDS:
                ps = {k: predict_step(params, at_once, link, world, calls=k) for k in PROJECTED_CALLS}
                rows.append({
                    "link": label, "latency_s": alpha, "bandwidth_Bps": bandwidth, "algorithm": algorithm, "world": world,
                    "head_s": ps[0].head,
                    "per_step_s": {str(k): p.control for k, p in ps.items()},
                })  # fmt: skip
    record = {
        "command": " ".join(["python", "benchmarks/control_plane.py", *sys.argv[1:]]),
        "what": "per call: one 4 KiB head; per step: K heads one after another plus the step's own, all exposed (ddp_step)",
        "rows": rows,
        "resnet50": resnet_projection(args) if args.resnet else None,
    }
    out = RESULTS / "control_plane_projection.json"
    out.write_text(json.dumps(record, indent=1))
    for label in links:
        print(f"\n{label}: head per call, ms (ring / tree); per step with K calls and its own, ms")
        print(f"  {'N':>4}{'head':>16}" + "".join(f"{'K=' + str(k):>18}" for k in PROJECTED_CALLS))
        for world in WORLDS:
            ring, tree = (
                next(r for r in rows if r["link"] == label and r["algorithm"] == a and r["world"] == world) for a in ("ring", "tree")
            )
            cells = "".join(f"{ring['per_step_s'][str(k)] * 1e3:>9.2f} / {tree['per_step_s'][str(k)] * 1e3:<6.2f}" for k in PROJECTED_CALLS)
            print(f"  {world:>4}{ring['head_s'] * 1e3:>8.3f} / {tree['head_s'] * 1e3:<6.3f}{cells}")
    print(f"\nwrote {out}")
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", default="run", choices=("run", "project", "worker"))
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit", help="each host's link rate, both ways (tc syntax)")
    p.add_argument("--calls", type=int, nargs="+", default=[0, 8, 32], help="the K to time (0 is always timed)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--timeout", type=float, default=600, help="seconds for the launch")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--resnet", action="store_true", help="project: also ResNet-50's step with and without its heads")
    p.add_argument("--resnet-ms", type=float, default=100.0, help="project: ResNet-50's assumed step (benchmarks/scaling.py's)")
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--argv", nargs=argparse.REMAINDER, default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    args.calls = sorted({0, *args.calls})
    if args.what == "worker":
        worker(args)
    elif args.what == "project":
        project(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
