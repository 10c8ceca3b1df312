"""Calls made back to back on an NCCL group: what the agreement's heads cost the host.

    python benchmarks/nccl_pacing.py                      # heads 5 and 20 ms late, 50 calls a step
    python benchmarks/nccl_pacing.py --late-ms 1 5 20 --calls 50 --rounds 8

No GPU here, so the group is gloo made to act as an NCCL one (``tests/test_control.py``'s
``_nccl_group``): its waits do not block the host, its heads travel on its gloo side group and
arrive ``--late-ms`` after they are sent (a side group across many hosts: a multi-hop TCP ring),
and its data's collectives run as they are issued. One step is ``--calls`` ``fddp.pmean`` calls of
a small tree back to back (a global batch norm per layer) and ``fddp.optim.apply_gradients``; each
row is the median step over ``--rounds`` (the first two left out), on 2 ranks, rank 0's time.

A host that waits for each call's head (read one call later, as fddp did before its known calls
were checked in a batch) pays about ``calls x late`` a step; with the batch, one head a step, read
a step later, so the step is the calls' own host work. Prints a table and writes
``benchmarks/results/nccl_pacing.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the harness (tests/dist.py) and the NCCL emulation


def _worker(late_s: float, calls: int, rounds: int) -> float:
    import torch
    from test_control import _nccl_group

    import fddp

    params = {f"bn{i}": torch.randn(8) for i in range(4)}
    opt = fddp.optim.sgd(0.1)
    state = opt.init(params)
    steps = []
    with _nccl_group(late_s, data=True) as (g, _):
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                fddp.pmean(params, group=g)
            params, state = fddp.optim.apply_gradients(opt, params, state, params)
            steps.append(time.perf_counter() - t0)
        fddp._dist.settle()
    return statistics.median(steps[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--late-ms", type=float, nargs="+", default=[5.0, 20.0], help="how late each head arrives")
    parser.add_argument("--calls", type=int, default=50, help="fddp.pmean calls a step")
    parser.add_argument("--rounds", type=int, default=8, help="steps timed (the first two left out)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "nccl_pacing.json"))
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error(f"--rounds must be at least 3 (the first two are left out), got {args.rounds}")
    from dist import run

    rows = []
    print(f"{'head late (ms)':>15} {'step (ms)':>10} {'calls x late (ms)':>18}")
    for late in args.late_ms:
        step_s = run(_worker, 2, late / 1e3, args.calls, args.rounds, timeout=600)[0]
        rows.append({"late_ms": late, "calls": args.calls, "step_ms": step_s * 1e3})
        print(f"{late:>15.1f} {step_s * 1e3:>10.1f} {args.calls * late:>18.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"ranks": 2, "rounds": args.rounds, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
