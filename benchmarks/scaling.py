"""The scaling model, validated on the test bed and projected to 256 ranks: the data of docs/scaling.md.

    python benchmarks/scaling.py validate --hosts 2,4 --rates 1gbit,10gbit   # needs root
    python benchmarks/scaling.py project                                     # from the validation
    python benchmarks/scaling.py                                             # both

``validate`` makes each test bed (tools/cluster.py: one host per rank, links capped at the rate),
and runs this script's worker there under one torchrun agent per host. Per model the worker runs
``benchmarks/step.py``'s ``floor_gav``, ``grad_and_value`` and ``grad_and_value_auto`` modes
(interleaved, medians of ``--repeats``), and predicts the two overlapped modes with
``fddp.scaling.predict_step`` from what fddp measured itself in the same run: the link
(``measure_link``: gloo all-reduces of 4 KiB to 8 MiB, an alpha-beta fit) and the backward
timeline (``measure_timeline``: when each gradient was ready, every rank computing at once over a
group of its own, the slowest rank's), plus the work after the backward pass (the optimizer: the
floor's step minus the timeline's end). Writes ``benchmarks/results/scaling_validation.json``.

``project`` predicts the overlapped step for N = 2 ... 256 ranks at 10, 25 and 100 Gbit/s with
the same model, for the benchmark models (their timelines from the 2-host validation: this CPU's
compute, one thread per rank) and for ResNet-50 (25.6M float32 values: its timeline measured here
on small images, stretched to an assumed GPU step, ``--resnet-ms``), choosing the bucket cap at
every point as ``fddp.scaling.choose_bucket_cap`` does. Writes ``benchmarks/results/scaling.json``
and ``scaling.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VALIDATION = Path(os.environ.get("FDDP_SCALING_VALIDATION", RESULTS / "scaling_validation.json"))
PROJECTION = RESULTS / "scaling.json"
WORLDS = (2, 4, 8, 16, 32, 64, 128, 256)
RATES_GBIT = (10, 25, 100)
PROJECTION_LATENCY_US = 25.0  # per message step: TCP/IP over 10-100 GbE is tens of microseconds
VALIDATED_MODES = ("grad_and_value", "grad_and_value_auto")


# ------------------------------------------------------------------------------------------- models


def resnet50():
    """ResNet-50 (He et al., 2016; torchvision's layout): 25,557,032 values in 161 tensors."""
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, width: int, stride: int) -> None:
            super().__init__()
            cout = 4 * width
            self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
            self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
            self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = torch.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return torch.relu(out + (x if self.down is None else self.down(x)))

    class ResNet50(nn.Module):
        def __init__(self, classes: int = 1000) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], 64
            for width, n, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
                for i in range(n):
                    blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                    cin = 4 * width
            self.blocks = nn.Sequential(*blocks)
            self.fc = nn.Linear(2048, classes)

        def forward(self, x):
            return self.fc(self.blocks(self.stem(x)).mean((2, 3)))

    return ResNet50()


# ------------------------------------------------------------------------------------------- worker


def worker(args: argparse.Namespace) -> None:
    """Under torchrun on the test bed: measure the steps, the link and the timelines; predict."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step as bench

    import fddp
    from fddp.scaling import Link, predict_step
    from fddp.sync import Timeline

    torch.set_num_threads(1)
    fddp.init()
    world = dist.get_world_size()
    out: dict = {"world_size": world, "torch": torch.__version__, "models": {}}
    for name in args.models:
        r = bench.bench_model(name, args.repeats, args.steps, args.warmup, only=list(VALIDATED_MODES))
        auto = r["auto"]
        link = Link(auto["link"]["latency_s"], auto["link"]["bandwidth_Bps"])
        t = auto["timelines"]["none"]
        timeline = Timeline(t["backward"], tuple(t["ready"]), (), (), (), t["end"])
        params = fddp.functionalize(bench.model_and_batch(name)[0])[1]
        floor = r["modes"]["floor_gav"]["median_ms"] / 1e3
        after = max(0.0, floor - timeline.end)  # the optimizer and the call's own set-up
        caps = {"grad_and_value": {}, "grad_and_value_auto": auto["caps"]["none"]}
        per_bucket = auto["choices"]["none"]["per_bucket_s"]
        rows = {}
        for mode, cap in caps.items():
            p = predict_step(params, timeline, link, world, after=after, per_bucket=per_bucket, **cap)
            measured = r["modes"][mode]["median_ms"] / 1e3
            rows[mode] = {
                "bucket_cap_mb": cap.get("bucket_cap_mb", 25.0),
                "first_bucket_mb": cap.get("first_bucket_mb", 1.0),
                "buckets": len(p.buckets),
                "predicted_s": p.step,
                "measured_s": measured,
                "measured_all_s": [x / 1e3 for x in r["modes"][mode]["all_ms"]],
                "error": p.step / measured - 1,
                "predicted_exposed_s": p.exposed,
            }
        out["models"][name] = {
            "values": r["values"],
            "tensors": r["tensors"],
            "link": auto["link"],
            "timeline": t,
            "after_s": after,
            "per_bucket_s": per_bucket,
            "floor_gav_s": floor,
            "ddp_s": r["modes"]["ddp"]["median_ms"] / 1e3,
            "choice": auto["choices"]["none"]["explain"],
            "modes": rows,
        }
        if fddp.is_main():
            for mode, row in rows.items():
                print(f"{name:<12} {mode:<20} cap {row['bucket_cap_mb']:5g} MiB  predicted {1e3 * row['predicted_s']:7.1f} ms  "
                      f"measured {1e3 * row['measured_s']:7.1f} ms  error {100 * row['error']:+6.1f}%", flush=True)  # fmt: skip
    if fddp.is_main():
        Path(args.out).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------- driver


def validate(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    from tools.cluster import Cluster, format_rate, measure_tcp, parse_rate, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make a test bed here: {reason}")
    runs = []
    for rate in args.rates:
        for n in args.hosts:
            with Cluster(n, rate=rate) as c:
                print(f"\n{c.describe()}", flush=True)
                tcp = max(measure_tcp(c, 0, 1), measure_tcp(c, 1, 0))
                print(f"TCP between node0 and node1: {tcp / 1e9:.3f} Gbit/s", flush=True)
                tmp = Path("/tmp") / f"{c.run_id}-scaling.json"
                worker_args = [str(Path(__file__).resolve()), "--worker", "--out", str(tmp), "--models", *args.models,
                               "--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup)]  # fmt: skip
                env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
                results = c.run_all(
                    [c.torchrun(h, worker_args) for h in c.hosts], timeout=args.timeout, envs=[{**c.env(h), **env} for h in c.hosts]
                )
                for r in results:
                    if r.returncode != 0:
                        raise SystemExit(f"{r.host.name} exited {r.returncode}:\n{r.output}")
                print(results[0].output.strip(), flush=True)
                data = json.loads(tmp.read_text())
                tmp.unlink()
                runs.append({"hosts": n, "rate": format_rate(parse_rate(rate)), "rate_bps": parse_rate(rate), "tcp_bps": tcp,
                             "load_avg": os.getloadavg(), **data})  # fmt: skip
    record = {
        "what": "fddp.scaling.predict_step against the measured overlapped step on the test bed (tools/cluster.py)",
        "command": " ".join(["python", "benchmarks/scaling.py", *sys.argv[1:]]),
        "runs": runs,
    }
    VALIDATION.parent.mkdir(parents=True, exist_ok=True)
    VALIDATION.write_text(json.dumps(record, indent=1))
    print(f"\nwrote {VALIDATION}\n")
    print(validation_table(record))
    return record


def validation_table(record: dict) -> str:
    lines = [f"{'hosts':>5} {'link':>7} {'model':<12} {'mode':<20} {'cap MiB':>7} {'predicted ms':>12} {'measured ms':>11} {'error':>7}"]
    for run in record["runs"]:
        for model, m in run["models"].items():
            for mode, row in m["modes"].items():
                lines.append(
                    f"{run['hosts']:>5} {run['rate']:>7} {model:<12} {mode:<20} {row['bucket_cap_mb']:7g} "
                    f"{1e3 * row['predicted_s']:12.1f} {1e3 * row['measured_s']:11.1f} {100 * row['error']:+6.1f}%"
                )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- projection


def resnet_timeline(step_s: float, image: int, batch: int, repeats: int) -> tuple:
    """ResNet-50's parameters and backward timeline, measured here on small images and stretched so
    that the whole step (forward, backward, SGD) takes ``step_s``: ``(params, timeline, after, how)``.

    Every layer's work scales alike with the image's area, so the shape of the timeline (which
    gradient is ready when, as a fraction of the step) carries over to full-size images.
    """
    import time

    import torch
    import torch.nn.functional as F

    import fddp
    import fddp.optim as fopt
    from fddp.scaling import measure_bucket_cost, measure_timeline
    from fddp.sync import Timeline

    torch.set_num_threads(1)
    fddp.init()
    torch.manual_seed(0)
    model = resnet50()
    apply_fn, params, buffers = fddp.functionalize_with_buffers(model)

    def loss(p, x, y):
        logits, _ = apply_fn(p, buffers, x)
        return F.cross_entropy(logits, y)

    x, y = torch.randn(batch, 3, image, image), torch.randint(0, 1000, (batch,))
    t = measure_timeline(loss, params, x, y, repeats=repeats)
    cost = measure_bucket_cost(loss, params, x, y, repeats=repeats)
    opt = fopt.sgd(0.1, momentum=0.9)
    state = opt.init(params)
    grads = fddp.grad(loss)(params, x, y)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fopt.apply_gradients(opt, grads, state, params)
        times.append(time.perf_counter() - t0)
    measured_step = t.end + statistics.median(times)
    k = step_s / measured_step
    scaled = Timeline(t.backward * k, tuple(r * k for r in t.ready), (), (), (), t.end * k)
    how = {"measured_step_s": measured_step, "image": image, "batch": batch, "per_bucket_s": cost}
    return params, scaled, statistics.median(times) * k, how


def project(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step as bench

    import fddp
    from fddp.scaling import Link, choose_bucket_cap, predict_step
    from fddp.sync import Timeline

    validation = json.loads(VALIDATION.read_text())
    base = min((r for r in validation["runs"] if r["hosts"] == 2), key=lambda r: r["rate_bps"])
    cases = {}
    for name, m in base["models"].items():
        t = m["timeline"]
        params = fddp.functionalize(bench.MODELS[name][0]())[1]
        cases[name] = {
            "params": params,
            "timeline": Timeline(t["backward"], tuple(t["ready"]), (), (), (), t["end"]),
            "after": m["after_s"],
            "per_bucket": m["per_bucket_s"],
            "values": m["values"],
            "compute": f"measured on this CPU (1 thread per rank, {base['hosts']} test-bed hosts at {base['rate']})",
        }
    params, timeline, after, how = resnet_timeline(args.resnet_ms / 1e3, args.resnet_image, args.resnet_batch, args.repeats)
    cases["resnet50"] = {
        "params": params,
        "timeline": timeline,
        "after": after,
        "per_bucket": how["per_bucket_s"],  # a CPU cost (launch, copy, collect): not stretched
        "values": sum(p.numel() for p in params.values()),
        "compute": (
            f"{args.resnet_ms:g} ms a step assumed (see docs/scaling.md); the shape of the timeline measured here on "
            f"{how['batch']} images of {how['image']}x{how['image']} ({1e3 * how['measured_step_s']:.0f} ms on this CPU), stretched"
        ),
    }
    out: dict = {
        "command": " ".join(["python", "benchmarks/scaling.py", *sys.argv[1:]]),
        "latency_us": args.latency_us,
        "link_efficiency": args.link_efficiency,
        "worlds": list(WORLDS),
        "rates_gbit": list(RATES_GBIT),
        "resnet_ms": args.resnet_ms,
        "models": {},
    }
    for name, c in cases.items():
        compute = predict_step(c["params"], c["timeline"], Link(1.0, 1.0), 1, after=c["after"]).compute
        rows = []
        for rate in RATES_GBIT:
            for algorithm in ("ring", "tree"):
                link = Link(args.latency_us * 1e-6, rate * 1e9 / 8 * args.link_efficiency, algorithm)
                for world in WORLDS:
                    choice = choose_bucket_cap(c["params"], c["timeline"], link, world, after=c["after"], per_bucket=c["per_bucket"])
                    chosen = choice.predictions[choice.bucket_cap_mb]
                    default = predict_step(c["params"], c["timeline"], link, world, after=c["after"], per_bucket=c["per_bucket"])
                    rows.append({
                        "rate_gbit": rate, "algorithm": algorithm, "world": world, "bucket_cap_mb": choice.bucket_cap_mb,
                        "buckets": len(chosen.buckets), "step_s": chosen.step, "efficiency": chosen.efficiency,
                        "default_step_s": default.step, "default_efficiency": default.efficiency,
                    })  # fmt: skip
        nbytes = 4 * c["values"]
        out["models"][name] = {
            "values": c["values"], "bytes": nbytes, "compute_s": compute, "compute": c["compute"],
            "per_bucket_s": c["per_bucket"], "rows": rows,
        }  # fmt: skip
        print(f"\n{name}: {c['values'] / 1e6:.2f}M values, compute {1e3 * compute:.1f} ms a step ({c['compute']})")
        for rate in RATES_GBIT:
            effs = {a: [r for r in rows if r["rate_gbit"] == rate and r["algorithm"] == a] for a in ("ring", "tree")}
            cells = "  ".join(f"{r['world']}:{r['efficiency']:.2f}/{effs['tree'][i]['efficiency']:.2f}" for i, r in enumerate(effs["ring"]))
            print(f"  {rate:>3} Gbit/s  efficiency ring/tree by N  {cells}")
    PROJECTION.write_text(json.dumps(out, indent=1))
    plot(out, PROJECTION.with_suffix(".png"))
    print(f"\nwrote {PROJECTION} and {PROJECTION.with_suffix('.png')}")
    return out


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["models"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), sharey=True)
    colors = {10: "tab:red", 25: "tab:orange", 100: "tab:green"}
    for ax, name in zip(axes, names):
        m = out["models"][name]
        for rate in out["rates_gbit"]:
            for algorithm, style in (("ring", "-"), ("tree", "--")):
                rows = [r for r in m["rows"] if r["rate_gbit"] == rate and r["algorithm"] == algorithm]
                ax.plot([r["world"] for r in rows], [r["efficiency"] for r in rows], style, marker=".", color=colors[rate],
                        label=f"{rate} Gbit/s, {algorithm}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(out["worlds"], [str(w) for w in out["worlds"]])
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.set_title(f"{name}: {m['values'] / 1e6:.1f}M values, {1e3 * m['compute_s']:.0f} ms compute", fontsize=9)
        ax.set_xlabel("ranks")
    axes[0].set_ylabel("predicted scaling efficiency\n(compute / step)")
    axes[-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"fddp.scaling: overlapped step, bucket cap chosen per point, {out['latency_us']:g} us per message step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", choices=["validate", "project", "all"], default="all")
    p.add_argument("--hosts", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--rates", type=lambda s: s.split(","), default=["1gbit", "10gbit"])
    p.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--latency-us", type=float, default=PROJECTION_LATENCY_US, help="projection: seconds per message step")
    p.add_argument("--link-efficiency", type=float, default=0.96, help="projection: goodput / line rate (TCP on the test bed)")
    p.add_argument("--resnet-ms", type=float, default=100.0, help="projection: ResNet-50's assumed step without communication")
    p.add_argument("--resnet-image", type=int, default=64)
    p.add_argument("--resnet-batch", type=int, default=4)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.what in ("validate", "all"):
        validate(args)
    if args.what in ("project", "all"):
        project(args)


if __name__ == "__main__":
    main()
