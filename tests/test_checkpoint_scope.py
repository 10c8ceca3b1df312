"""Checkpoint calls as fddp calls, housekeeping that cannot fail a checkpoint, one writer per
directory, and ``fddp.zero.load_full`` inside its call scope (issue 38, items 2, 3 and 8).

A failure on one rank anywhere in a checkpoint call (rank 0's cleanup of old temporaries, its
lock, its write; a rank that cannot read what it loads) must reach every rank as an fddp error
within seconds (the harness's group timeout is 30 s: a hang would show), the group still usable.
Pruning old checkpoints after a complete save is housekeeping: its failure warns, the checkpoint
loads, and the next save prunes. A second job that saves into a directory another job writes is
refused with an error naming the first, unless the first is provably gone.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from typing import Any, Callable

import pytest
import torch

import fddp
from dist import run
from fddp import checkpoint as ckpt
from fddp.checkpoint import CheckpointError, _lock, _sharded, _steps, _temp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_QUICK_S = 5.0  # every rank's error within this; the group's timeout (30 s) is what a hang would take


def _outcome(fn: Callable[[], Any]) -> tuple:
    """``("ok", value, seconds, warnings)`` or ``(exception type, message, seconds, warnings)``."""
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            value = fn()
            kind, what = "ok", str(value)
        except Exception as e:  # noqa: BLE001 - each rank reports what it raised
            kind, what = type(e).__name__, str(e)
    return (kind, what, time.monotonic() - t0, [str(w.message) for w in seen])


def _injected(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.EIO, "injected I/O error")


class _Patched:
    """Replace ``module.name`` with ``value`` on ``ranks`` while the block runs."""

    def __init__(self, module: Any, name: str, value: Any, ranks: tuple[int, ...]) -> None:
        self.module, self.name, self.value, self.ranks = module, name, value, ranks

    def __enter__(self) -> None:
        self.old = getattr(self.module, self.name)
        if fddp.rank() in self.ranks:
            setattr(self.module, self.name, self.value)

    def __exit__(self, *exc: Any) -> None:
        setattr(self.module, self.name, self.old)


def _file_tree(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "step": step}


def _sharded_tree(step: int) -> dict:
    return {"params": fddp.zero.shard({"w": torch.full((16,), float(step))}), "step": step, "mine": ckpt.PerRank({"r": fddp.rank()})}


# --- an OSError in each housekeeping step, on one rank -------------------------------------------------


def _housekeeping_worker(root: str) -> dict:
    out: dict[str, Any] = {}
    kinds = {"file": _file_tree, "sharded": _sharded_tree}
    # Before anything is written: rank 0's cleanup of abandoned temporaries, and its lock.
    for kind, tree in kinds.items():
        for name, (module, attr) in {"clean": (_temp, "clean"), "lock": (_lock, "hold")}.items():
            directory = os.path.join(root, f"{name}-{kind}")
            with _Patched(module, attr, _injected, ranks=(0,)):
                out[f"{name}, {kind}"] = _outcome(lambda: ckpt.save_step(directory, 1, tree(1), keep=1))
            # The group is still in step: the same save goes through on every rank.
            out[f"{name}, {kind}, again"] = _outcome(lambda: ckpt.save_step(directory, 1, tree(1), keep=1))
    # After the checkpoint is complete: pruning fails on rank 0. A warning; every later save retries.
    for kind, tree in kinds.items():
        directory = os.path.join(root, f"prune-{kind}")
        ckpt.save_step(directory, 1, tree(1), keep=1)
        with _Patched(_steps, "_remove", _injected, ranks=(0,)):
            out[f"prune, {kind}"] = _outcome(lambda: ckpt.save_step(directory, 2, tree(2), keep=1))
            out[f"prune, {kind}, steps"] = [s for s, _ in ckpt.steps(directory)]
        like = {"w": torch.zeros(16), "step": 0} if kind == "file" else _sharded_tree(0)
        out[f"prune, {kind}, loads"] = ckpt.load_step(ckpt.latest(directory), like)["step"]
        out[f"prune, {kind}, next"] = _outcome(lambda: ckpt.save_step(directory, 3, tree(3), keep=1))
        out[f"prune, {kind}, next steps"] = [s for s, _ in ckpt.steps(directory)]
    # After DCP's collectives, before the rename: every rank raises, through the closing barrier.
    directory = os.path.join(root, "finish")
    with _Patched(_sharded, "_finish", _injected, ranks=(0,)):
        out["finish"] = _outcome(lambda: ckpt.save_step(directory, 1, _sharded_tree(1)))
    out["finish, left"] = sorted(n for n in os.listdir(directory) if n != _lock.NAME) if os.path.isdir(directory) else []
    out["finish, again"] = _outcome(lambda: ckpt.save_step(directory, 1, _sharded_tree(1)))
    # Loading: one rank cannot read the checkpoint, or holds another tree.
    like = _sharded_tree(0)
    with _Patched(_sharded, "_read_manifest", _injected, ranks=(1,)):
        out["load, unreadable"] = _outcome(lambda: ckpt.load_step(ckpt.latest(directory), like))
    other = {**like, "params": {"w": torch.zeros(16 + fddp.rank())}}  # full leaves (replicated), one of another shape
    out["load, other tree"] = _outcome(lambda: ckpt.load_sharded(ckpt.latest(directory), other))
    out["load, again"] = _outcome(lambda: ckpt.load_step(ckpt.latest(directory), like)["step"])
    return out


def test_an_oserror_in_any_housekeeping_step_on_one_rank_is_an_error_on_every_rank_within_seconds():
    root = tempfile.mkdtemp(prefix="fddp-scope-")
    try:
        r0, r1 = run(_housekeeping_worker, 2, root, timeout=240)
    finally:
        subprocess.run(["rm", "-rf", root], check=False)
    for case in ("clean, file", "clean, sharded", "lock, file", "lock, sharded"):
        (k0, m0, s0, _), (k1, m1, s1, _) = r0[case], r1[case]
        assert k0 == "OSError" and "injected" in m0, (case, r0[case])
        assert k1 == "PeerError" and "rank 0 failed in fddp.checkpoint.save_step" in m1 and "injected" in m1, (case, r1[case])
        assert "still in step" in m1 and s1 < _QUICK_S, (case, r1[case])
        assert r0[case + ", again"][0] == r1[case + ", again"][0] == "ok", (case, r0[case + ", again"], r1[case + ", again"])
    for kind in ("file", "sharded"):
        (k0, _, _, w0), (k1, _, _, _) = r0[f"prune, {kind}"], r1[f"prune, {kind}"]
        assert k0 == k1 == "ok", (kind, r0[f"prune, {kind}"], r1[f"prune, {kind}"])
        assert any("is saved, but removing older checkpoints" in w and "tries again" in w for w in w0), w0
        assert r0[f"prune, {kind}, steps"] == [1, 2], r0  # the old step stays, the new one is complete
        assert r0[f"prune, {kind}, loads"] == r1[f"prune, {kind}, loads"] == 2
        assert r0[f"prune, {kind}, next"][0] == "ok" and not r0[f"prune, {kind}, next"][3], r0[f"prune, {kind}, next"]
        assert r0[f"prune, {kind}, next steps"] == [3], r0  # the next save pruned what the failed one left
    (k0, m0, _, _), (k1, m1, s1, _) = r0["finish"], r1["finish"]
    assert k0 == "OSError" and "injected" in m0, r0["finish"]
    assert k1 == "CheckpointError" and "not written: 1 rank(s) of the group failed" in m1 and s1 < _QUICK_S, r1["finish"]
    assert r0["finish, left"] == [], r0["finish, left"]  # its temporary removed, nothing under the step's name
    assert r0["finish, again"][0] == r1["finish, again"][0] == "ok", (r0["finish, again"], r1["finish, again"])
    (k0, m0, s0, _), (k1, m1, _, _) = r0["load, unreadable"], r1["load, unreadable"]
    assert k1 == "OSError" and k0 == "PeerError" and "rank 1 failed in fddp.checkpoint.load" in m0 and s0 < _QUICK_S, (r0, r1)
    (k0, m0, s0, _), (k1, m1, _, _) = r0["load, other tree"], r1["load, other tree"]
    assert k1 == "CheckpointError" and "does not match `like` at 'params/w'" in m1, r1["load, other tree"]
    assert k0 == "PeerError" and "CheckpointError" in m0 and s0 < _QUICK_S, r0["load, other tree"]
    assert r0["load, again"][:2] == r1["load, again"][:2] == ("ok", "1"), (r0["load, again"], r1["load, again"])


# --- fddp.zero.load_full -----------------------------------------------------------------------------


def _load_full_worker() -> dict:
    values = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5.0)}
    shards = fddp.zero.shard({k: torch.zeros_like(v) for k, v in values.items()})
    lacking = values if fddp.rank() == 0 else {"w": values["w"]}  # rank 1's copy of the weights lacks a key
    out = {"missing": _outcome(lambda: fddp.zero.load_full(shards, lacking))}
    full = fddp.zero.load_full(shards, values)  # the group is still in step
    out["again"] = all(torch.equal(v, values[k]) for k, v in fddp.zero.gather(full).wait().items())
    return out


def test_load_full_failing_on_one_rank_is_a_peer_error_on_the_other_within_seconds():
    r0, r1 = run(_load_full_worker, 2, timeout=120)
    (k1, m1, _, _), (k0, m0, s0, _) = r1["missing"], r0["missing"]
    assert k1 == "ValueError" and "no value for 1 of 2 leaves: 'b'" in m1, r1
    assert k0 == "PeerError" and "rank 1 failed in fddp.zero.load_full" in m0 and "ValueError" in m0 and s0 < _QUICK_S, r0
    assert r0["again"] and r1["again"]


# --- one writer per directory ---------------------------------------------------------------------------


def _lock_file(directory, **holder: Any) -> str:
    lock = os.path.join(directory, _lock.NAME)
    os.makedirs(directory, exist_ok=True)
    base = {"host": "elsewhere", "host_id": f"{_temp.HOST_ID:012x}", "pid": os.getppid(), "start": None, "job": None,
            "since": "2026-01-01T00:00:00+00:00", "token": "0123456789abcdef"}  # fmt: skip
    with open(lock, "w") as f:
        json.dump({**base, **holder}, f)
    return lock


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_directory_held_by_a_live_writer_on_this_host_is_refused_naming_it(tmp_path):
    lock = _lock_file(tmp_path, pid=os.getppid(), job="TORCHELASTIC_RUN_ID=other")  # a running process of this host
    with pytest.raises(CheckpointError) as info:
        ckpt.save_step(tmp_path, 1, _file_tree(1))
    message = str(info.value)
    assert f"process {os.getppid()} on host 'elsewhere', job TORCHELASTIC_RUN_ID=other" in message, message
    assert "still running on this host" in message and "another directory" in message and f"rm '{lock}'" in message, message
    assert ckpt.steps(tmp_path) == [] and json.load(open(lock))["token"] == "0123456789abcdef"  # nothing written, lock kept


def test_a_lock_from_another_host_is_refused_and_one_of_this_job_taken_over(tmp_path, monkeypatch):
    other_host = f"{_temp.HOST_ID ^ 1:012x}"
    _lock_file(tmp_path, host_id=other_host, job="TORCHELASTIC_RUN_ID=job-a")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    with pytest.raises(CheckpointError, match="another host or container, so fddp cannot tell whether it still runs"):
        ckpt.save_step(tmp_path, 1, _file_tree(1))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id names no job
    _lock_file(tmp_path, host_id=other_host, job=None)
    with pytest.raises(CheckpointError, match="another job writes"):
        ckpt.save_step(tmp_path, 1, _file_tree(1))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")  # a restart of the job that holds it, on another host
    _lock_file(tmp_path, host_id=other_host, job="TORCHELASTIC_RUN_ID=job-a")
    with pytest.warns(UserWarning, match="took over .* an earlier run of this job"):
        ckpt.save_step(tmp_path, 1, _file_tree(1))
    assert ckpt.steps(tmp_path)[0][0] == 1 and json.load(open(tmp_path / _lock.NAME))["pid"] == os.getpid()
    ckpt._lock.release(str(tmp_path))
    assert not os.path.exists(tmp_path / _lock.NAME)


def test_a_lock_whose_process_is_gone_is_taken_over_with_a_warning(tmp_path):
    _lock_file(tmp_path, pid=_dead_pid())
    with pytest.warns(UserWarning, match="its process is no longer running"):
        ckpt.save_step(tmp_path, 1, _file_tree(1))
    # A PID that runs again, started after the lock was taken: another process.
    _lock.release(str(tmp_path))
    _lock_file(tmp_path, pid=os.getppid(), start=-1)
    with pytest.warns(UserWarning, match="the PID now belongs to a newer process"):
        ckpt.save_step(tmp_path, 2, _file_tree(2))
    # Held: later saves check it is still theirs; taken from under them, they stop.
    ckpt.save_step(tmp_path, 3, _file_tree(3))
    _lock_file(tmp_path, pid=os.getppid(), token="fedcba9876543210")
    with pytest.raises(CheckpointError, match="another job writes"):
        ckpt.save_step(tmp_path, 4, _file_tree(4))
    assert [s for s, _ in ckpt.steps(tmp_path)] == [1, 2, 3]
    os.remove(tmp_path / _lock.NAME)
    _lock.release(str(tmp_path))


_JOB = textwrap.dedent(
    """
    import sys, time
    import torch
    from fddp import checkpoint as ckpt
    for step in (1, 2):
        ckpt.save_step(sys.argv[1], step, {"w": torch.full((4,), float(step)), "job": "a"}, keep=2)
    print("SAVED", flush=True)
    time.sleep(600)
    """
)


def test_two_jobs_in_one_directory_the_second_is_refused_until_the_first_is_gone(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    pipe = subprocess.PIPE
    job_a = subprocess.Popen([sys.executable, "-c", _JOB, str(tmp_path)], stdout=pipe, stderr=pipe, text=True, env=env)
    try:
        line = job_a.stdout.readline()
        assert line == "SAVED\n", job_a.stderr.read() if job_a.poll() is not None else line
        # Job B (this process) would rotate job A's checkpoints away as its own old ones: refused.
        with pytest.raises(CheckpointError, match=rf"process {job_a.pid} on host .* still running on this host"):
            ckpt.save_step(tmp_path, 3, {"w": torch.zeros(4), "job": "b"}, keep=2)
        assert [s for s, _ in ckpt.steps(tmp_path)] == [1, 2]
        assert ckpt.load(ckpt.latest(tmp_path))["job"] == "a"
        os.kill(job_a.pid, signal.SIGKILL)
        job_a.wait(timeout=30)
        with pytest.warns(UserWarning, match=rf"took over .* process {job_a.pid} .* no longer running"):
            ckpt.save_step(tmp_path, 3, {"w": torch.zeros(4), "job": "b"}, keep=2)
        assert [s for s, _ in ckpt.steps(tmp_path)] == [2, 3]
    finally:
        if job_a.poll() is None:
            job_a.kill()
            job_a.wait()
        job_a.stdout.close()
        job_a.stderr.close()
        _lock.release(str(tmp_path))


def _held_lock_worker(directory: str) -> dict:
    if fddp.rank() == 0:  # another job's writer, alive on this host, holds the directory
        _lock_file(directory, pid=os.getppid())
    torch.distributed.barrier()
    return {"save": _outcome(lambda: ckpt.save_step(directory, 1, _sharded_tree(1)))}


def test_a_held_directory_reaches_every_rank_as_an_fddp_error():
    directory = tempfile.mkdtemp(prefix="fddp-lock-")
    try:
        r0, r1 = run(_held_lock_worker, 2, directory, timeout=120)
    finally:
        subprocess.run(["rm", "-rf", directory], check=False)
    (k0, m0, _, _), (k1, m1, s1, _) = r0["save"], r1["save"]
    assert k0 == "CheckpointError" and "another job writes checkpoints into this directory" in m0, r0
    assert k1 == "PeerError" and "rank 0 failed in fddp.checkpoint.save_step" in m1 and "another job writes" in m1, r1
    assert s1 < _QUICK_S, r1
