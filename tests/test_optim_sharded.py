"""nanoGPT's optimizer recipe in every mode, against torch: param groups on shards, clipping, schedules.

The recipe (nanoGPT's ``configure_optimizers`` and training loop): AdamW with weight decay on the
2-D weights only (two param groups), a warmup + cosine learning rate, gradients clipped at a
global norm with the norm logged, 4 micro-batches per step, 2 ranks. Each mode is compared with
its torch reference, step for step:

- replicated (``fddp.accumulate_grads`` + ``fddp.ddp_step``): torch DDP (``no_sync`` for the
  first micro-batches) + ``torch.optim.AdamW(fused=True)`` + ``LambdaLR`` + ``clip_grad_norm_``;
- ZeRO-1 (the gradients all-reduced whole, then sharded): DDP + ``ZeroRedundancyOptimizer``;
- ZeRO-2 (``fddp.zero.ReduceScatter``): DDP + ``torch.optim.AdamW``;
- ZeRO-3 (``fddp.zero.fully_shard``): FSDP2 (``torch.distributed.fsdp.fully_shard``) + AdamW;
- DiLoCo: each rank's inner loop in torch, the pseudo-gradients all-reduced with
  ``torch.distributed`` and torch's Nesterov SGD as the outer step.

Where nothing is clipped (``max_norm`` far above the norm: the scale is exactly 1) every mode's
parameters equal torch's to the bit: two-term sums, divisions by powers of two, torch's fused
AdamW kernel per group, cut leaf-aligned on shards. Clipping on shards takes the norm as a float64
sum over the ranks where torch (DDP, FSDP2) takes per-tensor float32 norms, so there the norms
and parameters agree to rounding; replicated clipping is torch's to the bit.
"""

from __future__ import annotations

import copy

import optree
import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch import nn

import fddp
from dist import run
from models import TinyGPT

STEPS, MICRO, WARMUP, PEAK = 5, 4, 2, 3e-2
VOCAB, CONTEXT, WIDTH = 64, 6, 64
CAPS = dict(bucket_cap_mb=0.0005, first_bucket_mb=0.0002)  # ZeRO-1/2: buckets cut through leaves


def trainable(mode: str, model: nn.Module, caps: dict) -> tuple:
    """``(apply_fn, params, shards, grad_fn)`` of ``model`` trained in ``mode``: stage 3's shards
    (its params too) and a grad_and_value whose gradient shards come out averaged; else the
    broadcast params, their ZeRO-1/2 shards cut by ``caps`` (or the params, replicated), and a
    local torch.func gradient."""
    if mode == "zero3":
        apply_fn, shards = fddp.zero.fully_shard(model, min_unit_mb=0)
        return apply_fn, shards, shards, fddp.grad_and_value(lambda s, x, y: F.cross_entropy(apply_fn(s, x), y))
    apply_fn, params = fddp.functionalize(model)
    params = fddp.broadcast(params)
    shards = fddp.zero.shard(params, **caps) if mode in ("zero1", "zero2") else params
    return apply_fn, params, shards, torch.func.grad_and_value(lambda p, x, y: F.cross_entropy(apply_fn(p, x), y))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, WIDTH, 4 * WIDTH)


def _micro(step: int, m: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * m + rank)
    ids = torch.randint(0, VOCAB, (4, CONTEXT + 1), generator=g)
    return ids[:, :-1], ids[:, 1:].flatten()


SCHEDULE = fddp.optim.warmup_cosine_decay(0.0, PEAK, warmup_steps=WARMUP, decay_steps=STEPS + 1)


def _lr(step: int) -> float:
    # LambdaLR's factor on a base lr of 1: the schedule's own values (tests/test_optim.py checks
    # fddp's schedules against torch's), so that both optimizers get the same learning rates.
    return float(SCHEDULE(torch.tensor(step)))


# --- the recipe, as a user writes it -------------------------------------------------------------


def _recipe(max_norm: float):
    decay = fddp.optim.by_path(lambda path, p: p.ndim >= 2)  # no decay on biases, norms

    def make(lr):
        return fddp.optim.chain(
            fddp.optim.clip_by_global_norm(max_norm),
            fddp.optim.adamw(lr, betas=(0.9, 0.95), weight_decay=0.1, mask=decay),
        )

    return fddp.optim.inject_hyperparams(make)(lr=SCHEDULE)


def _fddp(mode: str, max_norm: float) -> tuple[dict, list[float]]:
    """``STEPS`` steps of the recipe in ``mode``; the gathered parameters and the logged norms."""
    opt = _recipe(max_norm)
    rank, norms = fddp.rank(), []
    apply_fn, params, shards, grad_fn = trainable(mode, _model(), CAPS)
    state = opt.init(shards)
    outer = fddp.diloco.diloco(3, fddp.optim.sgd(0.7, momentum=0.9, nesterov=True)) if mode == "diloco" else None
    outer_state = outer.init(params) if outer is not None else None
    for step in range(STEPS):
        acc = fddp.GradAccumulator()
        for m in range(MICRO):  # local sums only: no communication until the step
            g, _ = grad_fn(shards if mode == "zero3" else params, *_micro(step, m, rank))
            acc = fddp.accumulate_grads(acc, g)
        if mode == "replicated":
            grads = fddp.ddp_step(params, acc.mean())
        elif mode == "zero1":  # all-reduced whole, then this rank's slice: ZeRO-1
            grads = fddp.zero.shard(fddp.ddp_step(params, acc.mean()), **CAPS)
        elif mode == "zero2":  # reduce-scattered: this rank's slice of the mean
            grads = fddp.ddp_step(params, acc.mean(), compression=fddp.zero.ReduceScatter(), **CAPS)
        else:  # zero3: every micro-batch's gradient shard is already the ranks' mean; diloco: local
            grads = acc.mean()
        shards, state = fddp.optim.apply_gradients(opt, grads, state, shards)
        norms.append(float(state.inner_state[0].norm))  # the norm before clipping, as torch returns it
        assert float(fddp.optim.global_norm(grads)) == norms[-1]  # the same norm, asked for (one all-reduce on shards)
        assert float(state.hyperparams["lr"]) == _lr(step)
        if mode in ("zero1", "zero2"):
            params = fddp.zero.gather(shards).wait()
        elif mode == "diloco":
            shards, outer_state = outer.step(shards, outer_state)
            params = shards
        else:
            params = shards
    full = fddp.zero.unshard(shards) if mode == "zero3" else params
    return {k: v.detach().clone() for k, v in full.items()}, norms


# --- the references: torch's own loops ------------------------------------------------------------


def _groups(model: nn.Module) -> list[dict]:
    # nanoGPT's configure_optimizers: decay the parameters with dim >= 2, not the others.
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1.0, betas=(0.9, 0.95), fused=True)


def _torch(mode: str, max_norm: float) -> tuple[dict, list[float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    rank, norms = fddp.rank(), []
    model = _model()
    if mode == "zero3":
        mesh = init_device_mesh("cpu", (fddp.world_size(),))
        for unit in (model.tok, *model.block, model.ln, model.head):
            if any(True for _ in unit.parameters()):
                torch_fully_shard(unit, mesh=mesh)
        torch_fully_shard(model, mesh=mesh)
        net = model
    elif mode == "diloco":
        net = model  # each worker alone between the outer steps
        snapshot = copy.deepcopy(model)
        outer = torch.optim.SGD(snapshot.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    else:
        net = nn.parallel.DistributedDataParallel(model)
    if mode == "zero1":
        opt = ZeroRedundancyOptimizer(_groups(model), optimizer_class=torch.optim.AdamW, lr=1.0, betas=(0.9, 0.95), fused=True)
    else:
        opt = _adamw(_groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr)
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(MICRO):
            x, y = _micro(step, m, rank)
            if isinstance(net, nn.parallel.DistributedDataParallel) and m < MICRO - 1:
                with net.no_sync():
                    (F.cross_entropy(net(x), y) / MICRO).backward()
            else:
                (F.cross_entropy(net(x), y) / MICRO).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        sched.step()
        if mode == "diloco" and (step + 1) % 3 == 0:  # the outer step: mean pseudo-gradient, Nesterov SGD
            for s, p in zip(snapshot.parameters(), model.parameters()):
                delta = s.detach() - p.detach()
                tdist.all_reduce(delta)
                s.grad = delta / fddp.world_size()
            outer.step()
            with torch.no_grad():
                for s, p in zip(snapshot.parameters(), model.parameters()):
                    p.copy_(s)
    if mode == "zero3":
        return {k: v.full_tensor() for k, v in model.state_dict().items()}, norms
    return {k: v.detach().clone() for k, v in model.named_parameters()}, norms


def _recipe_worker(modes: tuple[str, ...], max_norms: tuple[float, ...]) -> dict:
    out = {}
    for max_norm in max_norms:
        for mode in modes:
            ours, our_norms = _fddp(mode, max_norm)
            theirs, their_norms = _torch(mode, max_norm)
            assert ours.keys() == theirs.keys(), (mode, sorted(ours), sorted(theirs))
            out[mode, max_norm] = {
                "equal": all(torch.equal(ours[k], theirs[k]) for k in theirs),
                "diff": max((ours[k] - theirs[k]).abs().max().item() for k in theirs),
                "moved": max((theirs[k] - v).abs().max().item() for k, v in _model().state_dict().items()),
                "norms": our_norms,
                "torch_norms": their_norms,
            }
    return out


MODES = ("replicated", "zero1", "zero2", "zero3", "diloco")


@pytest.fixture(scope="module")
def recipe_runs():
    # 1e9: the norm is logged but nothing is clipped; 0.5: every step clips (asserted below).
    return run(_recipe_worker, 2, MODES, (1e9, 0.5), timeout=600)


@pytest.mark.parametrize("mode", MODES)
def test_param_groups_and_schedule_equal_torch_to_the_bit_in_every_mode(mode, recipe_runs):
    for r in recipe_runs:
        res = r[mode, 1e9]
        assert res["moved"] > 1e-3, res  # the parameters trained
        # Weight decay on the matrices only, in every mode: torch's two param groups, to the bit.
        assert res["equal"] and res["diff"] == 0.0, (mode, res)
        if mode in ("replicated", "diloco"):  # replicated gradients: torch's clip_grad_norm_ arithmetic
            assert res["norms"] == res["torch_norms"], res
        else:
            for a, b in zip(res["norms"], res["torch_norms"]):
                assert abs(a - b) <= 1e-6 * b, (mode, res)  # a float64 sum over the ranks, torch's float32 norms
    if mode != "diloco":  # DiLoCo's workers step apart between their outer steps
        assert all(r[mode, 1e9] == recipe_runs[0][mode, 1e9] for r in recipe_runs)  # every rank saw the same numbers


@pytest.mark.parametrize("mode", MODES)
def test_clipping_with_the_norm_logged_in_every_mode(mode, recipe_runs):
    for r in recipe_runs:
        res = r[mode, 0.5]
        assert min(res["torch_norms"]) > 0.5, res  # every step clipped
        if mode in ("replicated", "diloco"):
            assert res["equal"] and res["norms"] == res["torch_norms"], (mode, res)  # clip_grad_norm_ to the bit
        else:
            for a, b in zip(res["norms"], res["torch_norms"]):
                assert abs(a - b) <= 1e-6 * b, (mode, res)
            assert res["diff"] <= 1e-6, (mode, res)  # the scale differs by rounding


# --- one process: groups on shards, the errors -------------------------------------------------------


def test_groups_on_shards_equal_the_replicated_groups_at_one_rank():
    fddp.init()
    _, params = fddp.functionalize(_model())
    params = {k: v.detach().clone() for k, v in params.items()}
    decay = fddp.optim.by_path(lambda path, p: p.ndim >= 2)
    makers = {
        "adamw_mask": lambda: fddp.optim.adamw(1e-2, weight_decay=0.1, mask=decay),
        "sgd_mask": lambda: fddp.optim.sgd(0.05, momentum=0.9, weight_decay=0.1, mask=decay),
        "multi_transform": lambda: fddp.optim.multi_transform(
            {"matrix": fddp.optim.adamw(1e-2, weight_decay=0.1), "vector": fddp.optim.sgd(0.05), "frozen": fddp.optim.set_to_zero()},
            fddp.optim.by_path(lambda path, p: "frozen" if path.startswith("tok.") else "matrix" if p.ndim >= 2 else "vector"),
        ),
        "labels_tree": lambda: fddp.optim.adamw(1e-2, weight_decay=0.1, mask={k: k.startswith("block.") for k in params}),
        "labels_function": lambda: fddp.optim.adamw(1e-2, weight_decay=0.1, mask=lambda p: {k: v.ndim >= 2 for k, v in p.items()}),
        "inject": lambda: fddp.optim.inject_hyperparams(fddp.optim.adamw)(lr=1e-2, weight_decay=0.1, mask=decay),
    }
    for name, make in makers.items():
        for fused in (False, True):
            opt = make()
            p, s = params, opt.init(params)
            sh = fddp.zero.shard(params, **CAPS)
            ss = opt.init(sh)
            assert any(len(pieces) > 1 for pieces in sh.split.pieces)  # shards that hold several leaves
            for _ in range(3):
                g = {k: torch.randn_like(v) for k, v in params.items()}
                gs = fddp.zero.shard(g, **CAPS)
                if fused:
                    p, s = fddp.optim.apply_gradients(opt, g, s, p)
                    before = [t.clone() for t in optree.tree_leaves((sh, ss))]
                    new_sh, new_ss = fddp.optim.apply_gradients(opt, gs, ss, sh)
                    assert all(torch.equal(a, b) for a, b in zip(before, optree.tree_leaves((sh, ss))))  # pure
                    sh, ss = new_sh, new_ss
                else:
                    u, s = opt.update(g, s, p)
                    p = fddp.optim.apply_updates(p, u)
                    u, ss = opt.update(gs, ss, sh)
                    sh = fddp.optim.apply_updates(sh, u)
            full = fddp.zero.gather(sh).wait()
            assert all(torch.equal(full[k], p[k]) for k in p), (name, fused)
            assert all(torch.equal(t[c.held :], torch.zeros_like(t[c.held :])) for t, c in zip(sh.shards, sh.layout.cuts))
            if name == "multi_transform":
                assert torch.equal(full["tok.weight"], params["tok.weight"])  # frozen
    # Donated: the groups step the shards and the state in place, and equal torch's fused kernel.
    opt = makers["adamw_mask"]()
    p = {k: v.clone() for k, v in params.items()}
    s, sh = opt.init(p), fddp.zero.shard(params, **CAPS)
    ss = opt.init(sh)
    for _ in range(3):
        g = {k: torch.randn_like(v) for k, v in params.items()}
        p, s = fddp.optim.apply_gradients(opt, g, s, p, donate=True)
        held = [t.data_ptr() for t in optree.tree_leaves((sh, ss.exp_avg))]
        sh, ss = fddp.optim.apply_gradients(opt, fddp.zero.shard(g, **CAPS), ss, sh, donate=True)
        assert [t.data_ptr() for t in optree.tree_leaves((sh, ss.exp_avg))] == held
    full = fddp.zero.gather(sh).wait()
    assert all(torch.equal(full[k], p[k]) for k in p)


def test_group_states_on_shards_checkpoint_and_reshard_like_any_sharded_tree(tmp_path):
    fddp.init()
    _, params = fddp.functionalize(_model())
    params = {k: v.detach().clone() for k, v in params.items()}
    decay = fddp.optim.by_path(lambda path, p: p.ndim >= 2)
    opt = fddp.optim.chain(
        fddp.optim.clip_by_global_norm(1.0),
        fddp.optim.multi_transform({True: fddp.optim.adamw(1e-2, weight_decay=0.1, mask=decay), False: fddp.optim.sgd(0.1)}, decay),
    )
    sh = fddp.zero.shard(params, **CAPS)
    state = opt.init(sh)
    g = fddp.zero.shard({k: torch.randn_like(v) for k, v in params.items()}, **CAPS)
    sh, state = fddp.optim.apply_gradients(opt, g, state, sh)
    fddp.checkpoint.save_sharded(str(tmp_path / "ck"), {"params": sh, "opt": state})
    like = {"params": fddp.zero.shard(params), "opt": opt.init(fddp.zero.shard(params))}  # another bucket layout
    back = fddp.checkpoint.load_sharded(str(tmp_path / "ck"), like)
    a, b = opt.update(g, state, sh)[0], None
    g2 = fddp.zero.shard(fddp.zero.gather(g).wait())
    b = opt.update(g2, back["opt"], back["params"])[0]
    full_a, full_b = fddp.zero.gather(a).wait(), fddp.zero.gather(b).wait()
    assert all(torch.equal(full_a[k], full_b[k]) for k in full_a)
    assert float(back["opt"][0].norm) == float(state[0].norm) > 0


def test_groups_on_shards_errors_name_the_whole_leaf():
    fddp.init()
    _, params = fddp.functionalize(_model())
    sh = fddp.zero.shard({k: v.detach() for k, v in params.items()}, **CAPS)
    opt = fddp.optim.multi_transform({"a": fddp.optim.sgd(0.1)}, fddp.optim.by_path(lambda path, p: "b" if path == "head.bias" else "a"))
    with pytest.raises(ValueError, match=r"leaf 'head.bias' has the label 'b'"):
        opt.init(sh)
    with pytest.raises(ValueError, match="labels are those of the whole parameters"):
        fddp.optim.adamw(mask={"w": True}).init(sh)
    nested = {"shards": sh, "step": torch.zeros(())}
    with pytest.raises(TypeError, match="below its root"):
        fddp.optim.adamw(mask=True).update(optree.tree_map(torch.zeros_like, nested), fddp.optim.adamw().init(nested), nested)
