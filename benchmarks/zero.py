"""ZeRO: memory per rank and step time, fddp's sharded path against torch's replicated and sharded ones.

Run with ``python benchmarks/zero.py`` (CPU, gloo): it launches ``torchrun`` once per world size.
The model is benchmarks/step.py's transformer (1.6M values in 100 tensors), trained with AdamW on
each rank's own batch. Memory is measured at every world size of ``--memory-worlds`` (2 and 4),
step time at ``--time-world`` (2), with the modes interleaved within every repeat so that they share
the machine's noise; each time is the median over repeats of the mean step time (the slowest
rank's). Prints a table and writes ``benchmarks/results/zero.json``.

Modes (AdamW everywhere; torch's fused kernel, the fastest torch.optim on this CPU):
    ddp             torch DDP + torch.optim.AdamW(fused=True): replicated state (the reference)
    torch_zero      torch DDP + ZeroRedundancyOptimizer(AdamW, fused=True): state sharded (ZeRO-1,
                    full gradients), new parameters broadcast after the step (torch's
                    overlap_with_ddp refuses gloo)
    fddp            fddp.grad_and_value (all-reduce inside backward) + fddp.optim.apply_gradients
    fddp_zero       fddp.grad_and_value(compression=fddp.zero.ReduceScatter()) + apply_gradients on
                    this rank's shards + fddp.zero.gather(shards).wait() (ZeRO-2)
    fddp_donated    fddp, with params and state donated to apply_gradients (updated in place)
    fddp_zero_donated  fddp_zero, with the shards and their state donated

Memory columns (bytes per rank, unique storages, so views of one buffer count once):
    state           the optimizer state the loop keeps (torch: optimizer.state; ZeRO: the local
                    optimizer's)
    grads           the gradients held after the step (torch: every p.grad; fddp: what the sync
                    returned: the full tree or this rank's shards)
    ddp buckets     DDP's own bucket buffers, kept besides p.grad (gradient_as_bucket_view=False)
    params          the parameters held (fddp_zero: the gathered full tree plus this rank's shards)
    pool cached     fddp's host buffer pool after two steps of this mode alone: freed buffers it
                    keeps for reuse (not part of the training state; fddp.clear_caches() drops them)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step import MODELS  # noqa: E402  (benchmarks/step.py's models)

import fddp  # noqa: E402
from fddp import _pool  # noqa: E402

LR = 1e-3
MODEL = "transformer"
MODES = ("ddp", "torch_zero", "fddp", "fddp_zero", "fddp_donated", "fddp_zero_donated")


def nbytes(tensors: Any) -> int:
    """Bytes of the unique storages behind ``tensors`` (a tree; views of one buffer count once)."""
    seen: dict[int, int] = {}
    for t in optree.tree_leaves(tensors):
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def pool_cached() -> int:
    return sum(t.untyped_storage().nbytes() for ts in _pool._host_buffers.free.values() for t in ts)


class Mode:
    """One way to train: ``step(x, y)`` makes one step; ``memory()`` measures what the loop holds."""

    step: Callable[[torch.Tensor, torch.Tensor], None]
    memory: Callable[[], dict[str, int]]


def torch_mode(model: nn.Module, zero: bool) -> Mode:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    m = Mode()
    net = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
    if zero:
        opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR, fused=True)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        opt.step()

    def memory() -> dict[str, int]:
        local = opt.optim if zero else opt
        buckets = net._get_ddp_logging_data().get("bucket_sizes", "")
        return {
            "state": nbytes([list(s.values()) for s in local.state.values()]),
            "grads": nbytes([p.grad for p in net.parameters() if p.grad is not None]),
            "ddp_buckets": sum(int(b) for b in str(buckets).split(",") if b.strip()),
            "params": nbytes(list(net.parameters())),
            "pool_cached": 0,
        }

    m.step, m.memory = step, memory
    return m


def fddp_mode(model: nn.Module, sharded: bool, donate: bool) -> Mode:
    m = Mode()
    apply_fn, params = fddp.functionalize(copy.deepcopy(model))
    params = fddp.broadcast(params)
    opt = fddp.optim.adamw(LR)
    loss = lambda p, x, y: F.cross_entropy(apply_fn(p, x), y)  # noqa: E731
    box: dict[str, Any] = {"params": params}
    if sharded:
        box["shards"] = fddp.zero.shard(params)
        box["state"] = opt.init(box["shards"])
        sync = fddp.grad_and_value(loss, compression=fddp.zero.ReduceScatter())
    else:
        box["state"] = opt.init(params)
        sync = fddp.grad_and_value(loss)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        grads, _ = sync(box["params"], x, y)
        box["grads"] = grads
        if sharded:
            box["shards"], box["state"] = fddp.optim.apply_gradients(opt, grads, box["state"], box["shards"], donate=donate)
            box["params"] = fddp.zero.gather(box["shards"]).wait()
        else:
            box["params"], box["state"] = fddp.optim.apply_gradients(opt, grads, box["state"], box["params"], donate=donate)

    def memory() -> dict[str, int]:
        held = [box["params"], box["shards"]] if sharded else [box["params"]]
        return {
            "state": nbytes(box["state"]),
            "grads": nbytes(box["grads"]),
            "ddp_buckets": 0,
            "params": nbytes(held),
            "pool_cached": pool_cached(),
        }

    m.step, m.memory = step, memory
    return m


def make_modes(model: nn.Module, names: list[str]) -> dict[str, Mode]:
    makers = {
        "ddp": lambda: torch_mode(model, zero=False),
        "torch_zero": lambda: torch_mode(model, zero=True),
        "fddp": lambda: fddp_mode(model, sharded=False, donate=False),
        "fddp_zero": lambda: fddp_mode(model, sharded=True, donate=False),
        "fddp_donated": lambda: fddp_mode(model, sharded=False, donate=True),
        "fddp_zero_donated": lambda: fddp_mode(model, sharded=True, donate=True),
    }
    return {n: makers[n]() for n in names}


def time_steps(step: Callable, batch: tuple, n: int) -> tuple[float, float]:
    """Mean wall time of a step (the slowest rank's) and CPU time (every rank's, all threads, summed)."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        step(*batch)
    wall = torch.tensor([(time.perf_counter() - t0) / n])
    cpu = torch.tensor([(time.process_time() - c0) / n])
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    return float(wall), float(cpu)


def worker(args: argparse.Namespace) -> None:
    """One rank of one world size (under torchrun): memory, and with ``--repeats`` > 0, step times."""
    torch.set_num_threads(1)  # the ranks share the machine's cores, for torch and fddp alike
    fddp.init()
    ctor, shape = MODELS[MODEL]
    torch.manual_seed(0)
    model = ctor()
    g = torch.Generator().manual_seed(1 + fddp.rank())
    batch = (torch.randn(shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g))
    modes = make_modes(model, args.modes)
    for mode in modes.values():
        for _ in range(args.warmup):
            mode.step(*batch)
    memory = {}
    for name, mode in modes.items():
        fddp.clear_caches()  # the pool then holds only this mode's freed buffers
        for _ in range(2):
            mode.step(*batch)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mode.memory())
        memory[name] = {k: max(r[k] for r in per_rank) for k in per_rank[0]}  # the fullest rank
    times: dict[str, list[float]] = {n: [] for n in modes}
    cpu: dict[str, list[float]] = {n: [] for n in modes}
    for r in range(args.repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))  # interleave, alternate order
        for n in order:
            wall, used = time_steps(modes[n].step, batch, args.steps)
            times[n].append(wall)
            cpu[n].append(used)
    if fddp.is_main():
        out = {
            "world_size": dist.get_world_size(),
            "values": sum(p.numel() for p in model.parameters()),
            "tensors": len(list(model.parameters())),
            "memory": memory,
            "times_ms": {n: [1e3 * t for t in ts] for n, ts in times.items()},
            "cpu_ms": {n: [1e3 * t for t in ts] for n, ts in cpu.items()},
        }
        with open(args.worker_out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def launch(world: int, args: argparse.Namespace, repeats: int, out: str) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", os.path.abspath(__file__),
        "--worker-out", out, "--repeats", str(repeats), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--modes", *args.modes,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        return json.load(f)


def load_average() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "unknown"


def report(results: dict[str, Any], time_world: int) -> str:
    first = next(iter(results.values()))
    lines = [f"{MODEL}: {first['values'] / 1e6:.2f}M values in {first['tensors']} tensors, AdamW, torch {torch.__version__}"]
    lines.append("\nmemory per rank (MB; the fullest rank)")
    lines.append(f"  {'N':>2} {'mode':<18}{'state':>9}{'÷ ddp':>7}{'grads':>9}{'÷ ddp':>7}{'ddp bkts':>9}{'params':>9}{'pool':>8}")
    for world, r in results.items():
        mem = r["memory"]
        ref = mem.get("ddp")
        for name, m in mem.items():
            s_ratio = f"{m['state'] / ref['state']:7.3f}" if ref else ""
            g_ratio = f"{m['grads'] / ref['grads']:7.3f}" if ref and ref["grads"] else ""
            lines.append(
                f"  {world:>2} {name:<18}{m['state'] / 1e6:9.3f}{s_ratio}{m['grads'] / 1e6:9.3f}{g_ratio}"
                f"{m['ddp_buckets'] / 1e6:9.3f}{m['params'] / 1e6:9.3f}{m['pool_cached'] / 1e6:8.2f}"
            )
    timed = results[str(time_world)]
    for key, what in (("times_ms", "wall time (the slowest rank)"), ("cpu_ms", "CPU time (all ranks and threads)")):
        med = {n: statistics.median(ts) for n, ts in timed.get(key, {}).items() if ts}
        if not med:
            continue
        lines.append(f"\nstep {what}, {time_world} ranks: median over {len(next(iter(timed[key].values())))} repeats (ms)")
        lines.append(f"  {'mode':<18}{'median':>8}{'× ddp':>7}{'× torch_zero':>13}{'× fddp':>8}")
        for n, t in med.items():
            cols = [f"{t / med[b]:{w}.2f}" if b in med else " " * w for b, w in (("ddp", 7), ("torch_zero", 13), ("fddp", 8))]
            lines.append(f"  {n:<18}{t:8.1f}{''.join(cols)}")
        if "fddp_zero_donated" in med and "fddp_donated" in med:
            lines.append(f"  fddp_zero_donated / fddp_donated: {med['fddp_zero_donated'] / med['fddp_donated']:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--memory-worlds", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--time-world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "zero.json"))
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        worker(args)
        return
    results: dict[str, Any] = {}
    load_before = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted(set(args.memory_worlds) | {args.time_world}):
            repeats = args.repeats if world == args.time_world else 0
            results[str(world)] = launch(world, args, repeats, os.path.join(tmp, f"{world}.json"))
    text = report(results, args.time_world)
    loads = f"load average (1, 5, 15 min) before: {load_before}, after: {load_average()} on {os.cpu_count()} CPUs"
    print(text + "\n\n" + loads)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    kept = {k: v for k, v in vars(args).items() if k not in ("out", "worker_out")}
    meta = {"model": MODEL, "torch": torch.__version__, "time_world": args.time_world, "load_average": loads, "args": kept}
    with open(args.out, "w") as f:
        json.dump({**meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
