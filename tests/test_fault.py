"""A worker SIGKILLed mid-run under torchrun: the group restarts, resumes, and ends bitwise equal.

Runs ``examples/resume.py`` twice under ``torchrun --standalone --nproc-per-node=2 --max-restarts=2``,
side by side: once undisturbed, and once through a wrapper that makes rank 1 SIGKILL itself at the
start of its 13th ``fddp.ddp_step`` of the first attempt (``TORCHELASTIC_RESTART_COUNT=0``), between
the checkpoints of steps 10 and 15. Rank 0 is then blocked in that step's all-reduce; torchrun sees
rank 1 die, stops the group and starts it again, and the example resumes from step 10.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fddp.checkpoint as ckpt
from fddp import runtime

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "resume.py"
STEPS, EVERY, KILL_AT = 24, 5, 13

# Runs the example with fddp.ddp_step wrapped so that rank 1 of the first attempt kills itself.
KILLER = """
import os, runpy, signal, sys
import fddp

if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    real_ddp_step, calls = fddp.ddp_step, [0]

    def ddp_step_or_die(*args, **kwargs):
        calls[0] += 1
        if calls[0] == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_ddp_step(*args, **kwargs)

    fddp.ddp_step = ddp_step_or_die
sys.argv = [{example!r}] + sys.argv[1:]
runpy.run_path({example!r}, run_name="__main__")
"""


def _torchrun(script: Path, run_dir: Path) -> tuple[subprocess.Popen, Path]:
    """Start torchrun on ``script``; its output goes to ``run_dir/log`` (a file: a pipe would keep
    the test waiting on any worker that outlives torchrun)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(k, None)
    # The marker lets the test find and kill exactly the processes it started (workers run in their
    # own sessions, so killing torchrun's process group would miss them).
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FDDP_FAULT_TEST_RUN=str(run_dir))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
        str(script), "--steps", str(STEPS), "--ckpt-every", str(EVERY),
        "--ckpt-dir", str(run_dir / "ckpt"), "--out", str(run_dir / "final.pt"),
    ]  # fmt: skip
    run_dir.mkdir()
    log = run_dir / "log"
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), log


def _kill_leftovers(run_dir: Path) -> None:
    marker = f"FDDP_FAULT_TEST_RUN={run_dir}\0".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:  # gone, or not ours to read
            pass


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finally:
        _kill_leftovers(log.parent)
    out = log.read_text()
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode} (negative: killed after {timeout} s):\n{out}"
    return out


def test_sigkilled_worker_restarts_and_ends_bitwise_equal(tmp_path):
    killer = tmp_path / "kill_rank1.py"
    killer.write_text(KILLER.format(kill_at=KILL_AT, example=str(EXAMPLE)))
    # Both runs at once: most of the cost is starting Python and importing torch.
    faulty = _torchrun(killer, tmp_path / "faulty")
    clean = _torchrun(EXAMPLE, tmp_path / "clean")
    faulty_out = _finish(*faulty, timeout=100)
    clean_out = _finish(*clean, timeout=15)

    assert "exitcode: -9" in faulty_out, f"rank 1 was not killed by SIGKILL:\n{faulty_out}"
    assert f"resumed from step {EVERY * ((KILL_AT - 1) // EVERY)} of {STEPS}" in faulty_out, faulty_out
    assert "resumed" not in clean_out and "exitcode" not in clean_out, clean_out
    resumed = ckpt.load(tmp_path / "faulty" / "final.pt")
    reference = ckpt.load(tmp_path / "clean" / "final.pt")
    assert resumed.keys() == reference.keys()
    torch.manual_seed(0)  # the example's initial parameters: training must have moved them
    initial = dict(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 4)).named_parameters())
    for k in reference:
        assert torch.equal(resumed[k], reference[k]), f"parameter {k} differs after the resume"
        assert not torch.equal(reference[k], initial[k].detach()), k


def test_restart_scoped_store_only_when_one_agent_runs_every_rank(monkeypatch):
    """fddp.init scopes the process group's store keys by torchrun's restart count (see
    fddp.runtime._restart_scoped_store), but only where that count is the same for every rank."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    env = dict(
        RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port),
        TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="1",
    )  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    scoped = runtime._restart_scoped_store(datetime.timedelta(seconds=10))
    scoped.set("k", "v")
    assert server.get("fddp/restart_1/k") == b"v"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two agents: their restart counts may differ
    assert runtime._restart_scoped_store(None) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the store is not torchrun's
    assert runtime._restart_scoped_store(None) is None
