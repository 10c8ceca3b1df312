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

import optree
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
        self.outputs: dict[subprocess.Popen, Path] = {}
        self.started = time.monotonic()

    def restart_lighthouse(self, down_s: float = 0.5) -> None:
        port = self.lh.address.rsplit(":", 1)[1]
        self.lh.shutdown()
        time.sleep(down_s)
        self.lh = fddp.ft.lighthouse(f"127.0.0.1:{port}", **self.options)

    def spawn(self, replica: int, incarnation: int = 0, *args: str) -> subprocess.Popen:
        path = self.tmp / f"out-{replica}-{incarnation}.txt"
        out = open(path, "w")
        cmd = [sys.executable, str(WORKER), "--lighthouse", self.lh.address, "--replica", str(replica),
               "--incarnation", str(incarnation), "--out", str(self.tmp), *args]  # fmt: skip
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(p)
        self.outputs[p] = path
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
        text = self.outputs[p].read_text()
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


# --- one process ----------------------------------------------------------------------------------


def test_live_state_round_trips_every_leaf_type_exactly_and_refuses_damage():
    """The wire format: the codec's payload as JSON (no pickle) and raw bytes, CRC-checked, checked
    against the receiver's tree."""
    from fddp.ft import _wire

    opt = fddp.optim.sgd(0.1, momentum=0.9)
    params = {"w": torch.randn(3, 4), "h": torch.randn(5, dtype=torch.bfloat16), "e": torch.zeros(0),
              "c": torch.randn(2, dtype=torch.complex64)}  # fmt: skip
    tree = {
        "params": params, "opt": opt.init(params), "mask": torch.tensor([True, False]), "big": torch.arange(3_000_000, dtype=torch.int64),
        "step": 7, "lr": 0.1, "inf": float("inf"), "name": "run", "raw": b"\x00\xff", "none": None, "z": 1 + 2j, "t": (1, [2.5, "x"]),
    }  # fmt: skip
    packed = _wire.pack(tree, step=3)
    header = _wire.header_of(packed.header)
    assert json.loads(bytes(packed.header.tolist()))["step"] == 3  # the header is JSON
    assert len(packed.chunks) == 2  # the small leaves share a chunk, the big one travels alone
    got, step = _wire.unpack(header, [c.clone() for c in packed.chunks], like=tree, where="a peer")
    assert step == 3 and type(got["opt"]) is type(tree["opt"])
    assert_bitwise_equal(got, tree)
    assert [type(x) for x in _leaves(got)] == [type(x) for x in _leaves(tree)]

    damaged = [c.clone() for c in packed.chunks]
    damaged[0][5] ^= 1
    with pytest.raises(fddp.checkpoint.CheckpointError, match="CRC-32"):
        _wire.unpack(header, damaged, like=tree, where="a peer")
    other = {**tree, "params": {**params, "w": torch.randn(4, 3)}}
    with pytest.raises(fddp.checkpoint.CheckpointError, match="params/w"):
        _wire.unpack(header, packed.chunks, like=other, where="a peer")
    with pytest.raises(fddp.checkpoint.CheckpointError, match="not fddp live state"):
        _wire.header_of(torch.frombuffer(bytearray(b'{"format": "pickle"}'), dtype=torch.uint8))


def test_state_checksum_sees_one_ulp_and_the_step_count():
    from fddp.ft._replicas import state_checksum

    a = {"w": torch.randn(100), "count": 3}
    b = {"w": a["w"].clone(), "count": 3}
    assert state_checksum(a) == state_checksum(b)
    b["w"][17] = torch.nextafter(b["w"][17], torch.tensor(9.0))
    assert state_checksum(a) != state_checksum(b)
    assert state_checksum(a) != state_checksum({**a, "count": 4})


def test_each_epochs_store_is_closed_and_its_helper_thread_ends():
    """A quorum's store runs its operations on a helper thread, which holds it alive: every
    membership change made one that lived (with its connection) until the process ended."""
    import threading

    import torch.distributed as dist

    from fddp.ft._store import BoundedStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores = [BoundedStore(f"127.0.0.1:{server.port}/fddp-test", deadline=1.0) for _ in range(3)]
    for s in stores:
        s.set("k", "v")
        s.close()
    deadline = time.monotonic() + 5
    while any(t.name == "fddp-ft-store" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "fddp-ft-store"]


def test_a_failure_that_repeats_is_an_error_not_a_silent_retry_loop():
    """torchft 0.2.0 retries a step whose state transfer fails (numpy missing) every 5 s forever;
    Replicas counts failed steps in a row and raises after max_retries, naming the last failure."""
    from fddp.ft._replicas import Replicas

    r = Replicas.__new__(Replicas)  # the counter alone: no Manager, no Lighthouse
    r.replica_id, r.max_retries, r._failures, r._last_error = "replica_0", 2, 0, None
    for _ in range(2):
        r._fail(ModuleNotFoundError("No module named 'numpy'"))
    with pytest.raises(RuntimeError, match=r"failed 3 steps in a row \(max_retries=2\).*ModuleNotFoundError: No module named 'numpy'"):
        r._fail(ModuleNotFoundError("No module named 'numpy'"))


# --- replica groups as processes --------------------------------------------------------------------


def assert_bitwise_equal(a, b) -> None:
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), (x, y)
        else:
            assert type(x) is type(y) and x == y, (x, y)


def _leaves(tree) -> list:
    return optree.tree_leaves(tree, none_is_leaf=True)


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


def replay_diloco(run: Run, syncs: list[dict], replicas: int) -> dict:
    """The job's committed synchronisations, replayed: each member group's inner steps of the round
    (plain SGD from the snapshot, its logged batches), the mean pseudo-gradient weighted by the
    samples each trained on, torch.optim.SGD with Nesterov momentum on the snapshot."""
    logs = {r: [log for inc in range(3) if (log := run.log(r, inc))] for r in range(replicas)}

    def took_part(log: list[dict], sync: dict) -> bool:  # in this synchronisation, or joined the job through it
        return any((e["event"] == "sync" and (e["before"], e["after"]) == (sync["before"], sync["after"]))
                   or (e["event"] == "started" and e["step"] == sync["after"]) for e in log)  # fmt: skip

    snapshot = {k: v.clone().requires_grad_() for k, v in ft_worker.init_params(1).items()}
    outer = torch.optim.SGD(snapshot.values(), lr=0.7, momentum=0.9, nesterov=True)
    for sync in syncs:
        total, weight = None, 0.0
        for name in sync["members"]:
            r = _member(name)
            (log,) = [log for log in logs[r] if took_part(log, sync)]  # the incarnation of the group that was there
            steps = [e for e in log if e["event"] == "inner" and e["round"] == sync["before"]]
            theta = {k: v.detach().clone().requires_grad_() for k, v in snapshot.items()}
            inner = torch.optim.SGD(theta.values(), lr=0.05)
            for e in steps:
                x, y = ft_worker.batch(r, e["key"], e["n"])
                for p, g in zip(theta.values(), torch.autograd.grad(ft_worker.loss_fn(theta, x, y), list(theta.values()))):
                    p.grad = g
                inner.step()
            w = float(sum(e["n"] for e in steps))
            pseudo = [(s.detach() - t.detach()) * w for s, t in zip(snapshot.values(), theta.values())]
            total = pseudo if total is None else [a + b for a, b in zip(total, pseudo)]
            weight += w
        for p, g in zip(snapshot.values(), total):
            p.grad = g / weight
        outer.step()
    return {k: v.detach() for k, v in snapshot.items()}


def test_diloco_takes_a_quorum_only_to_synchronise_and_a_restarted_group_joins_at_the_next_one(run):
    """DiLoCo every 3 inner steps: group 1 is SIGKILLed inside the all-reduce of its 3rd
    synchronisation; group 0's synchronisation fails once and goes on; group 1 restarts, waits for
    group 0's next synchronisation, takes part in it with weight 0 (it trained on nothing), and both
    end bitwise equal, where the replay of the committed rounds ends."""
    common = ["--mode", "diloco", "--every", "3", "--steps", "6", "--want", "2", "--after", "3", "--pace", "0.02",
              "--go", str(run.tmp / "go")]  # fmt: skip
    a = run.spawn(0, 0, *common)
    b = run.spawn(1, 0, *common, "--die-at", "3")
    b2 = run.spawn(1, 1, *common, "--wait", str(run.tmp / "restart"))
    run.until("both groups' Managers", lambda: run.has(0, 0, "up") and run.has(1, 0, "up"))
    (run.tmp / "go").touch()
    assert b.wait(timeout=60) == -signal.SIGKILL
    (run.tmp / "restart").touch()
    run.finish(a, b2)

    syncs = [r for r in run.log(0, 0) if r["event"] == "sync"]
    failed = [r for r in syncs if r["after"] == r["before"]]
    assert len(failed) == 1, syncs  # the synchronisation group 1 died in
    committed = [r for r in syncs if r["after"] > r["before"]]
    inner = [r for r in run.log(0, 0) if r["event"] == "inner"]
    assert len(inner) == 3 * len(syncs) - len(failed) * 2  # a retry is one inner step later, not a lost round
    survivor, rejoined = run.final(0, 0), run.final(1, 1)
    assert_bitwise_equal(survivor, rejoined)
    reference = replay_diloco(run, committed, 2)
    for k, v in reference.items():
        # float64, to rounding: fddp's fused Nesterov kernel orders its operations unlike torch.optim's
        torch.testing.assert_close(survivor["snapshot"][k], v, rtol=1e-13, atol=1e-15)
        assert torch.equal(survivor["params"][k], survivor["snapshot"][k])


def test_a_lighthouse_restart_that_lets_each_group_commit_alone_heals_them_at_the_merge(run):
    """torchft 0.2.0 lets two groups that each committed steps alone (a Lighthouse restarted with
    min_replicas=1 while one was unreachable) merge at equal step numbers with different states.
    Here: the Lighthouse restarts, group 1 is stopped (SIGSTOP) while group 0 commits steps 10-19
    alone, then group 0 is stopped while group 1 commits its own 10-19; at step 21 they merge (or a
    step or two later, when group 0's Manager is slow to come back and group 1 goes on alone), the
    check finds different checksums, the group behind (at equal steps, group 1) takes the other's
    state, and they end bitwise equal."""
    common = ["--mode", "replicated", "--steps", "25", "--pace", "0.02", "--timeout", "2", "--go", str(run.tmp / "go"),
              "--pause", f"10:{run.tmp / 'p1'}", "--pause", f"20:{run.tmp / 'p2'}"]  # fmt: skip
    a, b = run.spawn(0, 0, *common), run.spawn(1, 0, *common)
    run.until("both groups' Managers", lambda: run.has(0, 0, "up") and run.has(1, 0, "up"))
    (run.tmp / "go").touch()

    def paused(r: int, step: int) -> bool:
        return any(e["event"] == "paused" and e["step"] == step for e in run.log(r))

    run.until("both groups at step 10", lambda: paused(0, 10) and paused(1, 10))
    run.restart_lighthouse()
    b.send_signal(signal.SIGSTOP)
    (run.tmp / "p1").touch()
    run.until("group 0 alone at step 20", lambda: paused(0, 20))
    a.send_signal(signal.SIGSTOP)
    time.sleep(1.5)  # the Lighthouse's heartbeat timeout: group 0 looks dead to it now
    b.send_signal(signal.SIGCONT)
    run.until("group 1 alone at step 20", lambda: paused(1, 20))
    a.send_signal(signal.SIGCONT)
    (run.tmp / "p2").touch()
    run.finish(a, b)

    logs = [[e for e in run.log(r) if e["event"] == "step"] for r in (0, 1)]
    alones = [[e["step"] for e in log if e["committed"] and e["size"] == 1] for log in logs]
    for alone in alones:  # each committed steps 10..20 alone: the split the check must heal
        # (one may commit a step or two more alone while the other's Manager comes back from SIGSTOP)
        assert alone[:11] == list(range(10, 21)) and alone == list(range(10, 10 + len(alone))), alone
    merged = [next(e for e in log if e["committed"] and e["size"] == 2 and e["step"] > 20) for log in logs]
    # Each merges at the step after its last one alone (a group that heals logs the step it was at).
    assert [m["step"] for m in merged] == [10 + len(a) for a in alones], (merged, alones)
    # The group with fewer steps takes the other's state; at equal steps group 1 takes group 0's (the lowest rank's).
    behind = 0 if len(alones[0]) < len(alones[1]) else 1
    assert [m["healed"] for m in merged] == [r == behind for r in (0, 1)], (merged, alones)
    if len(alones[0]) == len(alones[1]):  # equal steps, different states: only fddp's check sees it (torchft does not)
        assert "diverged" in (run.tmp / "out-1-0.txt").read_text()
    # (a group a step behind is healed by torchft's own recovery, as a late joiner is)
    assert_bitwise_equal(run.final(0), run.final(1))
    for r in (0, 1):  # several epochs each (the split, the merge), and one quorum store left open: the last
        (done,) = [e for e in run.log(r) if e["event"] == "done"]
        assert done["stores"] == 1, done


def test_the_example_trains_on_its_replica_groups(tmp_path):
    """examples/fault_tolerant.py as the docs launch it, under torchrun with the Lighthouse's address in
    the environment (here one replica group, every step and then DiLoCo): it joins, trains, finishes."""
    lh = fddp.ft.lighthouse(min_replicas=1, join_timeout=5.0, heartbeat_timeout=1.0)
    try:
        example = Path(__file__).resolve().parent.parent / "examples" / "fault_tolerant.py"
        env = {**os.environ, "TORCHFT_LIGHTHOUSE": lh.address, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        for extra in ([], ["--diloco", "10"]):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(example),
                   "--steps", "40", "--log-every", "20", *extra]  # fmt: skip
            proc = subprocess.run(cmd, env={**env, "REPLICA_GROUP_ID": "0"}, capture_output=True, text=True, timeout=180)
            assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
            lines = [line for line in proc.stdout.splitlines() if line.startswith("[0]")]
            assert "joined" in lines[0] and "done" in lines[-1], proc.stdout
            accuracy = float(lines[-1].split("test accuracy ")[1].split()[0])
            assert accuracy > 0.5, proc.stdout  # chance is 0.1: it trained
    finally:
        lh.shutdown()
