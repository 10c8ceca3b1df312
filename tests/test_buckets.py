"""Bucket plans follow torch DDP's assignment; flatten / unflatten round-trip without extra copies."""

from __future__ import annotations

import pytest
import torch

import fddp
from fddp._layout import MB, flatten, unflatten
from fddp._layout import plan as make_plan
from fddp._pool import new_buffer
from fddp._tree import LeafSpec

CPU = torch.device("cpu")


def spec(n: int, dtype: torch.dtype = torch.float32, shape: tuple[int, ...] | None = None) -> LeafSpec:
    return LeafSpec(shape or (n,), dtype, CPU)


def test_reverse_order_first_bucket_small_then_cap():
    # 10 leaves of 0.25 MiB each: the first bucket closes at 1 MiB (4 leaves), the others at 2 MiB (8 leaves).
    specs = tuple(spec(MB // 16) for _ in range(10))
    plan = make_plan(specs, bucket_cap_mb=2.0, first_bucket_mb=1.0)
    assert [b.indices for b in plan.buckets] == [(9, 8, 7, 6), (5, 4, 3, 2, 1, 0)]
    assert plan.buckets[0].nbytes == MB and plan.nbytes == 10 * MB // 4


def test_matches_torch_ddp_assignment():
    # torch's own assignment (used by DDP's Reducer) on the same sizes, limits [first, cap].
    import torch.distributed as dist

    sizes = [3000, 200_000, 17, 90_000, 400_000, 5, 120_000, 64]
    tensors = [torch.empty(n) for n in sizes]
    first, cap = 0.5, 1.0
    ref, _ = dist._compute_bucket_assignment_by_size(
        list(reversed(tensors)), [int(first * MB), int(cap * MB)], [False] * len(tensors)
    )
    ref_sets = sorted(sorted(len(sizes) - 1 - i for i in b) for b in ref)
    plan = make_plan(tuple(spec(n) for n in sizes), bucket_cap_mb=cap, first_bucket_mb=first)
    assert sorted(sorted(b.indices) for b in plan.buckets) == ref_sets


def test_one_bucket_per_dtype_and_device():
    specs = (spec(4), spec(4, torch.float64), spec(4), spec(4, torch.bfloat16))
    plan = make_plan(specs)
    assert [(b.indices, b.dtype) for b in plan.buckets] == [
        ((3,), torch.bfloat16),
        ((2, 0), torch.float32),
        ((1,), torch.float64),
    ]


def test_plan_is_cached_and_deterministic():
    specs = tuple(spec(n) for n in (5, 7, 11))
    assert make_plan(specs, 1.0, 0.5) is make_plan(tuple(spec(n) for n in (5, 7, 11)), 1.0, 0.5)


@pytest.mark.parametrize("bad", [0, -1.0, "25"])
def test_bad_caps_rejected(bad):
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
        make_plan((spec(1),), bucket_cap_mb=bad)


def test_flatten_unflatten_round_trip_with_views():
    leaves = [torch.randn(3, 4), None, torch.randn(5), torch.randn(2, 2).t()]  # one non-contiguous leaf
    originals = [None if t is None else t.clone() for t in leaves]
    specs = (LeafSpec.of(leaves[0]), spec(6, shape=(2, 3)), LeafSpec.of(leaves[2]), LeafSpec.of(leaves[3]))
    plan = make_plan(specs, bucket_cap_mb=1e-4, first_bucket_mb=1e-5)
    flats = flatten(plan, leaves)
    out = unflatten(plan, flats)
    assert torch.equal(out[0], leaves[0]) and torch.equal(out[2], leaves[2]) and torch.equal(out[3], leaves[3])
    assert torch.equal(out[1], torch.zeros(2, 3))
    # every leaf is a view into its bucket buffer: no second copy
    bases = {f.untyped_storage().data_ptr() for f in flats}
    assert all(o.untyped_storage().data_ptr() in bases for o in out)
    # and the buffers never alias the inputs, so they can be reduced in place
    for f in flats:
        f.add_(1.0)
    assert all(t is None or torch.equal(t, o) for t, o in zip(leaves, originals))


def test_flatten_casts_in_the_same_copy():
    leaves = [torch.tensor([1.0, 2.5]), torch.tensor([3.0])]
    plan = make_plan(tuple(LeafSpec.of(t) for t in leaves))
    (flat,) = flatten(plan, leaves, dtype=torch.bfloat16)
    assert flat.dtype == torch.bfloat16 and flat.tolist() == [3.0, 1.0, 2.5]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_host_buffers_are_reused_only_when_nothing_refers_to_them():
    cpu = torch.device("cpu")
    n = 1234  # a size no other test uses
    a = new_buffer(n, torch.float32, cpu)
    b = new_buffer(n, torch.float32, cpu)
    assert _storage(a) != _storage(b), "a buffer still in use was handed out twice"
    pa = _storage(a)
    view, alias, array = a[3:7].view(2, 2), a.detach(), a[:5].numpy()
    del a
    for holder in ("view", "alias", "array"):
        c = new_buffer(n, torch.float32, cpu)
        assert _storage(c) != pa, f"reused while a {holder} of it was alive"
        del c
        if holder == "view":
            del view
        elif holder == "alias":
            del alias
        else:
            del array
    assert _storage(new_buffer(n, torch.float32, cpu)) == pa, "an unreferenced buffer was not reused"


def test_results_held_by_the_caller_never_change():
    # flatten draws on the reused buffers: earlier results the caller still holds must stay intact
    leaves = [torch.arange(6.0).reshape(2, 3), torch.ones(4)]
    plan = make_plan(tuple(LeafSpec.of(t) for t in leaves))
    first = unflatten(plan, flatten(plan, leaves))
    kept = [t.clone() for t in first]
    for k in range(5):
        unflatten(plan, flatten(plan, [t * (k + 2) for t in leaves]))
    assert all(torch.equal(a, b) for a, b in zip(first, kept))


def test_release_buffers_forgets_kept_buffers_but_not_live_ones():
    from fddp import _pool

    cpu = torch.device("cpu")
    n = 4321  # a size no other test uses
    live = new_buffer(n, torch.float32, cpu)
    live.fill_(7.0)
    assert _pool._host_buffers.free[(n, torch.float32)], "the buffer was not kept for reuse"
    fddp.clear_caches()
    assert not _pool._host_buffers.free, "buffers are still kept"
    assert _storage(new_buffer(n, torch.float32, cpu)) != _storage(live), "a live buffer was handed out"
    assert torch.equal(live, torch.full((n,), 7.0)), "a live buffer changed"
