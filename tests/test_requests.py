"""Requests ride in the agreement: a bit one rank sets reaches every rank at the same call, with no
collective of its own (``fddp._dist.request`` / ``take_requested``)."""

from __future__ import annotations

import torch

import fddp
from dist import run


def _worker() -> list[int]:
    from fddp import _dist

    params = fddp.broadcast({"w": torch.ones(3)})
    seen = [_dist.take_requested(None)]  # nothing asked yet
    if fddp.rank() == 1:
        _dist.request(None, 0b10)
    fddp.ddp_step(params, params)  # rank 1's bit rides in this call's header
    seen.append(_dist.take_requested(None))
    seen.append(_dist.take_requested(None))  # taken: gone
    fddp.ddp_step(params, params)
    seen.append(_dist.take_requested(None))  # sent once, not again
    return seen


def test_a_request_reaches_every_rank_at_the_same_call():
    assert run(_worker, 2) == [[0, 0b10, 0, 0]] * 2


def test_a_one_rank_group_takes_its_own_requests():
    from fddp import _dist

    if not fddp.is_initialized():
        fddp.init()
    _dist.take_requested(None)
    _dist.request(None, 1)
    assert _dist.take_requested(None) == 1
    assert _dist.take_requested(None) == 0


def test_a_caller_takes_only_its_own_bits():
    from fddp import _dist

    if not fddp.is_initialized():
        fddp.init()
    _dist.take_requested(None)
    _dist.request(None, 0b101)
    assert _dist.take_requested(None, 0b001) == 0b001
    assert _dist.take_requested(None, 0b011) == 0  # taken: gone; 0b100 is another owner's
    assert _dist.take_requested(None) == 0b100
