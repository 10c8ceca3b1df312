"""Fault tolerance on torchft (fddp.ft): replica groups that die, restart and rejoin, checked
against a replay of the same batches in one process with torch.optim (the reference).

Each run is a Lighthouse in this process and one process per replica group
(``tests/ft_worker.py``), SIGKILLed and restarted for real. The workers log every step; the
reference replays, from the survivor's log, the steps the job committed, with the groups that took
part in each and their batches (so the batches lost with a dead group are skipped, as the job
skipped them), and must land where the job did. Replicas that come back must end bitwise equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="fault tolerance needs torchft: pip install 'fddp[ft]'")

import fddp  # noqa: E402
import fddp.ft  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import ft_worker  # noqa: E402

WORKER = Path(__file__).with_name("ft_worker.py")
DEADLINE_S = 150.0  # a whole run; each wait below is far shorter


class Run:
    """A Lighthouse here and replica groups as processes; everything is torn down on exit."""

    def __init__(self, tmp: Path, **lighthouse: float) -> None:
        self.tmp, self.options = tmp, dict(min_replicas=1, join_timeout=5.0, heartbeat_timeout=1.0, **lighthouse)
        self.lh = fddp.ft.lighthouse(**self.options)
        self.procs: list[subprocess.Popen] = []
        self.started = time.monotonic()

    def restart_lighthouse(self, down_s: float = 0.5) -> None:
        port = self.lh.address.rsplit(":", 1)[1]
        self.lh.shutdown()
        time.sleep(down_s)
        self.lh = fddp.ft.lighthouse(f"127.0.0.1:{port}", **self.options)

    def spawn(self, replica: int, incarnation: int = 0, *args: str) -> subprocess.Popen:
        out = open(self.tmp / f"out-{replica}-{incarnation}.txt", "w")
        cmd = [sys.executable, str(WORKER), "--lighthouse", self.lh.address, "--replica", str(replica),
               "--incarnation", str(incarnation), "--out", str(self.tmp), *args]  # fmt: skip
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(p)
        return p

    def log(self, replica: int, incarnation: int = 0) -> list[dict]:
        path = self.tmp / f"log-{replica}-{incarnation}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def until(self, what: str, ok, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while not ok():
            for p in self.procs:
                if p.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"a replica group failed while waiting for {what}:\n{self.output(p)}")
            if time.monotonic() > end:
                raise AssertionError(f"timed out waiting for {what}\n" + "\n".join(self.output(p) for p in self.procs))
            time.sleep(0.02)

    def has(self, replica: int, incarnation: int, event: str) -> bool:
        return any(r["event"] == event for r in self.log(replica, incarnation))

    def output(self, p: subprocess.Popen) -> str:
        i = self.procs.index(p)
        name = sorted(self.tmp.glob("out-*.txt"), key=os.path.getmtime)
        text = "".join(f.read_text()[-3000:] for f in name if f"{i}" in f.name)
        return "\n".join(line for line in text.splitlines() if "INFO" not in line)[-4000:]

    def finish(self, *procs: subprocess.Popen) -> None:
        for p in procs:
            left = DEADLINE_S - (time.monotonic() - self.started)
            try:
                assert p.wait(timeout=max(left, 1.0)) == 0, self.output(p)
            except subprocess.TimeoutExpired:
                raise AssertionError("a replica group did not finish:\n" + self.output(p)) from None

    def final(self, replica: int, incarnation: int = 0) -> dict:
        return fddp.checkpoint.load(str(self.tmp / f"final-{replica}-{incarnation}.pt"))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        self.lh.shutdown()


@pytest.fixture
def run(tmp_path):
    r = Run(tmp_path)
    yield r
    r.close()


def assert_bitwise_equal(a, b) -> None:
    la, lb = [torch.as_tensor(x) for x in _leaves(a)], [torch.as_tensor(x) for x in _leaves(b)]
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert torch.equal(x, y), (x - y).abs().max()


def _leaves(tree) -> list:
    import optree

    return optree.tree_leaves(tree)


def _member(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def replay_replicated(steps: list[dict]) -> dict:
    """The job's committed steps, replayed in one process: each step's gradient is the mean over
    the groups in its quorum, weighted by their batch sizes; torch.optim.SGD applies it."""
    params = {k: v.clone().requires_grad_() for k, v in ft_worker.init_params(1).items()}  # replica_0's: the primary
    opt = torch.optim.SGD(params.values(), lr=0.05, momentum=0.5)
    for rec in steps:
        members = [_member(m) for m in rec["members"]]
        total = None
        for m in members:
            n = ft_worker.batch_size(m)
            x, y = ft_worker.batch(m, rec["step"], n)
            g = torch.autograd.grad(ft_worker.loss_fn(params, x, y), list(params.values()))
            g = [gi * float(n) for gi in g]
            total = g if total is None else [a + b for a, b in zip(total, g)]
        weight = float(sum(ft_worker.batch_size(m) for m in members))
        for p, g in zip(params.values(), total):
            p.grad = g / weight
        opt.step()
    return {k: v.detach() for k, v in params.items()}


def test_replicated_step_survives_a_death_in_the_all_reduce_and_the_restarted_group_rejoins_bitwise(run):
    """Replica group 1 is SIGKILLed inside the all-reduce of its 4th step (its first bucket sent);
    group 0 loses that one step, goes on alone, and when group 1 restarts (a new process, a fresh
    random init) it receives the live state and both end bitwise equal, where the reference ends.
    numpy is blocked in every process: the live state must not need it (torchft's own transport does)."""
    common = ["--mode", "replicated", "--steps", "8", "--want", "2", "--after", "3", "--pace", "0.02", "--no-numpy",
              "--go", str(run.tmp / "go")]  # fmt: skip
    a = run.spawn(0, 0, *common)
    b = run.spawn(1, 0, *common, "--die-at", "4")
    b2 = run.spawn(1, 1, *common, "--wait", str(run.tmp / "restart"))  # imports now, starts when told
    run.until("both groups' Managers", lambda: run.has(0, 0, "up") and run.has(1, 0, "up"))
    (run.tmp / "go").touch()
    assert b.wait(timeout=60) == -signal.SIGKILL
    run.until("the survivor to step on alone", lambda: any(r.get("size") == 1 and r.get("committed") for r in run.log(0, 0)))
    (run.tmp / "restart").touch()
    run.finish(a, b2)

    steps = [r for r in run.log(0, 0) if r["event"] == "step"]
    lost = [r for r in steps if not r["committed"]]
    assert len(lost) == 1 and lost[0]["step"] == 3, lost  # the step group 1 died in, and only that one
    assert "Connection closed" in lost[0]["error"] or "PeerError" in lost[0]["error"], lost[0]["error"]
    joined = [r for r in run.log(1, 1) if r["event"] == "started"][0]
    assert joined["step"] > 3 and joined["members"] == ["replica_0", "replica_1"]  # it took the live state mid-run
    committed = [r for r in steps if r["committed"]]
    assert [r["step"] for r in committed] == list(range(len(committed)))  # no step twice, none skipped
    assert {len(r["members"]) for r in committed} == {1, 2}

    survivor, rejoined = run.final(0, 0), run.final(1, 1)
    assert_bitwise_equal(survivor, rejoined)
    reference = replay_replicated(committed)
    for k, v in reference.items():
        torch.testing.assert_close(survivor["params"][k], v, rtol=0, atol=0)  # the same arithmetic, to the bit
