"""fddp.grad / grad_and_value: bitwise equal to ddp_step after torch.func.grad, overlap, compile."""

from __future__ import annotations

import warnings

import optree
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad as func_grad

import fddp
from dist import count_all_reduces, run
from fddp.sync import plan_of as plan_for
from models import make_batch, make_model

CAPS = [(25.0, 1.0), (0.004, 0.001), (1e-5, 1e-5)]  # one bucket; a few; one per leaf


def _equal_trees(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _models_worker() -> list[tuple]:
    """Per model and bucket cap: (equal to ddp_step?, equal loss?, collectives, buckets, all launched in backward?)."""
    out = []
    for name in ("mlp", "conv", "transformer"):
        apply_fn, params = fddp.functionalize(make_model(name))
        x, y = make_batch(name, seed=fddp.rank())  # a different batch on every rank

        def loss(p, x, y):
            return F.cross_entropy(apply_fn(p, x), y)

        for cap, first in CAPS:
            ref = fddp.ddp_step(params, func_grad(loss)(params, x, y), bucket_cap_mb=cap, first_bucket_mb=first)
            gv = fddp.grad_and_value(loss, bucket_cap_mb=cap, first_bucket_mb=first)
            gv(params, x, y)  # the first call of a signature may check it across ranks
            with count_all_reduces() as calls:
                grads, value = gv(params, x, y)
            plan = plan_for(params, cap, first)
            out.append(
                (
                    name,
                    cap,
                    _equal_trees(grads, ref),
                    torch.equal(value, loss(params, x, y)),
                    len(calls),
                    len(plan.buckets),
                    all(inside for _, inside in calls),
                )
            )
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_equals_ddp_step_one_collective_per_bucket_launched_in_backward(world):
    for rank_rows in run(_models_worker, world, timeout=120):
        assert len(rank_rows) == 3 * len(CAPS)
        for name, cap, same, same_value, calls, buckets, in_backward in rank_rows:
            assert same, f"{name} cap={cap}: grads differ from ddp_step(torch.func.grad(...))"
            assert same_value, f"{name} cap={cap}: value differs from the loss"
            assert calls == buckets, f"{name} cap={cap}: {calls} all-reduces for {buckets} buckets"
            # Every leaf is used, so every bucket's all-reduce starts before backward ends.
            assert world == 1 or in_backward, f"{name} cap={cap}: an all-reduce started after backward"


def _options_worker() -> dict:
    """Trees, argnums, has_aux, unused leaves and the shared sync options, against ddp_step."""
    r = fddp.rank()
    g = torch.Generator().manual_seed(10 + r)
    params = {"enc": {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)}, "unused": torch.randn(3, generator=g),
              "seq": [torch.randn(5, 2, generator=g), torch.randn(2, dtype=torch.float64, generator=g)]}
    x = torch.randn(4, 6, generator=g)
    caps = dict(bucket_cap_mb=1e-4, first_bucket_mb=1e-5)

    def fn(x, p):
        h = torch.tanh(x @ p["enc"]["w"] + p["enc"]["b"]) @ p["seq"][0]
        if r == 1:  # used on one rank only: that rank launches its bucket from backward, rank 0 after
            h = h + p["unused"].sum()
        return (h.double() * p["seq"][1]).sum(), h.detach()

    res = {}
    ref = fddp.ddp_step(params, func_grad(fn, argnums=1, has_aux=True)(x, params)[0], **caps)
    grads, (value, aux) = fddp.grad_and_value(fn, argnums=1, has_aux=True, **caps)(x, params)
    res["argnums=1"] = _same(grads, ref)
    res["aux"] = torch.equal(aux, fn(x, params)[1]) and torch.equal(value, fn(x, params)[0])

    both = func_grad(fn, argnums=(0, 1), has_aux=True)(x, params)[0]
    ref = fddp.ddp_step((x, params), both, **caps)
    grads, aux = fddp.grad(fn, argnums=(0, 1), has_aux=True, **caps)(x, params)
    res["argnums=(0, 1)"] = isinstance(grads, tuple) and _same(grads, ref)

    for opts in (dict(weight=float(r + 1)), dict(compression="bf16"), dict(compression="fp16"), dict(check_finite=True)):
        ref, ref_info = fddp.ddp_step(params, func_grad(fn, argnums=1, has_aux=True)(x, params)[0], return_info=True, **caps, **opts)
        call_time = {k: opts.pop(k) for k in ("weight",) if k in opts}  # per-step values go to the call
        grads, info = fddp.grad(lambda p: fn(x, p)[0], return_info=True, **caps, **opts)(params, **call_time)
        opts.update(call_time)
        res[str(opts)] = _same(grads, ref) and info.collectives == ref_info.collectives and info.bytes_sent == ref_info.bytes_sent
        if "weight" in opts:
            res[str(opts)] &= torch.equal(info.weight, ref_info.weight)
        if "check_finite" in opts:
            res[str(opts)] &= bool(info.finite) and bool(ref_info.finite)

    # PowerSGD: its state goes in and comes out the same way on both paths, over a few steps.
    ps = fddp.PowerSGD(rank=1, start_iter=1, min_compression_rate=1.0)
    mat = {"w": torch.randn(8, 6, generator=g), "v": torch.randn(6, generator=g)}
    loss = lambda p: (torch.tanh(x[:, :6] @ p["w"].t()) * p["v"].sum()).sum()  # noqa: E731
    s_ref = s_grad = ps.init(mat)
    ok = True
    for _ in range(3):
        ref, ref_info = fddp.ddp_step(mat, func_grad(loss)(mat), compression=ps, compression_state=s_ref, return_info=True)
        grads, info = fddp.grad(loss, compression=ps, return_info=True)(mat, compression_state=s_grad)
        ok &= _same(grads, ref) and info.collectives == ref_info.collectives and info.bytes_sent == ref_info.bytes_sent
        ok &= _same(info.compression_state.q, ref_info.compression_state.q)
        s_ref, s_grad = ref_info.compression_state, info.compression_state
    res["powersgd"] = ok
    return res


def _same(a, b) -> bool:
    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(torch.equal(u, v) for u, v in zip(la, lb))


def test_trees_argnums_unused_leaves_and_sync_options_match_ddp_step():
    for res in run(_options_worker, 2):
        assert all(res.values()), {k: v for k, v in res.items() if not v}


def _compiled_worker(steps: int) -> tuple:
    """Eager and compiled training steps (torch.func.grad + ddp_step + fddp.optim.sgd), in float64."""
    import torch._inductor.compile_fx as compile_fx

    apply_fn, params = fddp.functionalize(make_model("mlp").double())
    params = fddp.broadcast(params)  # also checks the tree's signature across ranks, in eager
    opt = fddp.optim.sgd(0.1, momentum=0.9)
    caps = dict(bucket_cap_mb=0.004, first_bucket_mb=0.001)

    def step(params, state, x, y):
        grads = fddp.ddp_step(params, func_grad(lambda p: F.cross_entropy(apply_fn(p, x), y))(params), **caps)
        updates, state = opt.update(grads, state, params)
        return fddp.optim.apply_updates(params, updates), state

    collectives: list[str] = []

    def backend(gm, example_inputs):  # inductor, after noting the collectives in the graph
        collectives.extend(str(n.target) for n in gm.graph.nodes if "all_reduce" in str(n.target))
        return compile_fx.compile_fx(gm, example_inputs)

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    eager_p, eager_s = params, opt.init(params)
    comp_p, comp_s = params, opt.init(params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            x, y = make_batch("mlp", seed=100 * i + fddp.rank())
            x = x.double()
            eager_p, eager_s = step(eager_p, eager_s, x, y)
            comp_p, comp_s = compiled(comp_p, comp_s, x, y)
    buckets = len(plan_for(params, **caps).buckets)
    return eager_p, comp_p, len(collectives), buckets, [str(w.message) for w in caught if "lru_cache" in str(w.message)]


def _recompiled_worker() -> list:
    """One compiled step function over models of three sizes in turn (as benchmarks/step.py runs
    its models): from the third, dynamo traces the parameters' sizes as symbols (automatic dynamic
    shapes), which the header's digest must not take as they are."""

    def one(p, x):
        g = func_grad(lambda q: (torch.tanh(x @ q["w"]) * q["b"]).sum())(p)
        return fddp.ddp_step(p, g)

    step = torch.compile(one, fullgraph=True)
    out = []
    for n in (4, 6, 9):
        p = fddp.broadcast({"w": torch.full((3, n), 0.1), "b": torch.full((n,), 0.5)})
        x = torch.full((2, 3), 1.0 + fddp.rank())
        out.append((step(p, x), one(p, x)))
    return out


def test_a_compiled_step_traced_with_symbolic_sizes_still_agrees():
    for out in run(_recompiled_worker, 2, timeout=240):
        for compiled, eager in out:
            for k in eager:
                torch.testing.assert_close(compiled[k], eager[k])


def test_compiled_step_matches_eager():
    results = run(_compiled_worker, 2, 3, timeout=240)
    for eager, compiled, n_collectives, buckets, fddp_warnings in results:
        # The all-reduces are inside the one graph: one per bucket, and the call's header.
        assert n_collectives == buckets + 1 and buckets > 1, (n_collectives, buckets)
        # Tracing fddp's code meets no lru_cache (dynamo ignores them, with a warning per function).
        assert fddp_warnings == [], fddp_warnings
        for k in eager:
            # Inductor's kernels (fused, with their own tanh) round differently from eager's, by how
            # much depends on the CPU: in float64 that stays far below the tolerance on any of them.
            torch.testing.assert_close(compiled[k], eager[k], rtol=1e-10, atol=1e-12, msg=f"param {k}")
    for k in results[0][0]:
        assert torch.equal(results[0][1][k], results[1][1][k]), f"compiled replicas differ at {k}"


def _compiled_weighted_worker() -> list:
    """A compiled ddp_step(weight=) and the eager one on the same float64 and float32 inputs: a
    tensor weight (1 and 3: W = 4, a power of two, so inductor's division agrees to the bit), one
    whose rank 0 is out of data (weight 0, NaN gradients), a Python number (a symbol to dynamo),
    grad_and_value(weight=), and a negative weight, which the graph cannot refuse (it cannot read
    it): the mean is NaN on every rank instead."""
    r = fddp.rank()
    params = {"a": torch.zeros(5, dtype=torch.float64), "b": torch.zeros(3)}
    g = {"a": torch.arange(5.0, dtype=torch.float64) * (r + 1), "b": torch.full((3,), 2.0 - 5 * r)}
    nan = {k: torch.full_like(v, float("nan")) for k, v in g.items()}

    def step(g, w):  # two buckets: the weight rides in the first, the second is scaled alone
        return fddp.ddp_step(params, g, weight=w, return_info=True, check_finite=True, bucket_cap_mb=1e-5, first_bucket_mb=1e-5)

    compiled = torch.compile(step, fullgraph=True)
    traced = torch.compile(step, fullgraph=True, backend="aot_eager")  # a number: dynamo's graph, not inductor's time
    # Numbers: the first is the trace's constant, a second value makes dynamo trace a symbol.
    cases = [(compiled, g, torch.tensor(2.0 * r + 1)), (compiled, nan if r == 0 else g, torch.tensor(2.0 * r)),
             (traced, g, 2 * r + 1.0), (traced, nan if r == 0 else g, 2.0 * r)]  # fmt: skip
    out = [(fn(gs, w), step(gs, w)) for fn, gs, w in cases]
    # grad_and_value(weight=): under torch.compile, torch.func's gradients and the traced weighted mean.
    gv = fddp.grad_and_value(lambda p, x: (p["a"] * x).sum() + p["b"].sum() * x[0], return_info=True, check_finite=True,
                             bucket_cap_mb=1e-5, first_bucket_mb=1e-5)  # fmt: skip
    x, w = torch.arange(5.0, dtype=torch.float64) * (r + 1), torch.tensor(2.0 * r + 1)
    (cg, _, ci), (eg, _, ei) = torch.compile(gv, fullgraph=True, backend="aot_eager")(params, x, weight=w), gv(params, x, weight=w)
    out.append(((cg, ci), (eg, ei)))
    out.append(compiled(g, torch.tensor(-1.0 if r == 0 else 1.0)))
    return out


def test_a_compiled_weighted_mean_equals_the_eager_one():
    for res in run(_compiled_weighted_worker, 2, timeout=300):
        *same, poisoned = res
        for i, ((c, ci), (e, ei)) in enumerate(same):
            assert _equal_trees(c, e) and torch.equal(ci.weight, ei.weight) and bool(ci.finite) and bool(ei.finite), (i, c, e)
        # sum_r w_r g_r / sum_r w_r, written out: (1 g_0 + 3 g_1) / 4, and g_1 alone where rank 0 has weight 0.
        expect = {"a": torch.arange(5.0, dtype=torch.float64) * 7 / 4, "b": torch.full((3,), (2.0 - 3 * 3) / 4)}
        assert _equal_trees(same[0][0][0], expect) and _equal_trees(same[2][0][0], expect), same[0][0][0]
        rank_1 = {"a": torch.arange(5.0, dtype=torch.float64) * 2, "b": torch.full((3,), -3.0)}
        assert _equal_trees(same[1][0][0], rank_1) and _equal_trees(same[3][0][0], rank_1), same[1]
        assert float(same[0][0][1].weight) == 4 and float(same[1][0][1].weight) == 2, same
        assert _equal_trees(same[4][0][0], {"a": torch.arange(5.0, dtype=torch.float64) * 7 / 4, "b": torch.zeros(3)}), same[4]
        grads, info = poisoned
        assert all(torch.isnan(v).all() for v in grads.values()) and not bool(info.finite) and torch.isnan(info.weight), poisoned


# -------------------------------------------------------------------------------- single process


@pytest.fixture(scope="module", autouse=True)
def _world():
    fddp.init()


def test_fn_sees_the_callers_leaves_without_a_copy():
    apply_fn, params = fddp.functionalize(make_model("mlp"))
    x, y = make_batch("mlp", seed=0)
    seen = {}

    def loss(p):
        seen.update({k: v.data_ptr() for k, v in p.items()})
        return F.cross_entropy(apply_fn(p, x), y)

    caps = dict(bucket_cap_mb=0.004, first_bucket_mb=0.001)
    grads = fddp.grad(loss, **caps)(params)
    assert seen == {k: v.data_ptr() for k, v in params.items()}
    # the gradients are views into one buffer per bucket
    plan = plan_for(params, **caps)
    leaves = optree.tree_leaves(grads)
    for b in plan.buckets:
        storages = {leaves[i].untyped_storage().data_ptr() for i in b.indices}
        assert len(storages) == 1 and leaves[b.indices[0]].untyped_storage().nbytes() == b.nbytes
    # differentiating at those views gives what differentiating at ordinary tensors gives
    again = fddp.grad(loss, **caps)({k: g.clone() for k, g in grads.items()})
    viewed = fddp.grad(loss, **caps)(grads)
    assert _equal_trees(again, viewed)


def test_single_leaf_bucket_gradient_is_not_aliased():
    w = torch.ones(3)
    grads = fddp.grad(lambda p: p["w"].sum() * 2.0)({"w": w})
    assert torch.equal(grads["w"], torch.full((3,), 2.0)) and torch.equal(w, torch.ones(3))


def test_last_calls_raw_gradients_are_kept_until_the_next_call_starts():
    # On the CPU the transform keeps a step's raw gradients until its next call, as a module keeps
    # .grad, and frees them before fn runs again (as zero_grad(set_to_none=True) would): the
    # allocator then reuses that memory instead of returning it to the OS every step.
    import weakref

    raw: list[list[weakref.ref]] = []
    freed_before_fn: list[bool] = []

    def loss(p):
        freed_before_fn.append(all(r() is None for r in raw[-1]) if raw else True)
        refs: list[weakref.ref] = []
        raw.append(refs)
        # Runs after fddp's own hook on the same leaf, with the same gradient tensor.
        p["w"].register_hook(lambda g: refs.append(weakref.ref(g)))
        return (p["w"] * p["w"]).sum()

    step = fddp.grad(loss)
    params = {"w": torch.arange(4.0)}
    grads = step(params)
    assert len(raw[0]) == 1 and raw[0][0]() is not None  # held after the call
    assert torch.equal(grads["w"], 2 * params["w"])
    del grads
    step(params)
    assert freed_before_fn == [True, True]
    assert raw[0][0]() is None and raw[1][0]() is not None


def test_loss_not_depending_on_params_gives_zeros():
    grads, value = fddp.grad_and_value(lambda p, c: c * 2)({"a": torch.ones(2)}, torch.tensor(3.0))
    assert torch.equal(grads["a"], torch.zeros(2)) and value.item() == 6.0


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: fddp.grad(lambda p: p.sum(), argnums="0")(torch.ones(2)), TypeError, "argnums must be an int"),
        (lambda: fddp.grad(lambda p: p.sum(), argnums=(0, 0))(torch.ones(2)), TypeError, "distinct"),
        (lambda: fddp.grad(lambda p: p.sum(), argnums=2)(torch.ones(2)), ValueError, "refers to argument 2"),
        (lambda: fddp.grad(lambda p: p["w"] * 2)({"w": torch.ones(2)}), ValueError, r"scalar tensor.*shape \(2,\)"),
        (lambda: fddp.grad(lambda p: p["w"].sum(), has_aux=True)({"w": torch.ones(2)}), ValueError, r"\(loss, aux\)"),
        (lambda: fddp.grad(lambda p: p["n"].sum())({"n": torch.ones(2, dtype=torch.int64)}), TypeError, "leaf 'n' is torch.int64"),
        (lambda: fddp.grad(lambda p: p["w"].sum())({"w": [1.0]}), TypeError, "leaf 'w/0' is float"),
        (lambda: fddp.grad(lambda p: p.sum(), compression="int4")(torch.ones(2)), ValueError, "compression"),
    ],
)
def test_errors(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _device_thread_worker() -> list:
    """CUDA's backward, emulated on the CPU: autograd runs a CUDA graph's backward on its device
    thread while the caller waits, unless multithreading is disabled
    (``torch.autograd.set_multithreading_enabled``). Here every ``torch.autograd.grad`` with
    multithreading on runs on another thread. A differentiable psum and a SyncBatchNorm inside
    ``grad_and_value``'s ``fn`` issue their backward's collectives from it: an fddp call from a
    second thread while the caller's call holds the group."""
    import concurrent.futures

    real = torch.autograd.grad
    pool = concurrent.futures.ThreadPoolExecutor(1)

    def on_a_device_thread(*args, **kwargs):
        if torch._C._is_multithreading_enabled():
            return pool.submit(real, *args, **kwargs).result()
        return real(*args, **kwargs)

    r = fddp.rank()
    apply_fn, params = fddp.functionalize(fddp.SyncBatchNorm(3))
    params = {**fddp.broadcast(params), "w": torch.ones(3)}
    x = torch.arange(12.0).reshape(4, 3) * (r + 1)

    def fn(p, x):
        y = apply_fn({k: v for k, v in p.items() if k != "w"}, x * p["w"])
        return fddp.psum(y * y).sum()

    expected = fddp.grad_and_value(fn)(params, x)  # on this thread: the reference
    torch.autograd.grad = on_a_device_thread
    try:
        got = fddp.grad_and_value(fn)(params, x)
    finally:
        torch.autograd.grad = real
        pool.shutdown()
    return [torch.equal(got[1], expected[1])] + [torch.equal(got[0][k], expected[0][k]) for k in expected[0]]


def test_collectives_in_fns_backward_run_on_the_callers_thread():
    # Before: "fddp.psum (backward): thread ... started a synchronisation on a process group while
    # thread 'MainThread' is inside fddp.grad_and_value", and the group ended on every rank.
    for same in run(_device_thread_worker, 2, timeout=90):
        assert same == [True] * 4, same
