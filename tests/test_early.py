"""Early buckets: a call that repeats the last one the ranks completed sends its buckets without
waiting for its header, and still raises on every rank, with the group in step, when the ranks
differ (``fddp._dist._agreement``'s "Early buckets").

Each case ends with a plain step on every rank: the group is still usable, which it would not be
had one rank's buckets been left unmatched.
"""

from __future__ import annotations

import torch

import fddp
from dist import run


def _params(n: int = 5) -> dict:
    return {"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(2)}


def _early_flags() -> list[bool]:
    """Record, per ddp_step / grad_and_value call, whether its buckets went out early."""
    import fddp._dist._agreement as agreement

    seen: list[bool] = []
    original = agreement.goes_early

    def spy(group, what, signature):
        out = original(group, what, signature)
        seen.append(out)
        return out

    agreement.goes_early = spy
    import fddp.sync._setup as setup

    setup._dist.goes_early = spy
    return seen


def _repeat_worker(mode: str) -> tuple:
    seen = _early_flags()
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
    return seen, [{k: v.clone() for k, v in o.items()} for o in outs]


def test_repeated_calls_go_early_and_give_the_same_means():
    for mode in ("ddp_step", "grad_and_value"):
        (seen0, outs0), (seen1, outs1) = run(_repeat_worker, 2, mode)
        assert seen0 == seen1 == [False, True, True, True], (mode, seen0)  # the first call waits: nothing completed yet
        for step, (a, b) in enumerate(zip(outs0, outs1)):
            for k in a:
                expected = _params()[k] * 1.5 * (step + 1) if mode == "ddp_step" else torch.full_like(a[k], 1.5 * (step + 1))
                torch.testing.assert_close(a[k], expected, rtol=0, atol=0)
                torch.testing.assert_close(b[k], expected, rtol=0, atol=0)


def _mismatch_worker(mode: str) -> tuple:
    """Rank 0 repeats its step (early); rank 1 changes its tree (it waits for the header), or
    raises before sending anything (it announces in place of the header)."""
    seen = _early_flags()
    params = fddp.broadcast(_params())
    r = fddp.rank()
    for _ in range(2):
        fddp.ddp_step(params, params)
    error = None
    try:
        if r == 1 and mode == "tree":
            fddp.ddp_step(_params(6), _params(6))
        elif r == 1 and mode == "raise":
            fddp.ddp_step(params, {"w": torch.zeros(3)})  # a bad argument: announced before the header
        else:
            fddp.ddp_step(params, params)
    except Exception as e:  # noqa: BLE001 - the test compares the ranks' errors
        error = (type(e).__name__, str(e)[:300])
    after = fddp.ddp_step(params, {k: v * (r + 1) for k, v in params.items()})  # the group is still in step
    return error, seen, {k: v.clone() for k, v in after.items()}


def test_a_rank_that_changes_its_tree_or_fails_meets_its_peers_early_buckets_with_zeros():
    for mode, peer in (("tree", "MismatchError"), ("raise", "PeerError")):
        (e0, seen0, after0), (e1, seen1, after1) = run(_mismatch_worker, 2, mode, timeout=60)
        assert seen0[-2] is True, (mode, seen0)  # rank 0 went early at the third call
        assert e0 is not None and e0[0] == peer, (mode, e0)
        assert e1 is not None and e1[0] == ("MismatchError" if mode == "tree" else "ValueError"), (mode, e1)
        for k in after0:
            torch.testing.assert_close(after0[k], _params()[k] * 1.5, rtol=0, atol=0)
            torch.testing.assert_close(after1[k], _params()[k] * 1.5, rtol=0, atol=0)
