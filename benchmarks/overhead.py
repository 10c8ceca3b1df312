"""fddp's own per-call work: the time a step spends in fddp's Python, with the arithmetic made negligible.

    python benchmarks/overhead.py --leaves 34 100                 # wall time
    python benchmarks/overhead.py --leaves 34 100 --instructions  # also instructions, under callgrind
    torchrun --standalone --nproc-per-node=2 benchmarks/overhead.py --leaves 34 100  # with the round trips
    python benchmarks/overhead.py --leaves 34 100 --ranked-instructions  # the same rows' instructions (callgrind)

Under torchrun (2 or more gloo ranks) the rows are what a training step pays beyond torch's own
collective, each against its reference in the same repeat (after a barrier, rank 0's time):

    all_reduce                      one raw all-reduce of the gradients' values (DDP's one bucket)
    ddp_step                        fddp.ddp_step on the same gradients
    autograd.grad + hooks + all_reduce   the hooked backward, then the raw all-reduce
    fddp.grad_and_value             the same step through fddp
    torch.optim.SGD.step() / fddp.optim.apply_gradients

and ``per-call sum`` is the three overheads (ddp_step's, grad_and_value's, the optimizer's) added
up: what the agreement, the bookkeeping and the error channel cost a call.

One process, one thread, a tree of ``--leaves`` tensors of 4 values each (34 and 100 are the
benchmark MLP's and transformer's tensor counts), so what is timed is per-leaf and per-call
bookkeeping, not kernels. Each row is interleaved with its reference in every repeat and reported
as the median of ``--repeats`` calls:

    autograd.grad + no-op hooks   what fddp.grad must do anyway (a hook per leaf)
    fddp.grad                     over a one-rank group: setup, signature check, copies, views
    ddp_step                      on precomputed gradients
    torch.optim.SGD.step()        torch's in-place momentum step
    fddp.optim.apply_gradients    the pure step

The overheads are ``fddp.grad`` minus the hooked ``autograd.grad``, and ``apply_gradients`` minus
torch's step. ``--large N`` adds one call of ``fddp.grad`` on an N-leaf tree against plain
``torch.autograd.grad`` (medians of a few calls).

``--instructions`` runs the same rows again under valgrind's callgrind, which counts the
instructions each call executes: the count does not move with the machine's load, where the times
do by up to 60%. A small C helper (compiled with the system's C compiler against
``valgrind/callgrind.h``) zeroes the counters before a row's calls and dumps them after; the
per-call count is the dump's total over ``--instruction-calls`` calls.

``--ranked-instructions`` (run plainly, not under torchrun) counts the two-rank rows the same way:
it starts two gloo ranks on this host, rank 0 under callgrind (its main thread's instructions
only: gloo's threads and the wait are left out), and prints each row and the overheads, the
``per-call sum`` among them, in instructions per call. Every call then sends its agreement's head,
which a one-rank group does not.

Prints a table and writes ``benchmarks/results/overhead.json``. Timings are this machine's;
compare rows within a run.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import fddp
import fddp.optim as fopt
from floor import report

_CG_SOURCE = """
#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_zero(void) { CALLGRIND_ZERO_STATS; }
void cg_dump(const char *what) { CALLGRIND_DUMP_STATS_AT(what); }
"""


def calls(n: int) -> dict[str, Callable[[], object]]:
    params = {f"layers.{i}.weight": torch.randn(4) for i in range(n)}
    x = torch.randn(4)

    def loss(p, x):
        return sum((v * x).sum() for v in p.values())

    def hooked_autograd_grad():
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        for i, leaf in enumerate(leaves.values()):
            leaf.register_hook(functools.partial(lambda i, g: None, i))
        return torch.autograd.grad(loss(leaves, x), list(leaves.values()))

    grad = fddp.grad(loss)
    grads = grad(params, x)  # views into buckets, as a training loop gets them
    raw = torch.func.grad(loss)(params, x)
    opt = fopt.sgd(0.1, momentum=0.9)
    box = {"p": {k: v.clone() for k, v in params.items()}, "s": opt.init(params)}
    torch_params = [v.clone().requires_grad_() for v in params.values()]
    for p, g in zip(torch_params, raw.values()):
        p.grad = g.clone()
    torch_opt = torch.optim.SGD(torch_params, lr=0.1, momentum=0.9)

    def apply() -> None:
        box["p"], box["s"] = fopt.apply_gradients(opt, grads, box["s"], box["p"])

    return {
        "autograd.grad + no-op hooks": hooked_autograd_grad,
        "fddp.grad": lambda: grad(params, x),
        "ddp_step": lambda: fddp.ddp_step(params, raw),
        "torch.optim.SGD.step()": torch_opt.step,
        "fddp.optim.apply_gradients": apply,
    }


def ranked_calls(n: int) -> dict[str, Callable[[], object]]:
    """The rows of a run over several ranks (see the module's docstring)."""
    import torch.distributed as dist

    fns = calls(n)
    params = {f"layers.{i}.weight": torch.randn(4) for i in range(n)}
    params = fddp.broadcast(params)
    x = torch.randn(4)

    def loss(p, x):
        return sum((v * x).sum() for v in p.values())

    raw = torch.func.grad(loss)(params, x)
    flat = torch.cat([g.reshape(-1) for g in raw.values()])
    step = fddp.grad_and_value(loss)

    def hooked_and_reduced():
        fns["autograd.grad + no-op hooks"]()
        dist.all_reduce(flat.clone())

    return {
        "all_reduce": lambda: dist.all_reduce(flat.clone()),
        "ddp_step": lambda: fddp.ddp_step(params, raw),
        "autograd.grad + hooks + all_reduce": hooked_and_reduced,
        "fddp.grad_and_value": lambda: step(params, x),
        "torch.optim.SGD.step()": fns["torch.optim.SGD.step()"],
        "fddp.optim.apply_gradients": fns["fddp.optim.apply_gradients"],
    }


def measure_ranked(n: int, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each row over the ranks, rank 0's clock, with the overheads."""
    import torch.distributed as dist

    rows = interleaved(ranked_calls(n), repeats, before=dist.barrier)
    rows.update(_ranked_overheads(rows))
    return rows


def _ranked_overheads(rows: dict[str, float]) -> dict[str, float]:
    out = {
        "ddp_step overhead": rows["ddp_step"] - rows["all_reduce"],
        "grad_and_value overhead": rows["fddp.grad_and_value"] - rows["autograd.grad + hooks + all_reduce"],
        "optimizer overhead": rows["fddp.optim.apply_gradients"] - rows["torch.optim.SGD.step()"],
    }
    out["per-call sum"] = sum(out.values())
    return out


def with_overheads(rows: dict[str, float]) -> dict[str, float]:
    rows["grad overhead"] = rows["fddp.grad"] - rows["autograd.grad + no-op hooks"]
    rows["optimizer overhead"] = rows["fddp.optim.apply_gradients"] - rows["torch.optim.SGD.step()"]
    return rows


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, before: Callable[[], object] | None = None) -> dict[str, float]:
    """Median microseconds per call of each row, the rows interleaved in every repeat (every row
    sees the same machine), after 20 warm-up calls each; ``before`` runs untimed before each call."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            if before is not None:
                before()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: 1e6 * statistics.median(v) for k, v in times.items()}


def measure(n: int, repeats: int) -> dict[str, float]:
    return with_overheads(interleaved(calls(n), repeats))


def measure_large(n: int, repeats: int = 5) -> dict[str, float]:
    """``fddp.grad`` on an ``n``-leaf tree against plain ``torch.autograd.grad``, in ms."""
    params = {f"layers.{i}.weight": torch.randn(4) for i in range(n)}
    x = torch.randn(4)

    def loss(p, x):
        return sum((v * x).sum() for v in p.values())

    def plain():
        leaves = [v.detach().requires_grad_() for v in params.values()]
        return torch.autograd.grad(loss(dict(zip(params, leaves)), x), leaves)

    grad = fddp.grad(loss)
    fns = {"torch.autograd.grad": plain, "fddp.grad": lambda: grad(params, x)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    out = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    out["ratio"] = out["fddp.grad"] / out["torch.autograd.grad"]
    return out


def count_instructions(n: int, k: int) -> None:
    """In the child under callgrind: each row's ``k`` calls between a zero and a dump of the counters."""
    lib = ctypes.CDLL(os.environ["FDDP_CG_LIB"])
    fns = calls(n)
    for fn in fns.values():
        for _ in range(20):
            fn()
    lib.cg_zero()
    lib.cg_dump(b"warm-up")  # the first dump after start carries one-off costs: not a row
    for name, fn in fns.items():
        lib.cg_zero()
        for _ in range(k):
            fn()
        lib.cg_dump(name.encode())


def count_ranked_instructions(n: int, k: int) -> None:
    """In a rank of ``ranked_instructions``: each two-rank row's ``k`` calls, after a barrier,
    between a zero and a dump of rank 0's counters (instrumented from the warm calls on)."""
    import torch.distributed as dist

    lib = ctypes.CDLL(os.environ["FDDP_CG_LIB"]) if fddp.rank() == 0 else None
    fns = ranked_calls(n)
    for fn in fns.values():
        for _ in range(20):
            fn()
    if lib is not None:
        lib.cg_start()
    for name, fn in fns.items():
        dist.barrier()
        if lib is not None:
            lib.cg_zero()
        for _ in range(k):
            fn()
        if lib is not None:
            lib.cg_dump(name.encode())


def _callgrind_lib() -> tuple[str, str | None]:
    """A temporary directory and the compiled callgrind start/stop shim in it, or (why not, None)."""
    if shutil.which("valgrind") is None or shutil.which("cc") is None:
        return "valgrind or a C compiler is missing", None
    if not os.path.exists("/usr/include/valgrind/callgrind.h"):
        return "valgrind/callgrind.h is missing", None
    tmp = tempfile.mkdtemp(prefix="fddp-cg-")
    src, lib = os.path.join(tmp, "cg.c"), os.path.join(tmp, "libcg.so")
    with open(src, "w") as f:
        f.write(_CG_SOURCE)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", lib, src], check=True)
    return tmp, lib


def ranked_instructions(leaves: list[int], k: int) -> dict[int, dict[str, float]] | str:
    """Instructions per call of every two-rank row on rank 0 (see the module's docstring), or why not."""
    import socket

    tmp, lib = _callgrind_lib()
    if lib is None:
        return tmp  # why not
    try:
        out: dict[int, dict[str, float]] = {}
        for n in leaves:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            prefix = os.path.join(tmp, f"cg-{n}")
            env = {**os.environ, "FDDP_CG_LIB": lib, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}  # fmt: skip
            child = [sys.executable, __file__, "--ranked-child", str(n), "--instruction-calls", str(k)]
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            peer = subprocess.Popen(child, env={**env, "RANK": "1", "LOCAL_RANK": "1"}, **quiet)
            cg = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes", f"--callgrind-out-file={prefix}.%p"]
            try:
                subprocess.run(cg + child, check=True, env={**env, "RANK": "0", "LOCAL_RANK": "0"}, **quiet)
            finally:
                peer.wait(timeout=600)
            rows = _dumped(glob.glob(prefix + ".*-01"), k)
            out[n] = {name: rows[name] for name in ranked_calls_names()}
            out[n].update(_ranked_overheads(out[n]))
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dumped(paths: list[str], k: int) -> dict[str, float]:
    """Each named dump's total over ``k`` calls: ``{row: instructions per call}``."""
    rows: dict[str, float] = {}
    for path in paths:
        with open(path) as f:
            lines = f.read().splitlines()
        tag = "desc: Trigger: Client Request:"
        name = next((line[len(tag):].strip() for line in lines if line.startswith(tag)), "")
        total = next((int(line.split()[1]) for line in lines if line.startswith("summary:")), None)
        if name and total is not None:
            rows[name] = total / k
    return rows


def ranked_calls_names() -> tuple[str, ...]:
    return ("all_reduce", "ddp_step", "autograd.grad + hooks + all_reduce", "fddp.grad_and_value", "torch.optim.SGD.step()",
            "fddp.optim.apply_gradients")  # fmt: skip


def instructions(leaves: list[int], k: int) -> dict[int, dict[str, float]] | str:
    """Instructions per call of every row, or a sentence saying why they cannot be counted here."""
    tmp, lib = _callgrind_lib()
    if lib is None:
        return tmp  # why not
    try:
        out: dict[int, dict[str, float]] = {}
        for n in leaves:
            prefix = os.path.join(tmp, f"cg-{n}")
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={prefix}.%p", sys.executable, __file__]
            cmd += ["--child", str(n), "--instruction-calls", str(k)]
            env = {**os.environ, "FDDP_CG_LIB": lib, "OMP_NUM_THREADS": "1"}
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rows: dict[str, float] = {}
            for path in glob.glob(prefix + ".*"):
                with open(path) as f:
                    text = f.read()
                lines = text.splitlines()
                tag = "desc: Trigger: Client Request:"
                name = next((line[len(tag):].strip() for line in lines if line.startswith(tag)), "")
                total = next((int(line.split()[1]) for line in lines if line.startswith("summary:")), None)
                if name and total is not None and name in calls_names():
                    rows[name] = total / k
            out[n] = with_overheads({name: rows[name] for name in calls_names()})
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def calls_names() -> tuple[str, ...]:
    return ("autograd.grad + no-op hooks", "fddp.grad", "ddp_step", "torch.optim.SGD.step()", "fddp.optim.apply_gradients")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[34, 100])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--large", type=int, default=0, help="also time fddp.grad on a tree of this many leaves")
    parser.add_argument("--instructions", action="store_true", help="also count instructions per call under callgrind")
    parser.add_argument("--instruction-calls", type=int, default=20)
    parser.add_argument("--ranked-instructions", action="store_true",
                        help="count the two-rank rows' instructions per call under callgrind (run plainly: it starts the ranks)")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--ranked-child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "overhead.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.ranked_instructions:
        counted = ranked_instructions(args.leaves, args.instruction_calls)
        if isinstance(counted, str):
            print(f"instructions not counted: {counted}")
            return
        args.out = args.out.replace("overhead.json", "overhead_2ranks_instructions.json")
        report(counted, "instructions per call, rank 0", {n: f"{n} leaves" for n in counted}, ".0f", args, "results_instructions")
        total = sum(r["per-call sum"] for r in counted.values())
        print(f"per-call sum over {', '.join(map(str, counted))} leaves: {total / 1e6:.2f}M instructions")
        return
    fddp.init()  # one process: a one-rank group; a ranked child: its rank of two
    if args.ranked_child:
        count_ranked_instructions(args.ranked_child, args.instruction_calls)
        fddp.shutdown()
        return
    if args.child:
        count_instructions(args.child, args.instruction_calls)
        fddp.shutdown()
        return
    if fddp.world_size() > 1:
        ranked = {n: measure_ranked(n, args.repeats) for n in args.leaves}
        rank, world = fddp.rank(), fddp.world_size()
        fddp.shutdown()
        if rank == 0:
            args.out = args.out.replace("overhead.json", f"overhead_{world}ranks.json")
            report(ranked, "median us, rank 0, after a barrier", {n: f"{n} leaves" for n in ranked}, ".0f", args, "results_us")
            total = sum(r["per-call sum"] for r in ranked.values())
            print(f"per-call sum over {', '.join(map(str, ranked))} leaves: {total / 1e3:.2f} ms")
        return
    results = {n: measure(n, args.repeats) for n in args.leaves}
    large = measure_large(args.large) if args.large else None
    fddp.shutdown()
    report(results, "median us, 1 thread", {n: f"{n} leaves" for n in results}, ".0f", args, "results_us")
    extra: dict = {}
    if large is not None:
        print(f"{args.large} leaves: fddp.grad {large['fddp.grad']:.1f} ms, torch.autograd.grad "
              f"{large['torch.autograd.grad']:.1f} ms, ratio {large['ratio']:.2f}")
        extra["large"] = {"leaves": args.large, "ms": large}
    if args.instructions:
        counted = instructions(args.leaves, args.instruction_calls)
        if isinstance(counted, str):
            print(f"instructions not counted: {counted}")
            extra["instructions"] = counted
        else:
            width = max(len(r) for r in next(iter(counted.values())))
            print(f"{'instructions per call':<{width}}" + "".join(f"{f'{n} leaves':>14}" for n in counted))
            for row in next(iter(counted.values())):
                print(f"{row:<{width}}" + "".join(f"{counted[n][row]:14.0f}" for n in counted))
            extra["instructions"] = counted
    if extra:
        with open(args.out) as f:
            data = json.load(f)
        data.update(extra)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
