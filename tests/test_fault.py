"""A worker SIGKILLed mid-run under torchrun: the group restarts, resumes, and ends bitwise equal.

Each example runs twice under ``torchrun --standalone --nproc-per-node=2 --max-restarts=2``, side
by side: once undisturbed, and once through a wrapper that makes rank 1 SIGKILL itself at the start
of its k-th synchronising call (``fddp.ddp_step`` or a ``fddp.grad_and_value`` function) of the
first attempt (``TORCHELASTIC_RESTART_COUNT=0``), between two checkpoints. Rank 0 is then blocked in
that step's all-reduce; torchrun sees rank 1 die, stops the group and starts it again, and the
example resumes from its newest checkpoint. Its last checkpoint (parameters, optimizer state, step
and RNG state) must be bitwise the undisturbed run's.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import optree
import pytest
import torch
import torch.distributed as dist

import fddp.checkpoint as ckpt
from dist import kill_marked
from fddp import runtime

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


class Case(NamedTuple):
    script: str
    sync: str  # the fddp function the example calls once per step
    kill_at: int  # rank 1 dies at the start of this call (counting from 1) of its first attempt
    args: tuple[str, ...]  # "{run}" stands for the run's directory
    ckpt_dir: str  # relative to the run's directory
    resumed: str  # what the restarted run prints


CASES = {
    # Checkpoints every 5 steps; killed in step 13, it resumes from step 10.
    "resume": Case(
        "resume.py", "ddp_step", 13,
        ("--steps", "24", "--ckpt-every", "5", "--ckpt-dir", "{run}/ckpt", "--out", "{run}/final.pt"),
        "ckpt", "resumed from step 10 of 24",
    ),
    # Checkpoints every epoch of 23 steps; killed in step 30 (epoch 2), it resumes after epoch 1.
    "train_digits": Case(
        "train_digits.py", "grad_and_value", 30, ("--epochs", "3", "--out-dir", "{run}/out"),
        "out/ckpt", "(epoch 1, step 23)",
    ),
}  # fmt: skip

# Runs an example with its synchronising call wrapped so that rank 1 of the first attempt kills itself.
KILLER = """
import os, runpy, signal, sys
import fddp

if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    real, calls = fddp.{sync}, [0]

    def tick():
        calls[0] += 1
        if calls[0] == {kill_at}:
            os.kill(os.getpid(), signal.SIGKILL)

    def ddp_step(*args, **kwargs):
        tick()
        return real(*args, **kwargs)

    def grad_and_value(*args, **kwargs):
        step_fn = real(*args, **kwargs)

        def counted(*a, **k):
            tick()
            return step_fn(*a, **k)

        return counted

    fddp.{sync} = {sync}
sys.argv = [{example!r}] + sys.argv[1:]
runpy.run_path({example!r}, run_name="__main__")
"""


def _torchrun(script: Path, args: tuple[str, ...], run_dir: Path) -> tuple[subprocess.Popen, Path]:
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
        str(script), *(a.format(run=run_dir) for a in args),
    ]  # fmt: skip
    run_dir.mkdir()
    log = run_dir / "log"
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env), log


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> tuple[int, str]:
    """Wait for torchrun (killing it and its workers after ``timeout`` s); return its code and output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    finally:
        kill_marked("FDDP_FAULT_TEST_RUN", log.parent)
    return proc.returncode, log.read_text()


@pytest.mark.parametrize("name", CASES)
def test_sigkilled_worker_restarts_and_ends_bitwise_equal(tmp_path, name):
    case = CASES[name]
    example = EXAMPLES / case.script
    killer = tmp_path / "kill_rank1.py"
    killer.write_text(KILLER.format(sync=case.sync, kill_at=case.kill_at, example=str(example)))
    # Both runs at once: most of the cost is starting Python and importing torch.
    faulty = _torchrun(killer, case.args, tmp_path / "faulty")
    clean = _torchrun(example, case.args, tmp_path / "clean")
    faulty_rc, faulty_out = _finish(*faulty, timeout=100)
    clean_rc, clean_out = _finish(*clean, timeout=15)
    for rc, out in [(faulty_rc, faulty_out), (clean_rc, clean_out)]:
        assert rc == 0, f"torchrun exited with {rc} (negative: killed at the test's timeout):\n{out}"

    assert "exitcode: -9" in faulty_out, f"rank 1 was not killed by SIGKILL:\n{faulty_out}"
    assert case.resumed in faulty_out, faulty_out
    assert "resumed" not in clean_out and "exitcode" not in clean_out, clean_out
    clean_ckpts = ckpt.steps(tmp_path / "clean" / case.ckpt_dir)
    faulty_ckpts = ckpt.steps(tmp_path / "faulty" / case.ckpt_dir)
    step = clean_ckpts[-1][0]
    assert faulty_ckpts[-1][0] == step, (clean_ckpts, faulty_ckpts)
    reference, resumed = ckpt.load(clean_ckpts[-1][1]), ckpt.load(faulty_ckpts[-1][1])
    paths, leaves, spec = optree.tree_flatten_with_path(reference)
    resumed_leaves, resumed_spec = optree.tree_flatten(resumed)
    assert resumed_spec == spec
    for path, a, b in zip(paths, resumed_leaves, leaves):
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        assert same, f"{path} differs after the resume (checkpoint of step {step})"
    # Guard against a vacuous pass: training moved the parameters since the previous checkpoint.
    before = ckpt.load(clean_ckpts[-2][1])["params"]
    assert any(not torch.equal(reference["params"][k], before[k]) for k in before)


def test_restart_scoped_store_only_under_torchruns_shared_store(monkeypatch):
    """fddp.init scopes the process group's store keys by a session id (see
    fddp.runtime._restart_scoped_store) where torchrun's agent store is shared by the workers."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    env = dict(
        RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port),
        TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="1",
    )  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    scoped = runtime._restart_scoped_store(datetime.timedelta(seconds=10))
    scoped.set("k", "v")
    again = runtime._restart_scoped_store(datetime.timedelta(seconds=10))
    assert scoped.check(["k"]) and not again.check(["k"])  # a new start sees none of the old keys
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # the store is not torchrun's
    assert runtime._restart_scoped_store(None) is None


def _attempt(port: int, size: int, delays: list[float]) -> list[str]:
    """One start of a group: each rank (a thread) waits its delay, then runs the handshake."""
    sessions: list[str | None] = [None] * size

    def rank(r: int) -> None:
        time.sleep(delays[r])
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=20))
        sessions[r] = runtime._agree_on_session(store, r, size, datetime.timedelta(seconds=20))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(s is not None for s in sessions), sessions
    return sessions


def test_session_handshake_ignores_a_dead_attempts_keys():
    """pytorch issue #135712: the keys of an earlier start of the group stay in torchrun's store. A
    rank that starts early must not take a late peer's old entries for new ones, whichever is late."""
    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    seen = set()
    for delays in ([0, 0, 0], [0, 0.3, 0.1], [0.3, 0, 0], [0, 0.2, 0.2]):
        sessions = _attempt(server.port, 3, delays)
        assert len(set(sessions)) == 1, (delays, sessions)  # every rank holds the same id...
        assert sessions[0] not in seen, delays  # ...and no earlier attempt's
        seen.add(sessions[0])
