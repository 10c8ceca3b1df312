"""The GPU path's checks, one process per GPU under torchrun: NCCL groups, CUDA buckets, CUDA casts.

    torchrun --standalone --nproc-per-node=1 tests/cuda_checks.py --device cuda --out DIR

Each check compares fddp on ``--device`` with a reference someone else wrote where there is one
(torch DDP with the same comm hook, on the same device and backend) or with fddp's own CPU path
(PowerSGD: the same arithmetic on another device). ``tests/test_cuda.py`` launches this script
once and reports every check as its own test; ``tools/gpu_check.sh`` runs those tests. With
``--device cpu`` the same checks run on gloo (``tests/test_cuda.py`` does that in every suite run,
two ranks), so that the code a GPU machine runs has run before it gets there; the checks that only
mean something on a GPU (a pure-NCCL group, torch.compile's CUDA kernels) say so and are skipped.

Equality is exact (``torch.equal``) where the arithmetic is: on one or two ranks a mean is
``g / n`` summed, with ``n`` a power of two, so neither the order of the sum nor the bucket layout
changes a bit. Each rank writes ``DIR/rank<r>.json``: per check, ``"ok"``, ``"skipped: why"`` or
the traceback.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import traceback
from typing import Callable

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fddp

CHECKS: dict[str, Callable[[torch.device], str | None]] = {}


class Skip(Exception):
    """A check that does not apply on this device."""


def check(fn: Callable[[torch.device], None]) -> Callable[[torch.device], None]:
    CHECKS[fn.__name__] = fn
    return fn


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(device: torch.device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)


def _params(model: nn.Module) -> collections.OrderedDict:
    return collections.OrderedDict((k, v.detach().clone()) for k, v in model.named_parameters())


def _loss_fn(apply_fn):
    return lambda p, x, y: F.cross_entropy(apply_fn(p, x), y)


def _ddp(model: nn.Module, device: torch.device) -> nn.parallel.DistributedDataParallel:
    ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model.to(device), device_ids=ids)


def _assert_equal(a: dict, b: dict, what: str) -> None:
    for k in b:
        assert a[k].device == b[k].device, f"{what}: {k} on {a[k].device}, expected {b[k].device}"
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs by {(a[k] - b[k]).abs().max().item():.3g}"


def _ddp_grads(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    ddp.zero_grad()
    F.cross_entropy(ddp(x), y).backward()
    return {n: p.grad.clone() for n, p in ddp.module.named_parameters()}


def _without_host_syncs(step: Callable, carry: object, steps: int = 6, learn: int = 3) -> object:
    """``carry = step(carry)``, ``steps`` times; every step from the ``learn``-th on (the first
    ones learn their signatures) under ``torch.cuda.set_sync_debug_mode("error")``, which raises
    at any call that makes the host wait for the GPU."""
    for i in range(steps):
        torch.cuda.set_sync_debug_mode("error" if i >= learn else 0)
        try:
            carry = step(carry)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return carry


@check
def init_picks_the_backend_and_device(device: torch.device) -> None:
    """fddp.init chose NCCL for CUDA tensors (gloo on a CPU machine) and the GPU of LOCAL_RANK."""
    backend = str(dist.get_backend())
    if device.type == "cuda":
        assert "nccl" in backend, backend
        assert torch.cuda.current_device() == fddp.local_rank(), (torch.cuda.current_device(), fddp.local_rank())
        # "cpu:gloo,cuda:nccl" is an NCCL group to fddp: its waits must not take a timeout (torch's
        # NCCL wait with one blocks the host until the GPU is done), and its heads travel apart.
        from fddp._dist import _waits

        assert not _waits.sliced(None), backend
        if fddp.world_size() > 1:
            assert _waits.batched(None), backend
    else:
        assert backend == "gloo", backend
    assert fddp.device().type == device.type, (fddp.device(), device)


@check
def ddp_step_equals_torch_ddp(device: torch.device) -> None:
    """fddp.ddp_step of CUDA gradients: CUDA buckets, one NCCL all-reduce each, DDP's mean to the bit."""
    ddp = _ddp(_model(), device)
    apply_fn, _ = fddp.functionalize(_model())
    for step in range(3):
        x, y = _batch(device, 10 * step + fddp.rank())
        params = _params(ddp.module)
        local = torch.func.grad(_loss_fn(apply_fn))(params, x, y)
        grads, info = fddp.ddp_step(params, local, return_info=True)
        _assert_equal(grads, _ddp_grads(ddp, x, y), f"step {step}")
        assert info.collectives >= 1, info
        with torch.no_grad():
            for p in ddp.module.parameters():
                p -= 0.1 * p.grad


@check
def grad_and_value_equals_ddp_step(device: torch.device) -> None:
    """The overlapped path (all-reduces started inside backward, on CUDA streams) equals ddp_step."""
    apply_fn, params = fddp.functionalize(_model().to(device))
    loss_fn = _loss_fn(apply_fn)
    x, y = _batch(device, fddp.rank())
    grads, loss = fddp.grad_and_value(loss_fn)(params, x, y)
    expected = fddp.ddp_step(params, torch.func.grad(loss_fn)(params, x, y))
    _assert_equal(grads, expected, "grad_and_value")
    assert torch.equal(loss, loss_fn(params, x, y)), "the loss is this rank's"


@check
def cast_equals_torch_compress_hooks(device: torch.device) -> None:
    """fddp.Cast (compression="bf16"/"fp16") equals torch's bf16/fp16 compress hooks on DDP."""
    hooks = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
    if device.type == "cpu":
        # DDP refuses a hook named bf16_compress_hook without CUDA and NCCL; gloo reduces bf16 on
        # the CPU, so call torch's hook, unchanged, under another name (as tests/test_compress.py).
        hooks["bf16"] = lambda group, bucket: default_hooks.bf16_compress_hook(group, bucket)
    apply_fn, _ = fddp.functionalize(_model())
    for name, hook in hooks.items():
        ddp = _ddp(_model(), device)
        ddp.register_comm_hook(None, hook)
        for step in range(2):
            x, y = _batch(device, 10 * step + fddp.rank())
            params = _params(ddp.module)
            local = torch.func.grad(_loss_fn(apply_fn))(params, x, y)
            grads, info = fddp.ddp_step(params, local, compression=name, return_info=True)
            _, plain = fddp.ddp_step(params, local, return_info=True)
            _assert_equal(grads, _ddp_grads(ddp, x, y), f"{name} step {step}")
            assert info.bytes_sent * 2 == plain.bytes_sent, (name, info.bytes_sent, plain.bytes_sent)
            exact = fddp.ddp_step(params, local)
            assert any(not torch.equal(grads[k], exact[k]) for k in exact), f"{name}: no rounding happened"
            with torch.no_grad():
                for p in ddp.module.parameters():
                    p -= 0.1 * p.grad


@check
def powersgd_on_the_device_matches_the_cpu(device: torch.device) -> None:
    """fddp.PowerSGD on CUDA computes what it computes on the CPU (its state, seeded the same,
    stays on the device; matmul and QR kernels differ, so to float rounding)."""
    if device.type == "cpu":
        raise Skip("compares CUDA with the CPU")
    apply_fn, _ = fddp.functionalize(_model())
    base = _params(_model())
    hook = fddp.PowerSGD(rank=2, start_iter=1)
    here = {k: v.to(device) for k, v in base.items()}
    states = {"cpu": hook.init(base), "dev": hook.init(here)}
    for step in range(3):
        x, y = _batch(torch.device("cpu"), 10 * step + fddp.rank())
        local = torch.func.grad(_loss_fn(apply_fn))(base, x, y)
        cpu, info_cpu = fddp.ddp_step(base, local, compression=hook, compression_state=states["cpu"], return_info=True)
        dev_local = {k: v.to(device) for k, v in local.items()}
        dev, info_dev = fddp.ddp_step(here, dev_local, compression=hook, compression_state=states["dev"], return_info=True)
        states = {"cpu": info_cpu.compression_state, "dev": info_dev.compression_state}
        for k in cpu:
            assert dev[k].device.type == device.type, (k, dev[k].device)
            err = (dev[k].cpu() - cpu[k]).abs().max().item()
            assert err <= 1e-4 * max(cpu[k].abs().max().item(), 1e-12), (step, k, err)
        for leaf in optree.tree_leaves(states["dev"]):
            if isinstance(leaf, torch.Tensor) and leaf.numel() > 1:
                assert leaf.device.type == device.type, f"PowerSGD state left on {leaf.device}"


@check
def zero_reduce_scatter_equals_replicated(device: torch.device) -> None:
    """fddp.zero on CUDA (reduce-scatter, the default for CUDA buckets; all-gather into the
    parameters) takes the replicated path's AdamW steps to the bit."""
    apply_fn, params = fddp.functionalize(_model().to(device))
    params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()})
    loss_fn = _loss_fn(apply_fn)
    opt = fddp.optim.adamw(1e-2, weight_decay=0.1)
    full, full_state = params, opt.init(params)
    shards = fddp.zero.shard(params)
    shard_state = opt.init(shards)
    step = fddp.grad_and_value(loss_fn, compression=fddp.zero.ReduceScatter())
    for i in range(3):
        x, y = _batch(device, 10 * i + fddp.rank())
        grads, _ = fddp.grad_and_value(loss_fn)(full, x, y)
        full, full_state = fddp.optim.apply_gradients(opt, grads, full_state, full)
        shard_grads, _ = step(params, x, y)
        shards, shard_state = fddp.optim.apply_gradients(opt, shard_grads, shard_state, shards)
        params = fddp.zero.gather(shards).wait()
        _assert_equal(params, full, f"step {i}")


@check
def broadcast_sync_buffers_and_verify_replicas(device: torch.device) -> None:
    """Rank 0's values reach every rank; BatchNorm's running statistics are averaged; replicas agree."""
    torch.manual_seed(fddp.rank())  # different on every rank until broadcast
    model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8)).to(device)
    _, params, buffers = fddp.functionalize_with_buffers(model)
    params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()})
    fddp.verify_replicas(params)
    gathered = [torch.empty_like(params["0.weight"]) for _ in range(fddp.world_size())]
    dist.all_gather(gathered, params["0.weight"].contiguous())
    assert all(torch.equal(g, gathered[0]) for g in gathered), "broadcast left the ranks different"
    floats = {k: v.detach().clone() + fddp.rank() for k, v in buffers.items() if v.is_floating_point()}
    mean = fddp.sync_buffers(floats, mode="mean")
    for k, v in floats.items():
        expected = v - fddp.rank() + (fddp.world_size() - 1) / 2
        assert mean[k].device == v.device and torch.allclose(mean[k], expected, rtol=0, atol=1e-6), k


@check
def a_pure_nccl_group_carries_fddps_own_collectives(device: torch.device) -> None:
    """On a group that is NCCL only (no gloo beside it), fddp's signature agreement and checksums
    must travel as CUDA tensors: ddp_step, broadcast and verify_replicas on such a group."""
    if device.type == "cpu":
        raise Skip("needs NCCL")
    group = dist.new_group(backend="nccl")
    apply_fn, params = fddp.functionalize(_model().to(device))
    params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()}, group=group)
    fddp.verify_replicas(params, group=group)
    x, y = _batch(device, fddp.rank())
    local = torch.func.grad(_loss_fn(apply_fn))(params, x, y)
    _assert_equal(fddp.ddp_step(params, local, group=group), fddp.ddp_step(params, local), "nccl-only group")
    dist.destroy_process_group(group)


@check
def no_host_sync_per_step(device: torch.device) -> None:
    """Steady-state steps never make the host wait for the GPU (torch DDP's steps do not):
    grad_and_value, apply_gradients with clipping, apply_if_finite and ddp_step, on the default
    group and on a pure NCCL group (whose headers travel on a gloo side group), under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises at any synchronising call."""
    if device.type == "cpu":
        raise Skip("needs CUDA (tests/test_control.py counts the host reads on the CPU)")
    nccl = dist.new_group(backend="nccl")
    for group in (None, nccl):
        apply_fn, params = fddp.functionalize(_model().to(device))
        params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()}, group=group)
        opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(1e-3))
        state = opt.init(params)
        gv = fddp.grad_and_value(_loss_fn(apply_fn), group=group, return_info=True, check_finite=True)
        x, y = _batch(device, fddp.rank())

        def step(carry, gv=gv, opt=opt, x=x, y=y, group=group):
            params, state = carry
            grads, _, info = gv(params, x, y)
            new = fddp.optim.apply_gradients(opt, grads, state, params)
            params, state = fddp.apply_if_finite(info.finite, new, (params, state))
            fddp.ddp_step(params, grads, group=group)
            return params, state

        _without_host_syncs(step, (params, state))  # the first steps learn their signatures and compare the replicas
        torch.cuda.synchronize()
    dist.destroy_process_group(nccl)


@check
def known_calls_are_checked_in_a_batch(device: torch.device) -> None:
    """On NCCL a known call sends no head: ddp_step and psum join the group's batch, checked by
    one head that apply_gradients sends (and reads at the next step's), on the gloo side group
    (``tests/test_control.py`` runs the same on gloo, made NCCL-like)."""
    if device.type == "cpu":
        raise Skip("needs NCCL (tests/test_control.py emulates it on gloo)")
    if fddp.world_size() == 1:
        raise Skip("needs 2 GPUs: a one-rank group checks nothing across ranks")
    from fddp._dist import _groups

    apply_fn, params = fddp.functionalize(_model().to(device))
    params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()})
    opt = fddp.optim.sgd(1e-2)
    state = opt.init(params)
    x, y = _batch(device, fddp.rank())
    local = torch.func.grad(_loss_fn(apply_fn))(params, x, y)
    st = _groups.state(None)
    batched = []
    for _ in range(4):  # the first calls learn their signatures (and wait for their heads)
        grads = fddp.ddp_step(params, local)
        fddp.psum({"n": torch.ones((), device=device)})
        batched.append(len(st.unheaded))
        params, state = fddp.optim.apply_gradients(opt, grads, state, params)
        batched.append((len(st.unheaded), st.pending is not None))
    assert batched[-2:] == [2, (0, True)], batched
    fddp._dist.settle("the check", final=True)
    assert st.pending is None and not st.unheaded


@check
def a_stamp_is_read_on_the_device(device: torch.device) -> None:
    """A batched call's stamp (``fddp._dist.stamp``, an NCCL group's known calls) rides in the
    call's first all-reduce and its verdict stays on the device: the sum is unchanged where every
    rank sent the same stamp, and no value of it is finite where the stamps' sums fall short of
    what each rank expects (told here that there is one rank more than there is), with no host
    sync either way (on a GPU: under sync debug mode "error"). One GPU is enough."""
    from fddp.sync._comm import Comm

    n, r = fddp.world_size(), fddp.rank()
    for world, agrees in ((n, True), (n + 1, False)):
        t = torch.arange(8.0, device=device) * (r + 1)
        comm = Comm(None, "the check", None)  # type: ignore[arg-type] - no bucket plan, as fddp.psum's
        comm.world_size = world
        comm.stamp(0x5A5A5A5A)  # every chunk non-zero, so a missing rank changes every sum
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            comm.wait(comm.all_reduce(t), "the stamped all-reduce")
            comm.poison([t])
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        if agrees:
            assert torch.equal(t, torch.arange(8.0, device=device) * (n * (n + 1) // 2)), t
        else:
            assert not torch.isfinite(t).any(), t
        # Freed with its last reference, not at a garbage collection: a cycle through the stamped
        # work kept every call's copy of its first bucket alive until one.
        import gc
        import weakref

        gone = weakref.ref(comm)
        gc.disable()
        try:
            del comm
            assert gone() is None, "a Comm whose all-reduce carried a stamp outlived its last reference (a reference cycle)"
        finally:
            gc.enable()


@check
def the_host_runs_ahead_of_a_busy_gpu(device: torch.device) -> None:
    """A steady-state step (grad_and_value, ddp_step, psum, apply_gradients) returns on the host
    while the GPU is still busy with work queued before it: its collectives are only ordered on
    the stream, never waited for by the host. Fails where a wait takes a timeout (torch's NCCL
    wait then blocks the host until the GPU is done: fddp did so on the default group, a mixed
    "cpu:gloo,cuda:nccl" one, until it read that group as NCCL's), or where a head is read back
    from the GPU."""
    if device.type == "cpu":
        raise Skip("needs CUDA (tests/test_control.py makes gloo's collectives late, NCCL-like)")
    import time

    apply_fn, params = fddp.functionalize(_model().to(device))
    params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()})
    opt = fddp.optim.sgd(1e-2)
    state = opt.init(params)
    gv = fddp.grad_and_value(_loss_fn(apply_fn))
    x, y = _batch(device, fddp.rank())

    def step(params, state):
        grads, _ = gv(params, x, y)
        grads = fddp.ddp_step(params, grads)
        fddp.psum({"n": torch.ones((), device=device)})
        return fddp.optim.apply_gradients(opt, grads, state, params)

    for _ in range(3):  # the first calls learn their signatures (and wait for their heads)
        params, state = step(params, state)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.monotonic()
    torch.cuda._sleep(int(2e9))  # about a second of GPU cycles, queued ahead of the step
    params, state = step(params, state)
    host = time.monotonic() - t0
    torch.cuda.synchronize()
    gpu = time.monotonic() - t0
    assert gpu > 0.3 and host < 0.25 * gpu, f"the host returned after {host:.3f} s; the GPU finished after {gpu:.3f} s"


@check
def sharded_steps_never_sync_the_host(device: torch.device) -> None:
    """ZeRO-2 on the default group (a mixed "cpu:gloo,cuda:nccl" one from fddp.init): steady-state
    steps with clip_by_global_norm (a sharded sum of squares), check_finite (every rank's verdict)
    and Muon's owner exchange make no synchronising call. Before fddp._dist.data_device, those small
    all-reduces went to the CPU (the group's gloo side): a copy to the host, a sync, every step;
    SyncBatchNorm's count slot was a synced copy from the host, and its every layer a host-blocking head."""
    if device.type == "cpu":
        raise Skip("needs CUDA (sync debug mode)")
    model = fddp.sync_batchnorm(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))).to(device)
    apply_fn, params = fddp.functionalize(model)
    params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()})
    shards = fddp.zero.shard(params)
    opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.muon(1e-2))
    state = opt.init(shards)
    step = fddp.grad_and_value(_loss_fn(apply_fn), compression=fddp.zero.ReduceScatter(), return_info=True, check_finite=True)
    x = torch.randn(12, 8, device=device)
    y = torch.randint(0, 4, (12,), device=device)

    def one(carry):
        shards, state = carry
        grads, _, info = step(fddp.zero.gather(shards).wait(), x, y)
        return fddp.optim.apply_gradients(opt, grads, state, shards)

    _without_host_syncs(one, (shards, state))


@check
def loss_scaling_and_plain_sgd_never_sync_the_host(device: torch.device) -> None:
    """DynamicLossScale with its default (CPU) state, and sgd's update + apply_updates, over
    steady-state steps under sync debug mode: the scale reaches the GPU without a synced copy
    (update moves the state to the verdict's device once), and sgd's lr is a fill, not a copy."""
    if device.type == "cpu":
        raise Skip("needs CUDA (sync debug mode)")
    apply_fn, params = fddp.functionalize(_model().to(device))
    params = fddp.broadcast({k: v.detach().clone() for k, v in params.items()})
    scaler = fddp.DynamicLossScale()
    ls = scaler.init()
    opt = fddp.optim.sgd(1e-2, momentum=0.9)
    state = opt.init(params)
    gv = fddp.grad_and_value(lambda p, x, y, ls: scaler.scale_loss(ls, _loss_fn(apply_fn)(p, x, y)), return_info=True, check_finite=True)
    x, y = _batch(device, fddp.rank())

    def step(carry):
        params, state, ls = carry
        grads, _, info = gv(params, x, y, ls)
        grads = scaler.unscale_grads(ls, grads)
        updates, new_state = opt.update(grads, state, params)
        params, state = fddp.apply_if_finite(info.finite, (fddp.optim.apply_updates(params, updates), new_state), (params, state))
        return params, state, scaler.update(ls, info.finite)

    _, _, ls = _without_host_syncs(step, (params, state, ls), steps=5, learn=2)
    assert ls.scale.device == device, ls.scale.device


@contextlib.contextmanager
def _weights_read_on_the_device():
    """On the CPU, take the path of a weight (and weight sum) that the host cannot read: a GPU's."""
    from fddp.sync import _comm, _differentiable, _setup, hooks

    modules = (_comm, _differentiable, _setup, hooks)
    saved = [m.on_host for m in modules]
    for m in modules:
        m.on_host = lambda t: False
    try:
        yield
    finally:
        for m, f in zip(modules, saved):
            m.on_host = f


@check
def weighted_steps_never_sync_the_host(device: torch.device) -> None:
    """ddp_step(weight=) with the weight a tensor on the device (a sample count the GPU counted)
    and a Python number; float32 buckets, bf16 ones, and compression="bf16": steady-state steps
    make no synchronising call (the weight went to the host, and the weight sum came back, every
    call until fddp kept them on the device). The weighted mean equals torch.distributed's
    all-reduce of ``w_r g_r`` (``w_r / W g_r`` rounded to bf16 where bf16 travels), divided by
    that of ``w_r``, to the bit on one or two ranks, a rank with weight 0 and NaN gradients
    included; ``info.weight`` is the weight sum, on the device. A negative weight on the device
    makes the mean NaN on every rank. On the CPU the same steps run without sync debug mode,
    once as they run there and once forced down the GPU's path (a CPU weight raises at a negative
    value: tests/test_errors.py)."""
    n, r = fddp.world_size(), fddp.rank()
    trees = {"float32": _params(_model().to(device))}
    trees["bfloat16"] = collections.OrderedDict((k, v.bfloat16()) for k, v in trees["float32"].items())
    calls = [("float32", None), ("float32", "bf16"), ("bfloat16", None)]  # the weight rides in bucket 0; travels alone; alone
    caps = dict(bucket_cap_mb=0.004, first_bucket_mb=0.001)  # a few buckets
    steps = 6
    counts = [float((r + i) % 3) for i in range(steps)]  # 0 on a rank every third step (on one rank: W = 0, the mean 0)
    grads = []
    for i, c in enumerate(counts):
        gen = torch.Generator().manual_seed(100 * i + r)
        g = collections.OrderedDict((k, torch.randn(v.shape, generator=gen)) for k, v in trees["float32"].items())
        g = {t: collections.OrderedDict((k, (v if c else torch.full_like(v, float("nan"))).to(device, getattr(torch, t)))
                                        for k, v in g.items()) for t in trees}  # fmt: skip
        grads.append(g)
    # Made before sync debug mode: a copy to the GPU syncs.
    on_device = [torch.tensor(c, device=device) for c in counts]
    negative = torch.tensor(-1.0 if r == 0 else 1.0, device=device)

    def step(carry: tuple, device_path: bool = True) -> tuple:
        out, i = carry
        for weight in (on_device[i], counts[i]):
            for t, compression in calls:
                g, info = fddp.ddp_step(trees[t], grads[i][t], weight=weight, compression=compression, return_info=True, check_finite=True,
                                        **caps)  # fmt: skip
                out.append((i, compression, g, info, grads[i][t]))
        if device_path:  # a weight the host reads is refused at once instead
            g, info = fddp.ddp_step(trees["float32"], grads[i]["float32"], weight=negative, return_info=True, check_finite=True, **caps)
            out.append((i, "negative", g, info, None))
        return out, i + 1

    if device.type == "cuda":
        runs = [_without_host_syncs(step, ([], 0), steps=steps)[0]]
    else:
        runs = [functools.reduce(lambda c, _: step(c, device_path=False), range(steps), ([], 0))[0]]
        with _weights_read_on_the_device():
            runs.append(functools.reduce(lambda c, _: step(c), range(steps), ([], 0))[0])
    for out in runs:
        for i, compression, g, info, local in out:
            what = f"step {i}, compression={compression}" + (f", {next(iter(local.values())).dtype}" if local else "")
            if compression == "negative":
                assert not bool(info.finite) and torch.isnan(info.weight) and all(torch.isnan(v).all() for v in g.values()), what
                continue
            w = torch.tensor([counts[i]], dtype=torch.float64, device=device)
            dist.all_reduce(w)
            scale = counts[i] / max(float(w), torch.finfo(torch.float64).tiny)
            mean = collections.OrderedDict()
            for k, v in local.items():
                low = compression == "bf16" or v.dtype == torch.bfloat16  # sent as w_r / W * g_r in bf16
                m = torch.zeros_like(v, dtype=torch.bfloat16 if low else v.dtype) if counts[i] == 0 else (
                    (v.float() * scale).bfloat16() if low else v * counts[i])  # fmt: skip
                dist.all_reduce(m)
                # Divided by a tensor: CUDA's division by a Python number multiplies by its reciprocal.
                mean[k] = m.to(v.dtype) if low else m.div_(w[0].clamp_min(torch.finfo(v.dtype).tiny).to(v.dtype))
            assert info.weight.device.type == device.type and float(info.weight) == float(w), (what, info.weight)
            assert bool(info.finite), what
            if n <= 2:  # two summands: the same sum in any order
                _assert_equal(g, mean, what)
            else:
                for k in mean:
                    torch.testing.assert_close(g[k], mean[k], rtol=2e-2, atol=2e-2, msg=lambda m, k=k: f"{what}, {k}: {m}")


@check
def elementwise_optimizers_never_sync_the_host(device: torch.device) -> None:
    """rmsprop, adagrad, nadam, radam and adafactor's apply_gradients, with a constant lr and with
    a schedule's: steady-state steps make no synchronising call (on a GPU their scalars, and
    adafactor's norms, stay on the device, where the CPU reads the count as torch.optim does),
    and the parameters agree with torch.optim's (foreach=False, on the same device) to float
    rounding. On the CPU the check runs that same device path, forced, without sync debug mode
    (``tests/test_optim_on_device.py`` checks its numbers there to the bit)."""
    from fddp.optim import _elementwise as ew

    cases = [
        (fddp.optim.rmsprop, torch.optim.RMSprop, dict(momentum=0.9, centered=True, weight_decay=0.1)),
        (fddp.optim.adagrad, torch.optim.Adagrad, dict(lr_decay=0.01, weight_decay=0.1)),
        (fddp.optim.nadam, torch.optim.NAdam, dict(weight_decay=0.1, decoupled_weight_decay=True)),
        (fddp.optim.radam, torch.optim.RAdam, dict(weight_decay=0.1)),
        (fddp.optim.adafactor, torch.optim.Adafactor, dict(weight_decay=0.1)),
    ]
    schedule = fddp.optim.linear(1e-2, 1e-3, transition_steps=4)
    steps = 6
    shapes = {k: v.shape for k, v in _model().named_parameters()}
    gens = [torch.Generator().manual_seed(i) for i in range(steps)]
    grads = [collections.OrderedDict((k, torch.randn(s, generator=g).to(device)) for k, s in shapes.items()) for g in gens]

    def step(carry, opt):
        params, state, i = carry
        return (*fddp.optim.apply_gradients(opt, grads[i], state, params), i + 1)

    on_host = ew.on_host
    if device.type == "cpu":
        ew.on_host = lambda count: False  # the path a GPU takes
    try:
        for make, T, kw in cases:
            for lr in (1e-2, schedule):
                model = _model().to(device)
                opt = make(lr, **kw)
                params = _params(model)
                carry = (params, opt.init(params), 0)
                if device.type == "cuda":
                    carry = _without_host_syncs(functools.partial(step, opt=opt), carry, steps=steps, learn=2)
                else:
                    for _ in range(steps):
                        carry = step(carry, opt)
                params = carry[0]
                topt = T(model.parameters(), lr=1e-2, foreach=False, **kw)
                for i in range(steps):
                    for g in topt.param_groups:
                        g["lr"] = float(lr(torch.tensor(i))) if callable(lr) else lr
                    for k, p in model.named_parameters():
                        p.grad = grads[i][k].clone()
                    topt.step()
                for k, p in model.named_parameters():
                    what = f"{T.__name__}, lr {lr}, {k}"
                    torch.testing.assert_close(params[k], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")
    finally:
        ew.on_host = on_host


@check
def compiled_step_matches_eager(device: torch.device) -> None:
    """torch.compile of torch.func.grad + fddp.ddp_step, CUDA kernels (Triton), against eager;
    also weighted, the weight a tensor on the GPU."""
    if device.type == "cpu":
        raise Skip("the CPU's compiled step is tests/test_transforms.py's (weighted: tests/test_grad.py's)")
    apply_fn, params = fddp.functionalize(_model().to(device))
    loss_fn = _loss_fn(apply_fn)

    def sync(p, x, y, weight=None):
        return fddp.ddp_step(p, torch.func.grad(loss_fn)(p, x, y), weight=weight)

    x, y = _batch(device, fddp.rank())
    weight = torch.tensor(1.0 + 2 * fddp.rank(), device=device)
    for args in ((params, x, y), (params, x, y, weight)):
        compiled = torch.compile(sync)(*args)
        eager = sync(*args)
        for k in eager:
            torch.testing.assert_close(compiled[k], eager[k], rtol=1e-5, atol=1e-6)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], required=True)
    p.add_argument("--out", required=True, help="a directory for rank<r>.json")
    p.add_argument("--only", nargs="*", default=None, help="run only these checks")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    torch.set_num_threads(1)
    fddp.init(backend=None if args.device == "cuda" else "gloo", timeout=120)
    device = fddp.device() if args.device == "cuda" else torch.device("cpu")
    results = {}
    for name, fn in CHECKS.items():
        if args.only is not None and name not in args.only:
            continue
        try:
            fn(device)
            results[name] = "ok"
        except Skip as e:
            results[name] = f"skipped: {e}"
        except Exception:  # noqa: BLE001 - reported per check; the others still run
            results[name] = traceback.format_exc()
        fddp.clear_caches()
        # A check that failed on one rank may have left the others mid-collective: they time out
        # (timeout above) and report that, rather than run the next check out of step.
        dist.barrier()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{fddp.rank()}.json"), "w") as f:
        json.dump({"device": str(device), "backend": str(dist.get_backend()), "torch": torch.__version__, "results": results}, f, indent=1)
    fddp.shutdown()


if __name__ == "__main__":
    main()
