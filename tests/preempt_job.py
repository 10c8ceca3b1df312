"""A small training job that tests/test_preempt.py runs under torchrun and preempts with SIGTERM.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/preempt_job.py DIR STEPS DELAY OUT

Trains a linear model for STEPS steps (sleeping DELAY s after each, so that a signal lands mid-run)
with a :class:`fddp.checkpoint.Manager` saving asynchronously every 4 steps into DIR, resuming
from DIR's latest checkpoint when there is one. Each rank writes into OUT its pid (``pid-<rank>``,
at the start), the step it finished last (``progress-<rank>``) and, at the end, what it did
(``done-<rank>``: JSON; ``exit-<rank>`` once all is shut down); rank 0 saves the final parameters (``final.pt``). Batches are a function
of the step and the rank only, so a resumed run computes what an uninterrupted one does.

With ``FDDP_PREEMPT_TEST_SLOW=STEP:SECONDS`` in the environment, rank 0's write of the checkpoint
of STEP (the asynchronous save's, on its thread) writes ``OUT/writing-STEP`` and then takes
SECONDS longer: a save still in flight when the test's signal arrives.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import fddp
import fddp.checkpoint as ckpt


def _write(path: str, text: str) -> None:
    with open(path + ".part", "w") as f:
        f.write(text)
    os.replace(path + ".part", path)  # the test never reads half a file


def _slow_write(out: str) -> None:
    """Make rank 0's write of one step's checkpoint slow (``FDDP_PREEMPT_TEST_SLOW``, see above)."""
    from fddp.checkpoint import _codec

    slow_step, seconds = os.environ["FDDP_PREEMPT_TEST_SLOW"].split(":")
    real = _codec.write

    def write(f, payload):  # noqa: ANN001 - _codec.write's signature
        if f"ckpt-{int(slow_step):08d}.pt.tmp-" in f.name:
            _write(os.path.join(out, f"writing-{slow_step}"), "")
            time.sleep(float(seconds))
        real(f, payload)

    _codec.write = write


def main() -> None:
    directory, steps, delay, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    if "FDDP_PREEMPT_TEST_SLOW" in os.environ:
        _slow_write(out)
    torch.set_num_threads(1)
    fddp.init(timeout=60)
    rank = fddp.rank()
    _write(os.path.join(out, f"pid-{rank}"), str(os.getpid()))
    torch.manual_seed(0)
    params = {"w": torch.randn(16, 4), "b": torch.zeros(4)}
    opt = fddp.optim.adamw(lr=1e-2)
    state = {"params": params, "opt_state": opt.init(params), "step": 0}
    path = ckpt.latest(directory)
    if path is not None:
        state = ckpt.load_step(path, like=state)
    params, opt_state, start = fddp.broadcast(state["params"]), state["opt_state"], state["step"]

    def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((x @ p["w"] + p["b"] - y) ** 2).mean()

    grad_fn = fddp.grad_and_value(loss_fn)
    step = start
    with ckpt.Manager(directory, every=4, keep=2, async_=True) as manager:
        for step in range(start + 1, steps + 1):
            g = torch.Generator().manual_seed(1000 * step + rank)
            grads, _ = grad_fn(params, torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g))
            params, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, params)
            manager.step(step, {"params": params, "opt_state": opt_state, "step": step})
            _write(os.path.join(out, f"progress-{rank}"), str(step))
            if manager.should_stop:
                break
            time.sleep(delay)
    _write(os.path.join(out, f"done-{rank}"), json.dumps({"start": start, "last": step, "preempted": manager.preempted}))
    if rank == 0:
        ckpt.save(os.path.join(out, "final.pt"), {"params": params})
    fddp.shutdown()
    _write(os.path.join(out, f"exit-{rank}"), "")  # the end of a normal exit (a signal's default action never gets here)


if __name__ == "__main__":
    main()
