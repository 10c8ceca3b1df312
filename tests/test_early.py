"""Repeated calls, and a rank that leaves the repeat: a call whose data rides in its head (its
one collective) still raises on every rank, with the group in step, when the ranks differ
(``fddp._dist._agreement``'s "The data rides in the head"; this file once held the early-bucket
cases, which the head replaced: the cases are the same).

Each case ends with a plain step on every rank: the group is still usable, which it would not be
had one rank's buckets been left unmatched.
"""

from __future__ import annotations

import torch

import fddp
from dist import run


def _params(n: int = 5) -> dict:
    return {"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(2)}


def _repeat_worker(mode: str) -> tuple:
    params = fddp.broadcast(_params())
    r = fddp.rank()
    outs = []
    if mode == "ddp_step":
        for step in range(4):
            grads = {k: v * (r + 1) * (step + 1) for k, v in params.items()}
            outs.append(fddp.ddp_step(params, grads))
    else:
        fn = fddp.grad_and_value(lambda p, x: sum((v * x).sum() for v in p.values()))
        for step in range(4):
            outs.append(fn(params, torch.tensor(float((r + 1) * (step + 1))))[0])
    return [{k: v.clone() for k, v in o.items()} for o in outs]


def test_repeated_calls_give_the_same_means():
    for mode in ("ddp_step", "grad_and_value"):
        outs0, outs1 = run(_repeat_worker, 2, mode)
        for step, (a, b) in enumerate(zip(outs0, outs1)):
            for k in a:
                expected = _params()[k] * 1.5 * (step + 1) if mode == "ddp_step" else torch.full_like(a[k], 1.5 * (step + 1))
                torch.testing.assert_close(a[k], expected, rtol=0, atol=0)
                torch.testing.assert_close(b[k], expected, rtol=0, atol=0)


def _mismatch_worker(mode: str, n: int = 5) -> tuple:
    """Rank 0 repeats its step (its data in the head); rank 1 changes its tree (another head), or
    raises before sending anything (it announces in place of the head). ``n``: the tree's size (600
    is too large for the head: a head, then the bucket)."""
    params = fddp.broadcast(_params(n))
    r = fddp.rank()
    for _ in range(2):
        fddp.ddp_step(params, params)
    error = None
    try:
        if r == 1 and mode == "tree":
            fddp.ddp_step(_params(n + 1), _params(n + 1))
        elif r == 1 and mode == "raise":
            fddp.ddp_step(params, {"w": torch.zeros(3)})  # a bad argument: announced before the header
        else:
            fddp.ddp_step(params, params)
    except Exception as e:  # noqa: BLE001 - the test compares the ranks' errors
        error = (type(e).__name__, str(e)[:300])
    after = fddp.ddp_step(params, {k: v * (r + 1) for k, v in params.items()})  # the group is still in step
    return error, {k: v.clone() for k, v in after.items()}


def test_a_rank_that_changes_its_tree_or_fails_meets_its_peers_head():
    for n in (5, 600):
        for mode, peer in (("tree", "MismatchError"), ("raise", "PeerError")):
            (e0, after0), (e1, after1) = run(_mismatch_worker, 2, mode, n, timeout=60)
            assert e0 is not None and e0[0] == peer, (n, mode, e0)
            assert e1 is not None and e1[0] == ("MismatchError" if mode == "tree" else "ValueError"), (n, mode, e1)
            if mode == "tree":  # the first differing row is named, on both ranks
                assert "'w'" in e0[1] and str(n + 1) in e0[1] and e0[1] == e1[1], (e0, e1)
            for k in after0:
                torch.testing.assert_close(after0[k], _params(n)[k] * 1.5, rtol=0, atol=0)
                torch.testing.assert_close(after1[k], _params(n)[k] * 1.5, rtol=0, atol=0)
