"""ddp_step inside torch.func and autograd, against one-process float64 references.

Convention (JAX's ``lax.pmean``): the objective being differentiated is the sum of every rank's
objective, each rank holding its own replica of the inputs. So on rank r, differentiating rank r's
objective through ``ddp_step`` gives the derivative of ``F = sum_s objective_s`` with respect to
rank r's replica; the references below write ``F`` out with one replica per rank, in one process.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as tdist
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import fddp
from dist import count_all_reduces, run

D_IN, D_OUT = 5, 3
LR = 0.3


def _make_data(rank: int, k: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randn(n, D_IN, generator=g, dtype=torch.float64), torch.randn(n, D_OUT, generator=g, dtype=torch.float64)


# Made at import, outside any transform: a tensor created inside torch.func.grad is a wrapper that
# outlives its level, and vmap refuses random ops.
_DATA = {(r, k): _make_data(r, k) for r in range(3) for k in (0, 1, 2, 99)}


def _data(rank: int, k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return _DATA[rank, k]


def _params() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(D_OUT, D_IN, generator=g, dtype=torch.float64), "b": torch.randn(D_OUT, generator=g, dtype=torch.float64)}


def _loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x @ p["w"].T + p["b"]) - y).pow(2).mean()


def _inner_step(p: dict, rank: int, k: int, weight: float | None = None, lr=LR) -> dict:
    g = fddp.ddp_step(p, grad(_loss)(p, *_data(rank, k)), weight=weight, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    return {n: p[n] - lr * g[n] for n in p}


def _outer(p: dict, rank: int, weight: float | None = None) -> torch.Tensor:
    return _loss(_inner_step(p, rank, 0, weight), *_data(rank, 99))


def _ref_outer_sum(replicas: list[dict], weights: list[float] | None = None) -> torch.Tensor:
    """``F = sum_r outer_r``, rank r's objective evaluated on its own replica, written out."""
    n = len(replicas)
    gs = [grad(_loss)(q, *_data(r, 0)) for r, q in enumerate(replicas)]
    ws = [1.0] * n if weights is None else weights
    mean = {k: sum(w * g[k] for w, g in zip(ws, gs)) / sum(ws) for k in replicas[0]}
    return sum(_loss({k: q[k] - LR * mean[k] for k in q}, *_data(r, 99)) for r, q in enumerate(replicas))


def _maml_worker(weighted: bool) -> dict:
    r = fddp.rank()
    w = float(r + 1) if weighted else None
    p = _params()
    meta = grad(_outer)(p, r, w)  # rank r's objective, through ddp_step
    # plain autograd through the outputs, too
    q = {k: v.clone().requires_grad_() for k, v in p.items()}
    _outer(q, r, w).backward()
    return meta, {k: v.grad for k, v in q.items()}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("weighted", [False, True])
def test_maml_outer_gradient_through_ddp_step(world, weighted):
    results = run(_maml_worker, world, weighted)
    weights = [float(r + 1) for r in range(world)] if weighted else None
    for r, (meta, by_backward) in enumerate(results):
        replicas = [_params() for _ in range(world)]
        ref = grad(lambda q: _ref_outer_sum(replicas[:r] + [q] + replicas[r + 1 :], weights))(replicas[r])
        for k in ref:
            torch.testing.assert_close(meta[k], ref[k], rtol=1e-10, atol=1e-12, msg=f"rank {r} {k}")
            torch.testing.assert_close(by_backward[k], ref[k], rtol=1e-10, atol=1e-12, msg=f"rank {r} {k} (backward)")


def _hyper_worker() -> tuple:
    r = fddp.rank()

    def objective(lr: torch.Tensor) -> torch.Tensor:
        p = _params()
        for k in range(3):
            p = _inner_step(p, r, k, lr=lr)
        return _loss(p, *_data(r, 99))

    h = grad(objective)(torch.tensor(LR, dtype=torch.float64))
    return h, fddp.ddp_step({"lr": h}, {"lr": h})["lr"]


@pytest.mark.parametrize("world", [2, 3])
def test_hypergradient_of_the_learning_rate_through_three_steps(world):
    results = run(_hyper_worker, world)

    def total(lrs: list[torch.Tensor]) -> torch.Tensor:
        ps = [_params() for _ in range(world)]
        for k in range(3):
            gs = [grad(_loss)(q, *_data(r, k)) for r, q in enumerate(ps)]
            mean = {n: sum(g[n] for g in gs) / world for n in ps[0]}
            ps = [{n: q[n] - lr * mean[n] for n in q} for q, lr in zip(ps, lrs)]
        return sum(_loss(q, *_data(r, 99)) for r, q in enumerate(ps))

    lr0 = torch.tensor(LR, dtype=torch.float64)
    for r, (h, h_mean) in enumerate(results):
        ref = grad(lambda lr: total([lr0] * r + [lr] + [lr0] * (world - r - 1)))(lr0)
        torch.testing.assert_close(h, ref, rtol=1e-10, atol=1e-12)
        # Averaged over ranks: the derivative of the mean objective in the shared learning rate.
        shared = grad(lambda lr: total([lr] * world) / world)(lr0)
        torch.testing.assert_close(h_mean, shared, rtol=1e-10, atol=1e-12)


def _forward_mode_worker() -> tuple:
    r = fddp.rank()
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
    v = torch.arange(4, dtype=torch.float64)
    tangent = torch.full((4,), float(r + 1), dtype=torch.float64)  # different on every rank
    p = {"v": v}
    f = lambda u: fddp.ddp_step(p, {"v": torch.tanh(a @ u)})["v"]  # noqa: E731
    out, t = jvp(f, (v,), (tangent,))
    return out, t, jacfwd(f)(v), jacrev(f)(v)


@pytest.mark.parametrize("world", [2, 3])
def test_jvp_jacfwd_and_jacrev_average_over_ranks(world):
    results = run(_forward_mode_worker, world)
    v = torch.arange(4, dtype=torch.float64)
    mats = [torch.randn(4, 4, generator=torch.Generator().manual_seed(r), dtype=torch.float64) for r in range(world)]
    jac = [torch.diag(1 - torch.tanh(m @ v) ** 2) @ m for m in mats]  # d tanh(A v) / dv on each rank
    out_ref = sum(torch.tanh(m @ v) for m in mats) / world
    t_ref = sum(j @ torch.full((4,), float(r + 1), dtype=torch.float64) for r, j in enumerate(jac)) / world
    for r, (out, t, jf, jr) in enumerate(results):
        torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(t, t_ref, rtol=1e-12, atol=1e-14)
        # jacfwd pushes the same basis on every rank: the mean of the ranks' Jacobians
        torch.testing.assert_close(jf, sum(jac) / world, rtol=1e-12, atol=1e-14)
        # jacrev: row i is the derivative of F_i = sum_s f_s,i in rank r's own input, where every
        # rank pushes the same basis cotangent back: the mean of equal cotangents is that cotangent.
        torch.testing.assert_close(jr, jac[r], rtol=1e-12, atol=1e-14)


K = 8  # ensemble members


def _int_grads(rank: int) -> dict:
    """Integer-valued float64 gradients: every sum is exact, whatever order the backend adds in."""
    g = torch.Generator().manual_seed(50 + rank)
    return {"w": torch.randint(-9, 10, (K, 6, 5), generator=g).double(), "b": torch.randint(-9, 10, (K, 5), generator=g).double()}


def _ensemble_worker() -> tuple:
    grads = _int_grads(fddp.rank())
    params = {k: torch.zeros_like(v) for k, v in grads.items()}
    caps = dict(bucket_cap_mb=1e-4, first_bucket_mb=1e-5)  # one leaf per bucket: 2 buckets
    fddp.ddp_step({k: v[0] for k, v in params.items()}, {k: v[0] for k, v in grads.items()}, **caps)  # signatures
    vmap(lambda p, g: fddp.ddp_step(p, g, **caps))(params, grads)
    with count_all_reduces() as calls:
        batched = vmap(lambda p, g: fddp.ddp_step(p, g, **caps))(params, grads)
    separate = [fddp.ddp_step({k: v[i] for k, v in params.items()}, {k: v[i] for k, v in grads.items()}, **caps) for i in range(K)]
    member = {k: v[0] for k, v in params.items()}
    return batched, separate, calls, len(fddp.sync.plan_of(member, **caps).buckets)


@pytest.mark.parametrize("world", [2, 3])
def test_vmap_over_an_ensemble_is_one_collective_per_bucket(world):
    ref = {k: sum(_int_grads(r)[k] for r in range(world)) / world for k in ("w", "b")}
    for batched, separate, calls, buckets in run(_ensemble_worker, world):
        assert len(calls) == buckets == 2, calls
        assert sorted(n for n, _ in calls) == [K * 5, K * 30]  # every member in each collective
        for k in ref:
            assert torch.equal(batched[k], ref[k]), k
            for i in range(K):
                assert torch.equal(batched[k][i], separate[i][k]), (i, k)


def _vmap_grad_worker() -> tuple:
    r = fddp.rank()
    ps = {k: torch.stack([v + 0.1 * i for i in range(4)]) for k, v in _params().items()}
    f = lambda p: _outer(p, r)  # noqa: E731
    vmap(grad(f))(ps)  # the signature check of the stacked tree, once
    with count_all_reduces() as calls:
        batched = vmap(grad(f))(ps)
    separate = [grad(f)({k: v[i] for k, v in ps.items()}) for i in range(4)]
    buckets = len(fddp.sync.plan_of(_params(), bucket_cap_mb=1e-4, first_bucket_mb=1e-4).buckets)
    return batched, separate, len(calls), buckets


def test_vmap_of_grad_with_ddp_step_inside():
    for batched, separate, calls, buckets in run(_vmap_grad_worker, 2):
        assert calls == 2 * buckets  # forward and backward, for all 4 members at once
        for i, ref in enumerate(separate):
            for k in ref:
                torch.testing.assert_close(batched[k][i], ref[k], rtol=1e-12, atol=1e-14)


def _outer_on(p: dict, x: torch.Tensor, y: torch.Tensor, x_out: torch.Tensor, y_out: torch.Tensor) -> torch.Tensor:
    g = fddp.ddp_step(p, grad(_loss)(p, x, y), bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    return _loss({n: p[n] - LR * g[n] for n in p}, x_out, y_out)


def _compiled_worker() -> tuple:
    r = fddp.rank()
    p, data = _params(), (*_data(r, 0), *_data(r, 99))
    eager = grad(_outer_on)(p, *data)
    compiled = torch.compile(grad(_outer_on), fullgraph=True)(p, *data)
    return eager, compiled, grad(_outer)(p, r)


def test_compiled_gradient_through_ddp_step_equals_eager():
    for eager, compiled, reference in run(_compiled_worker, 2, timeout=240):
        for k in eager:
            assert torch.equal(eager[k], reference[k])  # the same function as the MAML test's
            torch.testing.assert_close(compiled[k], eager[k], rtol=1e-12, atol=1e-14)


def _errors_worker() -> dict:
    p = {"w": torch.randn(3)}
    errors = {}
    cases = {
        "broadcast under grad": lambda: grad(lambda q: fddp.broadcast(q)["w"].sum())(p),
        "bf16 under grad": lambda: grad(lambda q: fddp.ddp_step(q, {"w": q["w"] * 2}, compression="bf16")["w"].sum())(p),
        "bf16 under jvp": lambda: jvp(lambda w: fddp.ddp_step(p, {"w": w}, compression="bf16")["w"], (p["w"],), (p["w"],)),
        "powersgd under vmap": lambda: vmap(
            lambda g: fddp.ddp_step(
                p, {"w": g}, compression=fddp.PowerSGD(start_iter=0),
                compression_state=fddp.PowerSGD(start_iter=0).init(p), return_info=True,
            )[0]["w"]
        )(torch.ones(2, 3)),
        "verify_replicas under grad": lambda: grad(lambda q: (fddp.verify_replicas(q), q["w"].sum())[1])(p),
    }
    for name, call in cases.items():
        try:
            call()
        except (RuntimeError, NotImplementedError) as e:
            errors[name] = str(e)
    # Nothing is poisoned: plain calls on trees of the same size work afterwards.
    after = fddp.ddp_step(p, {"w": torch.ones(3)})["w"]
    gv = fddp.grad_and_value(lambda q: q["w"].sum())(p)[0]["w"]
    b = fddp.broadcast({"w": torch.full((3,), 1.0 + fddp.rank())})["w"]
    # grad_and_value inside vmap falls back to torch.func.grad_and_value and the differentiable
    # ddp_step: each member's gradient averaged over the ranks, one collective for all members.
    scale = torch.tensor([[1.0], [3.0]]) * (1.0 + fddp.rank())
    vg, vv = vmap(fddp.grad_and_value(lambda q, c: (q * c).sum()))(torch.ones(2, 3), scale)
    return errors, after, gv, b, (vg, vv)


def test_unsupported_calls_raise_on_every_rank_and_poison_nothing():
    expected = {
        "broadcast under grad": ["fddp.broadcast", "torch.func.grad"],
        "bf16 under grad": ["compression=Cast", "no derivative"],
        "bf16 under jvp": ["no derivative", "forward mode"],
        "powersgd under vmap": ["PowerSGD", "torch.func.vmap"],
        "verify_replicas under grad": ["fddp.verify_replicas", "torch.func.grad"],
    }
    for errors, after, gv, b, (vg, vv) in run(_errors_worker, 2):
        for name, parts in expected.items():
            assert name in errors, f"{name}: no error"
            for part in parts:
                assert part in errors[name], (name, part, errors[name])
        assert torch.equal(after, torch.ones(3)) and torch.equal(gv, torch.ones(3)) and torch.equal(b, torch.ones(3))
        # Members' gradients 1*(1+r) and 3*(1+r), averaged over ranks 0 and 1; the values stay local.
        assert torch.equal(vg, torch.tensor([[1.5] * 3, [4.5] * 3]))
        assert vv.shape == (2,)


def test_the_issue_snippet_on_one_rank():
    fddp.init()
    p = {"w": torch.randn(3)}
    f = lambda q: fddp.ddp_step(q, {"w": q["w"] * 2})["w"].sum()  # noqa: E731
    assert torch.equal(grad(f)(p)["w"], torch.full((3,), 2.0))
    assert torch.equal(fddp.ddp_step(p, {"w": torch.ones(3)})["w"], torch.ones(3))
    x = torch.ones(3, requires_grad=True)
    fddp.ddp_step(p, {"w": 5 * x})["w"].sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 5.0))
    assert tdist.get_world_size() == 1
