"""One rank's failure is every rank's error, within seconds: the error channel of ``fddp._dist``.

Each case is one a hostile round found on fddp before the channel (issue 30): a rank that raises
before its header or in the middle of its backward, ranks on different groups, a rank that turns
the agreement off alone, a derivative taken through ``ddp_step`` on one rank only, an option that
adds a collective on one rank only. Every case must end, on every rank, with the correct result or
an fddp error naming the cause, long before the group's timeout; and nothing may be refused that
is right (a bucket cap of 25 against 25.0, a comm hook written as a plain class, calls made in turn
from a thread pool).

Cases that leave a group unusable run on groups of their own, so that the pool's default group
stays in step for the tests that follow.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time

import torch
import torch.distributed as tdist

import fddp
from dist import run

_TIMEOUT = datetime.timedelta(seconds=20)  # what a case may not wait for: it must end long before


def _group():
    return tdist.new_group(timeout=_TIMEOUT)


def _outcome(fn):
    """``("ok", value)`` (a tensor's; else its type's name) or ``(exception type name, message, seconds it took)``."""
    t0 = time.monotonic()
    try:
        value = fn()
        return ("ok", value if isinstance(value, torch.Tensor) else type(value).__name__)
    except Exception as e:  # noqa: BLE001 - the case reports what each rank saw
        return (type(e).__name__, str(e), time.monotonic() - t0)


# --- a failure after the call sent something: fatal, every rank learns it within a poll ------------------


def _backward_worker():
    group = _group()
    params = fddp.broadcast({f"l{i}": torch.full((64, 64), 0.01 * (i + 1)) for i in range(4)}, group=group)
    armed = [False]

    def boom(g):
        if armed[0]:
            raise ValueError("a NaN in the activations")

    def loss(p, x):
        for i in range(4):
            x = torch.tanh(x @ p[f"l{i}"])
            if i == 0 and fddp.rank() == 1:
                x.register_hook(boom)
        return x.sum()

    # Small buckets: rank 1 has sent its first buckets when its hook raises, deep in backward.
    step = fddp.grad_and_value(loss, group=group, bucket_cap_mb=0.01, first_bucket_mb=0.01)
    x = torch.randn(8, 64)
    step(params, x)  # a first call, fine on both
    armed[0] = True
    first = _outcome(lambda: step(params, x))
    again = _outcome(lambda: step(params, x))
    other = _outcome(lambda: fddp.ddp_step(params, params, group=group))
    return first, again, other


def test_a_rank_that_fails_in_backward_makes_every_rank_raise_at_once_and_the_group_refuses_more():
    (f0, a0, o0), (f1, a1, o1) = run(_backward_worker, 2, timeout=60)
    assert f1[0] == "ValueError", f1
    assert f0[0] == "PeerError" and f0[2] < 5, f0  # the group's timeout is 20 s: the channel, not the timeout
    assert "rank 1 failed in fddp.grad_and_value" in f0[1] and "ValueError: a NaN in the activations" in f0[1], f0
    assert "restart" in f0[1], f0
    for out in (a0, o0, a1, o1):  # at once, and naming the first failure
        assert out[0] == "PeerError" and out[2] < 1 and "a NaN in the activations" in out[1], out
    assert "this rank failed" in a1[1], a1


# --- a failure before the call sent anything: announced, the group stays in step --------------------------


def _validation_worker():
    group = _group()
    p = {"w": torch.ones(3)}
    bad = {"w": torch.ones(4)} if fddp.rank() == 1 else {"w": torch.ones(3)}
    first = _outcome(lambda: fddp.ddp_step(p, bad, group=group))
    then = _outcome(lambda: fddp.ddp_step(p, {"w": torch.full((3,), float(fddp.rank()))}, group=group)["w"])
    return first, then


def test_a_validation_error_on_one_rank_is_named_on_its_peers_and_the_next_call_works():
    (f0, t0), (f1, t1) = run(_validation_worker, 2, timeout=60)
    assert f1[0] == "ValueError" and "does not match its parameter" in f1[1], f1
    assert f0[0] == "PeerError" and f0[2] < 5, f0
    assert "rank 1 failed in fddp.ddp_step" in f0[1] and "ValueError" in f0[1] and "still in step" in f0[1], f0
    assert t0[0] == t1[0] == "ok" and torch.equal(t0[1], torch.full((3,), 0.5)) and torch.equal(t1[1], t0[1]), (t0, t1)


# --- ranks on different groups: a deadlock, found on the board ---------------------------------------------


def _groups_worker():
    a, b = _group(), _group()  # two groups of the same two ranks
    mine = a if fddp.rank() == 0 else b
    p = {"w": torch.ones(3)}
    return _outcome(lambda: fddp.ddp_step(p, p, group=mine))


def test_ranks_calling_on_different_groups_raise_instead_of_hanging():
    o0, o1 = run(_groups_worker, 2, timeout=60)
    for out in (o0, o1):
        assert out[0] in ("MismatchError", "PeerError") and out[2] < 12, out  # the group's timeout is 20 s
    message = o0[1] if o0[0] == "MismatchError" else o1[1]
    assert "ranks wait in different collectives" in message and "same process groups" in message, message


# --- the agreement turned off on one rank ---------------------------------------------------------------


def _agreement_off_worker():
    group = _group()
    p = {"w": torch.ones(3)}
    fddp.ddp_step(p, p, group=group)  # known to both: with the agreement off it would send no header
    if fddp.rank() == 1:
        fddp.set_checks(agreement=False)
    try:
        return _outcome(lambda: fddp.ddp_step(p, p, group=group)), _outcome(lambda: fddp.ddp_step(p, p, group=group))
    finally:
        fddp.set_checks(agreement=True)


def test_the_agreement_turned_off_on_one_rank_is_an_error_on_every_rank_not_an_abort():
    (f0, n0), (f1, n1) = run(_agreement_off_worker, 2, timeout=60)
    for f in (f0, f1):
        assert f[0] == "MismatchError" and "set_checks(agreement=...)" in f[1] and "rank 1 has it off" in f[1], f
    assert n0[0] == n1[0] == "PeerError", (n0, n1)  # the ranks' calls can no longer be matched


# --- a derivative through ddp_step on one rank only --------------------------------------------------------


def _derivative_worker():
    group = _group()
    p = {"w": torch.ones(3)}
    g = {"w": torch.full((3,), 10.0 + 10 * fddp.rank())}
    if fddp.rank() == 0:  # differentiates through the sync: a second collective, in backward
        return _outcome(lambda: torch.func.grad(lambda g: fddp.ddp_step(p, g, group=group)["w"].sum())(g))
    first = fddp.ddp_step(p, g, group=group)["w"]
    return _outcome(lambda: fddp.ddp_step(p, {"w": first * 2}, group=group))


def test_a_derivative_through_ddp_step_on_one_rank_only_is_an_error_not_a_wrong_mean():
    o0, o1 = run(_derivative_worker, 2, timeout=60)
    for out in (o0, o1):
        assert out[0] == "MismatchError" and "different fddp calls" in out[1] and "fddp.ddp_step (backward)" in out[1], out


def _unsynced_worker():
    group = _group()
    params = fddp.broadcast({"w": torch.ones(8), "b": torch.zeros(2)}, group=group)
    opt = fddp.optim.sgd(0.1)
    state = opt.init(params)
    seen = []
    for i in range(4):
        g = {"w": torch.full((8,), float(i + 1 + fddp.rank())), "b": torch.ones(2)}
        if i == 1 and fddp.rank() == 1:  # rank 1 applies its own gradients once, unsynchronised
            params, state = fddp.optim.apply_gradients(opt, g, state, params)
            continue
        for _ in range(2 if i == 1 and fddp.rank() == 0 else 1):  # (rank 0 meets its next call here)
            t0 = time.monotonic()
            try:
                mean = fddp.ddp_step(params, g, group=group)
            except fddp.MismatchError as e:
                return seen + ["MismatchError"], str(e), time.monotonic() - t0
            seen.append("ok")
        params, state = fddp.optim.apply_gradients(opt, mean, state, params)
    return seen, None, None


def test_a_rank_that_applies_its_own_gradients_once_is_named_at_its_next_call():
    """Each ddp_step pairs with one of the same signature, a valid mean; but rank 1's parameters
    drifted from its peer's, and the next call's header says so on both ranks, with the fix."""
    for seen, message, took in run(_unsynced_worker, 2, timeout=60):
        assert seen == ["ok", "MismatchError"], (seen, message)
        assert "drifted apart" in message and "at leaf 'b'" in message and took < 10, (message, took)


# --- an option that adds a collective on one rank only ------------------------------------------------------


def _finite_worker():
    group = _group()
    p = {"w": torch.ones(4)}
    check = fddp.rank() == 0
    return _outcome(lambda: fddp.ddp_step(p, p, group=group, compression=fddp.zero.ReduceScatter(), check_finite=check, return_info=True))


def test_check_finite_on_one_rank_is_named_not_an_abort():
    for out in run(_finite_worker, 2, timeout=60):
        assert out[0] == "MismatchError" and "Option check_finite: rank 0 has True, rank 1 has False" in out[1], out


# --- no false alarms ---------------------------------------------------------------------------------------


class _PlainHook(fddp.hooks.CommHook):
    """A hook written as a plain class, as fddp/sync/hooks.py's docstring shows: its repr is an address."""

    def __init__(self) -> None:
        self.scale = 1.0

    def launch(self, state, bucket):
        return bucket.comm.all_reduce(bucket.buffer), state

    def finish(self, state, bucket, pending):
        bucket.comm.wait(pending, "the all-reduce")
        return bucket.buffer.div_(bucket.comm.world_size), state


def _no_alarm_worker():
    p = {"w": torch.ones(3)}
    g = {"w": torch.full((3,), float(fddp.rank()))}
    cap = 25 if fddp.rank() == 0 else 25.0
    out = {"cap": fddp.ddp_step(p, g, bucket_cap_mb=cap)["w"]}
    out["cap again"] = fddp.ddp_step(p, g, bucket_cap_mb=25.0 if fddp.rank() == 0 else 25)["w"]
    out["plain hook"] = fddp.ddp_step(p, g, compression=_PlainHook())["w"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # calls served in turn by either worker thread
        for i in range(6):
            out[f"pool {i}"] = pool.submit(fddp.ddp_step, p, g).result()["w"]
    return out


def test_equal_options_plain_class_hooks_and_thread_pools_are_not_refused():
    for out in run(_no_alarm_worker, 2, timeout=60):
        for name, value in out.items():
            assert torch.equal(value, torch.full((3,), 0.5)), (name, value)


# --- Int8 and values that are not finite -------------------------------------------------------------------


def _int8_worker():
    group = _group()
    i8 = fddp.Int8()
    p = {"w": torch.zeros(600), "b": torch.zeros(10)}
    r = fddp.rank()

    def grads(seed):
        g = torch.Generator().manual_seed(seed + 100 * r)
        return {"w": torch.randn(600, generator=g), "b": torch.randn(10, generator=g)}

    def step(g, state):
        return fddp.ddp_step(p, g, group=group, compression=i8, compression_state=state, check_finite=True, return_info=True)

    s0 = i8.init(p)
    _, info = step(grads(1), s0)
    s1 = info.compression_state
    out = {}
    for name, where in (("nan", (1, 3)), ("inf", (0, 599))):  # (the rank, the element) that goes bad, once
        g = grads(2)
        if r == where[0]:
            g["w"][where[1]] = float(name)
        mean, info = step(g, s1)
        out[name] = (bool(info.finite), info.compression_state is s1, bool(torch.isnan(mean["w"]).any()))
    # The step after the skipped ones equals a run in which they never happened, to the bit.
    mean, _ = step(grads(3), s1)
    _, info = step(grads(1), s0)
    ref, _ = step(grads(3), info.compression_state)
    out["recovered"] = torch.equal(mean["w"], ref["w"]) and torch.equal(mean["b"], ref["b"])
    return out


def test_int8_makes_a_non_finite_value_on_one_rank_non_finite_everywhere_and_returns_the_state_it_was_given():
    for out in run(_int8_worker, 2, timeout=60):
        assert out["nan"] == (False, True, True), out  # finite: no; the same state back; NaN in the mean
        assert out["inf"] == (False, True, True), out
        assert out["recovered"], out


# --- compiled steps --------------------------------------------------------------------------------------


def _compiled_worker():
    group = _group()
    p = {"w": torch.ones(8)}
    compression = "bf16" if fddp.rank() == 0 else "fp16"  # buffers of one size, different bits

    @torch.compile(fullgraph=True)
    def step(g):
        return fddp.ddp_step(p, g, group=group, compression=compression)

    differ = _outcome(lambda: step({"w": torch.full((8,), 1.0 + fddp.rank())})["w"])

    @torch.compile(fullgraph=True)
    def same(g):
        return fddp.ddp_step(p, g, group=group)

    g = {"w": torch.full((8,), 1.0 + fddp.rank())}
    same(g)  # both ranks, once
    if fddp.rank() == 1:  # one compiled call more, where rank 0 makes an eager one
        more = _outcome(lambda: same(g)["w"])
    else:
        more = _outcome(lambda: fddp.ddp_step(p, g, group=group)["w"])
    return differ, more


def test_compiled_steps_that_differ_between_ranks_raise_on_every_rank():
    (d0, m0), (d1, m1) = run(_compiled_worker, 2, timeout=300)
    for out in (d0, d1):
        assert out[0] == "RuntimeError" and "fddp.ddp_step (compiled): the ranks disagree" in out[1], out
    # A compiled call meets an eager one: the graph's header has the eager one's size, so the eager
    # rank raises (its peer did not say what it runs: it was in a compiled step) instead of an abort.
    assert m1[0] == "RuntimeError" and "(compiled): the ranks disagree" in m1[1], m1
    assert m0[0] == "MismatchError" and "compiled step" in m0[1] and m0[2] < 10, m0
# --- fully sharded forwards that differ between ranks (ZeRO stage 3) ----------------------------------------


class _Blocks(torch.nn.Module):
    """Three square blocks and a head, run in an order (and with a block skipped) the call chooses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x, order=(0, 1, 2)):
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        return self.head(x)


def _stage3_worker(case: str):
    group = _group()
    apply_fn, shards = fddp.zero.fully_shard(_Blocks(), group=group, min_unit_mb=0)  # a unit per block
    x = torch.randn(4, 8)
    deviant = fddp.rank() == 1

    def step(order=(0, 1, 2), use_head=True):
        def loss(s):
            out = apply_fn(s, x, order)
            return out.sum() if use_head else out.detach().sum() + s.shards[0].sum() * 0
        return torch.func.grad(loss)(shards)

    def gv_loss(s, use_head):
        return apply_fn(s, x).sum() if use_head else apply_fn(s, x).detach().sum() + s.shards[0].sum() * 0

    gv = fddp.grad_and_value(gv_loss)
    for _ in range(4):  # the sequence is learnt over the first calls, then checked
        gv(shards, True) if case == "unused" else step()
    if case == "order":
        return _outcome(lambda: step((0, 2, 1) if deviant else (0, 1, 2)))
    if case == "skip":
        return _outcome(lambda: step((0, 2) if deviant else (0, 1, 2)))
    if case == "unused":  # through fddp.grad_and_value, which raises in the very call
        return _outcome(lambda: gv(shards, not deviant)), _outcome(lambda: gv(shards, True))
    if case == "eval":  # rank 0 evaluates alone between two steps
        first = _outcome(lambda: apply_fn(shards, x).sum() if not deviant else step())
        return first
    if case == "models":  # two models of one architecture, called in another order on one rank
        other_fn, other = fddp.zero.fully_shard(_Blocks(), group=group, min_unit_mb=0)
        pair = [lambda: apply_fn(shards, x), lambda: other_fn(other, x)]
        with torch.no_grad():
            return _outcome(lambda: [f() for f in (pair[::-1] if deviant else pair)])
    raise AssertionError(case)


def test_stage3_units_in_another_order_or_skipped_on_one_rank_fail_on_every_rank():
    for case in ("order", "skip"):
        o0, o1 = run(_stage3_worker, 2, case, timeout=90)
        assert o1[0] == "MismatchError" and "as the" in o1[1] and "the sequence the ranks agreed on" in o1[1], (case, o1)
        assert o0[0] == "PeerError" and o0[2] < 5 and "rank 1 failed in fddp.zero.fully_shard" in o0[1], (case, o0)


def test_stage3_an_output_unused_in_one_ranks_loss_fails_on_every_rank_not_an_abort():
    (o0, a0), (o1, a1) = run(_stage3_worker, 2, "unused", timeout=90)
    # Rank 1's head never runs its backward: as its graph is freed, it fails the group, and rank 0,
    # waiting in the head's reduction, raises within a poll.
    assert o1[0] == "PeerError" and "dropped a forward's graph without running its backward" in o1[1], o1
    assert o0[0] == "PeerError" and o0[2] < 5 and "rank 1 failed in fddp.zero.fully_shard" in o0[1], o0
    assert a0[0] == a1[0] == "PeerError", (a0, a1)  # and the group is done, on both


def test_stage3_an_evaluation_forward_on_one_rank_is_named_on_every_rank():
    o0, o1 = run(_stage3_worker, 2, "eval", timeout=90)
    for out in (o0, o1):
        assert out[0] == "MismatchError" and "an evaluation forward" in out[1] and "a training forward" in out[1], out


def test_stage3_two_models_of_one_architecture_in_another_order_are_named():
    for out in run(_stage3_worker, 2, "models", timeout=90):
        assert out[0] == "MismatchError" and "fully_shard's model #" in out[1], out


def _batchnorm_worker():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    apply_fn, shards = fddp.zero.fully_shard(model, group=_group())
    return _outcome(lambda: apply_fn(shards, torch.randn(8, 4)))


def test_stage3_a_forward_that_writes_batchnorm_statistics_is_refused_on_every_rank():
    for out in run(_batchnorm_worker, 2, timeout=60):
        assert out[0] == "RuntimeError" and "'1.running_mean'" in out[1] and "each would keep its own" in out[1], out


def _watcher_worker() -> tuple:
    """The NCCL path's watcher, on a gloo group with a stand-in abort: a peer's fatal failure
    posted while this rank is inside a call is read by the thread, which aborts the group."""
    import threading

    import torch.distributed as dist

    from fddp._dist import _watcher

    group = dist.new_group([0, 1])
    aborted = threading.Event()
    _watcher.watch(group, abort=aborted.set)
    fddp.broadcast({"w": torch.zeros(1)}, group=group)  # in step, and the channel exists
    fddp.broadcast({"sync": torch.zeros(1)})
    if fddp.rank() == 1:
        fddp._dist.fail(group, "test", RuntimeError("this rank's stream is gone"))
        return None
    t0 = time.monotonic()
    with fddp._dist.call(group, "a call in flight"):
        aborted.wait(10)  # the host is not in any wait: only the watcher can see the failure
    took = time.monotonic() - t0
    try:
        fddp.broadcast({"w": torch.zeros(1)}, group=group)
    except fddp.PeerError as e:
        return aborted.is_set(), took, str(e)
    return aborted.is_set(), took, "no error"


def test_the_watcher_aborts_a_group_whose_waits_cannot_read_the_channel():
    (aborted, took, message), _ = run(_watcher_worker, 2)
    assert aborted and took < 5.0, (aborted, took)
    assert "rank 1 failed in fddp.test" in message and "this rank's stream is gone" in message, message
