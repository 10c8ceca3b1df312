"""ZeRO stage 3 (fddp.zero.fully_shard): memory per rank and step time, against stage 2, torch FSDP2 and DDP.

    python benchmarks/stage3.py                          # memory at 2 and 4 ranks, step times at 2 (loopback, gloo)
    python benchmarks/stage3.py --models lm --repeats 5
    python benchmarks/stage3.py --same-numbers --models mlp transformer lm   # 20 steps, SGD-momentum and AdamW, 2, 3 and 4 ranks
    python benchmarks/stage3.py --soak 2000 --models transformer   # RSS every 100 steps of a long run, per mode
    python benchmarks/stage3.py --mixed-precision   # bf16 gathers: stage 3's parameters against FSDP2's, same policy
    python benchmarks/stage3.py --models transformer --memory-worlds --modes fsdp2_accum stage3_accum  # accumulation
    python benchmarks/stage3.py --models transformer --memory-worlds --modes ddp_accum replicated_accum  # replicated
    python benchmarks/stage3.py --models transformer --memory-worlds --modes stage3 stage3_compiled  # compiled units

It launches ``torchrun`` itself. The models are benchmarks/step.py's (the MLP, the transformer, the
conv net, the LM) and GPT-2 from ``transformers`` (a small random config, the model the default
units were not tuned on), trained with AdamW (torch's fused kernel everywhere; fddp's shards donated, so that every
optimizer updates in place) on each rank's own batch. Memory: one process group per mode and world
size, so that each peak RSS is that mode's alone; step time: the modes interleaved within every
repeat, the median over repeats of the mean step time (the slowest rank's). Prints tables and
writes ``benchmarks/results/stage3.json`` (``--out``; ``--same-numbers``: ``stage3_same.json``;
``--mixed-precision``: ``stage3_bf16.json``; ``--soak``: ``stage3_soak_<models>.json``).

Modes:
    ddp            torch DDP + torch.optim.AdamW(fused=True): everything replicated (the reference)
    fsdp2          torch.distributed.fsdp.fully_shard on every block and on the root, AdamW(fused=True)
    stage2         fddp.grad_and_value(compression=fddp.zero.ReduceScatter()) + apply_gradients on
                   the shards + fddp.zero.gather (ZeRO-2: the full parameters are kept)
    stage3         fddp.zero.fully_shard (its default units, chosen by size: min_unit_mb=0.5;
                   remat="params": each unit's parameters gathered again in backward) +
                   fddp.grad_and_value (autograd; the gathers' backward averages) + apply_gradients
    stage3_fine    the same with min_unit_mb=0: every block a unit, however small (the old default)
    stage3_blocks  the same with FSDP2's units: the blocks, everything else in the root unit
    stage3_func    the same, differentiated by torch.func.grad_and_value (every op through its level)
    stage3_unit    the same with remat="unit": units recomputed in backward (activation checkpointing)
    stage3_keep    the same with remat=None: the full parameters kept from forward to backward
    stage3_noprefetch  stage3 with prefetch=0: each gather starts when its unit needs it
    stage3_floor   stage3 over a group of one rank: the same code with no collective (its compute)
    hybrid         stage3 sharded within each host (torchrun's local ranks), replicated across hosts
    fsdp2_bf16     fsdp2 with MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    stage3_bf16    stage3 with the same policy: fully_shard(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    stage3_bf16_floor  stage3_bf16 over a group of one rank (its compute, in bf16)
    replicated     fddp.grad_and_value + fddp.optim.apply_gradients(donate=True), everything replicated
                   (fddp's counterpart of ddp)
    ddp_accum      ddp over 4 micro-batches a step: no_sync() for the first 3 (the loss divided by 4)
    replicated_accum  fddp replicated over 4 micro-batches: torch.func.grad + fddp.accumulate_grads for
                   the first 3, the last through fddp.grad_and_value(accumulated=) (reduced in its backward)
    replicated_accum_autograd  the same with the first 3 through torch.autograd.grad (no transform)
    fsdp2_accum    fsdp2 over 4 micro-batches: set_requires_gradient_sync(False) for the first 3
    fsdp2_accum_keep  the same with set_reshard_after_backward(False) for the first 3 (gathered once)
    stage3_accum   stage3 over 4 micro-batches: apply_fn.no_sync() for the first 3
    stage3_accum_keep  the same with no_sync(keep_gathered=True) (gathered once)
    stage3_compiled  stage3 with fully_shard(compile=True): each unit's compute compiled (inductor)

Memory columns, per rank (the fullest rank), MB:
    held       what the loop keeps between steps: parameters + gradients + optimizer state (distinct
               storages, as benchmarks/zero.py counts them; FSDP2: the DTensors' local shards)
    transient  stage 3: the most bytes of gathered units and gradient buffers alive at once in a
               step (fddp.zero.Counters.peak_bytes)
    bound      stage 3: 16 P / N (parameters, gradients, AdamW's two moments, in float32) plus the
               full parameters of (prefetch + 1) units, the largest ones
    peak RSS   the process's high-water mark over three steps, reset after the warm-up
               (/proc/self/clear_refs): activations, allocator caches and buffers included
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step  # noqa: E402  (benchmarks/step.py's models and batches)
from step import GPT2, LM  # noqa: E402

import fddp  # noqa: E402

MODELS = {k: v for k, v in step.MODELS.items() if k != "heldout"}  # gpt2: the model the unit rule was not tuned on

TOKENS = (LM, GPT2)  # models whose input is token ids


def model_and_batch(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model (the same initialisation on every rank) and this rank's own batch."""
    if name != "gpt2":
        return step.model_and_batch(name)
    torch.manual_seed(0)
    return GPT2(), batch_for(name, 1 + fddp.rank())

LR = 1e-3
MODES = (
    "ddp",
    "fsdp2",
    "replicated",
    "stage2",
    "stage3",
    "stage3_fine",
    "stage3_blocks",
    "stage3_func",
    "stage3_unit",
    "stage3_keep",
    "stage3_noprefetch",
    "stage3_floor",
    "hybrid",
    "fsdp2_bf16",
    "stage3_bf16",
    "stage3_bf16_floor",
    "ddp_accum",
    "replicated_accum",
    "replicated_accum_autograd",
    "fsdp2_accum",
    "fsdp2_accum_keep",
    "stage3_accum",
    "stage3_accum_keep",
    "stage3_compiled",
)
ACCUM = 4  # micro-batches a step in the *_accum modes
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def nbytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tree; DTensors by their local shard)."""
    seen: dict[int, int] = {}
    for t in optree.tree_leaves(tensors, none_is_leaf=False):
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def batch_for(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch for model ``name`` (as benchmarks/step.py makes them) from ``seed``."""
    ctor, shape = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    if ctor in TOKENS:
        ids = torch.randint(0, ctor.VOCAB, (shape[0], shape[1] + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].reshape(-1)
    return torch.randn(shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, as FSDP2 users wrap them (the rest goes to the root)."""
    if hasattr(model, "encoder"):
        return list(model.encoder.layers)
    if isinstance(model, LM):
        return list(model.blocks.layers)
    if isinstance(model, GPT2):
        return list(model.model.transformer.h)
    if isinstance(model, step.ConvNet):
        return []  # 114k values: the root alone (fddp's default units make the same choice)
    return list(model.blocks)


class Mode:
    """One way to train: ``step(x, y)`` makes a step; ``memory()`` counts what the loop holds."""

    def __init__(self, step: Callable[..., None], memory: Callable[[], dict[str, int]], comm: Callable[[], int] | None = None) -> None:
        self.step, self.memory, self.comm = step, memory, comm


def fsdp2(model: nn.Module, bf16: bool = False) -> nn.Module:
    """torch FSDP2 as its users wrap a model: every block, then the root; ``bf16``: with
    ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for b in blocks(model):
        torch_fully_shard(b, mesh=mesh, mp_policy=policy)
    return torch_fully_shard(model, mesh=mesh, mp_policy=policy)


def torch_mode(model: nn.Module, fsdp: bool, bf16: bool = False, accum: int = 1, keep: bool = False) -> Mode:
    if fsdp:
        net = fsdp2(model, bf16)
    else:
        net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        if accum == 1:
            F.cross_entropy(net(x), y).backward()
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum)) if accum > 1 else ()):
            last = i == accum - 1
            if fsdp:
                net.set_requires_gradient_sync(last)
                net.set_reshard_after_backward(last or not keep)
            with net.no_sync() if not fsdp and not last else contextlib.nullcontext():
                (F.cross_entropy(net(xm), ym) / accum).backward()
        opt.step()

    def memory() -> dict[str, int]:
        params = list(net.parameters())
        return {
            "params": nbytes(params),
            "grads": nbytes([p.grad for p in params if p.grad is not None]),
            "state": nbytes([list(s.values()) for s in opt.state.values()]),
            "transient": 0,
        }

    return Mode(step, memory)


def stage2_mode(model: nn.Module) -> Mode:
    apply_fn, params = fddp.functionalize(model)
    opt = fddp.optim.adamw(LR)
    box: dict[str, Any] = {"params": params, "shards": fddp.zero.shard(params)}
    box["state"] = opt.init(box["shards"])
    sync = fddp.grad_and_value(lambda p, x, y: F.cross_entropy(apply_fn(p, x), y), compression=fddp.zero.ReduceScatter())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        grads, _ = sync(box["params"], x, y)
        box["grads"] = grads
        box["shards"], box["state"] = fddp.optim.apply_gradients(opt, grads, box["state"], box["shards"], donate=True)
        box["params"] = fddp.zero.gather(box["shards"]).wait()

    def memory() -> dict[str, int]:
        return {
            "params": nbytes([box["params"], box["shards"]]),
            "grads": nbytes(box["grads"]),
            "state": nbytes(box["state"]),
            "transient": 0,
        }

    return Mode(step, memory)


def autograd_grad(loss: Callable[..., torch.Tensor]) -> Callable[..., dict[str, torch.Tensor]]:
    """``torch.func.grad(loss)`` for a dict of parameters, through ``torch.autograd.grad``: no
    transform's per-op dispatch (1.3x faster on the benchmark transformer's micro-batch)."""

    def local(params: dict[str, torch.Tensor], *args: Any) -> dict[str, torch.Tensor]:
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        return dict(zip(leaves, torch.autograd.grad(loss(leaves, *args), list(leaves.values()))))

    return local


def replicated_mode(model: nn.Module, accum: int = 1, local_grad: str = "func") -> Mode:
    apply_fn, params = fddp.functionalize(model)
    opt = fddp.optim.adamw(LR)
    box: dict[str, Any] = {"params": params, "state": opt.init(params)}
    loss = lambda p, x, y: F.cross_entropy(apply_fn(p, x), y)  # noqa: E731
    local = torch.func.grad(loss) if local_grad == "func" else autograd_grad(loss)
    last = fddp.grad_and_value(loss)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        micro = list(zip(x.chunk(accum), y.chunk(accum)))
        acc = fddp.GradAccumulator()
        for xm, ym in micro[:-1]:
            acc = fddp.accumulate_grads(acc, local(box["params"], xm, ym))
        # The window's mean (or, unaccumulated, the batch's gradient), reduced in this backward.
        grads, _ = last(box["params"], *micro[-1], accumulated=acc) if accum > 1 else last(box["params"], x, y)
        box["grads"] = grads
        box["params"], box["state"] = fddp.optim.apply_gradients(opt, grads, box["state"], box["params"], donate=True)

    def memory() -> dict[str, int]:
        return {"params": nbytes(box["params"]), "grads": nbytes(box["grads"]), "state": nbytes(box["state"]), "transient": 0}

    return Mode(step, memory)


def stage3_mode(
    model: nn.Module, remat: str | None = "params", prefetch: int = 1, group: Any = None, replica_group: Any = None,
    func: bool = False, units: Any = None, accum: int = 1, keep: bool = False, **options: Any,
) -> Mode:  # fmt: skip
    apply_fn, shards = fddp.zero.fully_shard(
        model, units=units, remat=remat, prefetch=prefetch, group=group, replica_group=replica_group, **options
    )
    opt = fddp.optim.adamw(LR)
    box: dict[str, Any] = {"shards": shards, "state": opt.init(shards), "fn": apply_fn}
    loss = lambda s, x, y: F.cross_entropy(apply_fn(s, x), y)  # noqa: E731
    gv = torch.func.grad_and_value(loss) if func else fddp.grad_and_value(loss)
    gv_accum = fddp.grad_and_value(lambda s, x, y: loss(s, x, y) / accum)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if accum == 1:
            grads, _ = gv(box["shards"], x, y)
        for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum)) if accum > 1 else ()):
            with apply_fn.no_sync(keep_gathered=keep) if i < accum - 1 else contextlib.nullcontext():
                grads, _ = gv_accum(box["shards"], xm, ym)
        box["grads"] = grads
        box["shards"], box["state"] = fddp.optim.apply_gradients(opt, grads, box["state"], box["shards"], donate=True)

    def memory() -> dict[str, int]:
        return {
            "params": nbytes(box["shards"]),
            "grads": nbytes(box["grads"]),
            "state": nbytes(box["state"]),
            "transient": apply_fn.counters.peak_bytes,
        }

    m = Mode(step, memory)
    m.apply_fn = apply_fn  # type: ignore[attr-defined]
    return m


def make_mode(name: str, model: nn.Module) -> Mode:
    model = copy.deepcopy(model)
    if name in ("ddp", "fsdp2", "fsdp2_bf16"):
        return torch_mode(model, fsdp=name != "ddp", bf16=name == "fsdp2_bf16")
    if name in ("ddp_accum", "fsdp2_accum", "fsdp2_accum_keep"):
        return torch_mode(model, fsdp=name != "ddp_accum", accum=ACCUM, keep=name.endswith("_keep"))
    if name in ("replicated", "replicated_accum", "replicated_accum_autograd"):
        accum = ACCUM if name != "replicated" else 1
        return replicated_mode(model, accum, local_grad="autograd" if name.endswith("_autograd") else "func")
    if name in ("stage3_accum", "stage3_accum_keep"):
        return stage3_mode(model, accum=ACCUM, keep=name.endswith("_keep"))
    if name == "stage3_bf16":
        return stage3_mode(model, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if name == "stage2":
        return stage2_mode(model)
    if name in ("stage3_floor", "stage3_bf16_floor"):
        own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
        bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if name == "stage3_bf16_floor" else {}
        return stage3_mode(model, group=own, **bf16)
    if name == "stage3_compiled":
        return stage3_mode(model, compile=True)
    if name == "stage3_func":
        return stage3_mode(model, func=True)
    if name == "stage3_fine":
        return stage3_mode(model, min_unit_mb=0)
    if name == "stage3_blocks":
        return stage3_mode(model, units=[*blocks(model), ""])
    if name == "stage3_noprefetch":
        return stage3_mode(model, prefetch=0)
    if name == "hybrid":
        per_host = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        hosts, rank = dist.get_world_size() // per_host, dist.get_rank()
        within = [dist.new_group([h * per_host + i for i in range(per_host)]) for h in range(hosts)]
        across = [dist.new_group([h * per_host + i for h in range(hosts)]) for i in range(per_host)]
        return stage3_mode(model, group=within[rank // per_host], replica_group=across[rank % per_host])
    return stage3_mode(model, remat={"stage3": "params", "stage3_unit": "unit", "stage3_keep": None}[name])


def bound(apply_fn: Any, prefetch: int = 1) -> int:
    """16 P / N plus the (prefetch + 1) largest units' full parameters, in bytes."""
    lay = apply_fn.layout
    per_unit = sorted((sum(lay.plan.buckets[k].nbytes for k in ks) for ks in lay.unit_buckets), reverse=True)
    values = sum(b.numel for b in lay.plan.buckets)
    return 16 * values // lay.world + sum(per_unit[: prefetch + 1])


def _trim() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # pragma: no cover - not glibc
        pass


def _hwm_kb() -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(fields["VmHWM"].split()[0]), int(fields["VmRSS"].split()[0])


def memory_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One mode alone in this process group: what it holds, its transient peak, its peak RSS."""
    model, batch = model_and_batch(args.model)
    mode = make_mode(args.mode, model)
    del model
    for _ in range(2):
        mode.step(*batch)
    _trim()
    if hasattr(mode, "apply_fn"):
        mode.apply_fn.counters.peak_bytes = mode.apply_fn.counters.live_bytes
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    for _ in range(3):
        mode.step(*batch)
    hwm, rss = _hwm_kb()
    out = {**mode.memory(), "peak_rss": hwm * 1024, "rss": rss * 1024}
    if hasattr(mode, "apply_fn"):
        out["bound"] = bound(mode.apply_fn)
    return out


def time_worker(args: argparse.Namespace) -> dict[str, Any]:
    """Every mode of ``args.modes`` in one process group, interleaved: median step times."""
    model, batch = model_and_batch(args.model)
    modes = {n: make_mode(n, model) for n in args.modes}
    for m in modes.values():
        for _ in range(args.warmup):
            m.step(*batch)
    times: dict[str, list[float]] = {n: [] for n in modes}
    cpu: dict[str, list[float]] = {n: [] for n in modes}
    for r in range(args.repeats):
        for n in list(modes) if r % 2 == 0 else list(reversed(modes)):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                modes[n].step(*batch)
            t = torch.tensor([(time.perf_counter() - t0) / args.steps])
            c = torch.tensor([(time.process_time() - c0) / args.steps])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            dist.all_reduce(c)  # every rank's CPU time, all threads (gloo's too), added up
            times[n].append(1e3 * t.item())
            cpu[n].append(1e3 * c.item())
    out: dict[str, Any] = {"times_ms": times, "cpu_ms": cpu}
    counters = {}
    for n, m in modes.items():
        if hasattr(m, "apply_fn"):
            c = m.apply_fn.counters
            done = args.warmup + args.repeats * args.steps
            counters[n] = {
                "gathered_bytes": c.gathered_bytes / done,
                "reduced_bytes": c.reduced_bytes / done,
                "replica_bytes": c.replica_bytes / done,
                "prefetch_hits": c.prefetch_hits,
                "prefetch_misses": c.prefetch_misses,
            }
    out["per_step"] = counters
    out["ddp_payload_bytes"] = 4 * sum(p.numel() for p in model.parameters())  # one all-reduce of the float32 gradients
    return out


def soak_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One mode alone for ``args.soak`` steps: this rank's RSS every ``args.soak_every`` steps (a
    long run must not grow: nothing a step makes may outlive it)."""
    model, batch = model_and_batch(args.model)
    mode = make_mode(args.mode, model)
    del model
    rss: dict[int, int] = {}
    t0 = time.perf_counter()
    for i in range(1, args.soak + 1):
        mode.step(*batch)
        if i % args.soak_every == 0:
            _trim()
            rss[i] = _hwm_kb()[1] * 1024
    return {"rss": rss, "step_ms": 1e3 * (time.perf_counter() - t0) / args.soak}


def soak(args: argparse.Namespace) -> None:
    """RSS over a long run, each mode in its own process group (the fullest rank)."""
    before = load_average()
    results: dict[str, Any] = {}
    for name in args.models:
        for mode in args.soak_modes:
            per_rank = launch(2, ["--task", "soak", "--model", name, "--mode", mode, "--soak", str(args.soak),
                                  "--soak-every", str(args.soak_every)])  # fmt: skip
            steps = sorted(int(i) for i in per_rank[0]["rss"])
            rss = {i: max(p["rss"][str(i)] for p in per_rank) for i in steps}
            results[f"{name}/{mode}"] = {"rss": rss, "step_ms": max(p["step_ms"] for p in per_rank)}
            first, last, ms = rss[steps[0]], rss[steps[-1]], results[f"{name}/{mode}"]["step_ms"]
            print(f"{name} {mode}: RSS (MB, the fullest of 2 ranks) at steps {steps[0]}..{steps[-1]}, every {args.soak_every}:", flush=True)
            print("  " + " ".join(f"{rss[i] / 2**20:.1f}" for i in steps), flush=True)
            grew = (last - first) / max(steps[-1] - steps[0], 1) / 1024
            change = f"{(last - first) / 2**20:+.2f} MB ({grew:+.2f} KB a step)"
            print(f"  step {steps[-1]} - step {steps[0]}: {change}; {ms:.1f} ms a step", flush=True)
    print(f"load average (1, 5, 15 min) before {before}, after {load_average()} on {os.cpu_count()} CPUs")
    with open(os.path.join(RESULTS, f"stage3_soak_{'_'.join(args.models)}.json"), "w") as f:
        json.dump({"torch": torch.__version__, "steps": args.soak, "every": args.soak_every, "load_before": before,
                   "load_after": load_average(), "results": results}, f, indent=1)  # fmt: skip


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    fddp.init()
    tasks = {"memory": memory_worker, "time": time_worker, "soak": soak_worker, "mp": mp_worker}
    result = tasks[args.task](args)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, result)
    if dist.get_rank() == 0:
        with open(args.worker_out, "w") as f:
            json.dump(per_rank, f)
    dist.destroy_process_group()


def launch(world: int, worker_args: list[str], tries: int = 2) -> list[Any]:
    """Run the worker under torchrun; once more if it fails (a gloo abort at teardown, seen once
    in twenty launches on this loaded machine, would otherwise lose the whole run)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               os.path.abspath(__file__), "--worker-out", out, *worker_args]  # fmt: skip
        for attempt in range(tries):
            proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode == 0:
                break
            print(f"launch failed (exit {proc.returncode}): {' '.join(worker_args)}; attempt {attempt + 1} of {tries}", flush=True)
        else:
            raise SystemExit(f"{' '.join(cmd)} failed {tries} times")
        with open(out) as f:
            return json.load(f)


def load_average() -> list[float]:
    return list(os.getloadavg())


def paired(times: dict[str, list[float]], mode: str, ref: str) -> float:
    """The median over repeats of ``mode``'s time over ``ref``'s in the same repeat (the modes run
    interleaved, so a ratio within a repeat cancels the machine's load drifting between repeats)."""
    return statistics.median(a / b for a, b in zip(times[mode], times[ref]))


def report(record: dict[str, Any]) -> str:
    lines = []
    for model, r in record["results"].items():
        lines.append(
            f"\n{model}: {r['values'] / 1e6:.2f}M values in {r['tensors']} tensors, AdamW; 16 P = {16 * r['values'] / 2**20:.1f} MB"
        )
        lines.append(f"  memory per rank, MB (the fullest rank){'':8}held = params + grads + state; bound = 16P/N + (prefetch+1) units")
        lines.append(
            f"  {'N':>2} {'mode':<13}{'params':>8}{'grads':>8}{'state':>8}{'held':>8}"
            f"{'transient':>10}{'held+tr':>9}{'bound':>8}{'peak RSS':>10}"
        )
        for world, mem in r["memory"].items():
            for mode, m in mem.items():
                held = m["params"] + m["grads"] + m["state"]
                mb = lambda v: f"{v / 2**20:8.2f}"  # noqa: E731
                tr = f"{m['transient'] / 2**20:10.2f}" if m["transient"] else f"{'':10}"
                both = f"{(held + m['transient']) / 2**20:9.2f}" if m["transient"] else f"{'':9}"
                bd = mb(m["bound"]) if "bound" in m else f"{'':8}"
                lines.append(
                    f"  {world:>2} {mode:<13}{mb(m['params'])}{mb(m['grads'])}{mb(m['state'])}{mb(held)}"
                    f"{tr}{both}{bd}{m['peak_rss'] / 2**20:10.1f}"
                )
        t = r.get("times")
        if t:
            med = {n: statistics.median(v) for n, v in t["times_ms"].items()}
            lines.append(
                f"  step time, {t['world']} ranks, median of {len(next(iter(t['times_ms'].values())))} repeats "
                f"x {record['args']['steps']} steps (ms; range); ratios: the median over repeats of each repeat's ratio"
            )
            cpu = {n: statistics.median(v) for n, v in t.get("cpu_ms", {}).items()}
            lines.append(f"  {'mode':<18}{'median':>8}{'x stage2':>10}{'x fsdp2':>9}{'x ddp':>7}   range      CPU ms  x stage2")
            for n, v in med.items():
                cols = "".join(f"{paired(t['times_ms'], n, b):{w}.2f}" if b in med else " " * w
                               for b, w in (("stage2", 10), ("fsdp2", 9), ("ddp", 7)))  # fmt: skip
                c = f"{cpu[n]:9.1f}{cpu[n] / cpu['stage2']:9.2f}" if n in cpu and "stage2" in cpu else ""
                lines.append(f"  {n:<18}{v:8.1f}{cols}   {min(t['times_ms'][n]):4.0f}-{max(t['times_ms'][n]):<4.0f}{c}")
            if "stage3" in med and "stage3_keep" in med:
                lines.append(f"  rematerialising the parameters (stage3 / stage3_keep): {med['stage3'] / med['stage3_keep']:.2f}")
            for a, b in (("stage3_accum", "fsdp2_accum"), ("stage3_accum_keep", "fsdp2_accum_keep"),
                         ("stage3_accum_keep", "fsdp2_accum"), ("stage3_accum", "ddp_accum"),
                         ("replicated_accum", "ddp_accum"), ("replicated_accum_autograd", "ddp_accum")):  # fmt: skip
                if a in med and b in med:
                    lines.append(f"  accumulation over {ACCUM} micro-batches, {a} / {b}: {paired(t['times_ms'], a, b):.2f} (paired median)")
            if "replicated" in med and "ddp" in med:
                ratio = paired(t["times_ms"], "replicated", "ddp")
                lines.append(f"  replicated, fddp / torch DDP (both AdamW): {ratio:.2f} (paired median)")
            if "stage3_compiled" in med and "stage3" in med:
                ratio = paired(t["times_ms"], "stage3_compiled", "stage3")
                lines.append(f"  compiled units (stage3_compiled / stage3): {ratio:.2f} (paired median)")
            if "stage3_unit" in med and "stage3" in med:
                lines.append(f"  recomputing the units too (stage3_unit / stage3): {med['stage3_unit'] / med['stage3']:.2f}")
    lines.append(f"\nload average (1, 5, 15 min) before {record['load_before']}, after {record['load_after']} on {os.cpu_count()} CPUs")
    return "\n".join(lines)


def same_numbers(args: argparse.Namespace) -> None:
    """20 steps of SGD-momentum and AdamW: stage 3 against stage 2 and torch DDP + torch.optim."""
    results = {}
    for world in args.worlds:
        results[world] = launch(world, ["--task", "same", "--models", *args.models, "--steps", str(args.same_steps)])[0]
    for world, r in results.items():
        for case, v in r.items():
            print(
                f"{world} ranks {case:<22} stage3 == stage2: {str(v['equal']):5}  |stage3 - stage2| {v['vs_stage2']:.1e}  "
                f"|stage2 - ddp| {v['stage2_vs_ddp']:.1e}  |stage3 - ddp| {v['vs_ddp']:.1e}  replicas identical: {v['replicas']}"
            )
    with open(os.path.join(RESULTS, "stage3_same.json"), "w") as f:
        json.dump({"torch": torch.__version__, "steps": args.same_steps, "results": results}, f, indent=1)


def mixed_precision(args: argparse.Namespace) -> None:
    """bf16 gathers and compute, float32 master weights: stage 3 against torch FSDP2 with the same policy."""
    r = launch(2, ["--task", "mp", "--models", *args.models, "--same-steps", str(args.same_steps)])[0]
    print(f"{args.same_steps} AdamW steps (lr {LR}), 2 ranks, param_dtype=torch.bfloat16, reduce_dtype=torch.float32; "
          "parameters afterwards, max |difference|:")  # fmt: skip
    print(f"  {'model':<12}{'stage3 == fsdp2':>16}{'|stage3 - fsdp2|':>18}{'|fsdp2 - float32|':>19}"
          f"{'gathered KB/step':>18}{'(float32)':>11}{'reduced KB/step':>17}{'(float32)':>11}")  # fmt: skip
    for name, v in r.items():
        kb = [v[k] / 1024 for k in ("gathered", "gathered32", "reduced", "reduced32")]
        print(f"  {name:<12}{str(v['equal']):>16}{v['vs_fsdp2']:18.1e}{v['fsdp2_vs_float32']:19.1e}"
              f"{kb[0]:18.1f}{kb[1]:11.1f}{kb[2]:17.1f}{kb[3]:11.1f}")  # fmt: skip
    with open(os.path.join(RESULTS, "stage3_bf16.json"), "w") as f:
        json.dump({"torch": torch.__version__, "steps": args.same_steps, "results": r}, f, indent=1)


def mp_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One process group of :func:`mixed_precision`."""
    out = {}
    bf16 = torch.bfloat16
    for name in args.models:
        model, _ = model_and_batch(name)
        batches = [batch_for(name, 10_000 * step + fddp.rank()) for step in range(args.same_steps)]
        net = fsdp2(copy.deepcopy(model), bf16=True)
        topt = torch.optim.AdamW(net.parameters(), lr=LR, fused=True)
        for x, y in batches:
            topt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            topt.step()
        ref = {k: v.full_tensor() for k, v in net.state_dict().items()}
        runs = {}
        for dtype in (bf16, None):
            fn, shards = fddp.zero.fully_shard(copy.deepcopy(model), param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
            opt = fddp.optim.adamw(LR)
            state = opt.init(shards)
            step = fddp.grad_and_value(lambda s, x, y: F.cross_entropy(fn(s, x), y))  # noqa: B023
            for x, y in batches:
                grads, _ = step(shards, x, y)
                shards, state = fddp.optim.apply_gradients(opt, grads, state, shards)
            c = fn.counters
            runs[dtype] = fddp.zero.gather(shards).wait(), c.gathered_bytes / len(batches), c.reduced_bytes / len(batches)
        diff = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in f32)  # noqa: E731  (tied weights: once)
        (got, gathered, reduced), (f32, gathered32, reduced32) = runs[bf16], runs[None]
        out[name] = {
            "equal": all(torch.equal(got[k], ref[k]) for k in f32), "vs_fsdp2": diff(got, ref), "fsdp2_vs_float32": diff(ref, f32),
            "gathered": gathered, "gathered32": gathered32, "reduced": reduced, "reduced32": reduced32,
        }  # fmt: skip
    return out


def same_worker(args: argparse.Namespace) -> None:
    """One world size of :func:`same_numbers` (under torchrun)."""
    torch.set_num_threads(1)
    fddp.init()
    out = {}
    for name in args.models:
        for opt_name, lr in (("sgd", 0.01), ("adamw", LR)):
            model, _ = model_and_batch(name)
            batches = [batch_for(name, 10_000 * step + fddp.rank()) for step in range(args.same_steps)]
            ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model))
            topt = (
                torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
                if opt_name == "sgd"
                else torch.optim.AdamW(ddp.parameters(), lr=lr, fused=True)
            )
            opt = fddp.optim.sgd(lr, momentum=0.9) if opt_name == "sgd" else fddp.optim.adamw(lr)
            fn2, params = fddp.functionalize(copy.deepcopy(model))
            step2 = fddp.grad_and_value(lambda p, x, y: F.cross_entropy(fn2(p, x), y), compression=fddp.zero.ReduceScatter())
            sh2 = fddp.zero.shard(params)
            st2, full2 = opt.init(sh2), params
            fn3, sh3 = fddp.zero.fully_shard(copy.deepcopy(model))
            st3 = opt.init(sh3)
            g3 = torch.func.grad(lambda s, x, y: F.cross_entropy(fn3(s, x), y))
            for x, y in batches:
                topt.zero_grad()
                F.cross_entropy(ddp(x), y).backward()
                topt.step()
                g, _ = step2(full2, x, y)
                sh2, st2 = fddp.optim.apply_gradients(opt, g, st2, sh2)
                full2 = fddp.zero.gather(sh2).wait()
                sh3, st3 = fddp.optim.apply_gradients(opt, g3(sh3, x, y), st3, sh3)
            full3 = fddp.zero.gather(sh3).wait()
            ref = {k: p.detach() for k, p in ddp.module.named_parameters()}
            try:
                fddp.verify_replicas(full3)
                replicas = True
            except Exception:  # noqa: BLE001 - reported, not raised
                replicas = False
            diff = lambda a, b: max((a[k] - b[k]).abs().max().item() for k in b)  # noqa: E731
            out[f"{name}/{opt_name}"] = {
                "equal": all(torch.equal(full3[k], full2[k]) for k in full2), "vs_stage2": diff(full3, full2),
                "stage2_vs_ddp": diff(full2, ref), "vs_ddp": diff(full3, ref), "replicas": replicas,
            }  # fmt: skip
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, out)
    if dist.get_rank() == 0:
        assert all(r == per_rank[0] for r in per_rank), "ranks saw different numbers"
        with open(args.worker_out, "w") as f:
            json.dump(per_rank, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer", "conv", "lm", "gpt2"], choices=list(MODELS))
    parser.add_argument("--memory-worlds", nargs="*", type=int, default=[2, 4], help="none: step times only")
    parser.add_argument("--time-world", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=[m for m in MODES if "_accum" not in m and m != "stage3_compiled"], choices=MODES)
    parser.add_argument("--memory-modes", nargs="+", default=["ddp", "fsdp2", "stage2", "stage3", "stage3_unit"], choices=MODES)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--same-numbers", action="store_true", help="20 steps: stage 3 against stage 2 and DDP")
    parser.add_argument("--same-steps", type=int, default=20)
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 3, 4], help="with --same-numbers")
    parser.add_argument("--out", default=os.path.join(RESULTS, "stage3.json"))
    parser.add_argument("--soak", type=int, default=0, help="a long run of this many steps per mode, 2 ranks: RSS as it goes")
    parser.add_argument("--soak-every", type=int, default=100, help="with --soak: print RSS every this many steps")
    parser.add_argument("--soak-modes", nargs="+", default=["stage3", "stage3_func", "stage3_unit", "stage3_keep"], choices=MODES)
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 policy: stage 3's numbers against FSDP2's")
    parser.add_argument("--task", choices=["memory", "time", "same", "soak", "mp"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        same_worker(args) if args.task == "same" else worker(args)
        return
    os.makedirs(RESULTS, exist_ok=True)
    if args.same_numbers:
        same_numbers(args)
        return
    if args.soak:
        soak(args)
        return
    if args.mixed_precision:
        mixed_precision(args)
        return
    before = load_average()
    results: dict[str, Any] = {}
    for name in args.models:
        model, _ = model_and_batch(name)
        r: dict[str, Any] = {"values": sum(p.numel() for p in model.parameters()), "tensors": len(list(model.parameters())), "memory": {}}
        for world in args.memory_worlds:
            r["memory"][str(world)] = {}
            for mode in args.memory_modes:
                per_rank = launch(world, ["--task", "memory", "--model", name, "--mode", mode])
                r["memory"][str(world)][mode] = {k: max(p[k] for p in per_rank) for k in per_rank[0]}
        if args.repeats:
            per_rank = launch(args.time_world, ["--task", "time", "--model", name, "--modes", *args.modes, "--repeats",
                                                str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup)])  # fmt: skip
            r["times"] = {"world": args.time_world, **per_rank[0]}
        results[name] = r
    record = {"torch": torch.__version__, "args": {k: v for k, v in vars(args).items() if k not in ("out", "worker_out")},
              "load_before": before, "load_after": load_average(), "results": results}  # fmt: skip
    print(report(record))
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
