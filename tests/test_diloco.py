"""fddp.diloco: local SGD and (streaming) DiLoCo against references written independently of it.

- H = 1 with inner SGD and outer SGD at learning rate 1: ``ddp_step`` + SGD.
- local SGD: torch's ``PeriodicModelAverager`` on a module loop, and what torch does with
  parameters whose ``.grad`` is None.
- DiLoCo, streaming DiLoCo (fragments, delay, mixing), weighted and sharded: a one-process
  simulator that runs every worker's inner steps under ``vmap`` and writes the outer step out
  (float64).
- checkpoints between a fragment's launch and its merge resume bitwise; ranks that disagree on the
  schedule or the outer optimizer raise ``MismatchError``; a failed sync leaves everything as it was.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile

import optree
import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

import fddp
import fddp.checkpoint as ckpt
from dist import run
from fddp.diloco import _plan

K = 2  # workers (gloo ranks) in the multi-process tests


def _mlp(dtype=torch.float32, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    # Two layers of 42 values each: two fragments of equal bytes, one layer each.
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).to(dtype)


def _data(rank: int, steps: int, dtype=torch.float32, n: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(n, 6, generator=g, dtype=dtype), torch.randn(n, 6, generator=g, dtype=dtype)) for _ in range(steps)]


def _loss(apply_fn, params, x, y):
    return F.mse_loss(apply_fn(params, x), y)


def _equal(a, b) -> bool:
    la, sa = optree.tree_flatten(a, none_is_leaf=True)
    lb, sb = optree.tree_flatten(b, none_is_leaf=True)
    return sa == sb and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x is y for x, y in zip(la, lb)
    )


def _tensors(tree):
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in optree.tree_leaves(tree, none_is_leaf=True)]


# --- one process: fragments, schedule, configuration --------------------------------------------


def test_fragments_are_contiguous_in_definition_order_and_balanced():
    params = {f"l{i}.{k}": torch.zeros(n) for i, n in enumerate([100, 10, 100, 10, 300]) for k in ("w",)}
    params = {"l10.w": torch.zeros(50), **params}  # sorted order ('l0', 'l1', 'l10', ...) is not definition order
    frags = _plan.split(params, 3, "t")
    # Bytes 200, 400, 40, 400, 40, 1200: cuts nearest to 1/3 and 2/3 of 2280.
    assert [f.paths for f in frags] == [("l10.w", "l0.w", "l1.w"), ("l2.w", "l3.w"), ("l4.w",)]
    assert sum(f.nbytes for f in frags) == 4 * 570
    assert [len(f.indices) for f in _plan.split(params, 6, "t")] == [1] * 6
    with pytest.raises(ValueError, match="fragments=7 but the tree has only 6 leaves"):
        _plan.split(params, 7, "t")


def test_schedule_staggers_fragments_and_launches_delay_steps_early():
    launch = lambda p, f, h, d: [t for t in range(1, 2 * h + 1) if _plan.launches(t, p, f, h, d)]  # noqa: E731
    assert launch(0, 1, 4, 0) == [4, 8]
    assert launch(0, 1, 4, 1) == [3, 7]
    assert [launch(p, 4, 8, 0) for p in range(4)] == [[2, 10], [4, 12], [6, 14], [8, 16]]
    assert [launch(p, 2, 4, 1) for p in range(2)] == [[1, 5], [3, 7]]


def test_outer_optimizers_are_told_apart_by_their_settings():
    d = _plan.describe
    nesterov = lambda lr: fddp.optim.sgd(lr, momentum=0.9, nesterov=True)  # noqa: E731
    assert d(nesterov(0.7)) == d(nesterov(0.7))
    assert d(nesterov(0.7)) != d(nesterov(0.5))
    assert d(fddp.optim.sgd(0.7)) != d(nesterov(0.7))
    assert d(fddp.optim.adam(1e-3)) != d(fddp.optim.adamw(1e-3))
    assert "0x" not in d(fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), nesterov(0.7)))  # no addresses


class _Step:
    """A schedule written as a class: its settings are attributes."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def __call__(self, count):
        return self.lr


def test_outer_optimizers_are_compared_by_value_constants_and_attributes_included():
    d = _plan.describe
    # Two schedules of the same name, closure and defaults that differ in a constant of their code.
    schedules = [lambda c: 0.7 * 0.99**c, lambda c: 0.5 * 0.99**c]
    assert schedules[0].__qualname__ == schedules[1].__qualname__
    assert d(fddp.optim.sgd(schedules[0])) != d(fddp.optim.sgd(schedules[1]))
    assert d(fddp.optim.sgd(_Step(0.7))) != d(fddp.optim.sgd(_Step(0.5)))
    assert d(fddp.optim.sgd(_Step(0.7))) == d(fddp.optim.sgd(_Step(0.7)))
    # The same numbers compare equal whatever their type: 1 and 1.0 step alike.
    assert d(fddp.optim.sgd(1)) == d(fddp.optim.sgd(1.0))
    assert d((1.0, True)) != d((1.0, 1.0))  # but a flag is not a number


def test_fragments_by_prefix_take_whole_modules_and_say_what_is_wrong():
    params = {k: torch.zeros(n) for k, n in [("embed.w", 4), ("blocks.0.w", 8), ("blocks.0.b", 2), ("blocks.10.w", 8), ("head.w", 3)]}
    frags = _plan.split_by(params, [("blocks.0", "embed"), ("blocks.10", "head.w")], "t")
    assert [f.paths for f in frags] == [("embed.w", "blocks.0.w", "blocks.0.b"), ("blocks.10.w", "head.w")]  # definition order
    assert [f.nbytes for f in frags] == [56, 44]
    with pytest.raises(ValueError, match="prefix 'blocks.2' names no leaf"):
        _plan.split_by(params, [("blocks.2",), ("embed", "blocks", "head")], "t")
    with pytest.raises(ValueError, match="leaf 'blocks.0.w' is in fragment 0 and in fragment 1"):
        _plan.split_by(params, [("blocks",), ("blocks.0", "embed", "head")], "t")
    with pytest.raises(ValueError, match="2 leaves are in no fragment: 'embed.w', 'head.w'"):
        _plan.split_by(params, [("blocks",)], "t")
    with pytest.raises(ValueError, match="fragments must be an int or a sequence"):
        fddp.diloco.diloco(4, fragments="blocks")
    assert fddp.diloco.diloco(4, fragments=["embed", ["blocks", "head"]]).fragments == (("embed",), ("blocks", "head"))


def test_bad_configurations_say_what_is_wrong():
    with pytest.raises(ValueError, match="delay=4 must be < every=4"):
        fddp.diloco.diloco(4, delay=4)
    with pytest.raises(ValueError, match="fragments=5 > every=4"):
        fddp.diloco.diloco(4, fragments=5)
    with pytest.raises(ValueError, match="compression must be None, 'bf16'"):
        fddp.diloco.diloco(4, compression="int3")
    with pytest.raises(ValueError, match="mixing must be in"):
        fddp.diloco.diloco(4, mixing=1.5)
    with pytest.raises(TypeError, match="fddp.optim transformation"):
        fddp.diloco.diloco(4, optimizer=torch.optim.SGD)


# --- H = 1: data parallelism ---------------------------------------------------------------------


def _h1_worker(steps: int):
    apply_fn, params = fddp.functionalize(_mlp())
    params = {k: v.detach().clone() for k, v in params.items()}
    data = _data(fddp.rank(), steps)
    sgd = fddp.optim.sgd(0.1)
    # fddp.diloco: local SGD steps, every step averaged by the outer step (SGD, lr 1).
    outer = fddp.diloco.diloco(1, fddp.optim.sgd(1.0))
    p, s, o = params, sgd.init(params), outer.init(params)
    for x, y in data:
        p, s = fddp.optim.apply_gradients(sgd, torch.func.grad(_loss, argnums=1)(apply_fn, p, x, y), s, p)
        p, o = outer.step(p, o)
    # The reference: ddp_step's mean gradient, then SGD.
    q, t = params, sgd.init(params)
    for x, y in data:
        g = fddp.ddp_step(q, torch.func.grad(_loss, argnums=1)(apply_fn, q, x, y))
        q, t = fddp.optim.apply_gradients(sgd, g, t, q)
    # The warm start: steps of inner SGD averaged after each are DDP + SGD, whatever every is.
    warm = fddp.diloco.diloco(4, warmup=steps)
    w, s, o2 = params, sgd.init(params), warm.init(params)
    for x, y in data:
        w, s = fddp.optim.apply_gradients(sgd, torch.func.grad(_loss, argnums=1)(apply_fn, w, x, y), s, w)
        w, o2 = warm.step(w, o2)
    untouched = _equal(o2.outer_state, warm.init(params).outer_state)  # no outer step during the warm-up
    return p, q, o.snapshot, w, o2.snapshot, untouched


def test_h1_with_sgd_inside_and_outside_is_ddp_step_and_sgd():
    for p, q, snap, w, warm_snap, untouched in run(_h1_worker, K, 5):
        for k in q:
            torch.testing.assert_close(p[k], q[k], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(w[k], q[k], rtol=1e-5, atol=1e-6)
            assert torch.equal(p[k], snap[k]) and torch.equal(w[k], warm_snap[k])
        assert untouched


# --- local SGD: torch's PeriodicModelAverager ------------------------------------------------------


class _Branchy(nn.Module):
    """A layer used every step, one used on every other step only, one never used."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.sometimes, self.never = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.sometimes(h) if use else h


def _local_sgd_worker(steps: int, every: int):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    data = _data(fddp.rank(), steps)
    torch.manual_seed(1)
    ref = _Branchy()
    apply_fn, params = fddp.functionalize(copy.deepcopy(ref))
    params = {k: v.detach().clone() for k, v in params.items()}
    sgd = fddp.optim.sgd(0.1)
    outer = fddp.diloco.local_sgd(every)
    p, s, o = params, sgd.init(params), outer.init(params)
    for t, (x, y) in enumerate(data):
        g = torch.func.grad(lambda q: F.mse_loss(apply_fn(q, x, t % 2 == 0), y))(p)
        p, s = fddp.optim.apply_gradients(sgd, g, s, p)
        p, o = outer.step(p, o)

    def torch_loop(set_to_none: bool):
        model = copy.deepcopy(ref)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # PeriodicModelAverager counts from 0 and averages when (step - warmup) % period == 0:
        # warmup_steps = every - 1 averages after inner steps every, 2 * every, ... like fddp.
        avg = PeriodicModelAverager(period=every, warmup_steps=every - 1)
        for t, (x, y) in enumerate(data):
            opt.zero_grad(set_to_none=set_to_none)
            F.mse_loss(model(x, t % 2 == 0), y).backward()
            opt.step()
            avg.average_parameters(model.parameters())
        return {k: v.detach().clone() for k, v in model.named_parameters()}

    return p, torch_loop(False), torch_loop(True)


def test_local_sgd_is_torchs_periodic_model_averager_and_averages_what_torch_skips():
    # 8 steps, every 4: `sometimes` is used on steps 1, 3, 5, 7 only, so it is unused on the 4th and 8th, before each averaging.
    outs = run(_local_sgd_worker, K, 8, 4)
    for p, torch_zeros, _ in outs:
        # With zero gradients instead of None (zero_grad(set_to_none=False)) torch averages every
        # parameter, as fddp does.
        for k in p:
            torch.testing.assert_close(p[k], torch_zeros[k], rtol=1e-5, atol=1e-6)
    for k in outs[0][0]:
        assert torch.equal(outs[0][0][k], outs[1][0][k]), f"fddp's replicas differ at {k}"
    # With torch's default zero_grad(set_to_none=True), `sometimes` has .grad None at every
    # averaging step: get_params_to_average skips it, and the replicas keep their own values,
    # although both trained it on the steps between. `never` is never averaged either; it never moved.
    nones = [o[2] for o in outs]
    assert not torch.equal(nones[0]["sometimes.weight"], nones[1]["sometimes.weight"])
    assert torch.equal(nones[0]["a.weight"], nones[1]["a.weight"])
    assert torch.equal(nones[0]["never.weight"], outs[0][0]["never.weight"])


# --- DiLoCo against a one-process, vmap'd simulator of every worker --------------------------------

CONFIGS = {
    "diloco": dict(every=3, steps=8),
    "streaming": dict(every=4, fragments=2, delay=1, mixing=0.5, steps=11),
    "weighted": dict(every=3, steps=7, weighted=True),
    "sharded": dict(every=3, steps=8, shard=True),
    "int8": dict(every=3, steps=7, compression="int8"),
    "warm": dict(every=3, warmup=4, steps=11),
    "prefixes": dict(every=4, fragments=[["2"], ["0"]], delay=1, mixing=0.5, steps=11),
    "extrapolate": dict(every=3, steps=8, extrapolate=True),
    "extrapolate_4bit": dict(every=3, steps=8, extrapolate=True, compression="e3m0"),
}
LR_OUT, MOMENTUM = 0.7, 0.9


def _weights(rank: int, steps: int) -> list[float]:
    return [float((3 * rank + t) % 4) for t in range(steps)]  # 0 for some steps: a rank out of data


def _diloco_worker(names: list[str]):
    out = {}
    for name in names:
        cfg = dict(CONFIGS[name])
        steps, weighted = cfg.pop("steps"), cfg.pop("weighted", False)
        if cfg.get("compression") == "int8":
            cfg["compression"] = fddp.Int8(block=16)
        elif cfg.get("compression") == "e3m0":
            cfg["compression"] = fddp.diloco.Quantize(bits=4, block=16)
        apply_fn, params = fddp.functionalize(_mlp(torch.float64))
        params = {k: v.detach().clone() for k, v in params.items()}
        inner = fddp.optim.adamw(0.05, weight_decay=0.01)
        outer = fddp.diloco.diloco(optimizer=fddp.optim.sgd(LR_OUT, momentum=MOMENTUM, nesterov=True), **cfg)
        p, s, o = params, inner.init(params), outer.init(params)
        ws = _weights(fddp.rank(), steps)
        history, gains = [], []
        for t, (x, y) in enumerate(_config_data(cfg, fddp.rank(), steps)):
            g = torch.func.grad(_loss, argnums=1)(apply_fn, p, x, y)
            p, s = fddp.optim.apply_gradients(inner, g, s, p)
            p, o, info = outer.step(p, o, weight=ws[t] if weighted else None, return_info=True)
            history.append((p, o.snapshot))
            gains += info.gains
        out[name] = history
        out[name + " gains"] = gains
    return out


def _config_data(cfg: dict, rank: int, steps: int) -> list:
    if not cfg.get("extrapolate"):
        return _data(rank, steps, torch.float64)
    # The same inputs, opposite targets: pseudo-gradients that partly cancel, so FedExP's gain exceeds 1.
    return [(x, y if rank == 0 else -y) for x, y in _data(0, steps, torch.float64)]


def _simulate(name: str, world: int) -> list[tuple[dict, dict]]:
    """Every worker's inner steps at once under vmap, and the outer steps written out, in float64."""
    cfg = CONFIGS[name]
    every, steps, frags = cfg["every"], cfg["steps"], cfg.get("fragments", 1)
    delay, mixing, warmup = cfg.get("delay", 0), cfg.get("mixing", 0.0), cfg.get("warmup", 0)
    apply_fn, params = fddp.functionalize(_mlp(torch.float64))
    params = {k: v.detach().clone() for k, v in params.items()}
    keys = list(params)  # definition order: 0.weight, 0.bias, 2.weight, 2.bias
    if isinstance(frags, list):  # the user's, by prefix: "2" is the second Linear's weight and bias
        fragments = [[k for k in keys if any(k.startswith(f"{q}.") for q in prefixes)] for prefixes in frags]
    else:
        fragments = [keys[:2], keys[2:]] if frags == 2 else [keys]
    inner = fddp.optim.adamw(0.05, weight_decay=0.01)
    local = {k: v.expand(world, *v.shape).clone() for k, v in params.items()}
    state = torch.func.vmap(inner.init)(local)
    data = [_config_data(cfg, r, steps) for r in range(world)]
    weights = torch.tensor([_weights(r, steps) for r in range(world)], dtype=torch.float64)

    def inner_step(p, s, x, y):
        updates, s = inner.update(torch.func.grad(_loss, argnums=1)(apply_fn, p, x, y), s, p)
        return fddp.optim.apply_updates(p, updates), s

    snapshot = {k: v.clone() for k, v in params.items()}
    momentum = {k: None for k in keys}
    residual = [torch.zeros(world, sum(params[k].numel() for k in frag), dtype=torch.float64) for frag in fragments]
    pseudo, window_start = {}, [0] * len(fragments)
    history = []
    for t in range(1, steps + 1):
        x = torch.stack([data[r][t - 1][0] for r in range(world)])
        y = torch.stack([data[r][t - 1][1] for r in range(world)])
        local, state = torch.func.vmap(inner_step)(local, state, x, y)
        if t <= warmup:  # a synchronous step: every worker's parameters become their mean
            for k in keys:
                snapshot[k] = local[k].mean(0)
                local[k] = snapshot[k].expand(world, *snapshot[k].shape).clone()
            history.append(({k: v.clone() for k, v in local.items()}, {k: v.clone() for k, v in snapshot.items()}))
            continue
        for f, frag in enumerate(fragments):
            merge_at = (f + 1) * every // len(fragments) % every
            if (t - warmup + delay - merge_at) % every == 0:  # launch: every worker's pseudo-gradient
                w = weights[:, window_start[f] : t].sum(1) if cfg.get("weighted") else None
                window_start[f] = t
                pseudo[f] = (t + delay, w, {k: snapshot[k] - local[k] for k in frag})
            if f in pseudo and pseudo[f][0] == t:  # merge: the mean, the outer Nesterov step, the mix
                _, w, deltas = pseudo.pop(f)
                if cfg.get("compression") == "int8":
                    means = _int8_mean(deltas, frag, residual, f, world)
                elif cfg.get("compression") == "e3m0":
                    means = _e3m0_mean(deltas, frag, residual, f, world)
                elif w is not None:
                    means = {k: (w.view(-1, *[1] * (deltas[k].dim() - 1)) * deltas[k]).sum(0) / w.sum() for k in frag}
                else:
                    means = {k: deltas[k].sum(0) / world for k in frag}
                if cfg.get("extrapolate"):  # FedExP's gain: the ranks' mean squared norm over twice the mean's
                    ranks_sq = sum(float(deltas[k].double().square().sum()) for k in frag) / world
                    mean_sq = sum(float(means[k].double().square().sum()) for k in frag)
                    gain = max(1.0, ranks_sq / (2 * mean_sq + 1e-30))
                    means = {k: means[k] * gain for k in frag}
                for k in frag:
                    mean = means[k]
                    momentum[k] = mean.clone() if momentum[k] is None else MOMENTUM * momentum[k] + mean
                    snapshot[k] = snapshot[k] - LR_OUT * (mean + MOMENTUM * momentum[k])
                    local[k] = mixing * local[k] + (1 - mixing) * snapshot[k]
        history.append(({k: v.clone() for k, v in local.items()}, {k: v.clone() for k, v in snapshot.items()}))
    return history


def _int8_mean(deltas: dict, frag: list, residual: list, f: int, world: int, block: int = 16) -> dict:
    """fddp.Int8 written out: one bucket (the fragment's leaves, last first), blocks of ``block``
    with a scale shared by the workers, ``127 // world`` levels, the sum, the residual kept."""
    order = frag[::-1]  # a bucket fills in reverse definition order
    x = torch.cat([deltas[k].reshape(world, -1) for k in order], 1) + residual[f]
    n = x.shape[1]
    blocks = -(-n // block)
    grid = torch.zeros(world, blocks * block, dtype=x.dtype)
    grid[:, :n] = x
    grid = grid.view(world, blocks, block)
    levels = 127 // world
    scale = grid.abs().amax(2).amax(0) / levels
    q = torch.round(grid / scale.clamp_min(torch.finfo(scale.dtype).tiny)[:, None]).clamp(-levels, levels)
    residual[f] = x - (q * scale[:, None]).reshape(world, -1)[:, :n]
    mean = (q.sum(0) * (scale / world)[:, None]).reshape(-1)[:n]
    out, at = {}, 0
    for k in order:
        numel = deltas[k][0].numel()
        out[k] = mean[at : at + numel].view(deltas[k].shape[1:])
        at += numel
    return out


def _e3m0_mean(deltas: dict, frag: list, residual: list, f: int, world: int) -> dict:
    """fddp.diloco.Quantize(bits=4, block=16) written out: one bucket (the fragment's leaves, last
    first), each worker's values plus its residual quantised, the decoded values summed and halved."""
    order = frag[::-1]
    x = torch.cat([deltas[k].reshape(world, -1) for k in order], 1) + residual[f]
    sent = torch.stack([_quantised(x[r], "e3m0") for r in range(world)])
    residual[f] = x - sent
    total = sent[0].clone()
    for r in range(1, world):
        total = total + sent[r]
    mean, out, at = total / world, {}, 0
    for k in order:
        numel = deltas[k][0].numel()
        out[k] = mean[at : at + numel].view(deltas[k].shape[1:])
        at += numel
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_diloco_equals_a_one_process_simulator_of_every_worker(name, _diloco_runs):
    sim = _simulate(name, K)
    tol = dict(rtol=1e-12, atol=1e-12)
    for r, history in enumerate(_diloco_runs[name]):
        assert len(history) == len(sim)
        for t, ((p, snap), (p_sim, snap_sim)) in enumerate(zip(history, sim)):
            for k in p:
                torch.testing.assert_close(p[k], p_sim[k][r], **tol, msg=lambda m: f"step {t + 1}, rank {r}, {k}: {m}")
                torch.testing.assert_close(snap[k], snap_sim[k], **tol, msg=lambda m: f"step {t + 1}, snapshot {k}: {m}")
    final = _diloco_runs[name][0][-1][1]
    assert all(torch.equal(final[k], _diloco_runs[name][1][-1][1][k]) for k in final), "snapshots differ between ranks"
    if CONFIGS[name].get("extrapolate"):
        assert max(_diloco_runs[name + " gains"][0]) > 1.2, _diloco_runs[name + " gains"]  # the gain was exercised


@pytest.fixture(scope="module")
def _diloco_runs():
    outs = run(_diloco_worker, K, list(CONFIGS))
    return {name: [o[name] for o in outs] for name in outs[0]}


# --- checkpoints: mid-round and between a fragment's launch and its merge ---------------------------


def _train(apply_fn, inner, outer, p, s, o, data, steps):
    for t in steps:
        x, y = data[t]
        g = torch.func.grad(_loss, argnums=1)(apply_fn, p, x, y)
        p, s = fddp.optim.apply_gradients(inner, g, s, p)
        p, o = outer.step(p, o)
    return p, s, o


def _resume_worker(directory: str, first: int, total: int, eager: bool = False):
    apply_fn, params = fddp.functionalize(_mlp())
    params = {k: v.detach().clone() for k, v in params.items()}
    data = _data(fddp.rank(), total)
    inner = fddp.optim.adamw(0.05)
    if eager:  # the residuals of 4-bit pseudo-gradients and each rank's round origins are per-rank state
        outer = fddp.diloco.diloco(4, fragments=2, eager=True, compression=fddp.diloco.Quantize(bits=4, block=16))
    else:
        outer = fddp.diloco.diloco(4, fragments=2, delay=1, mixing=0.5, compression=fddp.Int8(block=16))
    p, s, o = _train(apply_fn, inner, outer, params, inner.init(params), outer.init(params), data, range(first))
    in_flight = [f.pending is not None for f in o.flights]
    # The local parameters, the inner state and the residuals differ between ranks: each rank
    # writes its own file, through a group of one.
    own, _ = tdist.new_subgroups(group_size=1)
    try:
        ckpt.save(os.path.join(directory, f"unsettled{fddp.rank()}.pt"), {"outer": o}, group=own)
        refused = None
    except TypeError as e:
        refused = str(e)
    o = outer.settle(o)  # every rank, at the same step: the fragment in flight becomes tensors
    path = os.path.join(directory, f"rank{fddp.rank()}.pt")
    ckpt.save(path, {"params": p, "inner": s, "outer": o}, group=own)
    before = _tensors((p, s, o))
    straight = _train(apply_fn, inner, outer, p, s, o, data, range(first, total))
    assert all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a is b for a, b in zip(before, _tensors((p, s, o)))
    ), "training modified the state it was given"
    like = {"params": params, "inner": inner.init(params), "outer": outer.init(params)}
    loaded = ckpt.load(path, like=like)
    resumed = _train(apply_fn, inner, outer, loaded["params"], loaded["inner"], loaded["outer"], data, range(first, total))
    settled = lambda run: (*run[:2], outer.settle(run[2]))  # noqa: E731 - an eager round is always in flight
    return in_flight, refused, settled(straight), settled(resumed)


@pytest.mark.parametrize("first, eager", [(5, False), (6, False), (5, True)])
def test_a_checkpoint_between_launch_and_merge_resumes_bitwise(first, eager):
    # Fragment 0 launches at steps 1, 5, 9 and merges one step later; fragment 1 launches at 3, 7.
    # After step 5 it is in flight; after step 6 nothing is, mid-round. Eager: fragment 0 launches
    # at 2, 6, 10, fragment 1 at 4, 8, 12, each in flight for a whole round.
    with tempfile.TemporaryDirectory() as d:
        outs = run(_resume_worker, K, d, first, 12, eager)
    for in_flight, refused, straight, resumed in outs:
        assert in_flight == ([True, True] if eager else [True, False] if first == 5 else [False, False])
        if first == 5:
            assert refused is not None and "flights" in refused and "InFlight" in refused
        assert _equal(straight, resumed)
    assert not torch.equal(outs[0][2][2].compression_state[0].error["0.weight"], outs[1][2][2].compression_state[0].error["0.weight"])
    if eager:
        assert not torch.equal(outs[0][2][2].origin[1]["2.weight"], outs[1][2][2].origin[1]["2.weight"])


# --- bad input: ranks that disagree, syncs that fail ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Fails(fddp.hooks.CommHook):
    """The mean, then an error once the all-reduce has landed (on every rank: no one is left waiting)."""

    def launch(self, state, bucket):
        return bucket.comm.all_reduce(bucket.buffer), state

    def finish(self, state, bucket, pending):
        bucket.comm.wait(pending, "the all-reduce")
        raise RuntimeError("injected failure")


def _bad_input_worker():
    apply_fn, params = fddp.functionalize(_mlp())
    params = {k: v.detach().clone() for k, v in params.items()}
    data = _data(fddp.rank(), 8)
    inner = fddp.optim.sgd(0.1)
    r = fddp.rank()
    nesterov = lambda lr: fddp.optim.sgd(lr, momentum=0.9, nesterov=True)  # noqa: E731
    disagree = {
        "every": [fddp.diloco.diloco(2), fddp.diloco.diloco(3)],
        "fragments": [fddp.diloco.diloco(4), fddp.diloco.diloco(4, fragments=2)],
        "optimizer": [fddp.diloco.diloco(2, nesterov(0.7)), fddp.diloco.diloco(2, nesterov(0.5))],
    }
    errors = {}
    for name, outers in disagree.items():
        outer = outers[r]
        try:
            _train(apply_fn, inner, outer, params, inner.init(params), outer.init(params), data, range(8))
        except fddp.MismatchError as e:
            errors[name] = str(e)
    failed = {}
    for delay in (0, 1):
        # A failure inside a synchronisation is fatal (the peers may be inside its collectives):
        # the process's groups carry no more fddp calls. Each case runs on a group of its own.
        group = tdist.new_group()
        outer = fddp.diloco.diloco(2, compression=_Fails(), delay=delay, group=group)
        p, s, o = _train(apply_fn, inner, outer, params, inner.init(params), outer.init(params), data, range(1))
        if delay:  # the launch at step 1 goes out; its merge at step 2 fails
            assert o.flights[0].pending is not None
        before = _tensors((p, o))
        try:
            outer.step(p, o)
        except RuntimeError as e:
            unchanged = all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a is b for a, b in zip(before, _tensors((p, o))))
            try:  # every rank is told to restart, not left to wait at the next call
                fddp.ddp_step(params, params, group=group)
                refused = None
            except fddp.PeerError as refusal:
                refused = str(refusal)
            failed[delay] = (str(e), unchanged, refused)
    return errors, failed


def test_ranks_that_disagree_raise_mismatch_and_a_failed_sync_changes_nothing():
    for errors, failed in run(_bad_input_worker, K):
        assert set(errors) == {"every", "fragments", "optimizer"}
        assert "Option diloco every: rank 0 has 2, rank 1 has 3" in errors["every"]
        assert "Option diloco fragments: rank 0 has 1, rank 1 has 2" in errors["fragments"]
        assert "Option diloco optimizer" in errors["optimizer"] and "lr=0.7" in errors["optimizer"]
        for delay in (0, 1):
            message, unchanged, refused = failed[delay]
            assert "injected failure" in message and unchanged
            assert refused is not None and "carries no more fddp calls" in refused


# --- composition: ZeRO inside each worker, DiLoCo across workers -----------------------------------


def _hybrid_worker(steps: int):
    # Ranks {0, 1} and {2, 3} are two workers; each trains with ZeRO-2 over its own pair, and the
    # outer step averages across the pairs, over {0, 2} and {1, 3}.
    r = fddp.rank()
    inner_groups = [tdist.new_group([0, 1]), tdist.new_group([2, 3])]
    outer_groups = [tdist.new_group([0, 2]), tdist.new_group([1, 3])]
    inner_g, outer_g = inner_groups[r // 2], outer_groups[r % 2]
    apply_fn, params = fddp.functionalize(_mlp())
    params = {k: v.detach().clone() for k, v in params.items()}
    worker_data = [_data(10 * (r // 2) + m, steps) for m in range(2)]  # both members' batches
    mine = worker_data[r % 2]
    adamw = fddp.optim.adamw(0.05)
    outer = fddp.diloco.diloco(3, group=outer_g)

    p, o = params, outer.init(params)
    shards = fddp.zero.shard(p, group=inner_g)
    s = adamw.init(shards)
    for x, y in mine:
        g = fddp.ddp_step(p, torch.func.grad(_loss, argnums=1)(apply_fn, p, x, y), group=inner_g,
                          compression=fddp.zero.ReduceScatter())  # fmt: skip
        shards, s = fddp.optim.apply_gradients(adamw, g, s, shards)
        p = fddp.zero.gather(shards).wait()
        p, o = outer.step(p, o)
        shards = fddp.zero.shard(p, group=inner_g)  # the outer step may have moved them

    # The reference: one rank per worker, the worker's whole batch, no inner communication.
    q, t, o2 = params, adamw.init(params), outer.init(params)
    for (x0, y0), (x1, y1) in zip(*worker_data):
        g = torch.func.grad(_loss, argnums=1)(apply_fn, q, torch.cat([x0, x1]), torch.cat([y0, y1]))
        q, t = fddp.optim.apply_gradients(adamw, g, t, q)
        q, o2 = outer.step(q, o2)
    return p, q


def test_zero_inside_each_worker_and_diloco_across_equals_one_rank_per_worker():
    for p, q in run(_hybrid_worker, 4, 7, timeout=240):  # 4 ranks on 2 shared cores: 76-91 s at load 30-56
        for k in q:
            torch.testing.assert_close(p[k], q[k], rtol=1e-4, atol=1e-5)


# --- uneven data: weights, and rounds in which no rank had any -------------------------------------


def _join_worker():
    apply_fn, params = fddp.functionalize(_mlp())
    params = {k: v.detach().clone() for k, v in params.items()}
    r = fddp.rank()
    data = fddp.Join(_data(r, 4 if r == 0 else 2))  # rank 1 runs out after two steps
    sgd = fddp.optim.sgd(0.1)
    outer = fddp.diloco.diloco(2, fddp.optim.sgd(1.0, momentum=0.9))
    p, s, o = params, sgd.init(params), outer.init(params)
    seen = []
    for _ in range(6):
        batch = next(data)
        if batch is not None:
            g = torch.func.grad(_loss, argnums=1)(apply_fn, p, *batch)
            p, s = fddp.optim.apply_gradients(sgd, g, s, p)
        before = (p, o)
        p, o, info = outer.step(p, o, weight=0 if batch is None else len(batch[0]), return_info=True)
        if info.syncs:
            seen.append((float(info.syncs[0].weight), before, (p, o)))
    return seen


def test_weights_average_what_each_rank_saw_and_a_round_without_data_changes_nothing():
    outs = run(_join_worker, K)
    (w1, _, _), (w2, before2, after2), (w3, before3, after3) = outs[0]
    assert (w1, w2, w3) == (32.0, 16.0, 0.0)  # 2 x 8 samples on each rank, then rank 0's alone, then none
    # Round 2: only rank 0 trained, so the weighted mean is its pseudo-gradient alone, and the
    # new global parameters (outer SGD, lr 1, momentum: m = 0.9 m + d) follow from it.
    p0 = before2[0]
    for k in p0:
        delta = before2[1].snapshot[k] - p0[k]
        m = 0.9 * before2[1].outer_state[0].momentum_buffer[k] + delta
        torch.testing.assert_close(after2[0][k], before2[1].snapshot[k] - m, rtol=1e-6, atol=1e-7)
    # Round 3: no data anywhere: no outer step (the momentum would otherwise still move things).
    assert _equal(after3[1].outer_state, before3[1].outer_state) and _equal(after3[1].snapshot, before3[1].snapshot)
    for p_r, _ in [o[2][2] for o in outs]:
        assert _equal(p_r, after3[1].snapshot)


def _bad_weight_worker():
    """A weight that as_weight could not read on the host (a GPU tensor's) and made NaN, on one rank."""
    import fddp.diloco._checks as checks

    apply_fn, params = fddp.functionalize(_mlp())
    params = {k: v.detach().clone() for k, v in params.items()}
    outer = fddp.diloco.diloco(2, fddp.optim.sgd(1.0, momentum=0.9))
    o = outer.init(params)
    import fddp.sync._setup as setup

    real, real_on_host = checks.as_weight, setup.on_host
    if fddp.rank() == 1:  # a negative GPU weight, as as_weight leaves it, and not read on the host after
        checks.as_weight = lambda w: torch.tensor(float("nan"), dtype=torch.float64)  # noqa: E731
        setup.on_host = lambda t: False  # noqa: E731
    try:
        p, o2 = outer.step(params, o, weight=1)
        p, o2 = outer.step(p, o2, weight=1)  # the sync: its weights' sum is NaN on every rank
        return "no error", None
    except ValueError as e:
        return str(e), _equal(o.snapshot, outer.init(params).snapshot)
    finally:
        checks.as_weight, setup.on_host = real, real_on_host


def test_a_weight_that_was_not_finite_raises_at_the_sync_on_every_rank():
    for message, unchanged in run(_bad_weight_worker, K):
        assert "summed over the ranks since the last synchronisation are nan" in message and unchanged, message


# --- state checked across ranks: another step, another start, another tree, other shapes -----------


def _state_checks_worker():
    apply_fn, params = fddp.functionalize(_mlp())
    params = {k: v.detach().clone() for k, v in params.items()}
    r = fddp.rank()
    data = _data(r, 12)
    sgd = fddp.optim.sgd(0.1)
    errors = {}

    def attempt(name, fn):
        try:
            fn()
        except (fddp.MismatchError, fddp.PeerError, ValueError, TypeError) as e:
            errors[name] = (type(e).__name__, str(e))

    # A start without fddp.broadcast: rank 1's parameters differ by one ulp in one value.
    own = {k: v.clone() for k, v in params.items()}
    if r == 1:
        own["2.bias"][3] = torch.nextafter(own["2.bias"][3], torch.tensor(9.0))
    outer = fddp.diloco.diloco(4)
    attempt("no broadcast", lambda: _train(apply_fn, sgd, outer, own, sgd.init(own), outer.init(own), data, range(4)))

    # A rank resumed from its own older file: rank 1 loads the state of step 6, rank 0 that of step 8.
    outer = fddp.diloco.diloco(4, fddp.optim.sgd(0.7, momentum=0.5, nesterov=True))
    p, s, o = _train(apply_fn, sgd, outer, params, sgd.init(params), outer.init(params), data, range(6))
    older = (p, s, o)
    p, s, o = _train(apply_fn, sgd, outer, p, s, o, data, range(6, 8))
    p, s, o = older if r == 1 else (p, s, o)
    attempt("older file", lambda: _train(apply_fn, sgd, outer, p, s, o, data, range(8, 12)))

    # Outer schedules of the same code that differ in a constant.
    schedules = [lambda c: 0.7 * 0.99**c, lambda c: 0.5 * 0.99**c]
    outer = fddp.diloco.diloco(4, fddp.optim.sgd(schedules[r], momentum=0.9, nesterov=True))
    attempt("schedule", lambda: _train(apply_fn, sgd, outer, params, sgd.init(params), outer.init(params), data, range(4)))

    # A DiLoCo state of another tree on one rank.
    torch.manual_seed(5)
    _, other = fddp.functionalize(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)))
    outer = fddp.diloco.diloco(4, fddp.optim.sgd(0.7))
    state = outer.init(other if r == 1 else params)
    attempt("other tree", lambda: _train(apply_fn, sgd, outer, params, sgd.init(params), state, data, range(4)))

    # A model resized after the state was made: the very next call says so, not the sync H - 1 steps later.
    outer = fddp.diloco.diloco(4, fddp.optim.sgd(0.6))
    p, s, o = _train(apply_fn, sgd, outer, params, sgd.init(params), outer.init(params), data, range(1))
    resized = {**p, "2.weight": torch.zeros(7, 6)}
    attempt("resized", lambda: outer.step(resized, o))

    # The same on one rank only: it raises at once, and its peer learns of it at its next synchronisation.
    outer = fddp.diloco.diloco(4, fddp.optim.sgd(0.55))
    p, s, o = _train(apply_fn, sgd, outer, params, sgd.init(params), outer.init(params), data, range(1))

    def resized_on_one_rank():
        q, state = p, o
        for t in range(2, 5):  # steps 2 and 3 count; step 4 synchronises
            q = {**q, "2.weight": torch.zeros(7, 6)} if (r == 1 and t == 2) else q
            q, state = outer.step(q, state)

    attempt("resized on one rank", resized_on_one_rank)

    # ZeRO shards over the group that DiLoCo averages across: refused, as ddp_step refuses them.
    _, shards = fddp.zero.fully_shard(_mlp())
    attempt("fully_shard", lambda: fddp.diloco.local_sgd(2).init(shards))
    attempt("fully_shard step", lambda: fddp.diloco.local_sgd(2).step(shards, fddp.diloco.local_sgd(2).init(params)))
    attempt("shard", lambda: fddp.diloco.local_sgd(2).init(fddp.zero.shard(params)))
    fddp.ddp_step(params, params)  # the group still works
    return errors


def test_stale_or_mismatched_state_is_an_error_on_every_rank_naming_what_differs():
    outs = run(_state_checks_worker, K)
    for errors in outs:
        kind, msg = errors["no broadcast"]
        assert kind == "MismatchError" and "leaf '2.bias'" in msg and "fddp.broadcast(params)" in msg, msg
        kind, msg = errors["older file"]
        assert kind == "MismatchError" and "rank 0 at step 12, rank 1 at step 8" in msg and "checkpoint" in msg, msg
        kind, msg = errors["schedule"]
        assert kind == "MismatchError" and "option diloco optimizer" in msg.lower() and "0.7" in msg and "0.5" in msg, msg
        kind, msg = errors["other tree"]
        assert kind == "MismatchError" and "Rank 1's params do not match the DiLoCo state at leaf '2.bias'" in msg, msg
        kind, msg = errors["resized"]
        assert kind == "ValueError" and "leaf '2.weight'" in msg and "(7, 6)" in msg and "(6, 6)" in msg, msg
    kind, msg = outs[1]["resized on one rank"]
    assert kind == "ValueError" and "leaf '2.weight'" in msg, msg
    kind, msg = outs[0]["resized on one rank"]
    assert kind == "PeerError" and "rank 1" in msg and "ValueError" in msg, msg
    for errors in outs:
        for name in ("fully_shard", "fully_shard step"):
            kind, msg = errors[name]
            assert kind == "TypeError" and "fully sharded" in msg and "group=replica_group" in msg, msg
        assert errors["shard"][0] == "TypeError" and "fddp.zero.shard" in errors["shard"][1]
    same = {k: v for k, v in outs[0].items() if k != "resized on one rank"}
    assert same == {k: v for k, v in outs[1].items() if k != "resized on one rank"}  # word for word on every rank


# --- pseudo-gradients in 4 and 2 bits, and top k, with error feedback: against the arithmetic written out ---

_HOOKS = {
    "e3m0": lambda: fddp.diloco.Quantize(bits=4, format="e3m0", block=16),
    "int4": lambda: fddp.diloco.Quantize(bits=4, format="int", block=16),
    "int2": lambda: fddp.diloco.Quantize(bits=2, block=16),
    "topk": lambda: fddp.diloco.TopK(0.1),
}


def _grads(rank: int, steps: int) -> list[dict]:
    """Values of a wide range of sizes (so that blocks round differently), per rank."""
    g = torch.Generator().manual_seed(50 + rank)
    return [
        {k: torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g)) for k, shape in (("a", (3, 7)), ("b", (20,)))}
        for _ in range(steps)
    ]


def _hook_worker(names: list[str], steps: int):
    params = {"a": torch.zeros(3, 7), "b": torch.zeros(20)}
    out = {}
    for name in names:
        hook = _HOOKS[name]()
        state = hook.init(params)
        history = []
        for grads in _grads(fddp.rank(), steps):
            mean, info = fddp.ddp_step(params, grads, compression=hook, compression_state=state, return_info=True)
            state = info.compression_state
            history.append(({k: v.clone() for k, v in mean.items()}, state.error, info.bytes_sent))
        out[name] = history
    return out


def _quantised(x: torch.Tensor, name: str, block: int = 16) -> torch.Tensor:
    """What one rank sends of ``x`` (1-D), decoded: the formats of fddp.diloco.Quantize written out."""
    n = x.numel()
    grid = torch.zeros(-(-n // block) * block, dtype=x.dtype)
    grid[:n] = x
    grid = grid.view(-1, block)
    if name == "int2":  # ternary, 1.5 x the block's mean |x|, larger values clipped
        scale = grid.abs().mean(1) * 1.5
    else:
        scale = grid.abs().amax(1)
    u = grid / scale.clamp_min(torch.finfo(x.dtype).tiny)[:, None]
    if name == "e3m0":  # the nearest of 0 and 2**-6 .. 2**0 (ties to the larger), the sign apart
        grid_values = torch.tensor([2.0**-k for k in range(7)] + [0.0], dtype=torch.float64)  # largest first: ties go up
        nearest = grid_values[(u.abs().double()[..., None] - grid_values).abs().argmin(-1)].to(x.dtype)
        values = torch.where(u < 0, -nearest, nearest) * scale[:, None]
    else:
        levels = 7 if name == "int4" else 1
        q = torch.round(u * levels).clamp(-levels, levels)
        values = q * (scale / levels)[:, None]
    return values.reshape(-1)[:n]


def _simulate_hook(name: str, world: int, steps: int) -> list:
    grads = [_grads(r, steps) for r in range(world)]
    order = ["b", "a"]  # one bucket, filled in reverse definition order
    residual = [torch.zeros(41) for _ in range(world)]
    history = []
    for t in range(steps):
        x = [torch.cat([grads[r][t][k].reshape(-1) for k in order]) + residual[r] for r in range(world)]
        if name == "topk":
            k = 5  # ceil(0.1 * 41)
            sent = []
            for r in range(world):
                keep = torch.zeros(41, dtype=torch.bool)
                keep[torch.argsort(x[r].abs(), descending=True)[:k]] = True
                sent.append(torch.where(keep, x[r], 0.0))
            nbytes = k * 4 + k * 4
        else:
            sent = [_quantised(v, name) for v in x]
            blocks = 3  # 41 values in blocks of 16
            nbytes = (blocks * 16 * (2 if name == "int2" else 4)) // 8 + blocks * 4
        total = sent[0].clone()
        for r in range(1, world):
            total = total + sent[r]
        mean = total / world
        residual = [x[r] - sent[r] for r in range(world)]
        split = lambda v: {"b": v[:20], "a": v[20:].view(3, 7)}  # noqa: E731
        history.append((split(mean), [split(r) for r in residual], nbytes))
    return history


@pytest.fixture(scope="module")
def _hook_runs():
    outs = run(_hook_worker, K, list(_HOOKS), 4)
    return {name: [o[name] for o in outs] for name in _HOOKS}


@pytest.mark.parametrize("name", list(_HOOKS))
def test_compressed_pseudo_gradients_are_the_arithmetic_written_out_to_the_bit(name, _hook_runs):
    sim = _simulate_hook(name, K, 4)
    for r, history in enumerate(_hook_runs[name]):
        for t, ((mean, error, nbytes), (mean_sim, errors_sim, nbytes_sim)) in enumerate(zip(history, sim)):
            for k in ("a", "b"):
                assert torch.equal(mean[k], mean_sim[k]), f"{name}, step {t + 1}, rank {r}: the mean of {k} differs"
                assert torch.equal(error[k], errors_sim[r][k]), f"{name}, step {t + 1}, rank {r}: the residual of {k} differs"
            # What each rank hands to the gathers: the packed codes and the scales, or k indices and values.
            assert nbytes == nbytes_sim, (name, nbytes, nbytes_sim)
    # Error feedback at work: what was not sent is carried, so the residual is not zero.
    assert any(bool(e.abs().sum() > 0) for e in _hook_runs[name][0][-1][1].values())


def test_compressions_say_what_is_wrong():
    with pytest.raises(ValueError, match="format='e3m0' takes bits in"):
        fddp.diloco.Quantize(bits=2, format="e3m0")
    with pytest.raises(ValueError, match="format must be one of"):
        fddp.diloco.Quantize(format="fp4")
    with pytest.raises(ValueError, match="fraction must be in"):
        fddp.diloco.TopK(0.0)
    assert fddp.diloco.Quantize(bits=2).format == "int" and fddp.diloco.Quantize(bits=2).scale == "mean"
    with pytest.raises(ValueError, match="eager=True .* takes no delay"):
        fddp.diloco.diloco(4, eager=True, delay=1)


# --- the outer step that never waits (eager updates): against its one-process simulator, to the bit ---

EAGER = {
    "mean": dict(every=3, steps=11),  # the default outer step: the ranks' mean
    "nesterov": dict(every=3, steps=11, outer="nesterov"),
    "fragments": dict(every=4, steps=13, fragments=2, outer="nesterov"),
    "e3m0": dict(every=3, steps=11, compression="e3m0"),
    "warm": dict(every=3, steps=11, warmup=2, outer="nesterov"),
}


def _eager_outer(cfg: dict):
    opt = fddp.optim.sgd(LR_OUT, momentum=MOMENTUM, nesterov=True) if cfg.get("outer") == "nesterov" else fddp.optim.sgd(1.0)
    compression = fddp.diloco.Quantize(bits=4, block=16) if cfg.get("compression") == "e3m0" else None
    return opt, compression


def _eager_worker(names: list[str]):
    out = {}
    for name in names:
        cfg = EAGER[name]
        opt, compression = _eager_outer(cfg)
        apply_fn, params = fddp.functionalize(_mlp())
        params = {k: v.detach().clone() for k, v in params.items()}
        inner = fddp.optim.adamw(0.05, weight_decay=0.01)
        outer = fddp.diloco.diloco(cfg["every"], opt, eager=True, fragments=cfg.get("fragments", 1), compression=compression,
                                   warmup=cfg.get("warmup", 0))  # fmt: skip
        p, s, o = params, inner.init(params), outer.init(params)
        history, waits = [], []
        for x, y in _data(fddp.rank(), cfg["steps"]):
            g = torch.func.grad(_loss, argnums=1)(apply_fn, p, x, y)
            p, s = fddp.optim.apply_gradients(inner, g, s, p)
            p, o, info = outer.step(p, o, return_info=True)
            history.append((p, o.snapshot))
            waits.append(bool(info.syncs))
        o = outer.settle(o)
        out[name] = (history, o.snapshot, waits)
    return out


def _simulate_eager(name: str, world: int):
    """Every worker in turn, with the same kernels; the eager schedule written out: at a fragment's
    launch, last round's mean steps the snapshot and the outer state; each worker then goes on from
    the snapshot stepped with its own delta / N (the outer state left as it is)."""
    cfg = EAGER[name]
    every, steps, count, warmup = cfg["every"], cfg["steps"], cfg.get("fragments", 1), cfg.get("warmup", 0)
    opt, _ = _eager_outer(cfg)
    apply_fn, params = fddp.functionalize(_mlp())
    params = {k: v.detach().clone() for k, v in params.items()}
    keys = list(params)
    fragments = [keys[:2], keys[2:]] if count == 2 else [keys]
    inner = fddp.optim.adamw(0.05, weight_decay=0.01)
    data = [_data(r, steps) for r in range(world)]
    local = [dict(params) for _ in range(world)]
    states = [inner.init(params) for _ in range(world)]
    snapshot = dict(params)
    outer_state = [opt.init({k: snapshot[k] for k in frag}) for frag in fragments]
    origin = [[{k: snapshot[k] for k in frag} for frag in fragments] for _ in range(world)]
    residual = [[torch.zeros(sum(params[k].numel() for k in frag)) for frag in fragments] for _ in range(world)]
    in_flight: list = [None] * count
    history = [[] for _ in range(world)]
    snapshots = []

    def mean_of(deltas: list[dict], f: int) -> dict:
        if cfg.get("compression") != "e3m0":
            # fddp's mean on 2 ranks: each scaled by 1/2 as it is copied into the bucket, then summed
            total = {k: deltas[0][k] * 0.5 for k in deltas[0]}
            return {k: total[k] + deltas[r][k] * 0.5 for r in range(1, world) for k in total}
        order = fragments[f][::-1]  # one bucket, filled in reverse definition order
        sent = []
        for r in range(world):
            x = torch.cat([deltas[r][k].reshape(-1) for k in order]) + residual[r][f]
            sent.append(_quantised(x, "e3m0"))
            residual[r][f] = x - sent[-1]
        total = sent[0].clone()
        for r in range(1, world):
            total = total + sent[r]
        flat, out, at = total / world, {}, 0
        for k in order:
            out[k] = flat[at : at + params[k].numel()].view(params[k].shape)
            at += params[k].numel()
        return out

    for t in range(1, steps + 1):
        for r in range(world):
            x, y = data[r][t - 1]
            g = torch.func.grad(_loss, argnums=1)(apply_fn, local[r], x, y)
            local[r], states[r] = fddp.optim.apply_gradients(inner, g, states[r], local[r])
        if t <= warmup:  # synchronous: every worker's parameters become their mean, origins too
            deltas = [{k: snapshot[k] - local[r][k] for k in keys} for r in range(world)]
            mean = mean_of(deltas, 0)
            snapshot = {k: snapshot[k] - mean[k] for k in keys}
            for r in range(world):
                local[r] = dict(snapshot)
                origin[r] = [{k: snapshot[k] for k in frag} for frag in fragments]
        else:
            for f, frag in enumerate(fragments):
                if (t - warmup - (f + 1) * every // count % every) % every:
                    continue
                if in_flight[f] is not None:  # last round's mean, one round late
                    new, outer_state[f] = fddp.optim.apply_gradients(opt, in_flight[f], outer_state[f], {k: snapshot[k] for k in frag})
                    snapshot.update(new)
                deltas = [{k: origin[r][f][k] - local[r][k] for k in frag} for r in range(world)]
                in_flight[f] = mean_of(deltas, f)  # what lands next round (the residual is kept at launch)
                for r in range(world):
                    share = {k: torch.div(deltas[r][k], world) for k in frag}
                    start_tree, _ = fddp.optim.apply_gradients(opt, share, outer_state[f], {k: snapshot[k] for k in frag})
                    local[r] = {**local[r], **start_tree}
                    origin[r][f] = dict(start_tree)
        for r in range(world):
            history[r].append((dict(local[r]), dict(snapshot)))
        snapshots.append(dict(snapshot))
    for f, frag in enumerate(fragments):  # settle: the last round lands
        if in_flight[f] is not None:
            new, outer_state[f] = fddp.optim.apply_gradients(opt, in_flight[f], outer_state[f], {k: snapshot[k] for k in frag})
            snapshot.update(new)
    return history, snapshot


@pytest.fixture(scope="module")
def _eager_runs():
    outs = run(_eager_worker, K, list(EAGER))
    return {name: [o[name] for o in outs] for name in EAGER}


@pytest.mark.parametrize("name", list(EAGER))
def test_eager_outer_step_equals_its_one_process_simulator_to_the_bit(name, _eager_runs):
    sim, sim_final = _simulate_eager(name, K)
    for r, (history, final, _) in enumerate(_eager_runs[name]):
        assert len(history) == len(sim[r])
        for t, ((p, snap), (p_sim, snap_sim)) in enumerate(zip(history, sim[r])):
            for k in p:
                assert torch.equal(p[k], p_sim[k]), f"step {t + 1}, rank {r}, params {k}: {(p[k] - p_sim[k]).abs().max()}"
                assert torch.equal(snap[k], snap_sim[k]), f"step {t + 1}, snapshot {k}: {(snap[k] - snap_sim[k]).abs().max()}"
        assert all(torch.equal(final[k], sim_final[k]) for k in final), "the settled snapshot differs"
        # The ranks' own parameters differ (each applied its own share); the snapshot is the same everywhere.
        other = _eager_runs[name][1 - r][0][-1][0]
        assert any(not torch.equal(history[-1][0][k], other[k]) for k in other)
    if name == "mean":  # launches at steps 3, 6, 9: each mean is received at the next launch, never at its own
        assert [t for t, received in enumerate(_eager_runs[name][0][2], 1) if received] == [6, 9]


def _eager_failure_worker():
    import datetime
    import time

    group = tdist.new_group(timeout=datetime.timedelta(seconds=20))  # this case leaves its group unusable
    base = fddp.optim.sgd(1.0)
    calls = [0]

    def update(grads, state, params=None, **extra):
        calls[0] += 1
        if fddp.rank() == 1 and calls[0] == 2:  # rank 1, when last round's mean lands (after its collectives)
            raise RuntimeError("injected outer failure")
        return base.update(grads, state, params)

    apply_fn, params = fddp.functionalize(_mlp())
    params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()}, group=group)
    outer = fddp.diloco.diloco(3, fddp.optim.GradientTransformation(base.init, update), eager=True, group=group)
    inner = fddp.optim.sgd(0.1)
    p, s, o = params, inner.init(params), outer.init(params)
    t0 = time.monotonic()
    try:
        for x, y in _data(fddp.rank(), 12):
            g = torch.func.grad(_loss, argnums=1)(apply_fn, p, x, y)
            p, s = fddp.optim.apply_gradients(inner, g, s, p)
            p, o = outer.step(p, o)
        return ("ok", int(o.count), time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the test reports what each rank saw
        return (type(e).__name__, str(e), time.monotonic() - t0)


def test_a_failure_inside_an_eager_sync_reaches_every_rank():
    outs = run(_eager_failure_worker, K)
    assert outs[1][0] == "RuntimeError" and "injected outer failure" in outs[1][1]
    # Rank 0 is past that step (its own share applied, its next round running): it learns at its
    # next synchronisation, from the error channel, within seconds, not at the group's timeout.
    assert outs[0][0] == "PeerError" and "rank 1" in outs[0][1], outs[0]
    assert outs[0][2] < 15, outs[0]


def test_fault_tolerance_refuses_an_outer_step_that_keeps_a_sync_in_flight():
    ft = pytest.importorskip("fddp.ft")
    replicas = type("Replicas", (), {"group": None})()  # the checks come before the replicas are used
    with pytest.raises(NotImplementedError, match="eager=True"):
        ft.FaultTolerantOuter(replicas, fddp.diloco.diloco(4, eager=True))
