"""Where a step's no-communication floor goes: each piece of torch's and fddp's step timed alone.

    python benchmarks/floor.py --models mlp transformer

One process, one thread, benchmarks/step.py's models and batches. Per piece, the median of
``--repeats`` timed calls (after 5 warm-up calls): the module's forward and backward against
``torch.autograd.grad`` and ``torch.func.grad`` through ``functional_call``, ``fddp.grad`` over a
one-rank group (its per-leaf hooks and the copies into buckets), and torch's in-place
SGD-momentum step against ``fddp.optim.apply_gradients`` (pure, and donated). Prints a table and
writes ``benchmarks/results/floor.json``. Timings are this machine's; compare rows within a run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from step import LR, MOMENTUM, model_and_batch

import fddp
import fddp.optim as fopt


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``repeats`` calls, after 5 warm-up calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def pieces(name: str) -> dict[str, Callable[[], object]]:
    model, (x, y) = model_and_batch(name)
    module = copy.deepcopy(model)
    torch_opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)

    def module_backward() -> None:
        module.zero_grad(set_to_none=True)
        F.cross_entropy(module(x), y).backward()

    module_backward()  # .grad exists for the optimizer's step
    apply_fn, params = fddp.functionalize(copy.deepcopy(model))
    loss = lambda p, x, y: F.cross_entropy(apply_fn(p, x), y)  # noqa: E731
    func_grad, fddp_grad = torch.func.grad(loss), fddp.grad(loss)
    opt = fopt.sgd(LR, momentum=MOMENTUM)
    grads = fddp_grad(params, x, y)  # views into the buckets, as a training loop gets them
    pure = {"p": {k: v.clone() for k, v in params.items()}, "s": opt.init(params)}
    donated = {"p": {k: v.clone() for k, v in params.items()}, "s": opt.init(params)}

    def autograd_grad() -> None:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        torch.autograd.grad(loss(leaves, x, y), list(leaves.values()))

    def apply(box: dict, donate: bool) -> None:
        box["p"], box["s"] = fopt.apply_gradients(opt, grads, box["s"], box["p"], donate=donate)

    return {
        "torch: module forward + backward": module_backward,
        "torch.autograd.grad through functional_call": autograd_grad,
        "torch.func.grad through functional_call": lambda: func_grad(params, x, y),
        "fddp.grad over a one-rank group (hooks, copies into buckets)": lambda: fddp_grad(params, x, y),
        "torch: SGD(momentum).step(), in place": torch_opt.step,
        "fddp.optim.apply_gradients, pure": lambda: apply(pure, False),
        "fddp.optim.apply_gradients, donated": lambda: apply(donated, True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "floor.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    fddp.init()  # one process: fddp.grad's group has one rank
    results = {name: {piece: timed(fn, args.repeats) for piece, fn in pieces(name).items()} for name in args.models}
    fddp.shutdown()
    report(results, "median ms, 1 thread", {m: m for m in results}, ".2f", args, "results_ms")


def report(results: dict, corner: str, columns: dict, fmt: str, args: argparse.Namespace, key: str) -> None:
    """Print ``results[column][row]`` as a table (``columns`` maps each column to its heading) and
    write them, with the torch version, the arguments and the load average, to ``args.out``."""
    width = max(len(corner), *(len(r) for rows in results.values() for r in rows))
    print(f"{corner:<{width}}" + "".join(f"{h:>14}" for h in columns.values()))
    for row in next(iter(results.values())):
        print(f"{row:<{width}}" + "".join(f"{results[c][row]:14{fmt}}" for c in columns))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "args": vars(args), "load_avg": os.getloadavg(), key: results}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
