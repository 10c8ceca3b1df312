"""Every torch.func transform through every ZeRO stage, against one-process float64 references (issue 48).

On rank ``r`` each stage computes with a variable of its own, ``v_r`` (stage 1: the replicated
parameters; stages 2, 3 and hybrid: the shards), and every rank's output is a function of the
variables of the ranks its collectives reach. The references write that function out in one
process, on the unsharded model through plain ``torch.func``:

- stages 2 and 3: the full parameters are the ranks' shards laid end to end, bucket by bucket
  (``_assemble``); the gradient of a shard is that of the *mean* of the ranks' objectives;
- hybrid (here: each rank a shard group of its own, every rank one replica): each rank holds the
  whole parameters, tied across the replicas; the gradient is again that of the mean;
- stage 1 (``ddp_step``'s mean inside, one SGD step of a MAML objective): JAX's ``pmean``
  convention (``tests/test_transforms.py``), the objective being the *sum* of the ranks'.

Forward mode pushes each rank's tangent through the collectives (a gathered tangent is every
rank's); ``jacfwd`` and ``hessian`` push the same basis vector on every rank at once, ``jacrev``
the same basis cotangent. Every transform is followed by a further fddp call on the same group,
and what a stage cannot differentiate raises its clear error, after which the group goes on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import optree
import pytest
import torch
import torch.distributed as tdist
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import fddp
from dist import count_calls, run

TRANSFORMS = ("grad", "vjp", "jvp", "vmap", "jacrev", "jacfwd", "hessian")
LR = 0.3
MEMBERS = 3  # vmap's ensemble


def _mlp(seed: int = 0, widths: tuple[int, ...] = (4, 6, 5, 3)) -> nn.Module:
    """float64 Linear layers with tanh between them: with min_unit_mb=0 each Linear is a unit."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).double()


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _data(q: int, k: int = 0) -> dict:
    """Rank ``q``'s data (the same on every rank that asks): inputs, targets, a cotangent, the
    ensemble's inputs, and stage 1's inner batch."""
    s = 1000 * k + 10 * q
    return {
        "x": _randn(s, 3, 4), "y": _randn(s + 1, 3, 3), "ct": _randn(s + 2, 3, 3), "xs": _randn(s + 3, MEMBERS, 3, 4),
        "ys": _randn(s + 4, MEMBERS, 3, 3), "x_in": _randn(s + 5, 3, 4), "y_in": _randn(s + 6, 3, 3),
    }  # fmt: skip


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _assemble(lay: Any, shards_by_rank: list) -> dict:
    """The full parameters from every rank's shards of ``lay``, in one process: bucket ``k`` is the
    ranks' shards of it laid end to end and cut to its length (fddp.zero's cut: rank ``r`` holds
    ``[r s, (r + 1) s)``), its leaves one after another in the plan's order."""
    leaves: list[Any] = [None] * lay.plan.num_leaves
    for k, b in enumerate(lay.plan.buckets):
        flat = torch.cat([s[k] for s in shards_by_rank])[: sum(b.numels)]
        for i, piece, shape in zip(b.indices, flat.split(b.numels), b.shapes):
            leaves[i] = piece.view(shape)
    return optree.tree_unflatten(lay.spec, leaves)


def _everyone(obj: Any) -> list:
    out: list[Any] = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def _max_diff(got: Any, ref: Any) -> float:
    a, b = torch_pytree.tree_leaves(got), torch_pytree.tree_leaves(ref)
    assert len(a) == len(b), (len(a), len(b))
    for s, t in zip(a, b):
        assert s.shape == t.shape, (s.shape, t.shape)
    return max((s - t).abs().max().item() for s, t in zip(a, b))


def _plus(tree: Any, u: Any) -> Any:
    return torch_pytree.tree_map(torch.add, tree, u)


@dataclasses.dataclass
class _Stage:
    """One stage as the transforms see it: this rank's variable ``v``, its output ``out(v, x)``
    (fddp's collectives inside), and the reference: the variables of the ranks its collectives
    reach (``group``, this rank's at ``me``), rank ``q``'s output ``psi(group, q, x)`` in plain
    torch, and the reverse mode's scale ``c`` (the mean's ``1/n``, or ``pmean``'s 1)."""

    v: Any
    out: Callable[[Any, torch.Tensor], torch.Tensor]
    group: list
    me: int
    psi: Callable[[list, int, torch.Tensor], torch.Tensor]
    c: float
    after: Callable[[], bool]  # a further fddp call on the same group: True when it gives what it should
    unsupported: Callable[[Callable], Any] | None = None  # the stage's sync inside a transform: its clear error
    expected_error: str = ""


def _stage(name: str, n: int, r: int) -> _Stage:
    ref_model = _mlp()
    ref = lambda p, x: functional_call(ref_model, p, (x,))  # noqa: E731
    if name == "1":
        params = {k: p.detach().clone() for k, p in _mlp().named_parameters()}
        caps = dict(bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
        d = _data(r)

        def out(p: dict, x: torch.Tensor) -> torch.Tensor:  # one inner SGD step on the mean gradient
            g = fddp.ddp_step(p, grad(lambda p_: _mse(ref(p_, d["x_in"]), d["y_in"]))(p), **caps)
            return ref({k: p[k] - LR * g[k] for k in p}, x)

        everyone = [_data(s) for s in range(n)]

        def psi(ps: list, q: int, x: torch.Tensor) -> torch.Tensor:
            gs = [grad(lambda p_: _mse(ref(p_, e["x_in"]), e["y_in"]))(p) for p, e in zip(ps, everyone)]
            return ref({k: ps[q][k] - LR * sum(g[k] for g in gs) / n for k in ps[q]}, x)

        def after() -> bool:
            mean = fddp.ddp_step(params, params, **caps)  # stage 1: the mean, then this rank's shard of it
            return all(torch.equal(a, mean[k]) for k, a in fddp.zero.gather(fddp.zero.shard(mean, **caps)).wait().items())

        shard = lambda p: fddp.zero.shard(p, **caps).shards[0].sum()  # noqa: E731 - stage 1's sharding, inside a transform
        return _Stage(params, out, [params] * n, r, psi, 1.0, after, lambda t: t(shard, params), "zero.shard cannot run inside")
    if name == "2":
        params = {k: p.detach().clone() for k, p in _mlp().named_parameters()}
        caps = dict(bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
        v = fddp.zero.shard(params, **caps)
        full = fddp.zero.gather(v).wait()
        d = _data(r)  # made outside the transforms: vmap refuses random ops
        grads_of = lambda s: grad(lambda p: _mse(ref(p, d["x"]), d["y"]))(fddp.zero.unshard(s))  # noqa: E731

        def rs(s: Any) -> torch.Tensor:
            return fddp.ddp_step(params, grads_of(s), compression=fddp.zero.ReduceScatter(), **caps).shards[0].sum()

        return _Stage(v, lambda s, x: ref(fddp.zero.unshard(s), x), _everyone(list(v.shards)), r,
                      lambda ss, q, x: ref(_assemble(v.layout, ss), x), 1.0 / n,
                      lambda: all(torch.equal(a, full[k]) for k, a in fddp.zero.gather(v).wait().items()),
                      lambda t: t(rs, v), "fddp.ddp_step: compression=ReduceScatter")  # fmt: skip
    if name == "3":
        fn, v = fddp.zero.fully_shard(_mlp(), min_unit_mb=0)
    else:  # hybrid: every rank a shard group of its own, the replicas across a group of all ranks
        singles = [tdist.new_group([q]) for q in range(n)]
        replicas = tdist.new_group(list(range(n)))
        fn, v = fddp.zero.fully_shard(_mlp(), min_unit_mb=0, group=singles[r], replica_group=replicas)
    assert len(fn.units) == 3, fn.units
    full = fddp.zero.gather(v).wait()
    group = _everyone(list(v.shards)) if name == "3" else [list(v.shards)]
    return _Stage(v, fn, group, r if name == "3" else 0, lambda ss, q, x: ref(_assemble(v.layout, ss), x), 1.0 / n,
                  lambda: all(torch.equal(a, full[k]) for k, a in fddp.zero.gather(v).wait().items()))  # fmt: skip


def _cell(st: _Stage, transform: str, n: int, r: int, tangent: Any, tangents: list) -> float:
    """Rank ``r``'s ``transform`` through the stage, minus the reference's: the largest difference.
    ``tangent``: this rank's tangent of ``st.v``; ``tangents``: those of the ranks in ``st.group``."""
    d, everyone = _data(r), [_data(q) for q in range(n)]
    me, g0, c = st.me, st.group, st.c
    loss = lambda v: _mse(st.out(v, d["x"]), d["y"])  # noqa: E731
    mean_loss = lambda g: c * sum(_mse(st.psi(g, q, e["x"]), e["y"]) for q, e in enumerate(everyone))  # noqa: E731
    zero = torch_pytree.tree_map(torch.zeros_like, g0[me])
    if transform == "grad":
        return _max_diff(grad(loss)(st.v), grad(mean_loss)(g0)[me])
    if transform == "vjp":
        got = vjp(lambda v: st.out(v, d["x"]), st.v)[1](d["ct"])[0]
        ref = grad(lambda g: c * sum((st.psi(g, q, e["x"]) * e["ct"]).sum() for q, e in enumerate(everyone)))(g0)[me]
        return _max_diff(got, ref)
    if transform == "jvp":
        got = jvp(lambda v: st.out(v, d["x"]), (st.v,), (tangent,))
        return _max_diff(got, jvp(lambda g: st.psi(g, r, d["x"]), (g0,), (tangents,)))
    if transform == "vmap":  # an ensemble's gradients: every member's collectives in one
        stack = lambda v: torch_pytree.tree_map(lambda t: torch.stack([t * (1 + 0.1 * m) for m in range(MEMBERS)]), v)  # noqa: E731
        got = vmap(grad(lambda v, x, y: _mse(st.out(v, x), y)))(stack(st.v), d["xs"], d["ys"])
        refs = []
        for m in range(MEMBERS):
            gm = [torch_pytree.tree_map(lambda t: t * (1 + 0.1 * m), g) for g in g0]
            refs.append(grad(lambda g: c * sum(_mse(st.psi(g, q, e["xs"][m]), e["ys"][m]) for q, e in enumerate(everyone)))(gm)[me])
        return _max_diff(got, torch_pytree.tree_map(lambda *ms: torch.stack(ms), *refs))
    if transform == "jacrev":  # every rank the same basis cotangent
        got = jacrev(lambda v: st.out(v, d["x"]))(st.v)
        return _max_diff(got, jacrev(lambda g: c * sum(st.psi(g, q, e["x"]) for q, e in enumerate(everyone)))(g0)[me])
    if transform == "jacfwd":  # every rank the same basis tangent
        got = jacfwd(lambda v: st.out(v, d["x"]))(st.v)
        return _max_diff(got, jacfwd(lambda u: st.psi([_plus(g, u) for g in g0], r, d["x"]))(zero))
    assert transform == "hessian"
    got = hessian(loss)(st.v)
    return _max_diff(got, jacfwd(lambda u: grad(mean_loss)([_plus(g, u) for g in g0])[me])(zero))


_AROUND = {
    "grad": lambda f, v: grad(f)(v),
    "vjp": lambda f, v: vjp(f, v)[1](torch.ones(())),
    "jvp": lambda f, v: jvp(f, (v,), (v,)),
    "vmap": lambda f, v: vmap(f)(torch_pytree.tree_map(lambda t: torch.stack([t, t]), v)),
    "jacrev": lambda f, v: jacrev(f)(v),
    "jacfwd": lambda f, v: jacfwd(f)(v),
    "hessian": lambda f, v: hessian(f)(v),
}


def _every_transform_worker(stage: str) -> dict:
    n, r = fddp.world_size(), fddp.rank()
    st = _stage(stage, n, r)
    # Each rank's tangent of its variable, different on every rank (forward mode gathers them all).
    tangent = torch_pytree.tree_map(lambda t: _randn(7 + r, *t.shape), st.v)
    spec = torch_pytree.tree_structure(st.group[st.me])
    tangents = [torch_pytree.tree_unflatten(leaves, spec) for leaves in _everyone(torch_pytree.tree_leaves(tangent))]
    tangents = tangents if len(st.group) == n else [tangents[r]]
    out: dict = {}
    for round_ in (0, 1):  # the second round runs every kind of call again: checked, not learnt
        for transform in TRANSFORMS:
            with count_calls(("all_reduce",), lambda *_: None) as calls:
                diff = _cell(st, transform, n, r, tangent, tangents)
            cell = out.setdefault(transform, {"diff": [], "headers": []})
            cell["diff"].append(diff)
            cell["headers"].append(calls.headers)
            cell.setdefault("after", []).append(st.after())
            if st.unsupported is not None and round_ == 0:
                try:
                    st.unsupported(lambda f, v, t=transform: _AROUND[t](f, v))
                    cell["error"] = "none"
                except RuntimeError as e:
                    cell["error"] = str(e)
                cell["expected"], cell["after error"] = st.expected_error, st.after()
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("stage", ["1", "2", "3", "hybrid"])
def test_every_transform_on_every_stage(stage, world):
    results = run(_every_transform_worker, world, stage, timeout=600)
    for r, result in enumerate(results):
        for transform in TRANSFORMS:
            cell = result[transform]
            assert max(cell["diff"]) <= 1e-12, (stage, r, transform, cell)
            assert all(cell["after"]), (stage, r, transform, cell)
            if stage in ("3", "hybrid"):
                # Learnt once (a token agreed per collective), then checked locally: the second
                # round's call sends its header alone on each group (hybrid: the shard group's, of
                # one rank, sends none).
                assert cell["headers"][1] == 1, (stage, r, transform, cell)
            if stage in ("1", "2"):
                # The stage's sync inside the transform: its clear error, on every rank; the group goes on.
                assert cell["expected"] in cell["error"], (stage, r, transform, cell)
                assert cell["after error"], (stage, r, transform, cell)
