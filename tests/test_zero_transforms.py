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


# --- forward mode through stage 3, w.r.t. the shards, the input, both (issue 48) ------------------------


FORWARD_CELLS = tuple(f"{t} {w}" for t in ("jvp", "jacfwd", "vmap of jvp") for w in ("params", "input", "both"))


class _Block(nn.Module):
    """A pre-norm transformer block with its attention written out (torch's fused CPU attention
    has no forward-mode derivative)."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, -1) @ v
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.fc2(torch.tanh(self.fc1(self.norm2(h))))


class _TinyViT(nn.Module):
    """A small vision transformer: patches embedded, a position table (the root unit's), two blocks, a head."""

    def __init__(self, patch: int = 4, patches: int = 5, d: int = 8) -> None:
        super().__init__()
        self.embed, self.pos = nn.Linear(patch, d), nn.Parameter(0.1 * torch.randn(patches, d))
        self.blocks = nn.ModuleList([_Block(d), _Block(d)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(1))


def _forward_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":  # the issue's: two layers, sharded with fully_shard's defaults (one root unit)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    return _TinyViT().double()  # the root (the position table), the embedding, two blocks, the head: five units


def _forward_mode_worker(name: str, directory: str) -> dict:
    n, r = fddp.world_size(), fddp.rank()
    model = _forward_model(name)
    fn, v = fddp.zero.fully_shard(model) if name == "mlp" else fddp.zero.fully_shard(model, min_unit_mb=0)
    ref_model = _forward_model(name)
    psi = lambda g, x_: functional_call(ref_model, _assemble(v.layout, g), (x_,))  # noqa: E731 - rank r's output, from every rank's shards
    shape = (5, 4) if name == "mlp" else (2, 5, 4)
    x, tx = _randn(50 + r, *shape), _randn(60 + r, *shape)
    txs = _randn(70 + r, 3, *shape)
    group = _everyone(list(v.shards))
    ones = fddp.zero.Sharded([torch.ones_like(s) for s in v.shards], v.layout)  # the tangent, the same on every rank
    stacked = fddp.zero.Sharded([_randn(80 + 10 * r + k, 3, *s.shape) for k, s in enumerate(v.shards)], v.layout)
    all_ones = [[torch.ones_like(s) for s in g] for g in group]
    all_stacked = _everyone(list(stacked.shards))
    zero = [torch.zeros_like(s) for s in group[r]]
    plus = lambda u: [[a + b for a, b in zip(g, u)] for g in group]  # noqa: E731 - the same basis tangent on every rank
    cells = {
        "jvp params": (lambda: jvp(lambda s: fn(s, x), (v,), (ones,)), lambda: jvp(lambda g: psi(g, x), (group,), (all_ones,))),
        "jvp input": (lambda: jvp(lambda x_: fn(v, x_), (x,), (tx,)), lambda: jvp(lambda x_: psi(group, x_), (x,), (tx,))),
        "jvp both": (
            lambda: jvp(lambda s, x_: fn(s, x_), (v, x), (ones, tx)),
            lambda: jvp(lambda g, x_: psi(g, x_), (group, x), (all_ones, tx)),
        ),
        "jacfwd params": (lambda: jacfwd(lambda s: fn(s, x))(v), lambda: jacfwd(lambda u: psi(plus(u), x))(zero)),
        "jacfwd input": (lambda: jacfwd(lambda x_: fn(v, x_))(x), lambda: jacfwd(lambda x_: psi(group, x_))(x)),
        "jacfwd both": (
            lambda: jacfwd(lambda s, x_: fn(s, x_), argnums=(0, 1))(v, x),
            lambda: jacfwd(lambda u, x_: psi(plus(u), x_), argnums=(0, 1))(zero, x),
        ),
        "vmap of jvp params": (
            lambda: vmap(lambda tt: jvp(lambda s: fn(s, x), (v,), (tt,))[1])(stacked),
            lambda: torch.stack([jvp(lambda g: psi(g, x), (group,), ([[t[k] for t in ts] for ts in all_stacked],))[1] for k in range(3)]),
        ),
        "vmap of jvp input": (
            lambda: vmap(lambda tt: jvp(lambda x_: fn(v, x_), (x,), (tt,))[1])(txs),
            lambda: torch.stack([jvp(lambda x_: psi(group, x_), (x,), (txs[k],))[1] for k in range(3)]),
        ),
        "vmap of jvp both": (
            lambda: vmap(lambda tt, tx_: jvp(lambda s, x_: fn(s, x_), (v, x), (tt, tx_))[1])(stacked, txs),
            lambda: torch.stack([
                jvp(lambda g, x_: psi(g, x_), (group, x), ([[t[k] for t in ts] for ts in all_stacked], txs[k]))[1] for k in range(3)
            ]),
        ),
    }  # fmt: skip
    out: dict = {"units": fn.units, "diff": {}}
    for _ in range(2):  # learnt, then checked: the failure came at a call after the first
        for cell in FORWARD_CELLS:
            got, ref = cells[cell]
            out["diff"][cell] = max(out["diff"].get(cell, 0.0), _max_diff(got(), ref()))
    # The gradient of the input alone: no shard is tracked, so no backward is owed (nothing reduced;
    # the gathered parameters stay in the graph).
    y0 = _randn(40 + r, *fn(v, x).shape)
    gx = grad(lambda x_: _mse(fn(v, x_), y0))(x)
    out["grad input"] = _max_diff(gx, grad(lambda x_: _mse(psi(group, x_), y0))(x))
    out["owed"] = fddp._dist._groups.state(None).owed
    # The group carries on: a checkpoint, a second model, a training loop (what the issue saw refused).
    fddp.checkpoint.save_sharded(directory, {"shards": v})
    fn2, v2 = fddp.zero.fully_shard(_mlp(1), min_unit_mb=0)
    y = _randn(90 + r, *fn(v, x).shape)
    everyone = _everyone((x, y))
    ref_grad = grad(lambda g: sum(_mse(psi(g, xq), yq) for xq, yq in everyone) / n)(group)[r]
    grads, _ = fddp.grad_and_value(lambda s: _mse(fn(s, x), y))(v)
    out["train grad"] = _max_diff(grads, ref_grad)
    opt = fddp.optim.sgd(lr=0.1)
    state = opt.init(v)
    for _ in range(2):
        grads, _ = fddp.grad_and_value(lambda s: _mse(fn(s, x), y))(v)
        v, state = fddp.optim.apply_gradients(opt, grads, state, v)
    out["second model"] = fddp.zero.gather(v2).wait() is not None and fn2(v2, _data(r)["x"]).shape == (3, 3)
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_forward_mode_with_respect_to_the_shards_the_input_and_both(name, world, tmp_path):
    """Issue 48: jvp w.r.t. the shards of a plain fully_shard(model), then w.r.t. the input, ended the
    group with a false MismatchError: the two ran under the same transforms, so their calls had one
    kind, and the first one's sequence (each gather followed by its tangent's) was checked against
    the second's (no tangents). Now what the transforms carry is part of the kind."""
    for r in run(_forward_mode_worker, world, name, str(tmp_path / "ckpt"), timeout=600):
        assert r["units"] == (("",) if name == "mlp" else ("", "embed", "blocks.0", "blocks.1", "head")), r["units"]
        for cell in FORWARD_CELLS:
            assert r["diff"][cell] <= 1e-12, (cell, r)
        assert r["train grad"] <= 1e-12 and r["second model"], r
        assert r["grad input"] <= 1e-12 and r["owed"] == 0, r


# --- ranks that differentiate otherwise: named, not paired --------------------------------------------


def _otherwise_worker(case: str) -> dict:
    import time

    r = fddp.rank()
    # The backward case ends its group (fatal by design): a group of its own, which dies with it.
    group = tdist.new_group() if case != "forward" else None
    fn, v = fddp.zero.fully_shard(_mlp(), min_unit_mb=0, group=group)
    x = _data(r)["x"]
    out: dict = {}
    if case == "forward":  # jvp w.r.t. the shards on rank 0, w.r.t. the input on rank 1: the header differs
        ones = fddp.zero.Sharded([torch.ones_like(s) for s in v.shards], v.layout)
        try:
            jvp(lambda s: fn(s, x), (v,), (ones,)) if r == 0 else jvp(lambda x_: fn(v, x_), (x,), (torch.ones_like(x),))
            out["error"] = "none"
        except (fddp.MismatchError, fddp.PeerError) as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["after"] = torch.equal(fddp.zero.gather(v).wait()["0.weight"], _mlp().state_dict()["0.weight"])
        return out
    # Both kinds learnt on every rank (jacrev's first: the kind's own sequence ends at a branch
    # point, where a plain backward agrees on its context too; or grad's first: the plain backward
    # checks its own sequence and waits in its reduction); then rank 0's backward runs under
    # jacrev's vmap, rank 1's plainly.
    f = lambda s: fn(s, x)  # noqa: E731
    for learn in ("jacrev", "grad") if case == "backward" else ("grad", "jacrev"):
        jacrev(f)(v) if learn == "jacrev" else grad(lambda s: f(s).sum())(v)
    start = time.monotonic()
    try:
        jacrev(f)(v) if r == 0 else grad(lambda s: f(s).sum())(v)
        out["error"] = "none"
    except (fddp.MismatchError, fddp.PeerError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    return out


def test_ranks_that_differentiate_otherwise_are_named():
    """jvp w.r.t. the shards on one rank and w.r.t. the input on another: a MismatchError at the
    header, naming the derivatives, and the group goes on. A backward under jacrev's vmap on one
    rank and a plain one on another: every rank raises in seconds (the branch's agreement on the
    store sees the peer waiting in its reduction), instead of pairing reductions of other sizes."""
    forward = run(_otherwise_worker, 2, "forward", timeout=120)
    for r in forward:
        assert r["error"].startswith("MismatchError") and "derivatives" in r["error"] and r["after"], r
    for case in ("backward", "backward, the plain one learnt first"):
        backward = run(_otherwise_worker, 2, case, timeout=120)
        assert any("MismatchError" in r["error"] and "under vmap(9)" in r["error"] for r in backward), (case, backward)
        for r in backward:
            assert r["error"] != "none" and r["seconds"] < 20, (case, r)
