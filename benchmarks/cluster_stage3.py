"""ZeRO stage 3 across the test bed, where bytes cost: prefetch against the link, and hybrid sharding.

    python benchmarks/cluster_stage3.py --rate 1gbit --repeats 5            # 2 hosts x 1 rank, then 2 x 2
    python benchmarks/cluster_stage3.py --rate 1gbit --repeats 7 --skip-hybrid   # 2 hosts x 1 rank: FSDP2, bf16

Makes a test bed (tools/cluster.py: network namespaces on a bridge, each host's link capped at
``--rate`` both ways; needs root), measures the link (TCP goodput between node0 and node1, both
ways: the best is the link's rate), and runs ``benchmarks/stage3.py``'s timing with one torchrun
agent per host:

- 2 hosts x 1 rank: torch DDP, torch FSDP2 (float32 and bf16 with MixedPrecisionPolicy), fddp
  stage 2, stage 3 (float32, bf16 gathers and compute with float32 reductions, and float32
  without prefetch), and stage 3's floors (the same code over a one-rank group: its compute with
  no collective, in float32 and in bf16). The limit of a stage-3 mode is ``max(floor, wire)``,
  ``wire`` the bytes each rank sends per step at the measured rate: its shard to the other rank
  for every gather (forward and backward, counted by ``apply_fn.counters``) and, for the
  gradients, the half of each bucket it sends its peer (two ranks reduce-scatter by one exchange);
- 2 hosts x 2 ranks: DDP, flat stage 3 over the 4 ranks, and hybrid sharding (shard within a
  host, replicate across hosts): the bytes each rank hands to collectives that cross hosts
  (DDP: its whole gradient; hybrid: its gradient shard) and the step times.

Writes ``benchmarks/results/cluster_stage3_<rate>.json`` (``_2x1`` with ``--skip-hybrid``,
``_hybrid`` with ``--only-hybrid``) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.cluster import Cluster, format_rate, measure_tcp, parse_rate, unavailable_reason  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def launch(c: Cluster, nproc: int, model: str, modes: list[str], args: argparse.Namespace, out: Path) -> list:
    argv = [str(ROOT / "benchmarks" / "stage3.py"), "--worker-out", str(out), "--task", "time", "--model", model,
            "--modes", *modes, "--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    results = c.run_all([c.torchrun(h, argv, nproc_per_node=nproc) for h in c.hosts], timeout=args.timeout,
                        envs=[{**c.env(h), **env} for h in c.hosts])  # fmt: skip
    for r in results:
        if r.returncode != 0:
            raise SystemExit(f"stage3.py on {r.host.name} exited {r.returncode}:\n{r.output[-4000:]}")
    return json.loads(out.read_text())


def summarise(per_rank: list, world: int, tcp_bps: float) -> dict:
    r0 = per_rank[0]
    med = {m: statistics.median(ts) for m, ts in r0["times_ms"].items()}
    out = {"median_ms": med, "all_ms": r0["times_ms"], "per_step": r0["per_step"], "ddp_payload_bytes": r0["ddp_payload_bytes"]}
    for c in r0["per_step"].values():
        # Bytes each rank sends per step: its shard to each of the N-1 others for every gather
        # (a ring all-gather); for the reductions, what it handed to them: on two ranks the half it
        # sends its peer, on more 2 (N-1)/N of every bucket it all-reduces (a ring all-reduce).
        reduce = c["reduced_bytes"] if world == 2 else 2 * (world - 1) / world * c["reduced_bytes"]
        sent = (world - 1) * c["gathered_bytes"] + reduce
        c["wire_bytes"] = sent
        c["wire_ms"] = 1e3 * 8 * sent / tcp_bps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--model", default="transformer")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--modes", nargs="+", default=["ddp", "fsdp2", "fsdp2_bf16", "stage2", "stage3", "stage3_bf16", "stage3_noprefetch",
                                                   "stage3_floor", "stage3_bf16_floor"], help="2 hosts x 1 rank")  # fmt: skip
    p.add_argument("--skip-hybrid", action="store_true")
    p.add_argument("--only-hybrid", action="store_true", help="2 hosts x 2 ranks only")
    args = p.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make a test bed here: {reason}")
    rate = parse_rate(args.rate)
    record: dict = {"command": " ".join(["python", "benchmarks/cluster_stage3.py", *sys.argv[1:]]), "rate": format_rate(rate),
                    "model": args.model, "load_before": os.getloadavg(), "args": vars(args)}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    with Cluster(2, rate=args.rate) as c:
        tcp = max(measure_tcp(c, a, b) for a, b in ((0, 1), (1, 0)))
        record["tcp_bps"] = tcp
        print(f"TCP node0 <-> node1: {tcp / 1e9:.3f} Gbit/s", flush=True)
        if not args.only_hybrid:
            flat = launch(c, 1, args.model, args.modes, args, RESULTS / "_c3.json")
            record["two_hosts"] = summarise(flat, 2, tcp)
        if not args.skip_hybrid:
            hyb = launch(c, 2, args.model, ["ddp", "stage3", "hybrid"], args, RESULTS / "_c3.json")
            record["two_hosts_two_ranks"] = summarise(hyb, 4, tcp)
        (RESULTS / "_c3.json").unlink(missing_ok=True)
    record["load_after"] = os.getloadavg()
    part = "_hybrid" if args.only_hybrid else "_2x1" if args.skip_hybrid else ""
    out = RESULTS / f"cluster_stage3_{format_rate(rate)}{part}.json"
    out.write_text(json.dumps(record, indent=1))
    print(table(record))
    print(f"\nwrote {out}")


def table(record: dict) -> str:
    lines = [
        f"{record['model']}, links {record['rate']} (TCP {record['tcp_bps'] / 1e9:.3f} Gbit/s); "
        f"load {record['load_before']} -> {record['load_after']}"
    ]
    t = record.get("two_hosts", {"median_ms": {}})
    med = t["median_ms"]
    if med:
        lines.append("\n2 hosts x 1 rank: step ms (median), x DDP, x FSDP2 (of the same precision), wire ms at the link rate, "
                     "limit = max(floor, wire)")  # fmt: skip
    for m, v in med.items():
        bf16 = "bf16" in m
        ref = med.get("fsdp2_bf16" if bf16 else "fsdp2")
        row = f"  {m:<18}{v:8.1f}{v / med['ddp']:7.2f}" + (f"{v / ref:7.2f}" if ref else " " * 7)
        c = t["per_step"].get(m)
        floor = med.get("stage3_bf16_floor" if bf16 else "stage3_floor")
        if c and "floor" not in m and floor is not None:
            limit = max(floor, c["wire_ms"])
            hits = f"{c['prefetch_hits']}/{c['prefetch_hits'] + c['prefetch_misses']}"
            row += f"   wire {c['wire_ms']:6.1f}   limit {limit:6.1f}   step / limit {v / limit:5.2f}   prefetch hits {hits}"
        lines.append(row)
    h = record.get("two_hosts_two_ranks")
    if h:
        med = h["median_ms"]
        lines.append("\n2 hosts x 2 ranks: step ms (median), x DDP; bytes per rank handed to collectives that cross hosts")
        ddp_bytes = h["ddp_payload_bytes"]
        for m, v in med.items():
            cross = {"ddp": ddp_bytes}.get(m)
            c = h["per_step"].get(m)
            if m == "hybrid":
                cross = c["replica_bytes"]
            elif m == "stage3":
                cross = c["gathered_bytes"] + c["reduced_bytes"]
            lines.append(
                f"  {m:<10}{v:8.1f}{v / med['ddp']:7.2f}   cross-host payload {cross / 2**20:7.2f} MB ({cross / ddp_bytes:.2f} of DDP's)"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
