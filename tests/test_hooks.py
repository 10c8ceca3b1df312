"""Comm hooks: a user-written hook (docs/concepts.md's top-k with error feedback) on 2 ranks, against
a one-process reference that writes out both ranks' arithmetic; and the protocol's checks."""

from __future__ import annotations

import math
import re
from pathlib import Path

import optree
import pytest
import torch

import fddp
from dist import run

ROOT = Path(__file__).resolve().parent.parent
CAPS = dict(bucket_cap_mb=1e-4, first_bucket_mb=1e-5)  # several buckets for a small tree


def _topk_class() -> type:
    """The ``TopK`` hook exactly as docs/concepts.md shows it."""
    text = (ROOT / "docs" / "concepts.md").read_text()
    code = re.search(r"<!-- the hook below is run by tests/test_hooks.py[^\n]*-->\n```python\n(.*?)```", text, re.DOTALL)
    namespace: dict = {}
    exec(compile(code.group(1), "docs/concepts.md", "exec"), namespace)
    return namespace["TopK"]


def _params() -> dict:
    return {"w": torch.zeros(6, 5), "b": torch.zeros(5), "v": torch.zeros(7)}


def _grads(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {k: torch.randn(v.shape, generator=g) for k, v in _params().items()}


def _hook_worker(steps: int) -> list:
    topk = _topk_class()(fraction=0.2)
    params = _params()
    state = topk.init(params)
    out = []
    for step in range(steps):
        grads, info = fddp.ddp_step(params, _grads(fddp.rank(), step), compression=topk, compression_state=state, return_info=True, **CAPS)
        state = info.compression_state
        out.append((grads, state, info.collectives))
    return out


def _reference(world: int, steps: int) -> list:
    """Both ranks' top-k and error feedback written out, bucket by bucket, in one process."""
    params = _params()
    plan = fddp.sync.plan_of(params, **CAPS)
    leaves, spec = optree.tree_flatten(params)
    residual = [[torch.zeros_like(t) for t in leaves] for _ in range(world)]
    out = []
    for step in range(steps):
        g = [optree.tree_leaves(_grads(r, step)) for r in range(world)]
        mean = [None] * len(leaves)
        for b in plan.buckets:
            total = torch.zeros(b.numel)
            for r in range(world):
                x = torch.cat([g[r][i].reshape(-1) + residual[r][i].reshape(-1) for i in b.indices])
                idx = x.abs().topk(max(1, math.ceil(0.2 * x.numel()))).indices
                total.index_add_(0, idx, x[idx])
                kept = x.clone()
                kept[idx] = 0
                for i, piece in zip(b.indices, kept.split(b.numels)):
                    residual[r][i] = piece.view(leaves[i].shape)
            total /= world
            for i, piece in zip(b.indices, total.split(b.numels)):
                mean[i] = piece.view(leaves[i].shape)
        out.append((optree.tree_unflatten(spec, mean), [optree.tree_unflatten(spec, res) for res in residual]))
    return out


def test_user_written_topk_hook_matches_its_reference():
    world, steps = 2, 3
    results = run(_hook_worker, world, steps)
    reference = _reference(world, steps)
    buckets = len(fddp.sync.plan_of(_params(), **CAPS).buckets)
    assert buckets >= 2
    for r, per_step in enumerate(results):
        for (grads, state, collectives), (ref_mean, ref_residuals) in zip(per_step, reference):
            assert collectives == 2 * buckets  # indices and values, per bucket
            for k in ref_mean:
                torch.testing.assert_close(grads[k], ref_mean[k], rtol=1e-6, atol=1e-7)
                assert torch.equal(state[k], ref_residuals[r][k]), (r, k)


class _Wrong(fddp.hooks.CommHook):
    """A broken hook: returns half a bucket."""

    def launch(self, state, bucket):
        return None, state

    def finish(self, state, bucket, pending):
        return bucket.buffer[: bucket.buffer.numel() // 2], state


def test_protocol_errors_name_the_hook_and_what_was_expected():
    fddp.init()
    p = {"w": torch.ones(4)}
    with pytest.raises(ValueError, match=r"_Wrong.*bucket 0; expected a 1-D tensor of 4 elements"):
        fddp.ddp_step(p, p, compression=_Wrong())
    with pytest.raises(ValueError, match="does not implement weighted means"):
        fddp.ddp_step(p, p, compression=_Wrong(), weight=2.0)
    topk = _topk_class()()
    with pytest.raises(ValueError, match="return_info=True"):
        fddp.ddp_step(p, p, compression=topk, compression_state=topk.init(p))
    with pytest.raises(ValueError, match="needs compression_state="):
        fddp.ddp_step(p, p, compression=topk, return_info=True)
    with pytest.raises(ValueError, match="check_finite=True computes info.finite"):
        fddp.ddp_step(p, p, check_finite=True)
    with pytest.raises(TypeError, match="takes weight= for itself"):
        fddp.grad_and_value(lambda params, weight: params["w"].sum())
