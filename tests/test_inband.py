"""The data in the head: a steady-state call sends no collective beyond its own data's, on any
number of ranks (``fddp._dist._agreement``'s "The data rides in the head").

A plain mean (or ``psum``) whose values fit in the head's DATA slots sends them in the call's
head: one all-reduce, the check included. A larger tree sends a head, then its buckets. Every
head has one size, whatever the call, so a rank at another call (another tree, another function,
a compiled step, a failure announced in place of a call) pairs head with head: every rank raises,
none aborts. Every case ends with a plain step on every rank: the group is still in step.
"""

from __future__ import annotations

import test_early
import torch
import torch.distributed as tdist

import fddp
from dist import count_calls, run


def _params(dtype: torch.dtype = torch.float32) -> dict:
    return {"w": torch.arange(5, dtype=dtype), "b": torch.ones(2, dtype=dtype)}


def _counted(fn) -> tuple:
    with count_calls(("all_reduce", "broadcast", "all_gather", "all_to_all_single"), lambda name, args: (name, args[0].numel())) as calls:
        out = fn()
    return out, (calls.headers, list(calls))


def _loop_worker(dtype: torch.dtype) -> tuple:
    params = fddp.broadcast(_params(dtype))
    r = fddp.rank()
    fn = fddp.grad_and_value(lambda p, x: sum((v * x).sum() for v in p.values()))
    per_call, outs = [], []
    for step in range(3):
        out, counted = _counted(lambda: fddp.ddp_step(params, {k: v * (r + 1) * (step + 1) for k, v in params.items()}))
        per_call.append(("ddp_step", *counted))
        outs.append(out)
    for _ in range(2):
        out, counted = _counted(lambda: fn(params, torch.tensor(float(r + 1), dtype=dtype))[0])
        per_call.append(("grad_and_value", *counted))
        outs.append(out)
    for _ in range(2):
        out, counted = _counted(lambda: fddp.psum({"x": torch.full((3,), float(r + 1), dtype=dtype)}))
        per_call.append(("psum", *counted))
        outs.append(out)
    _, counted = _counted(lambda: (fddp.ddp_step(params, params), fn(params, torch.tensor(1.0, dtype=dtype))))
    per_call.append(("alternating", *counted))
    fddp.verify_replicas(params)  # an agreement of another kind between two steps
    out, counted = _counted(lambda: fddp.ddp_step(params, params))
    per_call.append(("ddp_step after verify_replicas", *counted))
    big = {"w": torch.arange(600, dtype=dtype)}
    out, counted = _counted(lambda: fddp.ddp_step(big, big))
    per_call.append(("a tree too large for the head", *counted))
    return per_call, [{k: v.clone() for k, v in o.items()} for o in outs]


def test_steady_state_calls_send_no_collective_beyond_their_data():
    for world in (2, 3, 4):
        mean = (world + 1) / 2
        for dtype in (torch.float32, torch.float64) if world == 2 else (torch.float32,):
            for r, (per_call, outs) in enumerate(run(_loop_worker, world, dtype, timeout=120)):
                # Every call of a small tree, its first included: one all-reduce of its own values, no head apart.
                for what, headers, sizes in per_call[:7]:
                    n = 3 if what == "psum" else 7
                    assert (headers, sizes) == (0, [("all_reduce", n)]), (world, r, what, headers, sizes)
                assert per_call[7][1:] == (0, [("all_reduce", 7)] * 2), per_call[7]
                assert per_call[8][1:] == (0, [("all_reduce", 7)]), per_call[8]
                assert per_call[9][1:] == (1, [("all_reduce", 600)]), per_call[9]  # a head, then the bucket
                for step in range(3):  # small integers: exact on any number of ranks
                    expected = {k: v * mean * (step + 1) for k, v in _params(dtype).items()}
                    assert all(torch.equal(outs[step][k], expected[k]) for k in expected), (world, outs[step])
                for o in outs[3:5]:
                    assert all(torch.equal(v, torch.full_like(v, mean)) for v in o.values()), (world, o)
                for o in outs[5:7]:
                    assert torch.equal(o["x"], torch.full((3,), world * mean, dtype=dtype)), (world, o)


def _switch_worker() -> tuple:
    """After steady-state calls: one rank changes function, another fails in its forward, a third
    switches compression; each case is a clean error on every rank and leaves the group usable."""
    params = fddp.broadcast(_params())
    r = fddp.rank()
    fn = fddp.grad_and_value(lambda p, x: sum((v * x).sum() for v in p.values()))

    def bad(p, x):
        raise ValueError("this rank's forward fails")

    failing = fddp.grad_and_value(bad)
    errors = []
    for case in ("other function", "forward fails", "compression"):
        for _ in range(2):
            fn(params, torch.tensor(1.0))
        try:
            if case == "other function" and r == 1:
                fddp.ddp_step(params, params)
            elif case == "forward fails" and r == 1:
                failing(params, torch.tensor(1.0))
            elif case == "compression" and r == 0:
                fddp.grad_and_value(lambda p, x: sum((v * x).sum() for v in p.values()), compression="bf16")(params, torch.tensor(1.0))
            else:
                fn(params, torch.tensor(1.0))
        except Exception as e:  # noqa: BLE001 - the test compares the ranks' errors
            errors.append(type(e).__name__)
        errors.append(sorted(fddp.ddp_step(params, {k: v * (r + 1) for k, v in params.items()})["b"].tolist()))
    return errors


def test_a_rank_that_leaves_the_repeat_meets_its_peers_head():
    for world in (2, 3):
        mean = (world + 1) / 2
        results = run(_switch_worker, world, timeout=120)
        for r, errors in enumerate(results):
            peer = "ValueError" if r == 1 else "PeerError"
            assert errors == [
                "MismatchError", [mean] * 2, peer, [mean] * 2, "MismatchError", [mean] * 2,
            ], (world, r, errors)  # fmt: skip


def test_the_mismatch_cases_on_three_ranks():
    for n in (5, 600):
        for mode, peer in (("tree", "MismatchError"), ("raise", "PeerError")):
            results = run(test_early._mismatch_worker, 3, mode, n, timeout=90)
            for r, (error, after) in enumerate(results):
                expected = ("MismatchError" if mode == "tree" else "ValueError") if r == 1 else peer
                assert error is not None and error[0] == expected, (n, mode, r, error)
                for k in after:
                    torch.testing.assert_close(after[k], test_early._params(n)[k] * 2.0, rtol=0, atol=0)


# --- the two defects of the early/in-band machinery, as cases ----------------------------------------------


def _outcome(fn) -> tuple:
    try:
        return ("ok", fn())
    except Exception as e:  # noqa: BLE001 - the case reports what each rank saw
        return (type(e).__name__, str(e)[:400])


def _compiled_twice_worker() -> tuple:
    """A compiled step that syncs twice on rank 0 and once on rank 1, after eager steady-state steps:
    rank 1's next (eager) call meets rank 0's second compiled call. On a group of its own: rank 0's
    graph may have issued its second bucket, which nothing will ever meet."""
    group = tdist.new_group()
    p = {"w": torch.ones(8)}
    g = {"w": torch.full((8,), 1.0 + fddp.rank())}
    for _ in range(3):
        fddp.ddp_step(p, g, group=group)

    @torch.compile(fullgraph=True)
    def step(g):
        out = fddp.ddp_step(p, g, group=group)
        if fddp.rank() == 0:  # decided at trace time: this rank's graph syncs twice
            out = fddp.ddp_step(p, out, group=group)
        return out

    compiled = _outcome(lambda: step(g)["w"].tolist())
    after = _outcome(lambda: fddp.ddp_step(p, g, group=group)["w"].tolist()) if fddp.rank() == 1 else None
    return compiled, after


def test_a_compiled_step_that_syncs_more_often_on_one_rank_raises_on_every_rank():
    (c0, a0), (c1, a1) = run(_compiled_twice_worker, 2, timeout=300)
    # Rank 0's second head meets rank 1's next head (one size): rank 0's graph asserts, rank 1
    # names the peer that said nothing (it was inside a compiled step); neither process aborts.
    assert c0[0] == "RuntimeError" and "(compiled): the ranks disagree" in c0[1], c0
    assert c1 == ("ok", [1.5] * 8), c1
    assert a1[0] == "MismatchError" and "compiled step" in a1[1], a1


def _differentiable_worker() -> list:
    """Identical differentiable steps (gradients made with create_graph=True) on every rank, then
    one in which the last rank is out of data (grads=None): the same call, so it agrees."""
    params = fddp.broadcast({"w": torch.arange(4.0), "b": torch.ones(2)})
    r, n = fddp.rank(), fddp.world_size()
    outs = []
    for step in range(4):
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        loss = sum((v * v).sum() for v in leaves.values()) * (r + 1)
        grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), create_graph=True)))
        if step == 3 and r == n - 1:
            grads = None
        mean = _outcome(lambda: fddp.ddp_step(params, grads))
        outs.append((mean[0], {k: (v.detach().tolist(), v.requires_grad) for k, v in mean[1].items()} if mean[0] == "ok" else mean))
    outs.append(fddp.ddp_step(params, params)["w"].tolist())  # the group is still in step
    return outs


def test_a_differentiable_step_and_a_rank_out_of_data_agree():
    for world in (2, 3):
        params = {"w": torch.arange(4.0), "b": torch.ones(2)}
        for r, outs in enumerate(run(_differentiable_worker, world, timeout=120)):
            for step, (status, mean) in enumerate(outs[:4]):
                assert status == "ok", (world, r, step, mean)
                # 2 v (r + 1) summed over the ranks that have data, over the group's size.
                ranks = world - 1 if step == 3 else world
                scale = 2 * sum(range(1, ranks + 1)) / world
                for k, (values, requires_grad) in mean.items():
                    assert values == (params[k] * scale).tolist(), (world, r, step, k, values)
                    assert requires_grad == (step < 3 or r < world - 1), (world, r, step, k)
            assert outs[4] == params["w"].tolist()


def _announced_worker() -> tuple:
    """Rank 1 asks for a save (as a SIGTERM handler does); rank 0's next call fails before it
    sends anything (announced). Both must take the same request bits at the next boundary."""
    from fddp import _dist

    r = fddp.rank()
    params = fddp.broadcast({"w": torch.ones(3)})
    if r == 1:
        _dist.request(None, _dist.PREEMPT)
    failed = _outcome(lambda: fddp.ddp_step(params, {"w": torch.ones(3)}, weight=-1.0 if r == 0 else 1.0))[0]
    bits = _dist.take_requested(None)
    return failed, _dist.agreements(None), bits, fddp.ddp_step(params, params)["w"].tolist()


def test_a_rank_that_announces_a_failure_learns_its_peers_requests_too():
    # Before: the announcing rank never read its head's sum, so rank 1's Manager saved and
    # stopped while rank 0 trained on (and the two met at mismatched collectives).
    (f0, a0, b0, w0), (f1, a1, b1, w1) = run(_announced_worker, 2, timeout=60)
    assert (f0, f1) == ("ValueError", "PeerError")
    assert a0 == a1 and b0 == b1 == fddp._dist.PREEMPT, (a0, a1, b0, b1)
    assert w0 == w1 == [1.0, 1.0, 1.0]


def test_the_heads_sum_says_exactly_when_every_rank_sent_the_same_identity():
    """The head's arithmetic, with the all-reduce done by hand: sums of 0..255 chunks and their
    squares over n heads, for identities that differ in one bit, in every chunk, or not at all."""
    from fddp._dist import _header

    def summed(*heads):
        return torch.stack(heads).sum(0)

    a = (1 << 61) + 12345
    for n in (2, 3, 4, 7):
        v = _header.read(summed(*[_header.build(a, printed=99, flags=0b10 if i == 0 else 0) for i in range(n)]), n)
        assert v.agrees and v.compared and v.equal and v.flags == 0b10 and not v.new and v.fails == 0, (n, v)
        for other in (a ^ 1, a ^ (1 << 60), a + (1 << 8), 0):
            heads = [_header.build(a) for _ in range(n - 1)] + [_header.build(other)]
            assert not _header.read(summed(*heads), n).agrees, (n, other)
            assert not bool(_header.traced_verdict(summed(*heads), n)), (n, other)
        # A pair of ranks whose chunks sum alike but differ (3 + 5 against 4 + 4) is told apart by the squares.
        x, y, z = 3, 5, 4
        pair = _header.read(summed(_header.build(x), _header.build(y)), 2)
        assert not pair.agrees and _header.read(summed(_header.build(z), _header.build(z)), 2).agrees
        # Failures: the rank where one announced; none where several did (the channel names the first).
        heads = [_header.build(a) for _ in range(n - 1)] + [_header.build(0, failed=n - 1)]
        v = _header.read(summed(*heads), n)
        assert (v.fails, v.failed, v.agrees) == (1, n - 1, False)
        assert _header.read(summed(*[_header.build(0, failed=r) for r in range(n)]), n)[1:3] == (n, None)
        # Replica digests: compared only when every rank sent one.
        v = _header.read(summed(*[_header.build(a, printed=7 if r else 0) for r in range(n)]), n)
        assert v.agrees and not v.compared
        v = _header.read(summed(*[_header.build(a, printed=7 + (r == 0)) for r in range(n)]), n)
        assert v.agrees and v.compared and not v.equal
