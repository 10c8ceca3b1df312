"""Teardown: once the group is destroyed, its gloo threads are gone, not left to interpreter shutdown.

torch.distributed.nn.functional writes ``group=group.WORLD`` into its functions' signatures, so
importing it after the group exists (torch._dynamo does, and torch.func.grad imports torch._dynamo)
keeps that group alive after ``destroy_process_group``, with gloo's worker threads, until the
interpreter shuts down; destroying a gloo group there is what aborted workers at exit with
"terminate called without an active exception". Each case runs in a fresh interpreter, where
torch._dynamo is not imported yet.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import os
import torch
import torch.distributed as dist
import fddp

{make_group}
torch.func.grad(lambda w: (w * 2).sum())(torch.ones(3))  # imports torch._dynamo, after the group exists
dist.all_reduce(torch.ones(4))
{teardown}
names = [open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task")]
print("gloo threads left:", sorted(n for n in names if "gloo" in n))
"""

ONE_PROCESS = "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process's thread names from /proc")
@pytest.mark.parametrize(
    "make_group, teardown",
    [
        ("fddp.init()", "dist.destroy_process_group()"),  # fddp.init imports that module first
        # fddp's calls remember the group they ran on (weakly): the script's own destroy frees it
        ("fddp.init()\nfddp.ddp_step({'w': torch.ones(3)}, {'w': torch.ones(3)})", "dist.destroy_process_group()"),
        (ONE_PROCESS, "fddp.shutdown()"),  # a group the user made: shutdown lets go of it
        ("fddp.init()", "fddp.shutdown()\nfddp.shutdown()  # a second call does nothing"),
    ],
    ids=["init+destroy", "fddp call+destroy", "user group+shutdown", "init+shutdown twice"],
)
def test_no_gloo_thread_outlives_the_group(make_group: str, teardown: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    code = SCRIPT.format(make_group=make_group, teardown=teardown)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert "gloo threads left: []" in proc.stdout, proc.stdout + proc.stderr


def test_shutdown_without_a_group_does_nothing() -> None:
    # In a fresh interpreter: other tests leave a group alive in this one.
    code = "import fddp; fddp.shutdown(); assert not fddp.is_initialized(); print('ok')"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
