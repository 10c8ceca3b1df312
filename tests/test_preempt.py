"""Checkpoints that survive preemption (issue 47): :class:`fddp.checkpoint.Manager` saves on a signal
at a step boundary on every rank together, and writes asynchronously without losing a checkpoint.

- a real torchrun job of 2 ranks, one of them sent SIGTERM mid-training: both ranks save the step
  they reached and exit cleanly, and a fresh job resumes from that checkpoint to the same
  parameters, bitwise, as an uninterrupted run;
- a process SIGKILLed in the middle of an asynchronous write: the previous checkpoint is the
  latest and loads, the torn temporary never counts, and the next run cleans it up;
- a failed asynchronous write (an injected OSError on the writer): every rank raises at the same
  step, the next one, and every earlier checkpoint is intact;
- step boundaries: a signal is learnt by every rank even where no fddp call runs between two
  boundaries; where the steps make fddp calls, the manager adds no collective; threads and memory
  stay flat over many asynchronous saves.

Issue 53, jobs stopped as schedulers stop them:

- SIGTERM, and SIGINT, to torchrun's agent and its 2 workers together (what SLURM does; the agent
  forwards it, so each worker gets it twice): both workers save the step they reached and stop,
  with and without an asynchronous save in flight, and with the agent's forward 2.5 s late;
- a signal repeated within the grace period is one request, also while ``close`` runs; a later
  one before the save interrupts;
- one writer per directory and prefix in a process: a second Manager, or ``save_step``, of another
  group on a series is refused naming both.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

import fddp
from dist import kill_marked, run
from fddp import checkpoint as ckpt

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _env(marker: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        env.pop(k, None)
    # The marker lets the test find and kill exactly the processes it started.
    env.update(
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", FDDP_PREEMPT_TEST_RUN=str(marker),
        PYTHONPATH=os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")]),
    )  # fmt: skip
    return env


class _Job:
    """``tests/preempt_job.py`` under torchrun, 2 ranks; output in ``out/log``. ``slow``: rank 0's
    write of one step's checkpoint is slow (``"STEP:SECONDS"``, see preempt_job.py)."""

    def __init__(self, directory: Path, steps: int, delay: float, out: Path, slow: str | None = None) -> None:
        out.mkdir()
        self.out = out
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
            "--shutdown-timeout=100",  # a signalled agent SIGKILLs its workers after this (30 s by default): a loaded machine is slow
            str(TESTS / "preempt_job.py"), str(directory), str(steps), str(delay), str(out),
        ]  # fmt: skip
        env = _env(out)
        if slow is not None:
            env["FDDP_PREEMPT_TEST_SLOW"] = slow
        with open(out / "log", "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)

    def read(self, name: str) -> str | None:
        try:
            return (self.out / name).read_text()
        except FileNotFoundError:
            return None

    def wait_for(self, name: str, at_least: int | None = None, timeout: float = 180) -> None:
        """Wait until the job has written ``name`` (holding a number >= ``at_least``, if given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.read(name)
            if text is not None and (at_least is None or int(text) >= at_least):
                return
            assert self.proc.poll() is None, self.read("log")
            time.sleep(0.05)
        pytest.fail(f"no {name} within {timeout} s:\n{self.read('log')}")

    def finish(self, timeout: float, ok: bool = True) -> str:
        """Wait for torchrun to end; ``ok``: it must exit 0 (not so where the agent itself got the signal)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        finally:
            kill_marked("FDDP_PREEMPT_TEST_RUN", self.out)
        log = (self.out / "log").read_text()
        assert self.proc.returncode == 0 or not ok, f"torchrun exited with {self.proc.returncode}:\n{log}"
        return log


def test_sigterm_to_one_rank_saves_the_step_both_reached_and_a_fresh_job_resumes_bitwise(tmp_path):
    steps = 20
    reference = _Job(tmp_path / "ref", steps, 0.0, tmp_path / "ref-out")
    preempted = _Job(tmp_path / "ckpts", steps, 0.3, tmp_path / "preempted")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # rank 1 is mid-training: a few steps done, many to go
        progress = preempted.read("progress-1")
        if progress is not None and int(progress) >= 5:
            break
        assert preempted.proc.poll() is None, preempted.read("log")
        time.sleep(0.1)
    else:
        pytest.fail(f"rank 1 made no progress:\n{preempted.read('log')}")
    os.kill(int(preempted.read("pid-1")), signal.SIGTERM)
    preempted.finish(timeout=120)
    reference.finish(timeout=120)

    done = [json.loads(preempted.read(f"done-{r}")) for r in range(2)]
    reached = done[0]["last"]
    assert done[1] == done[0] and done[0]["preempted"] and 5 <= reached < steps, done
    found = ckpt.steps(tmp_path / "ckpts")
    assert found[-1][0] == reached and len(found) <= 2, found  # keep=2, the signal's save the newest
    saved = ckpt.load(found[-1][1])
    assert saved["step"] == reached
    assert not [n for n in os.listdir(tmp_path / "ckpts") if ".tmp-" in n]

    resumed = _Job(tmp_path / "ckpts", steps, 0.0, tmp_path / "resumed")
    resumed.finish(timeout=120)
    done = json.loads(resumed.read("done-0"))
    assert done == {"start": reached, "last": steps, "preempted": False}, done
    want, got = ckpt.load(tmp_path / "ref-out" / "final.pt"), ckpt.load(tmp_path / "resumed" / "final.pt")
    for name in want["params"]:
        assert torch.equal(got["params"][name], want["params"][name]), name
    assert not torch.equal(got["params"]["w"], saved["params"]["w"])  # the resumed job trained


def _signal_the_step(job: _Job, sig: int, agent_after: float = 0.0) -> None:
    """What SLURM does at ``scancel``, the time limit or ``--signal`` (and a Ctrl-C under ``srun``):
    signal every process of the job step, torchrun's agent and its workers together; the agent
    forwards the signal to its workers too, so each worker gets it twice within milliseconds, or,
    from an agent on a loaded node, ``agent_after`` seconds later (past the grace period)."""
    workers = [int(job.read(f"pid-{r}")) for r in range(2)]
    if not agent_after:
        os.kill(job.proc.pid, sig)
    for pid in workers:
        os.kill(pid, sig)
    if agent_after:
        time.sleep(agent_after)
        os.kill(job.proc.pid, sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_torchrun_agent_and_its_workers_saves_the_step_both_reached(tmp_path, sig):
    # Two jobs at once: in one, no save is in flight when the signal comes; in the other, the
    # asynchronous save of step 4 is still being written (4 s more): it must complete, and the
    # signal's save of the reached step after it; there the agent's forward comes 2.5 s late,
    # before the save (what a loaded machine did: it killed both workers short of their save).
    plain = _Job(tmp_path / "plain", 60, 0.3, tmp_path / "plain-out")
    slow = _Job(tmp_path / "slow", 60, 0.5, tmp_path / "slow-out", slow="4:4")
    try:
        plain.wait_for("progress-1", at_least=2)
        _signal_the_step(plain, sig)
        slow.wait_for("writing-4")
        _signal_the_step(slow, sig, agent_after=2.5)
    finally:
        logs = {"plain": plain.finish(timeout=120, ok=False), "slow": slow.finish(timeout=120, ok=False)}
    for name, job in (("plain", plain), ("slow", slow)):
        done = [job.read(f"done-{r}") for r in range(2)]
        if None in done:  # every worker left the loop; if not, the whole log says why (an assert's repr would cut it)
            pytest.fail(f"{name}: done files {done}; progress {[job.read(f'progress-{r}') for r in range(2)]}; log:\n{logs[name][-6000:]}")
        done = [json.loads(d) for d in done]
        reached = done[0]["last"]
        assert done[1] == done[0] and done[0]["preempted"] and 2 <= reached < 60, (name, done, logs[name])
        assert [job.read(f"exit-{r}") for r in range(2)] == ["", ""], (name, logs[name])  # and ended normally
        found = [s for s, _ in ckpt.steps(tmp_path / name)]
        assert found[-1] == reached and len(found) <= 2, (name, found)
        assert ckpt.load(ckpt.latest(tmp_path / name))["step"] == reached
    reached = json.loads(slow.read("done-0"))["last"]
    if reached < 8:  # (a signal learnt only at step 9 or later: step 8's periodic save pruned step 4's, rightly)
        assert [s for s, _ in ckpt.steps(tmp_path / "slow")] == [4, reached]  # the save in flight was not lost either


KILLED = """
import os, sys, time, torch
import fddp.checkpoint as ckpt
from fddp.checkpoint import _codec

directory, hang_at = sys.argv[1], int(sys.argv[2])
real = _codec.write

def write(f, payload):
    if f"ckpt-{hang_at:08d}.pt.tmp-" in f.name:
        f.write(b"PK\\x03\\x04 half a checkpoint")  # torn: what a kill mid-write leaves
        f.flush()
        open(os.path.join(directory, "..", "writing"), "w").close()
        time.sleep(600)  # until the test's SIGKILL
    real(f, payload)

_codec.write = write
w = torch.zeros(4)
with ckpt.Manager(directory, every=2, keep=3, async_=True) as manager:
    for step in range(1, 9):
        w += 1  # in place: the snapshot must not see later steps
        manager.step(step, {"w": w, "step": step})
        time.sleep(0.05)
print("finished")
"""


def test_a_kill_during_an_async_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    directory = tmp_path / "ckpts"
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    proc = subprocess.Popen([sys.executable, str(script), str(directory), "4"], env=_env(tmp_path), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "writing").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode() if proc.poll() else "slow"
            time.sleep(0.05)
        proc.kill()  # SIGKILL in the middle of the write of step 4
        proc.wait()
    finally:
        kill_marked("FDDP_PREEMPT_TEST_RUN", tmp_path)
    names = os.listdir(directory)
    assert any(n.startswith("ckpt-00000004.pt.tmp-") for n in names), names  # the torn temporary
    assert [s for s, _ in ckpt.steps(directory)] == [2]  # never taken for a checkpoint
    assert ckpt.load_step(ckpt.latest(directory), like={"w": torch.zeros(4), "step": 0})["step"] == 2
    assert torch.equal(ckpt.load(ckpt.latest(directory))["w"], torch.full((4,), 2.0))

    # The next run takes over the lock of the dead writer and deletes its abandoned temporary.
    proc = subprocess.run([sys.executable, str(script), str(directory), "-1"], env=_env(tmp_path), capture_output=True, timeout=120)
    assert proc.returncode == 0 and b"finished" in proc.stdout and b"took over" in proc.stderr, proc.stderr.decode()
    assert sorted(os.listdir(directory)) == ["ckpt-00000004.pt", "ckpt-00000006.pt", "ckpt-00000008.pt"]  # the lock: released at exit
    assert torch.equal(ckpt.load(ckpt.latest(directory))["w"], torch.full((4,), 8.0))


def _failed_write_worker(directory: str) -> tuple:
    """Every step saves asynchronously; the writer's write of step 4 fails with ENOSPC."""
    from fddp.checkpoint import _codec

    real = _codec.write

    def write(f, payload):
        if fddp.rank() == 0 and "ckpt-00000004.pt.tmp-" in f.name:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        real(f, payload)

    _codec.write = write
    params = fddp.broadcast({"w": torch.ones(3)})
    raised = None
    try:
        with ckpt.Manager(directory, every=1, keep=2, async_=True, signals=()) as manager:
            for step in range(1, 9):
                grads = fddp.ddp_step(params, {"w": params["w"] * step})
                params = {"w": params["w"] - 0.1 * grads["w"]}
                try:
                    manager.step(step, {"w": params["w"], "step": step})
                except ckpt.CheckpointError as e:
                    raised = (step, str(e), type(e.__cause__).__name__)
                    break
    finally:
        _codec.write = real
    fddp.broadcast({"after": torch.zeros(1)})  # the group is still in step
    return raised, [s for s, _ in ckpt.steps(directory)], sorted(os.listdir(directory))


def test_a_failed_async_write_raises_on_every_rank_at_the_next_step_and_keeps_earlier_checkpoints(tmp_path):
    (r0, steps0, names), (r1, steps1, _) = run(_failed_write_worker, 2, str(tmp_path))
    assert r0[0] == r1[0] == 5, (r0, r1)  # the step after the failed save of step 4, on both ranks
    assert r0[2] == "OSError" and "No space left" in r0[1] and "step 4" in r0[1] and "intact" in r0[1], r0
    assert "rank 0" in r1[1] and "step 4" in r1[1], r1
    assert steps0 == steps1 == [2, 3], steps0  # nothing pruned for the failed save, nothing torn
    assert names == [".fddp-writer.lock", "ckpt-00000002.pt", "ckpt-00000003.pt"], names
    assert ckpt.load(tmp_path / "ckpt-00000003.pt")["step"] == 3


def _boundaries_worker(directory: str) -> dict:
    import torch.distributed as dist

    from fddp._dist import _agreement

    out = {}
    def until_signalled(name: str, at: int, by: int, call=None, group=None) -> tuple[int, list[int]]:
        """Steps of a Manager (in directory/name) until a stop; rank ``by`` signals itself at step
        ``at``, after ``call``: the step it stopped at, and the steps saved."""
        with ckpt.Manager(os.path.join(directory, name), every=None, keep=2, group=group) as manager:
            for step in range(1, 10):
                if call is not None:
                    call()
                if step == at and fddp.rank() == by:
                    os.kill(os.getpid(), signal.SIGTERM)
                manager.step(step, {"step": step})
                if manager.should_stop:
                    break
        return step, [s for s, _ in ckpt.steps(os.path.join(directory, name))]

    # 1. No fddp call between boundaries: the boundary agrees itself; rank 1's signal reaches both.
    out["quiet"] = until_signalled("quiet", 3, 1)
    out["handler restored"] = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    # ... and with the agreement off (no header to ride in): rank 0's signal, saved by both ranks.
    fddp.set_checks(agreement=False)
    try:
        out["off"] = until_signalled("off", 4, 0, call=lambda: fddp.broadcast({"w": torch.ones(2)}))
    finally:
        fddp.set_checks(agreement=True)
    # ... and on an NCCL-like group (headers on a gloo side group, small tensors on a device that is
    # not the CPU, "meta" here): the boundary's values go on the side group, never a device tensor.
    from test_control import _side_group

    from fddp.checkpoint import _ranks

    g = _side_group()
    real_device, real_all_reduce, groups = _ranks.collective_device, dist.all_reduce, []
    _ranks.collective_device = lambda group: torch.device("meta") if group is g else real_device(group)
    dist.all_reduce = lambda *a, **k: groups.append(k.get("group")) or real_all_reduce(*a, **k)
    fddp.set_checks(agreement=False)
    try:
        step, saved = until_signalled("side", 4, 1, group=g)
    finally:
        fddp.set_checks(agreement=True)
        _ranks.collective_device, dist.all_reduce = real_device, real_all_reduce
    side = fddp._dist.control_group(g)
    out["off, side group"] = (step, saved, len(groups) >= 4, all(x is side for x in groups))  # one a boundary at least

    # 2. Steps that make fddp calls carry the requests: the manager adds no collective to them.
    params = fddp.broadcast({"w": torch.ones(64)})
    counted = [0]
    real = dist.all_reduce

    def counting(*args, **kwargs):
        counted[0] += 1
        return real(*args, **kwargs)

    def loop(manager) -> int:
        for step in range(1, 4):  # the history settles (the in-band header)
            fddp.ddp_step(params, params)
            manager.step(step, params) if manager else None
        counted[0] = 0
        dist.all_reduce = counting
        try:
            for step in range(4, 24):
                fddp.ddp_step(params, params)
                manager.step(step, params) if manager else None
        finally:
            dist.all_reduce = real
        return counted[0]

    out["collectives"] = loop(None)
    with ckpt.Manager(os.path.join(directory, "loud"), every=None, signals=()) as manager:
        out["collectives with a manager"] = loop(manager)

    # 3. Many asynchronous saves: no thread, snapshot, Python object or queued request left behind.
    # (tracemalloc sees Python's objects, RSS the snapshots' tensor data, 1 MiB a step.)
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def ours() -> int:  # Python memory allocated by fddp.checkpoint itself
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/fddp/checkpoint/*")])
        return sum(stat.size for stat in snapshot.statistics("filename"))

    threads = threading.active_count()
    w = torch.zeros(1 << 18)
    tracemalloc.start()
    with ckpt.Manager(os.path.join(directory, "many"), every=1, keep=2, async_=True, signals=()) as manager:
        for step in range(1, 61):
            fddp.ddp_step(params, params)
            w += 1  # in place, after the snapshot
            manager.step(step, {"w": w, "step": step})
            if step == 20:
                base = ours(), rss()
            out["max threads"] = max(out.get("max threads", 0), threading.active_count() - threads)
        out["grown"] = ours() - base[0], rss() - base[1]
    tracemalloc.stop()
    out["threads left"] = threading.active_count() - threads
    out["queued requests"] = len(_agreement._asked)
    fddp.broadcast({"written": torch.zeros(1)})  # close() waits for this rank's write only: wait for rank 0's
    out["many"] = [s for s, _ in ckpt.steps(os.path.join(directory, "many"))]
    return out


def test_step_boundaries_learn_signals_add_no_collective_and_leak_nothing(tmp_path):
    for r, out in enumerate(run(_boundaries_worker, 2, str(tmp_path), timeout=180)):
        assert out["quiet"] == (3, [3]), (r, out)  # both ranks saved step 3 and stopped there
        assert out["off"] == (4, [4]), (r, out)
        assert out["off, side group"] == (4, [4], True, True), (r, out)
        assert out["handler restored"], r
        assert out["collectives with a manager"] == out["collectives"] == 20, (r, out)
        assert out["max threads"] <= 1 and out["threads left"] == 0 and out["queued requests"] == 0, (r, out)
        assert out["grown"][0] < 16 * 1024 and out["grown"][1] < 16 * 2**20, (r, out)  # 40 leaked snapshots: 40 MiB
        assert out["many"] == [59, 60], (r, out)


def test_manager_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        ckpt.Manager(tmp_path, every=0)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or what an earlier test in this process left (tools/cluster.py's)
    try:
        with ckpt.Manager(tmp_path):
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # ignored stays ignored
            assert signal.getsignal(signal.SIGTERM) != before
        assert signal.getsignal(signal.SIGTERM) == before  # put back
    finally:
        signal.signal(signal.SIGINT, previous)
    with ckpt.Manager(tmp_path, signals=()) as first:
        with pytest.raises(RuntimeError, match="is open on this process group"):
            ckpt.Manager(tmp_path / "b", signals=())
        del first
    error = []
    t = threading.Thread(target=lambda: error.append(pytest.raises(ValueError, ckpt.Manager, tmp_path)))
    t.start()
    t.join()
    assert "main thread" in str(error[0].value)


@pytest.fixture
def ctrl_c():
    """SIGINT as a foreground process has it: a suite started in the background (``cmd &``, nohup)
    inherits it ignored, and an ignored signal stays ignored under a Manager (by design)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_signal_repeated_within_the_grace_period_is_one_request_and_a_later_one_interrupts(tmp_path, monkeypatch, ctrl_c):
    me = os.getpid()
    try:
        with ckpt.Manager(tmp_path / "a") as manager:  # the default grace period, 2 s
            t0 = time.monotonic()
            for sig in (signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGTERM):  # each twice: two paths of one delivery
                os.kill(me, sig)
            assert manager.step(1, {"step": 1}) and manager.should_stop
            os.kill(me, signal.SIGINT)  # after the save, still within the grace period: the same request, no second save
            assert manager.step(2, {"step": 2}) is False
            late = threading.Timer(0.3, os.kill, (me, signal.SIGINT))  # a copy that arrives while close() runs
            late.start()
            t1 = time.monotonic()
        closed = time.monotonic()
        late.join()
    except KeyboardInterrupt:
        pytest.fail("a repeat of one SIGINT within the grace period interrupted")
    assert closed - t0 > 1.9 and closed - t1 < 2.0, (t1 - t0, closed - t1)  # close() waited out the grace period for it
    assert [s for s, _ in ckpt.steps(tmp_path / "a")] == [1]

    with ckpt.Manager(tmp_path / "b", grace=0.2) as manager:
        os.kill(me, signal.SIGINT)
        # Timed from the handler's own record of the first Ctrl-C (the handler runs in the main
        # thread, when it next checks), not from os.kill.
        deadline = time.monotonic() + 5
        while signal.SIGINT not in manager._asked:
            assert time.monotonic() < deadline, (signal.getsignal(signal.SIGINT), threading.enumerate())  # never handled
            time.sleep(0.01)
        time.sleep(max(0.0, manager._asked[signal.SIGINT] + 0.3 - time.monotonic()))
        with pytest.raises(KeyboardInterrupt):  # a deliberate second Ctrl-C, before the save: interrupts as usual
            os.kill(me, signal.SIGINT)
            time.sleep(5)
    assert ckpt.steps(tmp_path / "b") == []

    # In a torchrun worker a late repeat before the save is the agent's forward (seen 2 s late on a
    # loaded machine, which killed a worker short of its save): the same request.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    try:
        with ckpt.Manager(tmp_path / "d", grace=0.2) as manager:
            os.kill(me, signal.SIGINT)
            time.sleep(0.3)
            os.kill(me, signal.SIGINT)
            time.sleep(0.1)
            assert manager.step(1, {"step": 1}) and manager.should_stop
    except KeyboardInterrupt:
        pytest.fail("a torchrun worker's late repeat of one SIGINT interrupted before the save")
    assert [s for s, _ in ckpt.steps(tmp_path / "d")] == [1]
    with pytest.raises(ValueError, match="grace must be"):
        ckpt.Manager(tmp_path / "c", grace=-1)


def _series_worker(directory: str) -> dict:
    import torch.distributed as dist

    g1, g2 = dist.new_group([0, 1]), dist.new_group([0, 1])  # a group each, as the one-manager-per-group error advises
    out = {}
    with ckpt.Manager(directory, every=1, keep=2, group=g1, signals=()) as a:
        try:
            ckpt.Manager(os.path.join(directory, "."), every=1, keep=2, group=g2, signals=())  # the same directory, spelt otherwise
        except ckpt.CheckpointError as e:
            out["second manager"] = str(e)
        try:
            ckpt.save_step(directory, 6, {"who": "b", "step": 6}, group=g2)
        except ckpt.CheckpointError as e:
            out["save_step"] = str(e)
        with ckpt.Manager(directory, every=1, keep=2, prefix="b", group=g2, signals=()) as b:  # a prefix of its own: fine
            for step in range(1, 7):
                a.step(step, {"who": "a", "step": step})
                b.step(step, {"who": "b", "step": step})
        ckpt.save_step(directory, 7, {"who": "a", "step": 7}, keep=2, group=g1)  # the manager's group continues its series
    out["a"] = [(s, ckpt.load(p)["who"]) for s, p in ckpt.steps(directory)]
    out["b"] = [(s, ckpt.load(p)["who"]) for s, p in ckpt.steps(directory, prefix="b")]
    with ckpt.Manager(directory, group=g2, signals=()) as c:  # a closed Manager's series is free again
        c.step(8, {"who": "c", "step": 8})
    # Plain saves: the first claims the series for its group for as long as the group exists.
    plain = os.path.join(directory, "plain")
    ckpt.save_step(plain, 1, {"step": 1}, group=g1)
    try:
        ckpt.save_step(plain, 2, {"step": 2})  # the default group
    except ckpt.CheckpointError as e:
        out["plain"] = str(e)
    ckpt.save_step(plain, 2, {"step": 2}, prefix="other")
    dist.destroy_process_group(g1)
    ckpt.save_step(plain, 3, {"step": 3})  # g1 is gone: its claim with it
    out["plain steps"] = [s for s, _ in ckpt.steps(plain)]
    fddp.broadcast({"done": torch.zeros(1)})
    return out


def test_one_writer_per_directory_and_prefix_in_a_process(tmp_path):
    for r, out in enumerate(run(_series_worker, 2, str(tmp_path))):
        second = out.get("second manager", "")
        assert "Manager" in second and second.count("'ckpt-<step>'") == 1 and "keep=" in second, (r, out)
        assert "prefix of its own" in second and "close the other Manager" in second, (r, second)
        assert second.count("fddp.checkpoint.Manager(") == 2, (r, second)  # both named
        assert "fddp.checkpoint.save_step(" in out.get("save_step", "") and "fddp.checkpoint.Manager(" in out["save_step"], (r, out)
        assert out["a"] == [(6, "a"), (7, "a")] and out["b"] == [(5, "b"), (6, "b")], (r, out)  # no overwrite, no cross-pruning
        assert "the default group" in out.get("plain", "") and "save_step" in out["plain"], (r, out)
        assert out["plain steps"] == [1, 3], (r, out)
