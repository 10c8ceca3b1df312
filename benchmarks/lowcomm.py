"""Low-communication training on slow links: time to accuracy of DDP, fddp every step and DiLoCo.

    python benchmarks/lowcomm.py --hosts 4 --rate 100mbit
    python benchmarks/lowcomm.py --task vision --hosts 2 --rate 100mbit --modes ddp diloco_H20 --tag _run1
    python benchmarks/lowcomm.py local --task lm --nproc 2 --modes ddp diloco_H20 local_H20_w20   # quality only
    python benchmarks/lowcomm.py --task text --hosts 4 --rate 100mbit --diloco-steps 450 \
        --modes ddp diloco_H20 diloco_H20_lr0.7_m0.9 diloco_H20_fedexp diloco_H20_eager_e3m0 --tag _r3_run1
    python benchmarks/lowcomm.py --task lm --hosts 2 --rate 10mbit --target-loss 3.3462 --diloco-steps 450 \
        --modes diloco_H20 stream_H20 diloco_H20_eager stream_H20_e3m0 diloco_H20_eager_e3m0 --tag _r3_run1
    python benchmarks/lowcomm.py report          # medians of the _run<k> repeats, held-out and tuned tasks apart
    python benchmarks/lowcomm.py memory          # outer state per rank, 2 and 4 ranks, no test bed

The tasks (``--task``) are in ``benchmarks/lowcomm_tasks.py``: DiLoCo's defaults were chosen on
``lowcomm_tasks.TUNED`` (``lm``, ``noniid``) with ``local`` runs, then run unchanged on
``lowcomm_tasks.HELD_OUT`` (``vision``, ``regression``, and from round three ``text``, ``shift``);
``report`` keeps the two apart. Without a ``ddp`` mode (10 Mbit/s, where DDP's 300 steps would
take most of an hour) ``--target-loss`` gives DDP's final eval loss from another run: the same
seeds and arithmetic give the same loss at any rate. What follows describes the default task,
``teacher``.

Makes a test bed (tools/cluster.py: network namespaces on a bridge, each host's link capped at
``--rate`` both ways; needs root), measures the link, and runs every mode, one after the other, in
one torchrun job with one rank per host. Writes ``benchmarks/results/lowcomm_<hosts>x1_<rate>.json``
and ``.png`` (eval loss against wall time), and prints the table.

The task: a student MLP (4 hidden layers of 512, GELU: 0.82M values, 3.3 MB in float32) learns a
fixed random teacher's labels on 64-dimensional Gaussian inputs; fresh samples every step (no
epochs, no overfitting), eval loss on 4096 held-out samples. Chosen because communication
dominates at these rates with a step that costs milliseconds on a shared CPU core: each sample
costs ~6 FLOPs per parameter, and DDP sends all 3.3 MB every step. (The LM example's
transformer spends ~20x more compute per byte of gradients, so 4 processes on 2 cores would be
compute-bound, not link-bound, before the link mattered.)

Modes (AdamW inside every one, one learning-rate schedule: warmup, cosine to 0.1x by DDP's last step,
then flat; lowcomm_tasks.BATCH samples per rank per step):
    floor           no communication at all: each rank trains alone (the compute floor)
    ddp             torch DDP (gloo) + torch.optim.AdamW: the reference
    fddp            fddp.ddp_step every step (plain, bf16, powersgd)
    diloco_H<h>     fddp.diloco.diloco(every=h), the library's defaults; _lr<x>_m<y> for outer Nesterov SGD at
                    learning rate x and momentum y (m0: plain SGD), _w<n> for warmup=n, _eager for eager=True
                    (the outer step that never waits), _fedexp for extrapolate=True (FedExP's gain)
    local_H<h>      fddp.diloco.local_sgd(every=h)
    stream_H<h>     the same, streaming: fragments, delay, mixing (--fragments, --delay, --mixing)
    ..._int8        pseudo-gradients sent as int8 with error feedback (fddp.Int8); _e3m0, _int4, _int2: 4 and
                    2 bits (fddp.diloco.Quantize), _topk<f>: the top fraction f (fddp.diloco.TopK), each with
                    error feedback
    paired_...      the same for --paired-steps, each step preceded by a floor step on a copy of its own:
                    the inner step between syncs against the no-communication floor, under the same load

DDP's final eval loss after ``--steps`` steps is the target. Every DiLoCo mode runs
``--diloco-steps`` (more: its steps are cheap) and reports its eval loss at DDP's sample count and
the wall time at which it first evaluated at or below the target. The clock stops while a mode
evaluates. Bytes are the payload each rank hands to collectives, per inner step.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import lowcomm_tasks  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"

# DDP's best peak learning rate per task (AdamW, of 1e-3, 2e-3, 3e-3 and 5e-3, by DDP's final eval loss; text:
# 2.4366, 2.3756, 2.3634, 2.3687, results/lowcomm_local_text_2_lr*.json). shift takes regression's (the same model and
# teacher), not swept.
LR = {"teacher": 3e-3, "lm": 3e-3, "noniid": 3e-3, "vision": 2e-3, "regression": 1e-3, "text": 3e-3, "shift": 1e-3}


def _outer(mode: str, args: argparse.Namespace) -> Any:
    """The outer step a DiLoCo mode names: ``diloco_H<h>`` takes the library's defaults; ``_lr<x>``,
    ``_m<x>`` (outer Nesterov SGD's learning rate and momentum) and ``_w<n>`` (warmup steps) override
    them; ``stream`` adds --fragments, --delay, --mixing; ``_int8`` sends int8."""
    import fddp

    tokens = mode.split("_")
    h = int(next(t for t in tokens if t.startswith("H"))[1:])
    lr = next((float(t[2:]) for t in tokens if t.startswith("lr")), None)
    m = next((float(t[1:]) for t in tokens if t.startswith("m") and t[1:2].isdigit()), None)
    w = next((int(t[1:]) for t in tokens if t.startswith("w") and t[1:].isdigit()), None)
    kw: dict[str, Any] = {}
    if lr is not None or m is not None:
        lr, m = (0.7 if lr is None else lr), (0.9 if m is None else m)
        kw["optimizer"] = fddp.optim.sgd(lr, momentum=m, nesterov=m > 0)
    if w is not None:
        kw["warmup"] = w
    if "int8" in tokens:
        kw["compression"] = fddp.Int8()
    for name in ("e3m0", "int4", "int2"):
        if name in tokens:
            kw["compression"] = name
    k = next((float(t[4:]) for t in tokens if t.startswith("topk")), None)
    if k is not None:
        kw["compression"] = fddp.diloco.TopK(k)
    if "eager" in tokens:
        kw["eager"] = True
    if "fedexp" in tokens:
        kw["extrapolate"] = True
    if "stream" in tokens or "stream" in mode:
        kw.update(fragments=args.fragments, delay=args.delay, mixing=args.mixing)
    if "local" in tokens:
        return fddp.diloco.local_sgd(h, **{k: v for k, v in kw.items() if k in ("compression", "warmup")})
    return fddp.diloco.diloco(h, **kw)


def _wire_bytes() -> int | None:
    """Bytes this host's test-bed interface has sent (``tools/cluster.py``'s eth0), or None elsewhere."""
    path = Path("/sys/class/net/eth0/statistics/tx_bytes")
    return int(path.read_text()) if os.environ.get("FDDP_HOST") and path.exists() else None


def worker(args: argparse.Namespace) -> None:
    """One rank (under torchrun): every mode of ``--modes`` in turn; rank 0 writes ``--out``."""
    import torch
    import torch.distributed as dist

    import fddp

    torch.set_num_threads(1)
    fddp.init()
    rank, world = fddp.rank(), fddp.world_size()
    task = lowcomm_tasks.make(args.task, rank, world, args.batch, args.seed)
    batch, (x_eval, y_eval) = task.batch, task.eval_set
    results: dict[str, Any] = {}

    for mode in args.modes:
        model = task.model()
        apply_fn, params = fddp.functionalize(copy.deepcopy(model))
        params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()})
        gen = torch.Generator().manual_seed(10_000 * (rank + 1) + args.seed)
        loss_fn = lambda p, x, y: task.loss(apply_fn(p, x), y)  # noqa: E731
        steps = args.diloco_steps if mode.startswith(("diloco", "stream", "floor", "local")) else args.steps
        steps = args.paired_steps if mode.startswith("paired") else steps
        record: dict[str, Any] = {"step": [], "samples": [], "time_s": [], "eval_loss": []}
        step_s: list[float] = []  # per inner step, between syncs
        sync_s: list[float] = []
        waits: list[float] = []
        outer_s: list[float] = []  # outer.step alone, between syncs
        floor_s: list[float] = []  # paired modes: the floor's step, interleaved with this mode's
        flying_s: list[float] = []  # between syncs, with a fragment's all-reduce in flight
        idle_s: list[float] = []  # between syncs, with nothing in flight
        pair_ratios: list[float] = []  # paired modes: this mode's step over the floor's, step by step
        sent = 0
        syncs_in = [0, 0, 0]  # eager modes: syncs landed, their bytes, syncs launched
        charged = [0.0]  # --eval-settled: waits for a round in flight at an evaluation, charged to the clock

        @torch.no_grad()
        def evaluate(p: Any) -> float:
            return float(task.loss(apply_fn(p, x_eval), y_eval))

        if mode == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))
            opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
            bucket_bytes = sum(p.numel() * p.element_size() for p in net.parameters())

            def step(t: int) -> None:
                nonlocal sent
                for group in opt.param_groups:
                    group["lr"] = float(lowcomm_tasks.lr_schedule(t, args.lr, args.warmup, args.steps, args.final_lr))
                x, y = batch(gen)
                opt.zero_grad(set_to_none=True)
                task.loss(net(x), y).backward()
                opt.step()
                sent += bucket_bytes

            def global_params() -> Any:
                return {k: v.detach() for k, v in net.module.named_parameters()}
        else:
            box: dict[str, Any] = {"p": params}
            peak, warm, total, final = args.lr, args.warmup, args.steps, args.final_lr
            inner = fddp.optim.adamw(lambda count: lowcomm_tasks.lr_schedule(count, peak, warm, total, final), weight_decay=0.0)
            box["s"] = inner.init(params)
            grad = torch.func.grad(loss_fn)
            if mode.startswith("fddp"):
                powersgd = fddp.PowerSGD(rank=args.powersgd_rank, start_iter=10)
                compression = {"fddp": None, "fddp_bf16": "bf16", "fddp_powersgd": powersgd}[mode]
                box["c"] = compression.init(params) if isinstance(compression, fddp.PowerSGD) else None
                # The all-reduce of each bucket starts inside backward, as DDP's does.
                synced = fddp.grad_and_value(loss_fn, compression=compression, return_info=True)

                def step(t: int) -> None:
                    nonlocal sent
                    x, y = batch(gen)
                    g, _, info = synced(box["p"], x, y, compression_state=box["c"])
                    box["c"] = info.compression_state
                    sent += info.bytes_sent
                    box["p"], box["s"] = fddp.optim.apply_gradients(inner, g, box["s"], box["p"])

                def global_params() -> Any:
                    return box["p"]
            else:
                outer = None
                if mode.startswith(("diloco", "stream", "paired", "local")):
                    outer = _outer(mode, args)
                    box["o"] = outer.init(params)
                if mode.startswith("paired"):
                    box["fp"], box["fs"] = params, inner.init(params)

                def floor_step() -> float:
                    """The floor's step on its own copy, next to this mode's: the same load."""
                    x, y = batch(gen)
                    t0 = time.perf_counter()
                    box["fp"], box["fs"] = fddp.optim.apply_gradients(inner, grad(box["fp"], x, y), box["fs"], box["fp"])
                    return time.perf_counter() - t0

                def step(t: int) -> None:
                    nonlocal sent
                    paired = "fp" in box
                    # Which of the two goes first alternates, so that neither always finds the caches warm.
                    floor = floor_step() if paired and t % 2 == 0 else None
                    x, y = batch(gen)
                    flying = outer is not None and any(f.pending is not None for f in box["o"].flights)
                    t0 = time.perf_counter()
                    box["p"], box["s"] = fddp.optim.apply_gradients(inner, grad(box["p"], x, y), box["s"], box["p"])
                    if outer is None:
                        step_s.append(time.perf_counter() - t0)
                        return
                    t1 = time.perf_counter()
                    box["p"], box["o"], info = outer.step(box["p"], box["o"], return_info=True)
                    t2 = time.perf_counter()
                    if outer.eager:
                        # A sync's bytes are known when it lands, a round after its launch: counted
                        # at the launch, as the bytes of the syncs landed so far, per sync.
                        syncs_in[0] += len(info.syncs)
                        syncs_in[1] += info.bytes_sent
                        syncs_in[2] += len(info.launched)
                        sent = syncs_in[1] / max(1, syncs_in[0]) * syncs_in[2]
                    else:
                        sent += info.bytes_sent
                    if paired and floor is None:
                        floor = floor_step()
                    if info.launched or info.merged:
                        sync_s.append(t2 - t0)
                        if info.syncs and (outer.delay or outer.eager):
                            waits.append(info.wait_s)
                        return
                    step_s.append(t2 - t0)
                    outer_s.append(t2 - t1)
                    (flying_s if flying else idle_s).append(t2 - t0)
                    if paired:
                        floor_s.append(floor)
                        pair_ratios.append((t2 - t0) / floor)

                def global_params() -> Any:
                    if outer is None:
                        return box["p"]
                    if args.eval_settled and outer.eager:
                        # The snapshot with the round in flight landed (every sample so far counted);
                        # the wait for it is charged to the clock, though the next inner steps would
                        # have hidden some of it (conservative). The state kept is not settled.
                        t0 = time.perf_counter()
                        settled = outer.settle(box["o"])
                        charged[0] += time.perf_counter() - t0
                        return settled.snapshot
                    return box["o"].snapshot

        dist.barrier()
        wire_before, wire_at_n = _wire_bytes(), None
        clock, sent_at_n = 0.0, None
        for t in range(steps):
            t0 = time.perf_counter()
            step(t)
            clock += time.perf_counter() - t0
            if t + 1 == args.steps:
                sent_at_n = sent
                wire_at_n = _wire_bytes()
            if (t + 1) % args.eval_every == 0 or t + 1 == steps:
                record["step"].append(t + 1)
                record["samples"].append((t + 1) * args.batch * world)
                record["time_s"].append(clock)
                record["eval_loss"].append(evaluate(global_params()))
                if charged[0]:
                    clock += charged[0]
                    charged[0] = 0.0
                    record["time_s"][-1] = clock
        dist.barrier()
        wire_at_n = wire_at_n if wire_at_n is not None else _wire_bytes()
        wire = None if wire_before is None or wire_at_n is None else (wire_at_n - wire_before) / min(steps, args.steps)
        wires: list[Any] = [None] * world
        dist.all_gather_object(wires, wire)
        record.update(
            # What each host's interface sent per inner step over DDP's steps (TCP/IP headers and
            # all), the mean over the hosts: the test bed's wire, not the payload.
            wire_bytes_per_step=None if None in wires else statistics.mean(wires),
            # Bytes per inner step over DDP's steps, a whole number of rounds of every H here.
            steps=steps, bytes_per_step=(sent if sent_at_n is None else sent_at_n) / min(steps, args.steps), total_s=clock,
            floor_paired_ms_median=1e3 * statistics.median(floor_s) if floor_s else None,
            paired_ratio_median=statistics.median(pair_ratios) if pair_ratios else None,
            step_ms_median=1e3 * statistics.median(step_s) if step_s else None,
            sync_ms_median=1e3 * statistics.median(sync_s) if sync_s else None,
            waits_ms=[1e3 * w for w in waits],
            outer_step_us_median=1e6 * statistics.median(outer_s) if outer_s else None,
            step_ms_in_flight=1e3 * statistics.median(flying_s) if flying_s else None,
            step_ms_idle=1e3 * statistics.median(idle_s) if idle_s else None,
            values=sum(p.numel() for p in params.values()),
        )  # fmt: skip
        results[mode] = record
        if rank == 0:
            print(f"{mode:<18} {steps:5d} steps {clock:8.1f} s  final eval loss {record['eval_loss'][-1]:.4f}  "
                  f"{record['bytes_per_step'] / 1e3:9.1f} kB/step", flush=True)  # fmt: skip
    if rank == 0:
        Path(args.out).write_text(json.dumps({"results": results, "load_avg_end": os.getloadavg()}, indent=1))
    fddp.shutdown()


# ------------------------------------------------------------------------------- the report


def summarise(res: dict[str, Any], ddp_steps: int, target_loss: float | None = None) -> dict[str, Any]:
    """Per mode: time to DDP's final eval loss, eval loss at DDP's samples, ratios, bytes.

    Without a ``ddp`` mode in ``res`` (the 10 Mbit/s runs, where DDP would take an hour), the target
    is ``target_loss`` (DDP's final eval loss from a run at another rate: the same seeds and
    arithmetic give the same loss) and the ratios to DDP's time and bytes are left out."""
    ddp = res.get("ddp")
    if ddp is None and target_loss is None:
        raise SystemExit("no ddp mode in this run: give --target-loss (DDP's final eval loss from another run)")
    target = ddp["eval_loss"][-1] if ddp is not None else target_loss
    out = {}
    for mode, r in res.items():
        floor = r["floor_paired_ms_median"]
        # A relative 1e-4 of slack: fddp's every-step modes end on DDP's loss up to float rounding.
        reached = (t for t, loss in zip(r["time_s"], r["eval_loss"]) if loss <= target * (1 + 1e-4))
        hit = None if mode.startswith("paired") else next(reached, None)
        steps_hit = next((s for s, loss in zip(r["step"], r["eval_loss"]) if loss <= target * (1 + 1e-4)), None)
        # Paired modes share their batches with the floor beside them: their loss is not comparable.
        at_n = None if mode.startswith("paired") else next((loss for s, loss in zip(r["step"], r["eval_loss"]) if s >= ddp_steps), None)
        out[mode] = {
            "time_to_target_s": hit,
            "ratio_to_ddp": None if hit is None or ddp is None else hit / ddp["total_s"],
            "eval_loss_at_ddp_samples": at_n,
            "loss_vs_ddp": None if at_n is None else at_n / target - 1,
            "samples_to_target": None if steps_hit is None or mode.startswith("paired") else steps_hit / ddp_steps,
            "bytes_per_step": r["bytes_per_step"],
            "bytes_ratio_to_ddp": None if ddp is None else r["bytes_per_step"] / ddp["bytes_per_step"],
            "wire_bytes_per_step": r.get("wire_bytes_per_step"),
            "wire_ratio_to_ddp": None if ddp is None or not r.get("wire_bytes_per_step") or not ddp.get("wire_bytes_per_step")
            else r["wire_bytes_per_step"] / ddp["wire_bytes_per_step"],
            "total_s": r["total_s"],
            "step_ms_median": r["step_ms_median"],
            "step_vs_floor": None if r["paired_ratio_median"] is None else r["paired_ratio_median"] - 1,
            "floor_paired_ms_median": floor,
            "sync_ms_median": r["sync_ms_median"],
            "max_wait_ms": max(r["waits_ms"]) if r["waits_ms"] else None,
            "outer_step_us_median": r["outer_step_us_median"],
            "step_ms_in_flight": r["step_ms_in_flight"],
            "step_ms_idle": r["step_ms_idle"],
        }
    return {"target_eval_loss": target, "ddp_total_s": None if ddp is None else ddp["total_s"], "modes": out}


def table(record: dict[str, Any]) -> str:
    c, s = record["cluster"], record["summary"]
    lines = [
        f"task {record.get('task', 'teacher')} ({record.get('protocol', 'teacher')}); "
        f"{c['hosts']} hosts x 1 rank, links {c['rate']} each way (TCP measured {c['tcp_bps'] / 1e6:.0f} Mbit/s); "
        f"{record['values'] / 1e6:.2f}M values ({4 * record['values'] / 2**20:.2f} MiB); target = DDP's final eval loss "
        f"{s['target_eval_loss']:.4f} after {record['args']['steps']} steps "
        f"({'from --target-loss' if s['ddp_total_s'] is None else format(s['ddp_total_s'], '.1f') + ' s'}); "
        f"load average before {', '.join(f'{x:.2f}' for x in record['load_avg']['before'])}, after "
        f"{', '.join(f'{x:.2f}' for x in record['load_avg']['after'])} on {record['load_avg']['cpus']} CPUs "
        f"({c['hosts']} ranks share them)",
        "",
        f"  {'mode':<20}{'steps':>6}{'time s':>9}{'to target s':>12}{'x DDP':>7}{'loss @N':>9}{'vs DDP':>8}"
        f"{'kB/step':>10}{'x bytes':>9}{'x wire':>9}{'step ms':>9}{'vs floor':>9}{'outer us':>9}{'sync ms':>9}{'max wait':>9}",
    ]
    def fmt(v: Any, f: str, scale: float = 1.0, unit: str = "") -> str:
        return "" if v is None else format(scale * v, f) + unit

    for mode, m in s["modes"].items():
        r = record["results"][mode]
        cells = [
            f"{r['steps']:6d}", f"{r['total_s']:9.1f}", f"{fmt(m['time_to_target_s'], '.1f'):>12}",
            f"{fmt(m['ratio_to_ddp'], '.3f'):>7}", f"{fmt(m['eval_loss_at_ddp_samples'], '.4f'):>9}",
            f"{fmt(m['loss_vs_ddp'], '+.1f', 100, '%'):>8}", f"{m['bytes_per_step'] / 1e3:10.1f}",
            f"{fmt(m['bytes_ratio_to_ddp'], '.4f'):>9}", f"{fmt(m.get('wire_ratio_to_ddp'), '.4f'):>9}",
            f"{fmt(m['step_ms_median'], '.2f'):>9}",
            f"{fmt(m['step_vs_floor'], '+.1f', 100, '%'):>9}", f"{fmt(m['outer_step_us_median'], '.0f'):>9}",
            f"{fmt(m['sync_ms_median'], '.1f'):>9}", f"{fmt(m['max_wait_ms'], '.1f'):>9}",
        ]  # fmt: skip
        lines.append(f"  {mode:<20}" + "".join(cells))
    lines.append(
        "\nto target = wall time (eval excluded) until the eval loss first reaches DDP's final one; loss @N = eval "
        "loss after DDP's number of samples; kB/step = bytes sent per rank per inner step over DDP's steps (the payload "
        "handed to collectives); x wire = what each host's interface sent (TCP/IP included) over DDP's; step ms = "
        "median inner step between syncs (vs floor, paired modes: the median over steps of its time over the "
        "no-communication step interleaved with it); outer us = median outer.step call between syncs; max wait = the "
        "longest a streaming or eager merge waited for its fragment"
    )
    return "\n".join(lines)


def plot(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, r in record["results"].items():
        if mode.startswith(("floor", "paired")):  # no communication; the floor's steps in the clock
            continue
        ax.plot(r["time_s"], r["eval_loss"], label=mode, lw=2 if mode == "ddp" else 1.2, color="black" if mode == "ddp" else None)
    ax.axhline(record["summary"]["target_eval_loss"], color="gray", ls=":", lw=1, label="DDP's final eval loss")
    c = record["cluster"]
    ax.set(xscale="log", yscale="log", xlabel="wall time, s (log)", ylabel="eval loss (log)",
           title=f"{c['hosts']} hosts, {c['rate']} links: eval loss against wall time")  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_cluster(args: argparse.Namespace) -> dict[str, Any]:
    from tools.cluster import Cluster, format_rate, measure_tcp, parse_rate, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make a test bed here: {reason}")
    rate_bps = parse_rate(args.rate)
    task = "" if args.task == "teacher" else f"{args.task}_"
    name = f"lowcomm_{task}{args.hosts}x1_{format_rate(rate_bps)}{args.tag}"
    out_json = Path(args.out_dir) / f"{name}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    raw = out_json.with_suffix(".raw.tmp")
    load_before = os.getloadavg()
    with Cluster(args.hosts, rate=args.rate) as c:
        print(c.describe(), flush=True)
        tcps = [measure_tcp(c, 0, 1, nbytes=8 << 20), measure_tcp(c, 1, 0, nbytes=8 << 20)]
        print(f"TCP node0 <-> node1: {', '.join(f'{t / 1e6:.0f}' for t in tcps)} Mbit/s", flush=True)
        argv = [str(ROOT / "benchmarks" / "lowcomm.py"), "worker", "--out", str(raw), *_worker_args(args)]
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        results = c.run_all([c.torchrun(h, argv) for h in c.hosts], timeout=args.timeout,
                            envs=[{**c.env(h), **env} for h in c.hosts])  # fmt: skip
        for r in results:
            if r.returncode != 0:
                raise SystemExit(f"the worker on {r.host.name} exited {r.returncode}:\n{r.output}")
        print(results[0].output.strip(), flush=True)
    res = json.loads(raw.read_text())
    raw.unlink()
    import torch

    record = {
        "command": " ".join(["python", "benchmarks/lowcomm.py", *sys.argv[1:]]),
        "args": vars(args),
        "torch": torch.__version__,
        "task": args.task,
        "protocol": "held out" if args.task in lowcomm_tasks.HELD_OUT else "tuned" if args.task in lowcomm_tasks.TUNED else "teacher",
        "cluster": {"hosts": args.hosts, "rate": format_rate(rate_bps), "rate_bps": rate_bps, "tcp_bps": max(tcps), "tcp_bps_all": tcps},
        "load_avg": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
        "values": next(iter(res["results"].values()))["values"],
        "results": res["results"],
        "summary": summarise(res["results"], args.steps, args.target_loss),
    }
    out_json.write_text(json.dumps(record, indent=1))
    plot(record, out_json.with_suffix(".png"))
    print()
    print(table(record))
    print(f"\nwrote {out_json} and {out_json.with_suffix('.png')}")
    return record


def _worker_args(args: argparse.Namespace) -> list[str]:
    keys = ["task", "steps", "diloco_steps", "paired_steps", "batch", "lr", "warmup", "final_lr", "eval_every", "seed",
            "fragments", "delay", "mixing", "powersgd_rank"]  # fmt: skip
    out = ["--modes", *args.modes, *(["--eval-settled"] if args.eval_settled else [])]
    for k in keys:
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return out


def run_local(args: argparse.Namespace) -> dict[str, Any]:
    """Quality only: every mode on ``--nproc`` local processes (no test bed, no rate limit).

    The losses and sample counts are those the test bed gives (the same seeds and arithmetic); the
    times are not (the link is the loopback). What the defaults were tuned with, on TUNED tasks.
    """
    out = Path(args.out or Path(args.out_dir) / f"lowcomm_local_{args.task}_{args.nproc}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           str(ROOT / "benchmarks" / "lowcomm.py"), "worker", "--out", str(out), *_worker_args(args)]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=args.timeout)
    res = json.loads(out.read_text())["results"]
    summary = summarise(res, args.steps, args.target_loss)
    print(f"task {args.task}, {args.nproc} local processes, target = DDP's final eval loss {summary['target_eval_loss']:.4f}")
    for mode, m in summary["modes"].items():
        at = m["eval_loss_at_ddp_samples"]
        print(f"  {mode:<28} loss @N {'' if at is None else format(at, '.4f'):>8} "
              f"({'' if m['loss_vs_ddp'] is None else format(100 * m['loss_vs_ddp'], '+.1f')}%)  "
              f"samples to target {'' if m['samples_to_target'] is None else format(m['samples_to_target'], '.2f')}x")  # fmt: skip
    return summary


def run_report(args: argparse.Namespace) -> None:
    """Medians over the repeats (``--tag _run<k>``) of each task's test-bed runs, held-out and tuned apart.

    Prints one line per task, hosts, rate and mode, and writes them to
    ``benchmarks/results/lowcomm_report.json``: time to DDP's final eval loss over DDP's time, the
    eval loss at DDP's samples over DDP's, the payload bytes and the interface's bytes over DDP's.
    """
    rows = []
    med = lambda xs: statistics.median([math.inf if x is None else x for x in xs]) if xs else None  # noqa: E731
    for protocol, tasks in (("held out", lowcomm_tasks.HELD_OUT), ("tuned", lowcomm_tasks.TUNED)):
        for task in tasks:
            for path_glob in sorted({p.name.rsplit("_run", 1)[0] for p in Path(args.out_dir).glob(f"lowcomm_{task}_*_run*.json")}):
                runs = [json.loads(p.read_text()) for p in sorted(Path(args.out_dir).glob(f"{path_glob}_run*.json"))]
                c = runs[0]["cluster"]
                loads = ", ".join(f"{r['load_avg']['before'][0]:.1f}-{r['load_avg']['after'][0]:.1f}" for r in runs)
                print(f"{protocol}: {task}, {c['hosts']} hosts x 1 rank (sharing {runs[0]['load_avg']['cpus']} cores), "
                      f"{c['rate']}, {len(runs)} runs, load average {loads}")  # fmt: skip
                modes = list(dict.fromkeys(m for r in runs for m in r["summary"]["modes"]))
                for mode in modes:
                    ms = [r["summary"]["modes"][mode] for r in runs if mode in r["summary"]["modes"]]
                    ratio = [m["ratio_to_ddp"] for m in ms]
                    loss = [m["loss_vs_ddp"] for m in ms]
                    hit = [m["time_to_target_s"] for m in ms]
                    row = {
                        "protocol": protocol, "task": task, "hosts": c["hosts"], "rate": c["rate"], "mode": mode, "runs": len(ms),
                        "files": f"{path_glob}_run*.json",
                        "time_ratio_median": med(ratio), "time_ratio_each": ratio,
                        "time_to_target_s_median": med(hit), "total_s_median": med([m.get("total_s") for m in ms]),
                        "loss_ratio_median": None if None in loss else 1 + statistics.median(loss), "loss_vs_ddp_each": loss,
                        "bytes_ratio": med([m["bytes_ratio_to_ddp"] for m in ms if m["bytes_ratio_to_ddp"] is not None]),
                        "wire_ratio_median": med([m.get("wire_ratio_to_ddp") for m in ms if m.get("wire_ratio_to_ddp") is not None]),
                        "load_avg": loads,
                    }  # fmt: skip
                    rows.append(row)
                    fx = lambda x, f: "-" if x is None else "not reached" if x == math.inf else format(x, f)  # noqa: E731
                    each = ", ".join(fx(x, ".3f") for x in ratio)
                    each_loss = ", ".join("-" if x is None else f"{100 * x:+.1f}%" for x in loss)
                    print(f"  {mode:<28} time to DDP's loss / DDP's: {fx(row['time_ratio_median'], '.3f')} ({each}); "
                          f"loss @N / DDP's: {fx(row['loss_ratio_median'], '.3f')} ({each_loss}); "
                          f"bytes / DDP's: {fx(row['bytes_ratio'], '.5f')}, wire {fx(row['wire_ratio_median'], '.5f')}")  # fmt: skip
    path = Path(args.out_dir) / "lowcomm_report.json"
    path.write_text(json.dumps({"command": "python benchmarks/lowcomm.py report", "rows": rows}, indent=1, default=str))
    print(f"wrote {path}")


# ------------------------------------------------------------------------------- memory


def memory_worker(args: argparse.Namespace) -> None:
    """One rank: the outer state's bytes, replicated and sharded, counted as benchmarks/zero.py counts."""
    import torch
    from zero import nbytes

    import fddp

    torch.set_num_threads(1)
    fddp.init()
    _, params = fddp.functionalize(lowcomm_tasks.make("teacher", fddp.rank(), fddp.world_size(), 1, 0).model())
    params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()})
    p_bytes = nbytes(params)
    rows = {}
    for opt_name, opt in (("nesterov", fddp.optim.sgd(0.7, momentum=0.9, nesterov=True)), ("adamw", fddp.optim.adamw(1e-3))):
        for shard in (False, True):
            outer = fddp.diloco.diloco(2, opt, shard=shard)
            state = outer.init(params)
            p = {k: v + 0.01 for k, v in params.items()}
            for _ in range(4):  # two syncs: the state as training leaves it
                p, state = outer.step(p, state)
            rows[f"{opt_name}{'_sharded' if shard else ''}"] = {
                "snapshot": nbytes(state.snapshot), "outer_state": nbytes(state.outer_state),
                "compression_state": nbytes(state.compression_state), "extra": nbytes(state),
            }  # fmt: skip
    if fddp.rank() == 0:
        Path(args.out).write_text(json.dumps({"world": fddp.world_size(), "param_bytes": p_bytes, "rows": rows}))
    fddp.shutdown()


def run_memory(args: argparse.Namespace) -> None:
    out = {}
    for world in (2, 4):
        tmp = Path(args.out_dir) / f"lowcomm_memory_{world}.tmp"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(ROOT / "benchmarks" / "lowcomm.py"), "memory-worker", "--out", str(tmp)]  # fmt: skip
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT / "benchmarks")
        out[world] = json.loads(tmp.read_text())
        tmp.unlink()
    lines = ["outer state per rank (unique storages, as benchmarks/zero.py counts), P = the parameters' bytes"]
    lines.append(f"  {'world':>5} {'outer optimizer':<18}{'snapshot':>10}{'opt state':>11}{'extra':>10}{'extra / P':>11}{'limit':>12}")
    for world, r in out.items():
        p = r["param_bytes"]
        for name, m in r["rows"].items():
            moments = 2 if name.startswith("adamw") else 1
            limit = (1 + moments / world) if name.endswith("sharded") else (1 + moments)
            lines.append(f"  {world:>5} {name:<18}{m['snapshot'] / p:10.3f}P{m['outer_state'] / p:10.3f}P"
                         f"{m['extra']:10d}{m['extra'] / p:10.3f}P{limit:10.3f}P")  # fmt: skip
    print("\n".join(lines))
    path = Path(args.out_dir) / "lowcomm_memory.json"
    path.write_text(json.dumps({"command": "python benchmarks/lowcomm.py memory", "worlds": out}, indent=1))
    print(f"wrote {path}")


# ------------------------------------------------------------------------------- command line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", default="cluster", choices=["cluster", "local", "report", "worker", "memory", "memory-worker"])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2, help="local: processes")
    p.add_argument("--rate", default="100mbit")
    modes = ["floor", "ddp", "fddp", "fddp_bf16", "fddp_powersgd", "diloco_H10", "diloco_H30", "diloco_H100", "stream_H30",
             "stream_H30_int8", "paired_H30", "paired_stream_H30_int8"]  # fmt: skip
    p.add_argument("--modes", nargs="+", default=modes)
    p.add_argument("--steps", type=int, default=300, help="steps of DDP and the every-step modes")
    p.add_argument("--diloco-steps", type=int, default=600, help="inner steps of the DiLoCo modes and the floor")
    p.add_argument("--paired-steps", type=int, default=300, help="steps of the paired (floor-interleaved) modes")
    p.add_argument("--batch", type=int, default=None, help="samples per rank per step (default: the task's, lowcomm_tasks.BATCH)")
    p.add_argument("--task", default="teacher", choices=lowcomm_tasks.TASKS, help="what to train (benchmarks/lowcomm_tasks.py)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate of every mode (default: DDP's best for the task, LR)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--final-lr", type=float, default=0.1, help="the cosine's end, times --lr, reached at --steps")
    p.add_argument("--eval-every", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fragments", type=int, default=3, help="streaming: fragments")
    p.add_argument("--delay", type=int, default=5, help="streaming: inner steps each fragment overlaps")
    p.add_argument("--mixing", type=float, default=0.5, help="streaming: weight of the local values at a merge")
    p.add_argument("--powersgd-rank", type=int, default=4)
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--out", default=None)
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--tag", default="", help="appended to the result's file name (repeats: _run2)")
    p.add_argument("--eval-settled", action="store_true",
                   help="eager modes: evaluate the snapshot with the round in flight landed (its wait charged to the clock)")
    p.add_argument("--target-loss", type=float, default=None,
                   help="without a ddp mode: DDP's final eval loss from another run of the task (the same at any rate)")
    args = p.parse_args()
    if args.lr is None:
        args.lr = LR[args.task]
    if args.batch is None:
        args.batch = lowcomm_tasks.BATCH[args.task]
    run = {"cluster": run_cluster, "local": run_local, "report": run_report, "worker": worker, "memory": run_memory,
           "memory-worker": memory_worker}  # fmt: skip
    run[args.what](args)


if __name__ == "__main__":
    main()
