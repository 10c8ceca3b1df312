"""No silent divergence: ranks that run different calls get the same clear error, never a wrong mean.

Each case is one a user met on fddp before the per-call agreement (issue 23): two threads on one
group, ranks switching between trees they had each checked before, a rank a step behind (a
different step count, a caught exception inside a step), a forgotten ``fddp.broadcast``, a rank
that stops early and calls ``fddp.shutdown()``. Every case must end with a correct result or an
error on every rank, within seconds.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading

import torch
import torch.distributed as tdist

import fddp
import fddp._dist
import fddp.sync._setup
from dist import run
from models import make_batch, make_model


def _short_group():
    return tdist.new_group(timeout=datetime.timedelta(seconds=10))


# --- 1. two threads calling ddp_step on one group ----------------------------------------------------


def _threads_worker(calls: int):
    group = _short_group()
    rank = fddp.rank()
    trees = {"a": {"w": torch.ones(2, 3)}, "b": {"w": torch.ones(7)}}  # of different sizes
    results: dict[str, list] = {"a": [], "b": []}
    errors: dict[str, str] = {}
    start = threading.Barrier(2)

    def loop(name: str) -> None:
        tree = trees[name]
        start.wait()
        for i in range(calls):
            grads = {"w": torch.full_like(tree["w"], float(rank + i))}  # the mean is i + 0.5
            try:
                results[name].append((i, fddp.ddp_step(tree, grads, group=group)["w"]))
            except (RuntimeError, fddp.MismatchError) as e:
                errors[name] = f"{type(e).__name__}: {e}"
                return

    threads = [threading.Thread(target=loop, args=(n,), name=f"worker-{n}") for n in trees]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    wrong = [(n, i) for n, rs in results.items() for i, out in rs if not torch.equal(out, torch.full_like(out, i + 0.5))]
    return wrong, errors


def test_two_threads_on_one_group_give_correct_means_or_clear_errors():
    for wrong, errors in run(_threads_worker, 2, 200, timeout=120):
        assert wrong == [], f"silently wrong means: {wrong}"
        assert errors, "two threads ran 200 calls each on one group without either being stopped"
        for message in errors.values():
            assert "thread" in message, message


# --- 2. ranks switching between trees each checked before ------------------------------------------------


def _switch_worker():
    a, b = {"w": torch.ones(2, 3)}, {"w": torch.ones(3, 2)}
    fddp.ddp_step(a, a)  # both trees checked on both ranks
    fddp.ddp_step(b, b)
    mine = a if fddp.rank() == 0 else b
    try:
        fddp.ddp_step(mine, mine)
    except fddp.MismatchError as e:
        return str(e)
    return "returned"


def test_ranks_switching_between_checked_trees_raise_on_every_rank():
    messages = run(_switch_worker, 2)
    assert messages[0] == messages[1], messages
    assert "shape=(2, 3)" in messages[0] and "shape=(3, 2)" in messages[0], messages[0]


# --- 2b. the agreement does not hold a rank back while its peer is still in its forward pass -----------


def _skewed_worker():
    import time

    p = fddp.broadcast({"w": torch.ones(64, 64), "v": torch.ones(64)})
    step = fddp.grad_and_value(lambda p, x, hook: ((hook(x @ p["w"]) + p["v"]) ** 2).sum())
    x = torch.randn(8, 64)
    stamps = {}

    def stamp(g):
        stamps.setdefault("backward", time.time())  # inside backward

    def hook(h):
        if h.requires_grad:
            h.register_hook(stamp)
        if fddp.rank() == 1:
            time.sleep(2.0)  # a slow forward pass
        stamps["forward end"] = time.time()
        return h

    step(p, x, hook)  # the first call: a new tree, agreed at once
    stamps.clear()
    grads, _ = step(p, x, hook)
    return stamps, grads["w"].sum().item()


def test_a_rank_runs_its_backward_while_its_peer_is_still_in_its_forward_pass():
    (s0, g0), (s1, g1) = run(_skewed_worker, 2, timeout=60)
    # Rank 0's backward ran during rank 1's 2-second forward: its agreement was sent, not waited
    # for, and finished only when its first bucket had to go out; the mean is the same.
    assert s0["backward"] < s1["forward end"] - 1.0, (s0, s1)
    assert g0 == g1


# --- 3. a rank one call behind ---------------------------------------------------------------------------


def _behind_worker(directory: str):
    group = _short_group()
    p = {"w": torch.ones(4)}
    steps = 10 if fddp.rank() == 0 else 9
    try:
        for _ in range(steps):
            fddp.ddp_step(p, p, group=group)
        fddp.checkpoint.save_step(directory, 10, {"p": p}, group=group)
    except fddp.MismatchError as e:
        return str(e)
    return "returned"


def test_a_rank_a_step_behind_meets_save_step_with_a_mismatch_on_every_rank():
    directory = tempfile.mkdtemp(prefix="fddp-behind-")
    m0, m1 = run(_behind_worker, 2, directory, timeout=60)
    # The same words on both ranks, each prefixed by the function it was in.
    assert m0.startswith("fddp.ddp_step: ") and m1.startswith("fddp.checkpoint.save_step: "), (m0, m1)
    assert m0.split(": ", 1)[1] == m1.split(": ", 1)[1], (m0, m1)
    parts = ["different fddp calls", "rank 0 is at its call 10 (fddp.ddp_step)", "rank 1 is at its call 10 (fddp.checkpoint.save_step)"]
    for part in parts:
        assert part in m0, (part, m0)


def _caught_worker():
    group = _short_group()
    apply_fn, params = fddp.functionalize(make_model("mlp"))
    params = fddp.broadcast(params)
    x, y = make_batch("mlp", seed=fddp.rank())
    step = fddp.grad_and_value(lambda p, x, y, fail: torch.nn.functional.cross_entropy(apply_fn(p, x), y) + fail(), group=group)
    outcome, sums = [], []
    for i in range(5):

        def fail() -> torch.Tensor:
            if fddp.rank() == 1 and i == 2:
                raise ValueError("a bad batch")
            return torch.zeros(())

        try:
            grads, _ = step(params, x, y, fail)
            outcome.append("ok")
            sums.append(sum(g.double().sum().item() for g in grads.values()))
        except ValueError:
            outcome.append("caught")  # the user's loop goes on, as in the issue
        except fddp.PeerError as e:
            outcome.append(str(e))  # the peer's failure, named at the same call: this loop goes on too
    return outcome, sums


def test_a_rank_that_fails_in_its_loss_is_named_on_its_peers_at_that_call_and_the_loop_goes_on():
    (o0, s0), (o1, s1) = run(_caught_worker, 2, timeout=60)
    assert o1 == ["ok", "ok", "caught", "ok", "ok"], o1
    # Rank 0 raises at the same call, naming rank 1, its call and its exception; the ranks stay in
    # step (rank 1 announced its failure in place of the call's header), so the next calls average
    # the same gradients on both ranks.
    assert o0[:2] == ["ok", "ok"] and o0[3:] == ["ok", "ok"], o0
    assert "rank 1 failed in fddp.grad_and_value" in o0[2] and "ValueError: a bad batch" in o0[2], o0[2]
    assert s0 == s1 and len(s0) == 4, (s0, s1)


# --- 6. a forgotten fddp.broadcast --------------------------------------------------------------------------


def _forgotten_worker(broadcast: bool, use_ddp_step: bool):
    apply_fn, params = fddp.functionalize(make_model("mlp", seed=fddp.rank()))  # different init per rank
    if broadcast:
        params = fddp.broadcast(params)
    x, y = make_batch("mlp", seed=fddp.rank())

    def loss(p):
        return torch.nn.functional.cross_entropy(apply_fn(p, x), y)

    try:
        if use_ddp_step:
            fddp.ddp_step(params, torch.func.grad(loss)(params))
        else:
            fddp.grad_and_value(loss)(params)
    except fddp.MismatchError as e:
        return str(e)
    return "returned"


def test_a_forgotten_broadcast_is_an_error_on_every_rank():
    for use_ddp_step in (False, True):
        m0, m1 = run(_forgotten_worker, 2, False, use_ddp_step)
        assert m0 == m1 and "fddp.broadcast(params)" in m0 and "ranks hold different values" in m0, m0
        assert run(_forgotten_worker, 2, True, use_ddp_step) == ["returned", "returned"]


# --- 7. a rank that stops early and calls fddp.shutdown() --------------------------------------------------

SHUTDOWN_SCRIPT = """
import os, sys, torch, fddp
fddp.init()  # torch's default timeout (30 minutes): the agreement must not need it
p = {"w": torch.ones(3)}
try:
    for _ in range(3 if fddp.rank() == 0 else 2):
        fddp.ddp_step(p, p)
    fddp.shutdown()
except fddp.MismatchError as e:
    print("MISMATCH:", e, flush=True)
    os._exit(3)
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_stops_early_and_shuts_down_is_an_error_on_every_rank_at_once():
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(SHUTDOWN_SCRIPT)],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=60)[0] for p in procs]  # seconds, not the 30-minute default
    finally:
        for p in procs:
            p.kill()
    for r, out in enumerate(outs):
        assert procs[r].returncode == 3, out
        assert "rank 0 is at its call 3 (fddp.ddp_step)" in out and "rank 1 is at its call 3 (fddp.shutdown)" in out, out


# --- 11. what fddp remembers is bounded ------------------------------------------------------------------


def test_the_remembered_signatures_are_bounded():
    fddp.init()
    fddp.clear_caches()
    for n in range(1, 2001):
        t = {"w": torch.zeros(n)}
        fddp.ddp_step(t, t)
    assert len(fddp._dist._groups.state(None).seen) <= 256
    assert len(fddp.sync._setup._records) <= 1024
    fddp.clear_caches()
    assert len(fddp.sync._setup._records) == 0
