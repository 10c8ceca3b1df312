"""One training step across the test bed, where bytes cost: every mode of benchmarks/step.py against
torch DDP in the same run, next to the physical limit of the link.

    python benchmarks/cluster_step.py --hosts 2 --rate 1gbit --repeats 3 --models mlp transformer
    python benchmarks/cluster_step.py --hosts 4 --rate 10gbit --modes grad_and_value ddp_step_bf16

Makes a test bed (tools/cluster.py: network namespaces on a bridge, each host's link capped at
``--rate`` both ways; needs root), measures the link (TCP goodput between node0 and node1, both
ways, twice: the best is the link's rate; and gloo all-reduces of the sizes each mode sends), then
runs ``benchmarks/step.py`` with one torchrun agent per host. Writes ``benchmarks/results/cluster_step_<hosts>x<nproc>_<rate>.json``
(step.py's results plus the test bed, the link measurements and the limits) and step.py's chart
next to it, and prints the table.

The limit of a mode: its compute cannot go below the no-communication floor (the fastest of
step.py's floors), and its bytes cannot cross the link faster than the measured rate. A ring all-reduce of
``b`` bytes over ``W`` ranks sends ``2 (W - 1) / W * b`` bytes out of every rank (and receives as
many), so ``wire = 2 (W - 1) / W * b / rate``; with perfect overlap a step takes at least
``max(floor, wire)``, and without any overlap ``floor + wire``. ``gloo ms`` is gloo's own
all-reduce of that many bytes in one tensor on the same links: what the library could hope for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.cluster import (  # noqa: E402
    Cluster,
    format_rate,
    measure_tcp,
    parse_rate,
    unavailable_reason,
)

RESULTS = ROOT / "benchmarks" / "results"


def wire_seconds(nbytes: float, world: int, rate_bps: float) -> float:
    """Seconds a ring all-reduce of ``nbytes`` keeps each rank's link busy at ``rate_bps`` bits/s."""
    return 0.0 if world < 2 else 2 * (world - 1) / world * nbytes * 8 / rate_bps


def limits(step: dict, world: int, rate_bps: float, gloo: dict[int, float]) -> dict:
    """Per model and mode: the wire time of its bytes, gloo's all-reduce of them, and the bounds."""
    out = {}
    for model, r in step["results"].items():
        modes = r["modes"]
        floor = min(d["median_ms"] for m, d in modes.items() if m.startswith("floor")) / 1e3
        ddp = modes["ddp"]["median_ms"] / 1e3
        out[model] = {}
        for m, d in modes.items():
            if m.startswith("floor"):
                continue
            wire = wire_seconds(d["bytes"], world, rate_bps)
            out[model][m] = {
                "wire_ms": 1e3 * wire,
                "gloo_ms": 1e3 * gloo[d["bytes"]] if d["bytes"] in gloo else None,
                "limit_ms": 1e3 * max(floor, wire),  # perfect overlap
                "serial_ms": 1e3 * (floor + wire),  # no overlap at all
                "limit_ratio_to_ddp": max(floor, wire) / ddp,
            }
    return out


def table(record: dict) -> str:
    c = record["cluster"]
    lines = [
        f"{c['hosts']} hosts x {c['nproc_per_node']} rank(s), links {c['rate']} each way "
        f"(TCP measured {c['tcp_bps'] / 1e9:.3f} Gbit/s), {record['args']['repeats']} repeats x "
        f"{record['args']['steps']} steps, torch {record['torch']}; load average (1, 5, 15 min) before "
        f"{', '.join(f'{x:.2f}' for x in record['load_avg']['before'])}, "
        f"after {', '.join(f'{x:.2f}' for x in record['load_avg']['after'])} "
        f"on {record['load_avg']['cpus']} CPUs"
    ]
    for model, r in record["results"].items():
        lines.append(f"\n{model}: {r['values'] / 1e6:.2f}M values in {r['tensors']} tensors")
        head = f"  {'mode':<24}{'median ms':>10}{'x DDP':>8}{'MB sent':>9}{'wire ms':>9}{'gloo ms':>9}{'limit ms':>10}{'limit x DDP':>13}"
        lines.append(head)
        for m, d in r["modes"].items():
            row = f"  {m:<24}{d['median_ms']:10.1f}{d['ratio_to_ddp']:8.2f}"
            lim = record["limits"][model].get(m)
            if lim is not None:
                gloo = "" if lim["gloo_ms"] is None else f"{lim['gloo_ms']:9.1f}"
                row += f"{d['bytes'] / 2**20:9.2f}{lim['wire_ms']:9.1f}{gloo:>9}{lim['limit_ms']:10.1f}{lim['limit_ratio_to_ddp']:13.2f}"
            lines.append(row)
    lines.append(
        "\nwire ms = 2(W-1)/W x bytes at the measured TCP rate; limit = max(fastest floor, wire) (perfect "
        "overlap); gloo ms = gloo's all-reduce of the same bytes in one tensor on the same links"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make a test bed here: {reason}")
    rate_bps = parse_rate(args.rate)
    name = f"cluster_step_{args.hosts}x{args.nproc_per_node}_{format_rate(rate_bps)}"
    out = Path(args.out_dir) / name  # step.py adds .json and .png
    out_json = Path(f"{out}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    world = args.hosts * args.nproc_per_node
    load_before = os.getloadavg()
    with Cluster(args.hosts, rate=args.rate) as c:
        print(c.describe(), flush=True)
        # Other work on the machine only ever slows a transfer down: the link's rate is the best seen.
        tcps = [measure_tcp(c, a, b) for a, b in ((0, 1), (1, 0), (0, 1), (1, 0))]
        tcp = max(tcps)
        print(f"TCP between node0 and node1: {', '.join(f'{t / 1e9:.3f}' for t in tcps)} Gbit/s", flush=True)

        def launch(script: str, script_args: list[str]) -> None:
            argv = [str(ROOT / "benchmarks" / script), *script_args]
            env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            results = c.run_all(
                [c.torchrun(h, argv, nproc_per_node=args.nproc_per_node) for h in c.hosts],
                timeout=args.timeout,
                envs=[{**c.env(h), **env} for h in c.hosts],
            )
            for r in results:
                if r.returncode != 0:
                    raise SystemExit(f"{script} on {r.host.name} exited {r.returncode}:\n{r.output}")
            print(results[0].output.strip(), flush=True)

        step_args = ["--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup),
                     "--models", *args.models, "--out", str(out)]  # fmt: skip
        if args.modes:
            step_args += ["--modes", *args.modes]
        if args.bucket_cap_mb is not None:
            step_args += ["--bucket-cap-mb", str(args.bucket_cap_mb)]
        if args.first_bucket_mb is not None:
            step_args += ["--first-bucket-mb", str(args.first_bucket_mb)]
        launch("step.py", step_args)
        step = json.loads(out_json.read_text())

        sizes = sorted({d["bytes"] for r in step["results"].values() for d in r["modes"].values() if d["bytes"]})
        gloo_json = out.with_name(name + ".allreduce.tmp")
        launch(
            "allreduce.py",
            ["--sizes", *map(str, sizes), "--repeats", str(max(args.repeats, 3)), "--out", str(gloo_json)],
        )
        gloo = {s["bytes"]: s["median_s"] for s in json.loads(gloo_json.read_text())["sizes"]}
        gloo_json.unlink()

    record = {
        **step,
        "command": " ".join(["python", "benchmarks/cluster_step.py", *sys.argv[1:]]),
        "cluster": {
            "hosts": args.hosts, "nproc_per_node": args.nproc_per_node, "world_size": world,
            "rate": format_rate(rate_bps), "rate_bps": rate_bps, "tcp_bps": tcp, "tcp_bps_all": tcps,
            "topology": "hosts on one bridge, tbf on both ends of each veth (tools/cluster.py)",
        },
        "gloo_allreduce_s": {str(k): v for k, v in gloo.items()},
        "load_avg": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
        "limits": limits(step, world, tcp, gloo),
    }  # fmt: skip
    out_json.write_text(json.dumps(record, indent=1))
    print()
    print(table(record))
    print(f"\nwrote {out_json} and {out}.png")
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--rate", default="1gbit", help="each host's link rate, both ways (tc syntax)")
    p.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    p.add_argument(
        "--modes", nargs="+", default=None, help="only these modes of step.py (the floors and ddp always run)"
    )
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="step.py's bucket cap for the fddp modes but the _auto ones")
    p.add_argument("--first-bucket-mb", type=float, default=None, help="step.py's first bucket cap for those modes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=3600, help="seconds for each launch")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args()
    if os.geteuid() != 0:
        print("note: the test bed needs root (CAP_NET_ADMIN)", file=sys.stderr)
    run(args)


if __name__ == "__main__":
    main()
