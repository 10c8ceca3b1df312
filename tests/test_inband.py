"""The header in band: a call that repeats the last one the ranks completed sends no header; its
first bucket's all-reduce carries the agreement in a tail (``fddp._dist._agreement``'s "In band").

Every case ends with a plain step on every rank: the group is still in step. In band is for two
ranks (see ``completed``); the cases also run on 3 ranks, where the header and early buckets
stand in for it (``test_early.py``'s cases, there on 2 ranks), so both paths meet the same cases.
"""

from __future__ import annotations

import test_early
import torch

import fddp
from dist import count_calls, run


def _params(dtype: torch.dtype = torch.float32) -> dict:
    return {"w": torch.arange(5, dtype=dtype), "b": torch.ones(2, dtype=dtype)}


def _loop_worker(dtype: torch.dtype) -> tuple:
    params = fddp.broadcast(_params(dtype))
    r = fddp.rank()
    fn = fddp.grad_and_value(lambda p, x: sum((v * x).sum() for v in p.values()))
    per_call = []
    outs = []
    for step in range(4):
        with count_calls(("all_reduce",), lambda _, args: args[0].numel()) as calls:
            outs.append(fddp.ddp_step(params, {k: v * (r + 1) * (step + 1) for k, v in params.items()}))
        per_call.append(("ddp_step", calls.headers, list(calls)))
    for _ in range(3):
        with count_calls(("all_reduce",), lambda _, args: args[0].numel()) as calls:
            outs.append(fn(params, torch.tensor(float(r + 1), dtype=dtype))[0])
        per_call.append(("grad_and_value", calls.headers, list(calls)))
    # A loop that alternates two calls: each is predicted from the one before it (the agreed
    # history's successor), so after one round to learn, neither sends a header.
    for _ in range(3):
        with count_calls(("all_reduce",), lambda _, args: args[0].numel()) as calls:
            fddp.ddp_step(params, params)
            fn(params, torch.tensor(float(r + 1), dtype=dtype))
        per_call.append(("alternating", calls.headers, list(calls)))
    fddp.verify_replicas(params)  # an agreement of another kind after a call that carried: a probe pairs with it
    with count_calls(("all_reduce",), lambda _, args: args[0].numel()) as calls:
        outs.append(fddp.ddp_step(params, params))
    per_call.append(("ddp_step after verify_replicas", calls.headers, list(calls)))
    return per_call, [{k: v.clone() for k, v in o.items()} for o in outs]


def test_repeated_calls_send_no_header_and_give_the_same_means():
    tail = fddp._dist._header.tail_size(2)
    for dtype in (torch.float32, torch.float64):
        for per_call, outs in run(_loop_worker, 2, dtype):
            n = 7  # both leaves in one bucket
            # The first ddp_step and the first grad_and_value have nothing to repeat: a header (or,
            # after a call that can carry one, zeros with a tail) then the bucket. Every repeat:
            # the bucket and its tail, in one all-reduce.
            assert per_call[0] == ("ddp_step", 1, [n]), per_call[0]
            for what, headers, sizes in per_call[1:4]:
                assert (headers, sizes) == (0, [n + tail]), (what, headers, sizes)
            assert per_call[4] == ("grad_and_value", 1, [n]), per_call[4]  # not a repeat: a probe (counted as a header)
            for what, headers, sizes in per_call[5:7]:
                assert (headers, sizes) == (0, [n + tail]), (what, headers, sizes)
            assert per_call[9][1:] == (0, [n + tail, n + tail]), per_call[7:10]  # the third round: both in band
            # verify_replicas agreed by a probe (zeros with a tail) and completed no bucket: the
            # next ddp_step has nothing to repeat, and no call that can carry, so a header again.
            assert per_call[10][1:] == (1, [n]), per_call[10]
            for step in range(4):
                expected = {k: v * 1.5 * (step + 1) for k, v in _params(dtype).items()}
                assert all(torch.equal(outs[step][k], expected[k]) for k in expected)
            for o in outs[4:7]:
                assert all(torch.equal(v, torch.full_like(v, 1.5)) for v in o.values())


def _switch_worker() -> tuple:
    """After in-band calls: one rank changes function, another fails in its forward, a third
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


def test_a_rank_that_leaves_the_repeat_meets_in_band_peers():
    for world in (2, 3):
        mean = (world + 1) / 2
        results = run(_switch_worker, world, timeout=120)
        for r, errors in enumerate(results):
            peer = "ValueError" if r == 1 else "PeerError"
            assert errors == [
                "MismatchError", [mean] * 2, peer, [mean] * 2, "MismatchError", [mean] * 2,
            ], (world, r, errors)  # fmt: skip


def test_the_early_bucket_cases_on_three_ranks():
    for mode, peer in (("tree", "MismatchError"), ("raise", "PeerError")):
        results = run(test_early._mismatch_worker, 3, mode, timeout=90)
        for r, (error, _seen, after) in enumerate(results):
            expected = ("MismatchError" if mode == "tree" else "ValueError") if r == 1 else peer
            assert error is not None and error[0] == expected, (mode, r, error)
            for k in after:
                torch.testing.assert_close(after[k], test_early._params()[k] * 2.0, rtol=0, atol=0)
