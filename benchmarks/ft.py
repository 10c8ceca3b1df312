"""Fault tolerance on torchft (fddp.ft): what a failure costs, what a step costs.

    python benchmarks/ft.py                      # this machine: 2 and 3 replica groups
    python benchmarks/ft.py cluster              # test bed: DiLoCo with a host killed and restarted

**Local** (one process per replica group, a Lighthouse in this process, heartbeat timeout 1 s), on
2 and 3 replica groups:

- *stall*: the groups are started one after the other; once all are in one quorum, the last is
  SIGKILLed from outside; the survivors' stall is the gap between their last commit before the
  death and their first after it, less a median step (target: heartbeat timeout + 1 s). The group
  is started again at once, a new process (as ``torchrun --max-restarts`` does): the *whole
  rejoin* runs from the kill to its first committed step, and its *protocol* share from its Manager
  being up (process start and imports behind it) to that step.
- *step*: a 2.1M-value MLP (float32, batch 32, SGD with momentum) on 2 groups: fddp's
  ``grad_and_value`` + ``apply_gradients`` on a plain gloo group, the same step through
  ``Replicas.step`` (quorum taken in the background, the vote), and torchft's own wrapper
  (``torchft.ddp.DistributedDataParallel`` + ``OptimizerWrapper`` on the same MLP as an
  ``nn.Module``). Modes alternate, ``--repeats`` launches each; per launch the median step after a
  warm-up; the figure is the median over launches. Separate launches on 2 shared cores differ by
  10-20% (far more on a loaded machine) from load alone, so each fddp.ft launch also runs the same
  step bare on the same group, step by step alternating with ``Replicas.step`` (the order
  alternating too; a quorum left running in the background is charged to ``Replicas.step``): the
  median ratio of neighbouring steps is the overhead under the same load (target <= 1.10x; with
  ``--parts long``, a step of 100 ms or more: <= 1.05x).
- *DiLoCo inner step*: with ``FaultTolerantOuter`` (every 20), the inner step plus the outer call
  between synchronisations against the inner step alone, interleaved step by step (target: within
  noise).

**Cluster** (tools/cluster.py: 4 hosts, 100 Mbit/s links each way; needs root): the low-communication
benchmark's task (benchmarks/lowcomm.py: a 0.82M-value MLP learning a teacher, AdamW inside, fresh
samples every step), DDP (torch, gloo) as the target, then DiLoCo every 30 steps across 4 replica
groups on ``Replicas`` without a failure, and with host 3's group SIGKILLed a third of the way in and
restarted (a new process on the same host) at half way. The eval loss of the snapshot against wall
time goes to ``benchmarks/results/ft_cluster_4x1_100mbit.png``.

Every timed run holds ``/tmp/fddp-timing.lock`` (run it under ``flock``, as the other benchmarks);
the table shows the load average. Writes ``benchmarks/results/ft.json`` / ``ft_cluster_*.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
FT_WORKER = ROOT / "tests" / "ft_worker.py"
HEARTBEAT_TIMEOUT_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------- step workers


def step_worker(args: argparse.Namespace) -> None:
    """One process of the step comparison: ``--mode`` fddp (rank ``--rank`` of a plain 2-rank gloo
    group), ft (a replica group of its own on ``Replicas``) or torchft (torchft's wrapper)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import fddp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh(), nn.Linear(args.width, args.width), nn.Tanh(),
                          nn.Linear(args.width, 10))  # fmt: skip
    g = torch.Generator().manual_seed(args.rank)
    batches = [(torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)) for _ in range(8)]
    times: list[float] = []
    extra: dict[str, Any] = {}
    if args.mode == "fddp":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=args.groups)
    else:
        port = _free_port()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    if args.mode in ("fddp", "ft"):
        apply_fn, params = fddp.functionalize(model)
        params = {k: v.detach().clone() for k, v in params.items()}
        opt = fddp.optim.sgd(0.01, momentum=0.9)
        loss_fn = lambda p, x, y: F.cross_entropy(apply_fn(p, x), y)  # noqa: E731
        if args.mode == "fddp":
            params = fddp.broadcast(params)
            gv = fddp.grad_and_value(loss_fn)
            state = (params, opt.init(params))
            for i in range(args.warmup + args.steps):
                x, y = batches[i % len(batches)]
                t0 = time.perf_counter()
                grads, _ = gv(state[0], x, y)
                state = fddp.optim.apply_gradients(opt, grads, state[1], state[0])
                times.append(time.perf_counter() - t0)
        else:
            import fddp.ft

            replicas = fddp.ft.Replicas(lighthouse=args.lighthouse, replica_id=f"replica_{args.rank}", store=("127.0.0.1", port),
                                        hostname="127.0.0.1", timeout=30)  # fmt: skip
            gv = fddp.grad_and_value(loss_fn, group=replicas.group)

            def train_step(s: Any, x: Any, y: Any) -> Any:
                grads, loss = gv(s["params"], x, y)
                p, o = fddp.optim.apply_gradients(opt, grads, s["opt"], s["params"])
                return {"params": p, "opt": o}, loss

            _wait_for(args.go)
            state = replicas.start({"params": params, "opt": opt.init(params)})
            plain, bare = state, []  # the same step on the same group, without Replicas.step around it
            i = 0
            while len(times) < args.warmup + args.steps:
                # Step by step, the order alternating: under a shared machine's load, which moves
                # from second to second, a pair of neighbouring steps is the fairest comparison.
                # A quorum Replicas.step leaves running in the background would finish during the
                # bare step next to it, hidden (and slowing that one): its wait is charged here.
                x, y = batches[i % len(batches)]
                first = i % 2
                i += 1
                for turn in (first, 1 - first):
                    t0 = time.perf_counter()
                    if turn == 0:
                        state, loss = replicas.step(train_step, state, x, y)
                        if replicas._pending is not None:
                            replicas._pending.result()
                        times.append(time.perf_counter() - t0)
                        assert loss is not None, "a step of the benchmark did not commit"
                    else:
                        plain, _ = train_step(plain, x, y)
                        bare.append(time.perf_counter() - t0)
            extra["pairs"] = [a / b for a, b in zip(times[args.warmup :], bare[args.warmup :])]
            extra["bare"] = bare[args.warmup :]
    else:
        from torchft.ddp import DistributedDataParallel
        from torchft.manager import Manager
        from torchft.optim import OptimizerWrapper
        from torchft.process_group import ProcessGroupGloo

        sgd = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        manager = Manager(
            pg=ProcessGroupGloo(timeout=datetime.timedelta(seconds=30)), min_replica_size=1,
            load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), sgd.load_state_dict(sd["optim"])),
            state_dict=lambda: {"model": model.state_dict(), "optim": sgd.state_dict()},
            replica_id=f"replica_{args.rank}", lighthouse_addr=args.lighthouse, store_addr="127.0.0.1", store_port=port,
            rank=0, world_size=1, hostname="127.0.0.1", timeout=datetime.timedelta(seconds=30),
        )  # fmt: skip
        net = DistributedDataParallel(manager, model)
        optimizer = OptimizerWrapper(manager, sgd)
        _wait_for(args.go)
        for i in range(args.warmup + args.steps):
            x, y = batches[i % len(batches)]
            t0 = time.perf_counter()
            optimizer.zero_grad()  # starts the quorum
            F.cross_entropy(net(x), y).backward()
            optimizer.step()  # the vote, then the step
            times.append(time.perf_counter() - t0)
    Path(args.out).write_text(json.dumps({"times": times[args.warmup :], "load": os.getloadavg(), **extra}))
    os._exit(0)  # torchft's quorum threads must not hold the exit


def _wait_for(path: str) -> None:
    while path and not os.path.exists(path):
        time.sleep(0.01)


def _step_launch(mode: str, args: argparse.Namespace, tmp: Path) -> tuple[float, float | None]:
    """One launch of ``mode`` on 2 groups: rank 0's median step, and for ``ft`` the median of the same
    step run bare on the same group in the same processes (blocks interleaved)."""
    import fddp.ft

    lh = fddp.ft.lighthouse(min_replicas=1, join_timeout=5.0, heartbeat_timeout=HEARTBEAT_TIMEOUT_S) if mode != "fddp" else None
    go = tmp / f"go-{mode}-{time.monotonic_ns()}"
    port = _free_port()
    procs, outs = [], []
    for r in range(2):
        out = tmp / f"{mode}-{r}-{time.monotonic_ns()}.json"
        cmd = [sys.executable, __file__, "step-worker", "--mode", mode, "--rank", str(r), "--groups", "2", "--port", str(port),
               "--out", str(out), "--go", str(go), "--width", str(args.width), "--batch", str(args.batch),
               "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--lighthouse", lh.address if lh else ""]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{mode}-{r}.err", "w"),
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))  # fmt: skip
        outs.append(out)
    time.sleep(0.5)
    # The groups' Managers up before the first quorum, so that both join it (torchft starts a
    # group alone otherwise): every process has printed nothing yet; wait for their imports.
    deadline = time.monotonic() + 120
    while mode != "fddp" and time.monotonic() < deadline and not _managers_up(tmp, mode, procs):
        time.sleep(0.1)
    go.touch()
    for p in procs:
        if p.wait(timeout=600) != 0:
            raise SystemExit(f"{mode} worker exited {p.returncode}:\n{(tmp / f'{mode}-0.err').read_text()[-3000:]}")
    if lh is not None:
        lh.shutdown()
    got = json.loads(outs[0].read_text())
    if "pairs" in got:  # the median ratio of neighbouring steps, expressed as the bare step's time
        t = statistics.median(got["times"])
        return t, t / statistics.median(got["pairs"])
    return statistics.median(got["times"]), None


def _managers_up(tmp: Path, mode: str, procs: list) -> bool:
    # torchft's Manager logs "Manager listening" once its server is up (ours too: it is torchft's).
    return all("listening" in (tmp / f"{mode}-{r}.err").read_text(errors="replace") for r in range(len(procs)))


# ------------------------------------------------------------------------------- stall and join


def _spawn(lh: str, out: Path, replica: int, incarnation: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(FT_WORKER), "--lighthouse", lh, "--replica", str(replica), "--incarnation", str(incarnation),
           "--out", str(out), "--mode", "replicated", "--steps", "100000", "--batch", "16", "--bucket-kb", "25600",
           "--quorum-every", "10", *extra]  # fmt: skip (Replicas' default quorum_every)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out / f"err-{replica}-{incarnation}.txt", "w"),
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})  # fmt: skip


def _log(out: Path, replica: int, incarnation: int = 0) -> list[dict]:
    path = out / f"log-{replica}-{incarnation}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []


def _until(ok, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > end:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.01)


def failure_run(groups: int, tmp: Path) -> dict[str, Any]:
    """``groups`` replica groups started one after the other; once all are in one quorum and 100
    steps are committed, the last is SIGKILLed and started again at once (a new process, as
    ``torchrun --max-restarts`` does): the whole rejoin runs from the kill to the restarted
    group's first committed step, process start and imports included."""
    import fddp.ft

    out = Path(tempfile.mkdtemp(dir=tmp))
    lh = fddp.ft.lighthouse(min_replicas=1, join_timeout=5.0, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
    procs = [_spawn(lh.address, out, r, 0, "--pace", "0.005") for r in range(groups)]
    late = None
    try:
        _until(lambda: sum(e["event"] == "step" and e["committed"] and e["size"] == groups for e in _log(out, 0)) >= 100,
               f"100 steps on {groups} groups")  # fmt: skip
        procs[-1].send_signal(signal.SIGKILL)
        killed = time.time()
        procs[-1].wait()
        late = _spawn(lh.address, out, groups - 1, 1, "--pace", "0.005")
        _until(lambda: any(e["event"] == "step" and e["committed"] for e in _log(out, groups - 1, 1)), "the restarted group's first step")
        _until(lambda: sum(e["event"] == "step" and e["committed"] and e["size"] == groups for e in _log(out, groups - 1, 1)) >= 20,
               "20 steps after the join")  # fmt: skip
    finally:
        for p in procs + ([late] if late else []):
            if p.poll() is None:
                p.kill()
            p.wait()
        lh.shutdown()
    steps = [e for e in _log(out, 0) if e["event"] == "step"]
    done = [e for e in steps if e["committed"]]
    step_s = statistics.median(b["t"] - a["t"] for a, b in zip(done, done[1:]))
    # On the survivor's own clock: its last commit with every group, its first without the dead one.
    first_alone = next(i for i, e in enumerate(done) if e["size"] == groups - 1 and e["t"] > killed)
    before, after = done[first_alone - 1]["t"], done[first_alone]["t"]
    joiner = _log(out, groups - 1, 1)
    up = next(e["t_up"] for e in joiner if e["event"] == "up")  # its Manager up: imports and process start behind it
    started = next(e for e in joiner if e["event"] == "started")
    first = next(e for e in joiner if e["event"] == "step" and e["committed"])
    lost = sum(1 for e in steps if not e["committed"] and e["t0"] > killed - 1)
    return {
        "groups": groups,
        "step_ms": 1e3 * step_s,
        "stall_s": after - before - step_s,
        "lost_steps": lost,
        "rejoin_total_s": first["t"] - killed,
        "rejoin_process_s": up - killed,
        "join_protocol_s": first["t"] - up,
        "join_start_s": started["t"] - up,
        "joined_at_step": started["step"],
        "survivor_missed_steps_at_join": sum(1 for e in steps if not e["committed"] and e["t0"] > up),
        "kill_to_first_commit_s": after - killed,
    }


# ------------------------------------------------------------------------------- DiLoCo inner steps


def diloco_worker(args: argparse.Namespace) -> None:
    """One replica group: FaultTolerantOuter every ``--every``; inner steps timed against the same
    step without the outer call, interleaved."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    import fddp
    import fddp.ft

    torch.set_num_threads(1)
    port = _free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    apply_fn, params = fddp.functionalize(model)
    params = {k: v.detach().clone() for k, v in params.items()}
    loss_fn = lambda p, x, y: F.cross_entropy(apply_fn(p, x), y)  # noqa: E731
    grad = torch.func.grad(loss_fn)
    inner = fddp.optim.adamw(1e-3)
    replicas = fddp.ft.Replicas(lighthouse=args.lighthouse, replica_id=f"replica_{args.rank}", store=("127.0.0.1", port),
                                hostname="127.0.0.1", timeout=30, quorum_timeout=120)  # fmt: skip
    outer = fddp.ft.FaultTolerantOuter(replicas, fddp.diloco.diloco(args.every, group=replicas.group))
    _wait_for(args.go)
    params, ostate, istate = outer.start(params, inner_state=inner.init(params))
    floor_p, floor_s = params, inner.init(params)
    g = torch.Generator().manual_seed(args.rank)
    with_outer, alone = [], []
    for t in range(args.steps):
        x, y = torch.randn(32, 256, generator=g), torch.randint(0, 10, (32,), generator=g)
        sync = (int(ostate.count) + 1) % args.every == 0
        first = t % 2  # which of the pair runs first alternates
        for turn in (first, 1 - first):
            t0 = time.perf_counter()
            if turn == 0:
                params, istate = fddp.optim.apply_gradients(inner, grad(params, x, y), istate, params)
                params, ostate, istate = outer.step(params, ostate, weight=32.0, inner_state=istate)
                (None if sync else with_outer.append(time.perf_counter() - t0))
            else:
                floor_p, floor_s = fddp.optim.apply_gradients(inner, grad(floor_p, x, y), floor_s, floor_p)
                (None if sync else alone.append(time.perf_counter() - t0))
    ratios = [a / b for a, b in zip(with_outer, alone)]
    Path(args.out).write_text(json.dumps({"with_outer_ms": 1e3 * statistics.median(with_outer), "alone_ms": 1e3 * statistics.median(alone),
                                          "ratio": statistics.median(ratios), "noise": statistics.pstdev(ratios)}))  # fmt: skip
    os._exit(0)


def diloco_run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import fddp.ft

    lh = fddp.ft.lighthouse(min_replicas=1, join_timeout=5.0, heartbeat_timeout=HEARTBEAT_TIMEOUT_S)
    go = tmp / f"go-diloco-{time.monotonic_ns()}"
    outs, procs = [], []
    for r in range(2):
        out = tmp / f"diloco-{r}.json"
        cmd = [sys.executable, __file__, "diloco-worker", "--rank", str(r), "--out", str(out), "--go", str(go),
               "--lighthouse", lh.address, "--steps", str(args.diloco_steps), "--every", "20"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp / f"diloco-{r}.err", "w"),
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}))  # fmt: skip
        outs.append(out)
    _until(lambda: all("listening" in (tmp / f"diloco-{r}.err").read_text(errors="replace") for r in range(2)), "the Managers")
    go.touch()
    for p in procs:
        p.wait(timeout=600)
    lh.shutdown()
    return json.loads(outs[0].read_text())


# ------------------------------------------------------------------------------- the local report


def run_local(args: argparse.Namespace) -> None:
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="fddp-ft-bench-"))
    load_before = os.getloadavg()
    record: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/ft.py", *sys.argv[1:]]),
        "torch": torch.__version__,
        "torchft": _torchft_version(),
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
    }
    if "step" in args.parts:
        record["step"] = _step_comparison(args, tmp, args.batch, args.modes)
    if "long" in args.parts:  # a step of 100 ms or more: the overhead target there is 1.05x
        record["long_step"] = _step_comparison(args, tmp, args.long_batch, ["ft"])
    if "failures" in args.parts:
        record["failures"] = []
        for groups in (2, 3):
            record["failures"].append(failure_run(groups, tmp))
            print(f"  failure on {groups} groups: {record['failures'][-1]}  (load {os.getloadavg()[0]:.2f})", flush=True)
    if "diloco" in args.parts:
        record["diloco_inner"] = diloco_run(args, tmp)
        print(f"  diloco inner step: {record['diloco_inner']}", flush=True)
    record["load_avg"] = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "ft.json"
    path.write_text(json.dumps(record, indent=1))
    print()
    print(local_table(record))
    print(f"\nwrote {path}")


def _step_comparison(args: argparse.Namespace, tmp: Path, batch: int, modes: list[str]) -> dict[str, Any]:
    """``--repeats`` launches of each mode (alternating order); ``ft`` launches also time the bare step."""
    per_mode: dict[str, list[float]] = {m: [] for m in modes + ["ft_bare"]}
    run = argparse.Namespace(**{**vars(args), "batch": batch})
    for rep in range(args.repeats):
        for m in modes if rep % 2 == 0 else modes[::-1]:
            t, bare = _step_launch(m, run, tmp)
            per_mode[m].append(t)
            if bare is not None:
                per_mode["ft_bare"].append(bare)
            shown = f"  (bare on the same group: {1e3 * bare:.2f} ms, {t / bare:.3f}x)" if bare else ""
            print(f"  step {m:<8} batch {batch} launch {rep + 1}: {1e3 * t:.2f} ms{shown}  (load {os.getloadavg()[0]:.2f})", flush=True)
    steps = {m: statistics.median(v) for m, v in per_mode.items()}
    ratios = [a / b for a, b in zip(per_mode["ft"], per_mode["ft_bare"])]
    out = {"values": _values(args.width), "batch": batch, "launches_ms": {m: [1e3 * t for t in v] for m, v in per_mode.items()},
           "median_ms": {m: 1e3 * t for m, t in steps.items()}, "ft_over_bare_paired": statistics.median(ratios),
           "ft_over_bare_launches": ratios}  # fmt: skip
    if "fddp" in modes:
        out["ft_over_fddp"] = steps["ft"] / steps["fddp"]
    if "torchft" in modes:
        out["torchft_over_fddp"] = steps["torchft"] / steps["fddp"]
    return out


def _values(width: int) -> int:
    return 2 * (width * width + width) + 10 * width + 10


def _torchft_version() -> str:
    from importlib.metadata import version

    return version("torchft")


def local_table(r: dict[str, Any]) -> str:
    la = r["load_avg"]
    lines = [
        f"torch {r['torch']}, torchft {r['torchft']}; load average before {la['before'][0]:.2f}, after {la['after'][0]:.2f} "
        f"on {la['cpus']} CPUs; Lighthouse heartbeat timeout {r['heartbeat_timeout_s']:g} s",
    ]
    if "step" in r:
        s = r["step"]
        ms = s["median_ms"]
        lines += ["", f"step on 2 replica groups, {s['values'] / 1e6:.2f}M values, batch {s['batch']} (median step, median of launches)"]
        if "fddp" in ms:
            lines.append(f"  {'fddp (plain gloo group)':<34}{ms['fddp']:8.2f} ms   1.00x")
        lines += [
            f"  {'fddp.ft Replicas.step':<34}{ms['ft']:8.2f} ms" + (f"   {s['ft_over_fddp']:.2f}x" if "ft_over_fddp" in s else ""),
            f"  {'  the same step bare, same group':<34}{ms['ft_bare']:8.2f} ms   Replicas.step / bare, neighbouring steps "
            f"paired: {s['ft_over_bare_paired']:.3f}x  (target <= 1.10x; launches "
            f"{', '.join(f'{x:.3f}' for x in s['ft_over_bare_launches'])})",
        ]
        if "torchft" in ms:
            lines.append(f"  {'torchft DDP + OptimizerWrapper':<34}{ms['torchft']:8.2f} ms   {s['torchft_over_fddp']:.2f}x")
    if "long_step" in r:
        s = r["long_step"]
        lines += [
            "",
            f"a longer step (batch {s['batch']}): Replicas.step {s['median_ms']['ft']:.2f} ms, bare {s['median_ms']['ft_bare']:.2f} ms, "
            f"paired {s['ft_over_bare_paired']:.3f}x  (target <= 1.05x; launches "
            f"{', '.join(f'{x:.3f}' for x in s['ft_over_bare_launches'])})",
        ]
    if "failures" in r:
        lines += [
            "",
            f"  {'groups':>6}{'step ms':>9}{'stall s':>9}{'lost':>6}{'rejoin s':>10}{'process s':>11}{'protocol s':>12}",
        ]
        for f in r["failures"]:
            lines.append(f"  {f['groups']:>6}{f['step_ms']:9.2f}{f['stall_s']:9.2f}{f['lost_steps']:6d}{f['rejoin_total_s']:10.2f}"
                         f"{f['rejoin_process_s']:11.2f}{f['join_protocol_s']:12.2f}")  # fmt: skip
        lines += [
            "",
            "stall = gap between the survivors' last commit before the kill and their first after it, less a median step; "
            "lost = the survivor's uncommitted steps; rejoin = from the SIGKILL to the restarted group's first committed step "
            "(started again at once, as torchrun --max-restarts does): process s to its Manager up (process start, imports), "
            "protocol s from there (quorum, live state, first step)",
        ]
    if "diloco_inner" in r:
        d = r["diloco_inner"]
        lines += [
            "",
            f"DiLoCo inner step between synchronisations: {d['with_outer_ms']:.2f} ms with FaultTolerantOuter.step, "
            f"{d['alone_ms']:.2f} ms alone; paired ratio {d['ratio']:.3f} (step-to-step spread {d['noise']:.3f})",
        ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------- the test bed


def cluster_worker(args: argparse.Namespace) -> None:
    """One replica group on a test-bed host: DiLoCo on the low-communication task, on Replicas."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import fddp
    import fddp.ft
    from benchmarks.lowcomm import _lr, _task

    torch.set_num_threads(1)
    _wait_for(args.go)  # a restart started early: its imports are done when it is told to join
    addr = os.environ["FDDP_ADDR"]
    port = _free_port()
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=0, world_size=1)
    student, batch, (x_eval, y_eval) = _task(args)
    apply_fn, params = fddp.functionalize(student())
    params = {k: v.detach().clone() for k, v in params.items()}
    loss_fn = lambda p, x, y: F.cross_entropy(apply_fn(p, x), y)  # noqa: E731
    grad = torch.func.grad(loss_fn)
    inner = fddp.optim.adamw(lambda count: _lr(count, args), weight_decay=0.0)
    replicas = fddp.ft.Replicas(lighthouse=args.lighthouse, replica_id=f"replica_{args.rank}", store=(addr, port), hostname=addr,
                                timeout=60, quorum_timeout=600, min_replicas=1)  # fmt: skip
    nesterov = fddp.optim.sgd(args.outer_lr, momentum=args.outer_momentum, nesterov=True)
    outer = fddp.ft.FaultTolerantOuter(replicas, fddp.diloco.diloco(args.every, nesterov, group=replicas.group))
    log = open(args.out, "a", buffering=1)
    log.write(json.dumps({"event": "up", "t": time.time()}) + "\n")
    params, ostate, istate = outer.start(params, inner_state=inner.init(params))  # a restart takes a peer's schedule position
    gen = torch.Generator().manual_seed(10_000 * (args.rank + 1) + 1000 * args.incarnation + args.seed)
    clock = 0.0
    log.write(json.dumps({"event": "started", "t": time.time(), "step": replicas.committed_steps, "count": int(ostate.count)}) + "\n")
    while int(ostate.count) < args.diloco_steps:
        t0 = time.perf_counter()
        x, y = batch(gen)
        params, istate = fddp.optim.apply_gradients(inner, grad(params, x, y), istate, params)
        before = replicas.committed_steps
        params, ostate, istate = outer.step(params, ostate, weight=float(len(x)), inner_state=istate)
        clock += time.perf_counter() - t0
        if replicas.committed_steps > before:  # a synchronisation: evaluate the snapshot (off the clock)
            with torch.no_grad():
                loss = float(F.cross_entropy(apply_fn(ostate.snapshot, x_eval), y_eval))
            log.write(json.dumps({"event": "sync", "t": time.time(), "clock": clock, "count": int(ostate.count), "size": replicas.size,
                                  "eval_loss": loss}) + "\n")  # fmt: skip
    log.write(json.dumps({"event": "done", "t": time.time()}) + "\n")
    log.close()
    replicas.close()
    os._exit(0)


def run_cluster(args: argparse.Namespace) -> None:
    import torch

    from tools.cluster import Cluster, format_rate, parse_rate, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make a test bed here: {reason}")
    rate = format_rate(parse_rate(args.rate))
    name = f"ft_cluster_{args.hosts}x1_{rate}"
    load_before = os.getloadavg()
    runs: dict[str, Any] = {}
    with Cluster(args.hosts, rate=args.rate) as c:
        print(c.describe(), flush=True)
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        # The target: DDP's final eval loss, from the low-communication benchmark's DDP mode on this test bed.
        raw = Path(tempfile.mkdtemp()) / "ddp.json"
        argv = [str(ROOT / "benchmarks" / "lowcomm.py"), "worker", "--out", str(raw), "--modes", "ddp", *_lowcomm_args(args)]
        for r in c.run_all([c.torchrun(h, argv) for h in c.hosts], timeout=1800, envs=[{**c.env(h), **env} for h in c.hosts]):
            if r.returncode != 0:
                raise SystemExit(f"DDP on {r.host.name} exited {r.returncode}:\n{r.output[-3000:]}")
        runs["ddp"] = json.loads(raw.read_text())["results"]["ddp"]
        print(f"ddp: final eval loss {runs['ddp']['eval_loss'][-1]:.4f} in {runs['ddp']['total_s']:.1f} s", flush=True)
        for kind in ("diloco", "diloco_killed"):
            runs[kind] = _cluster_diloco(c, args, env, killed=kind.endswith("killed"))
            last = runs[kind]["replicas"]["0"][-1]
            print(f"{kind}: final eval loss {last['eval_loss']:.4f} at {last['clock']:.1f} s", flush=True)
    target = runs["ddp"]["eval_loss"][-1]
    record = {
        "command": " ".join(["python", "benchmarks/ft.py", *sys.argv[1:]]),
        "args": vars(args),
        "torch": torch.__version__,
        "torchft": _torchft_version(),
        "cluster": {"hosts": args.hosts, "rate": rate},
        "load_avg": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
        "target_eval_loss": target,
        "runs": runs,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=1))
    _plot_cluster(record, path.with_suffix(".png"))
    print()
    print(cluster_table(record))
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


def _lowcomm_args(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--batch", str(args.batch), "--lr", str(args.lr), "--warmup", str(args.warmup),
            "--final-lr", str(args.final_lr), "--width", str(args.width_task), "--layers", str(args.layers),
            "--eval-every", "30", "--seed", str(args.seed)]  # fmt: skip


def _cluster_diloco(c: Any, args: argparse.Namespace, env: dict, killed: bool) -> dict[str, Any]:
    """One DiLoCo run across the hosts; with ``killed``, host 3's group dies a third of the way in
    and a new process takes its place at half way."""
    lh_host = c.hosts[0]
    port = 29510
    lighthouse_bin = str(Path(sys.executable).parent / "torchft_lighthouse")
    flags = ["--bind", f"{lh_host.addr}:{port}", "--min_replicas", "1", "--join_timeout_ms", "5000",
             "--heartbeat_timeout_ms", str(int(1000 * HEARTBEAT_TIMEOUT_S)), "--quorum_tick_ms", "10"]  # fmt: skip
    lh = c.popen(lh_host, [lighthouse_bin, *flags], env={**c.env(lh_host), **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    tmp = Path(tempfile.mkdtemp())
    lighthouse = f"http://{lh_host.addr}:{port}"

    def launch(h: Any, incarnation: int, go: str = "") -> subprocess.Popen:
        argv = [sys.executable, __file__, "cluster-worker", "--rank", str(h.index), "--incarnation", str(incarnation), "--go", go,
                "--lighthouse", lighthouse, "--out", str(tmp / f"{h.index}-{incarnation}.jsonl"), *_task_args(args)]  # fmt: skip
        return c.popen(h, argv, env={**c.env(h), **env}, stdout=subprocess.DEVNULL, stderr=open(tmp / f"{h.index}-{incarnation}.err", "w"),
                       cwd=str(ROOT))  # fmt: skip

    procs = [launch(h, 0) for h in c.hosts]
    victim = c.hosts[-1]
    restart = tmp / "restart"
    if killed:
        procs.append(launch(victim, 1, str(restart)))  # the replacement, imported and waiting
    events = {}
    try:
        if killed:
            logs = lambda: _jsonl(tmp / "0-0.jsonl")  # noqa: E731
            _until(lambda: any(e.get("count", 0) >= args.diloco_steps // 3 for e in logs()), "a third of the run", 1800)
            procs[-2].send_signal(signal.SIGKILL)
            events["killed_at_count"] = max(e.get("count", 0) for e in logs())
            events["killed_t"] = time.time()
            _until(lambda: any(e.get("count", 0) >= args.diloco_steps // 2 for e in logs()), "half the run", 1800)
            restart.touch()
            events["restarted_t"] = time.time()
        for p in procs:
            p.wait(timeout=1800)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        lh.kill()
        lh.wait()
    replicas = {str(h.index): [e for e in _jsonl(tmp / f"{h.index}-0.jsonl") if e["event"] == "sync"] for h in c.hosts}
    out: dict[str, Any] = {"replicas": replicas, **events}
    if killed:
        rejoined = _jsonl(tmp / f"{victim.index}-1.jsonl")
        up = next(e["t"] for e in rejoined if e["event"] == "up")
        started = next(e for e in rejoined if e["event"] == "started")
        out["rejoined"] = {"protocol_s": started["t"] - up, "at_count": started["count"],
                           "syncs": [e for e in rejoined if e["event"] == "sync"]}  # fmt: skip
    return out


def _task_args(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--diloco-steps", str(args.diloco_steps), "--batch", str(args.batch), "--lr", str(args.lr),
            "--warmup", str(args.warmup), "--final-lr", str(args.final_lr), "--width-task", str(args.width_task),
            "--layers", str(args.layers), "--seed", str(args.seed), "--every", str(args.every), "--outer-lr", str(args.outer_lr),
            "--outer-momentum", str(args.outer_momentum)]  # fmt: skip


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []


def cluster_table(r: dict[str, Any]) -> str:
    la = r["load_avg"]
    ddp = r["runs"]["ddp"]
    lines = [
        f"{r['cluster']['hosts']} hosts x 1 rank, {r['cluster']['rate']} links each way; torch {r['torch']}, torchft {r['torchft']}; "
        f"load average before {la['before'][0]:.2f}, after {la['after'][0]:.2f} on {la['cpus']} CPUs",
        f"target: DDP's final eval loss {r['target_eval_loss']:.4f} after {len(ddp['eval_loss']) * 30} steps ({ddp['total_s']:.1f} s)",
        "",
        f"  {'run':<16}{'final loss':>11}{'vs DDP':>8}{'time s':>9}{'to target s':>12}",
    ]
    for kind in ("diloco", "diloco_killed"):
        syncs = r["runs"][kind]["replicas"]["0"]
        hit = next((e["clock"] for e in syncs if e["eval_loss"] <= r["target_eval_loss"]), None)
        final = syncs[-1]["eval_loss"]
        lines.append(f"  {kind:<16}{final:11.4f}{100 * (final / r['target_eval_loss'] - 1):+7.1f}%{syncs[-1]['clock']:9.1f}"
                     f"{'' if hit is None else format(hit, '.1f'):>12}")  # fmt: skip
    k = r["runs"]["diloco_killed"]
    lines.append(f"\nkilled host 3's group at inner step {k['killed_at_count']}; its restart took part from inner step "
                 f"{k['rejoined']['at_count']} ({k['rejoined']['protocol_s']:.2f} s from its Manager up to its first synchronisation, "
                 "which waits for the others' next one)")  # fmt: skip
    return "\n".join(lines)


def _plot_cluster(r: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    ddp = r["runs"]["ddp"]
    k = r["runs"]["diloco_killed"]
    for ax, x_of, xlabel in ((axes[0], "steps", "steps per group (each a batch of 64)"),
                             (axes[1], "clock", "wall time, s (evaluation excluded)")):  # fmt: skip
        ax.plot(ddp["step"] if x_of == "steps" else ddp["time_s"], ddp["eval_loss"], color="black", lw=2, label="DDP (torch, gloo)")
        for kind, label in (("diloco", "DiLoCo H=30 on fddp.ft"), ("diloco_killed", "the same, host 3 killed and restarted")):
            syncs = r["runs"][kind]["replicas"]["0"]
            ax.plot([e["count"] if x_of == "steps" else e["clock"] for e in syncs], [e["eval_loss"] for e in syncs], lw=1.4,
                    label=label, marker=".")  # fmt: skip
        syncs = k["replicas"]["0"]
        for count, what in ((k["killed_at_count"], "killed"), (k["rejoined"]["at_count"], "rejoined")):
            at = next((e for e in syncs if e["count"] >= count), None)
            if at is not None:
                x = at["count"] if x_of == "steps" else at["clock"]
                ax.axvline(x, color="gray", ls="--", lw=0.8)
                ax.annotate(f" {what}", (x, 0.95), xycoords=("data", "axes fraction"), fontsize=8, color="gray")
        ax.axhline(r["target_eval_loss"], color="gray", ls=":", lw=1, label="DDP's final eval loss")
        ax.set(yscale="log", xlabel=xlabel)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("eval loss (log)")
    axes[1].set_xscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{r['cluster']['hosts']} hosts, {r['cluster']['rate']} links: DiLoCo across replica groups, one killed and restarted")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------- command line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", default="local", choices=["local", "cluster", "step-worker", "diloco-worker", "cluster-worker"])
    p.add_argument("--repeats", type=int, default=3, help="launches of each step mode")
    p.add_argument("--width", type=int, default=1024, help="the step comparison's MLP width (1024: 2.1M values)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--diloco-steps", type=int, default=400)
    p.add_argument("--parts", nargs="+", default=["step", "long", "failures", "diloco"], choices=["step", "long", "failures", "diloco"])
    p.add_argument("--long-batch", type=int, default=256, help="the longer step's batch (256: about 100 ms here)")
    p.add_argument("--modes", nargs="+", default=["fddp", "ft", "torchft"], choices=["fddp", "ft", "torchft"])
    # step-worker / diloco-worker / cluster-worker
    p.add_argument("--mode", default="fddp")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--out", default="")
    p.add_argument("--go", default="")
    p.add_argument("--lighthouse", default="")
    p.add_argument("--every", type=int, default=30)
    # cluster
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--outer-momentum", type=float, default=0.5)
    p.add_argument("--final-lr", type=float, default=0.1)
    p.add_argument("--width-task", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.what == "cluster":
        # The low-communication benchmark's settings: DDP 300 steps of 64 per rank; DiLoCo 450 inner steps.
        args.batch, args.warmup = 64 if args.batch == 32 else args.batch, 20 if args.warmup == 10 else args.warmup
        args.steps = 300 if args.steps == 60 else args.steps
        args.diloco_steps = 450 if args.diloco_steps == 400 else args.diloco_steps
    if args.what == "cluster-worker":
        args.width = args.width_task
    {"local": run_local, "cluster": run_cluster, "step-worker": step_worker, "diloco-worker": diloco_worker,
     "cluster-worker": cluster_worker}[args.what](args)  # fmt: skip


if __name__ == "__main__":
    main()
