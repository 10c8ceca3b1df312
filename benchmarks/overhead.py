"""fddp's own per-call work: the time a step spends in fddp's Python, with the arithmetic made negligible.

    python benchmarks/overhead.py --leaves 34 100

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
torch's step. Prints a table and writes ``benchmarks/results/overhead.json``. Timings are this
machine's; compare rows within a run.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch

import fddp
import fddp.optim as fopt
from floor import report


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


def measure(n: int, repeats: int) -> dict[str, float]:
    fns = calls(n)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        for _ in range(20):
            fn()
    for _ in range(repeats):  # interleaved: every row sees the same machine
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    us = {k: 1e6 * statistics.median(v) for k, v in times.items()}
    us["grad overhead"] = us["fddp.grad"] - us["autograd.grad + no-op hooks"]
    us["optimizer overhead"] = us["fddp.optim.apply_gradients"] - us["torch.optim.SGD.step()"]
    return us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--leaves", type=int, nargs="+", default=[34, 100])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "overhead.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    fddp.init()  # one process: a one-rank group
    results = {n: measure(n, args.repeats) for n in args.leaves}
    fddp.shutdown()
    report(results, "median us, 1 thread", {n: f"{n} leaves" for n in results}, ".0f", args, "results_us")


if __name__ == "__main__":
    main()
