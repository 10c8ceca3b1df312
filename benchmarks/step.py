"""One data-parallel training step: torch DDP against fddp's ways of synchronising gradients.

Run with ``torchrun --standalone --nproc-per-node=2 benchmarks/step.py`` (CPU, gloo).
``--bucket-cap-mb`` sets the bucket cap of every fddp mode but the ``_auto`` ones (default: 25, as
torch DDP's); ``benchmarks/cluster_step.py`` runs it across hosts joined by rate-limited links. Every mode
trains the same model with SGD (momentum 0.9) on each rank's own batch; modes are interleaved
within every repeat so they share the machine's noise, and each result is the median over repeats
of the mean step time (the slowest rank's). Prints a table of ratios against torch DDP measured in
the same run, writes ``benchmarks/results/step.json`` and draws ``benchmarks/results/step.png``
(``--replot`` redraws the chart from the JSON without measuring).

Modes:
    floor_torch       module forward/backward + torch.optim, no communication
    floor_fddp        torch.func.grad + fddp.optim, no communication
    floor_gav         fddp.grad_and_value over a one-rank group (its own hooks and copies) + fddp.optim:
                      the floor of the grad_and_value modes
    ddp               torch DDP + torch.optim.SGD (the reference)
    per_tensor        torch.func.grad + one all-reduce per tensor + fddp.optim
    ddp_step          torch.func.grad + fddp.ddp_step + fddp.optim
    ddp_step_bf16     the same, buckets sent in bfloat16
    ddp_step_fp16     the same, buckets sent in float16
    ddp_step_psgd1    the same, PowerSGD rank 1 (torch's default rank), compressing from step 0
    ddp_step_psgd4    the same, PowerSGD rank 4 (orthogonalised with QR)
    grad_and_value    fddp.grad_and_value (all-reduces overlap backward) + fddp.optim
    grad_and_value_donated  the same, params and optimizer state donated to apply_gradients
    grad_and_value_optax    the same, the optax split: opt.update + fddp.optim.apply_updates
    grad_and_value_bf16     fddp.grad_and_value, buckets sent in bfloat16 (cast as each bucket fills)
    grad_and_value_psgd1    fddp.grad_and_value, PowerSGD rank 1 from step 0 (compressed in backward)
    grad_and_value_auto     fddp.grad_and_value with the bucket cap fddp.scaling.auto_bucket_cap
                      chooses from the measured link and backward timeline, checked against the
                      default by a few timed steps (the same on every rank);
                      likewise grad_and_value_bf16_auto and grad_and_value_psgd1_auto
    compiled          torch.compile of torch.func.grad + fddp.ddp_step + fddp.optim, one graph
    grad_and_value_noagree  grad_and_value with the per-call agreement off (fddp.set_checks(agreement=False));
                      likewise ddp_step_noagree
    grad_and_value_lean     grad_and_value without the error channel and the header's fingerprint
                      (what the failure handling costs); likewise ddp_step_lean
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fddp
import fddp._dist
import fddp.optim as fopt
from fddp.sync import plan_of as plan_for

LR, MOMENTUM = 0.01, 0.9


# ---------------------------------------------------------------------------------------------- models


class MLP(nn.Module):
    """8 x (Linear(512) + LayerNorm) and a head: 2.1M values in 34 tensors."""

    def __init__(self, width: int = 512, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


class Transformer(nn.Module):
    """A TransformerEncoder of 8 layers (d=128): 100 parameter tensors."""

    def __init__(self, d: int = 128, layers: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(32, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


class ConvNet(nn.Module):
    """Three 3x3 convolutions and a linear head, on 32x32 RGB images."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2, self.c3 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1), nn.Conv2d(64, 128, 3, padding=1)
        self.head = nn.Linear(128 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for c in (self.c1, self.c2, self.c3):
            x = torch.max_pool2d(torch.relu(c(x)), 2)
        return self.head(x.flatten(1))


class LM(nn.Module):
    """A causal language model the benchmark was not tuned on: token and position embeddings, 4
    pre-norm decoder blocks (d=192) and an untied head over a 2048-token vocabulary; 2.6M values in
    54 tensors, the embedding and the head the largest. Its input is token ids; its output, one row of logits per
    position."""

    VOCAB, CONTEXT = 2048, 64

    def __init__(self, d: int = 192, layers: int = 4) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(self.VOCAB, d), nn.Embedding(self.CONTEXT, d)
        layer = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, self.VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.tokens(ids) + self.positions(torch.arange(t))
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True))).flatten(0, 1)


class GPT2(nn.Module):
    """Hugging Face's GPT-2 (``transformers``, the ``hf`` extra), random weights, a small config: 4
    blocks, d=128, a 2048-token vocabulary, the embedding tied to the head. Its input is token ids;
    its output, one row of logits per position."""

    VOCAB, CONTEXT = 2048, 64

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=self.VOCAB, n_positions=self.CONTEXT,
                                         bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits.flatten(0, 1)


class HeldOut(nn.Module):
    """A held-out causal LM, written by hand and never used to choose a default: 6 blocks of
    d=256 with their own attention (``scaled_dot_product_attention``) and GELU MLPs, pre-norm
    LayerNorms, the token embedding tied to the head, a 4096-token vocabulary; 5.8M values in 76
    tensors. Run it with ``--models heldout`` (not in the default set, so nothing is tuned on it)."""

    VOCAB, CONTEXT = 4096, 64

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            b, t, d = h.shape
            q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            h = h + self.proj(a)
            return h + self.down(F.gelu(self.up(self.ln2(h))))

    def __init__(self, d: int = 256, layers: int = 6, heads: int = 8) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(self.VOCAB, d), nn.Parameter(torch.zeros(self.CONTEXT, d))
        self.blocks = nn.ModuleList(self.Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions[: ids.shape[1]]
        for block in self.blocks:
            h = block(h)
        return (self.norm(h) @ self.tokens.weight.T).flatten(0, 1)  # the head tied to the embedding


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (MLP, (64, 512)),
    "transformer": (Transformer, (16, 32, 32)),
    "conv": (ConvNet, (16, 3, 32, 32)),
    "lm": (LM, (8, LM.CONTEXT)),  # token ids; the targets are the next tokens
    "gpt2": (GPT2, (8, GPT2.CONTEXT)),
    "heldout": (HeldOut, (8, HeldOut.CONTEXT)),
}
DEFAULT_MODELS = ["mlp", "transformer", "conv", "lm"]  # gpt2 needs the hf extra; heldout is held out


# ----------------------------------------------------------------------------------------------- modes


class Counter:
    """Counts the all-reduces issued through ``torch.distributed.all_reduce`` and their bytes.

    fddp's per-call head (``fddp._dist._header``: 4 KiB) is counted apart, in ``headers``, unless
    the call's data rides in it: then it counts as the data's collective, with the data's bytes.
    ``calls`` and ``bytes`` are the gradients' collectives and their values, comparable with DDP's
    buckets.
    """

    def __init__(self) -> None:
        self.calls, self.bytes, self.headers = 0, 0, 0

    @contextlib.contextmanager
    def active(self):
        header_mod = fddp._dist._header
        original, exchange = dist.all_reduce, header_mod.exchange
        in_header = [False]

        def counting(t, *args, **kwargs):
            if not in_header[0]:
                self.calls += 1
                self.bytes += t.numel() * t.element_size()
            return original(t, *args, **kwargs)

        def header(head, group, data=0):
            if data:
                self.calls += 1
                self.bytes += data * 4  # float32 values, or float64's 8: counted as the common float32
            else:
                self.headers += 1
            in_header[0] = True
            try:
                return exchange(head, group, data)
            finally:
                in_header[0] = False

        dist.all_reduce, header_mod.exchange = counting, header
        try:
            yield self
        finally:
            dist.all_reduce, header_mod.exchange = original, exchange


def _loss_fn(apply_fn: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    return lambda p, x, y: F.cross_entropy(apply_fn(p, x), y)


def _fddp_update(opt: fopt.GradientTransformation, donate: bool = False, split: bool = False) -> Callable[..., Any]:
    # apply_gradients writes the SGD step straight into new buffers eagerly (donated: torch's fused
    # kernel in place); under torch.compile it is update + apply_updates, which inductor fuses.
    # split: the optax way, opt.update then apply_updates (two passes, the updates materialised).
    def update(params, state, grads):
        if split:
            updates, state = opt.update(grads, state, params)
            return fopt.apply_updates(params, updates), state
        return fopt.apply_gradients(opt, grads, state, params, donate=donate)

    return update


def unagreed(step: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``step`` with fddp's per-call agreement off while it runs (``time_steps`` turns it off for a
    whole block of steps: the first call after the switch still sends a header, which says so)."""

    def run(x, y):
        with agreement_off():
            step(x, y)

    run.agreement_off = True  # type: ignore[attr-defined]
    return run


def lean(step: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``step`` without fddp's error channel (plain waits, no slices that read it) and without the
    header's fingerprint of the parameters: both patched out here, to measure what they cost (the
    library has no switch for them: without them a failure is a hang again)."""

    def run(x, y):
        waits, digest = fddp._dist._waits.sliced, fddp._dist.replica_digest
        fddp._dist._waits.sliced = lambda group: False
        fddp._dist.replica_digest = lambda leaves, depth="full": 0 if depth == "sampled" else digest(leaves, depth)
        try:
            step(x, y)
        finally:
            fddp._dist._waits.sliced, fddp._dist.replica_digest = waits, digest

    return run


@contextlib.contextmanager
def agreement_off():
    was = fddp.checks().agreement
    fddp.set_checks(agreement=False)
    try:
        yield
    finally:
        fddp.set_checks(agreement=was)


def make_modes(
    model: nn.Module, caps: dict[str, float], auto: dict[str, dict[str, float]] | None = None
) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
    """Build one closure per mode; each call makes one training step on its own copy of the model.

    ``caps`` are the bucket caps of the fddp modes (``bucket_cap_mb``, ``first_bucket_mb``; empty:
    the defaults); ``auto`` maps ``"none"``, ``"bf16"`` and ``"psgd1"`` to the caps of the ``_auto``
    modes (None: no ``_auto`` modes).
    """
    modes: dict[str, Callable] = {}

    def torch_mode(wrap: bool) -> Callable:
        m = copy.deepcopy(model)
        net = nn.parallel.DistributedDataParallel(m) if wrap else m
        opt = torch.optim.SGD(net.parameters(), lr=LR, momentum=MOMENTUM)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            opt.step()

        return step

    def fddp_mode(
        sync: Callable[[Any, Callable, torch.Tensor, torch.Tensor], Any],
        compile_: bool = False,
        donate: bool = False,
        split: bool = False,
    ) -> Callable:
        apply_fn, params = fddp.functionalize(copy.deepcopy(model))
        loss = _loss_fn(apply_fn)
        opt = fopt.sgd(LR, momentum=MOMENTUM)
        update = _fddp_update(opt, donate, split)
        box = {"params": {k: v.clone() for k, v in params.items()}}
        box["state"] = opt.init(box["params"])

        def one(params, state, x, y):
            return update(params, state, sync(params, loss, x, y))

        fn = torch.compile(one, fullgraph=True) if compile_ else one

        def step(x, y):
            box["params"], box["state"] = fn(box["params"], box["state"], x, y)

        return step

    def per_tensor(params, loss, x, y):
        grads = torch.func.grad(loss)(params, x, y)
        n = dist.get_world_size()
        works = [dist.all_reduce(g, async_op=True) for g in grads.values()]
        for w in works:
            w.wait()
        return {k: g.div_(n) for k, g in grads.items()}

    def powersgd(rank: int) -> Callable:
        # No torch line to match: torch's powerSGD_hook chains its all-reduces in future callbacks,
        # which on gloo can issue them in different orders on different ranks once a model has
        # more than one bucket (tests/test_compress.py drives it one bucket at a time instead).
        ps, box = fddp.PowerSGD(rank=rank, start_iter=0), {}

        def sync(params, loss, x, y):
            state = box.get("state") or ps.init(params)
            grads = torch.func.grad(loss)(params, x, y)
            grads, info = fddp.ddp_step(params, grads, compression=ps, compression_state=state, return_info=True, **caps)
            box["state"] = info.compression_state
            return grads

        return sync

    def overlapped(compression: Any = None, caps: dict[str, float] = caps) -> Callable:
        # The transform is built once per mode, as a training loop would; a stateful hook's state
        # goes in with every call and comes back in info.
        stateful = isinstance(compression, fddp.PowerSGD)
        box: dict[str, Any] = {}

        def sync(params, loss, x, y):
            if "step" not in box:
                box["step"] = fddp.grad(loss, compression=compression, return_info=stateful, **caps)
                box["state"] = compression.init(params) if stateful else None
            if not stateful:
                return box["step"](params, x, y)
            grads, info = box["step"](params, x, y, compression_state=box["state"])
            box["state"] = info.compression_state
            return grads

        return sync

    psgd1 = fddp.PowerSGD(rank=1, start_iter=0)
    modes["floor_torch"] = torch_mode(wrap=False)
    modes["floor_fddp"] = fddp_mode(lambda p, loss, x, y: torch.func.grad(loss)(p, x, y))
    # Every rank must create every group; each rank then differentiates over its own one-rank group.
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    alone_box: dict[str, Callable] = {}

    def floor_gav(params, loss, x, y):
        # Built once, as the overlapped modes and a training loop build theirs.
        if "grad" not in alone_box:
            alone_box["grad"] = fddp.grad(loss, group=alone)
        return alone_box["grad"](params, x, y)

    modes["floor_gav"] = fddp_mode(floor_gav)
    modes["ddp"] = torch_mode(wrap=True)
    modes["per_tensor"] = fddp_mode(per_tensor)
    modes["ddp_step"] = fddp_mode(lambda p, loss, x, y: fddp.ddp_step(p, torch.func.grad(loss)(p, x, y), **caps))
    modes["ddp_step_bf16"] = fddp_mode(lambda p, loss, x, y: fddp.ddp_step(p, torch.func.grad(loss)(p, x, y), compression="bf16", **caps))
    modes["ddp_step_fp16"] = fddp_mode(lambda p, loss, x, y: fddp.ddp_step(p, torch.func.grad(loss)(p, x, y), compression="fp16", **caps))
    modes["ddp_step_psgd1"] = fddp_mode(powersgd(1))
    modes["ddp_step_psgd4"] = fddp_mode(powersgd(4))
    modes["grad_and_value"] = fddp_mode(overlapped())
    # The same without the per-call agreement (fddp.set_checks(agreement=False) for this mode's
    # steps only; every rank runs the modes in the same order): what the agreement costs.
    modes["grad_and_value_noagree"] = unagreed(fddp_mode(overlapped()))
    modes["ddp_step_noagree"] = unagreed(fddp_mode(lambda p, loss, x, y: fddp.ddp_step(p, torch.func.grad(loss)(p, x, y), **caps)))
    # The same without the error channel and the header's fingerprint (patched out, see lean()): what
    # the failure handling of issue 30 costs a step.
    modes["grad_and_value_lean"] = lean(fddp_mode(overlapped()))
    modes["ddp_step_lean"] = lean(fddp_mode(lambda p, loss, x, y: fddp.ddp_step(p, torch.func.grad(loss)(p, x, y), **caps)))
    modes["grad_and_value_donated"] = fddp_mode(overlapped(), donate=True)
    modes["grad_and_value_optax"] = fddp_mode(overlapped(), split=True)
    modes["grad_and_value_bf16"] = fddp_mode(overlapped("bf16"))
    modes["grad_and_value_psgd1"] = fddp_mode(overlapped(psgd1))
    if auto is not None:
        modes["grad_and_value_auto"] = fddp_mode(overlapped(None, auto["none"]))
        modes["grad_and_value_bf16_auto"] = fddp_mode(overlapped("bf16", auto["bf16"]))
        modes["grad_and_value_psgd1_auto"] = fddp_mode(overlapped(psgd1, auto["psgd1"]))
    modes["compiled"] = fddp_mode(lambda p, loss, x, y: fddp.ddp_step(p, torch.func.grad(loss)(p, x, y), **caps), compile_=True)
    return modes


# ------------------------------------------------------------------------------------------- measuring


def comm_of(mode: str, step: Callable, model: nn.Module, batch: tuple, caps: dict[str, float]) -> tuple[int, int]:
    """Collectives and bytes one step of ``mode`` sends, from this rank."""
    params = fddp.functionalize(model)[1]
    plan = plan_for(params) if mode == "ddp" else plan_for(params, **caps)
    if mode.startswith("floor"):
        return 0, 0
    if mode in ("ddp", "compiled"):
        # DDP's reducer and the compiled graph do not go through dist.all_reduce: count the plan
        # (DDP assigns buckets by the same rule, tested in tests/test_buckets.py).
        return len(plan.buckets), plan.nbytes
    # The steady state: a step after two of this mode (the first of a signature checks the tree).
    step(*batch)
    step(*batch)
    with Counter().active() as c:
        step(*batch)
    return c.calls, c.bytes


def time_steps(step: Callable, batch: tuple, n: int) -> float:
    off = agreement_off() if getattr(step, "agreement_off", False) else contextlib.nullcontext()
    with off:
        if getattr(step, "agreement_off", False):
            step(*batch)  # untimed: the first call after the switch sends the one header that says so
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            step(*batch)
        elapsed = torch.tensor([(time.perf_counter() - t0) / n])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def choose_auto_caps(model: nn.Module, batch: tuple) -> dict[str, Any]:
    """The ``_auto`` modes' bucket caps: one measured link and backward timeline, one choice per
    compression (what it sends per gradient byte), the same on every rank."""
    apply_fn, params = fddp.functionalize(copy.deepcopy(model))
    loss = _loss_fn(apply_fn)
    link = fddp.scaling.measure_link()
    out: dict[str, Any] = {"link": {"latency_s": link.latency, "bandwidth_Bps": link.bandwidth}, "choices": {}, "timelines": {}}
    caps = {}
    for key, compression in (("none", None), ("bf16", "bf16"), ("psgd1", fddp.PowerSGD(rank=1, start_iter=0))):
        # What fddp.scaling.auto_bucket_cap does, with the parts kept for the record.
        timeline = fddp.scaling.measure_timeline(loss, params, *batch, compression=compression)
        cost = fddp.scaling.measure_bucket_cost(loss, params, *batch, compression=compression)
        world = dist.get_world_size()
        choice = fddp.scaling.choose_bucket_cap(params, timeline, link, world, compression=compression, per_bucket=cost)
        choice = fddp.scaling.verify_bucket_cap(choice, loss, params, *batch, compression=compression)
        caps[key] = {"bucket_cap_mb": choice.bucket_cap_mb, "first_bucket_mb": choice.first_bucket_mb}
        out["choices"][key] = {**caps[key], "explain": choice.explain(), "per_bucket_s": cost, "measured_s": choice.measured}
        out["timelines"][key] = {"backward": timeline.backward, "ready": list(timeline.ready), "end": timeline.end}
    out["caps"] = caps
    return out


def model_and_batch(name: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The model (the same initialisation on every rank) and this rank's own batch."""
    ctor, shape = MODELS[name]
    torch.manual_seed(0)
    model = ctor()
    g = torch.Generator().manual_seed(1 + fddp.rank())
    vocab = getattr(ctor, "VOCAB", None)
    if vocab is not None:  # token ids, a sequence one token longer: inputs and their next tokens
        ids = torch.randint(0, vocab, (shape[0], shape[1] + 1), generator=g)
        return model, (ids[:, :-1].contiguous(), ids[:, 1:].reshape(-1))
    return model, (torch.randn(shape, generator=g), torch.randint(0, 10, (shape[0],), generator=g))


def bench_model(
    name: str, repeats: int, steps: int, warmup: int, only: list[str] | None = None, caps: dict[str, float] | None = None
) -> dict[str, Any]:
    model, batch = model_and_batch(name)
    caps = caps or {}
    auto = choose_auto_caps(model, batch) if only is None or any(m.endswith("_auto") for m in only) else None
    modes = make_modes(model, caps, None if auto is None else auto["caps"])
    if only is not None:  # the floors and DDP always run: every ratio and overhead needs them
        if unknown := set(only) - set(modes):
            raise SystemExit(f"--modes: no mode {sorted(unknown)}; the modes are {list(modes)}")
        modes = {m: f for m, f in modes.items() if m in only or m.startswith("floor") or m == "ddp"}
    for step in modes.values():  # warm up (and compile) every mode before timing any
        for _ in range(warmup):
            step(*batch)
    comm = {m: comm_of(m, s, model, batch, caps) for m, s in modes.items()}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))  # interleave, alternate order
        for m in order:
            times[m].append(time_steps(modes[m], batch, steps))
    med = {m: statistics.median(ts) for m, ts in times.items()}
    n_params = sum(p.numel() for p in model.parameters())
    return {
        "values": n_params,
        "tensors": len(list(model.parameters())),
        "caps": caps,
        "auto": auto,
        "modes": {
            m: {
                "median_ms": 1e3 * med[m],
                "all_ms": [1e3 * t for t in times[m]],
                "ratio_to_ddp": med[m] / med["ddp"],
                "collectives": comm[m][0],
                "bytes": comm[m][1],
            }
            for m in modes
        },
    }


def allocator() -> str:
    """How glibc's malloc was tuned for this run (it changes CPU step times a lot, for every mode).

    A pure step allocates fresh buffers (gradients, new parameters, optimizer state) every step;
    by default glibc hands large freed blocks back to the OS and page-faults them in again.
    """
    keys = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")
    tuned = {k: os.environ[k] for k in keys if k in os.environ}
    return ", ".join(f"{k}={v}" for k, v in tuned.items()) or "glibc defaults"


def _floor_of(mode: str) -> str:
    if mode == "ddp":
        return "floor_torch"
    return "floor_gav" if mode.startswith("grad_and_value") else "floor_fddp"


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    lines = [
        f"world size {dist.get_world_size()}, {args.repeats} repeats x {args.steps} steps, torch {torch.__version__}, "
        f"allocator: {allocator()}"
    ]
    for name, r in results.items():
        mds = r["modes"]
        lines.append(f"\n{name}: {r['values'] / 1e6:.2f}M values in {r['tensors']} tensors")
        width = max(len(m) for m in mds) + 2
        lines.append(f"  {'mode':<{width}}{'median ms':>10}{'x DDP':>8}{'comm ms':>9}{'colls':>7}{'MB sent':>9}")
        for m, d in mds.items():
            floor = mds[_floor_of(m)]["median_ms"]
            overhead = "" if m.startswith("floor") else f"{d['median_ms'] - floor:9.1f}"
            lines.append(
                f"  {m:<{width}}{d['median_ms']:10.1f}{d['ratio_to_ddp']:8.2f}{overhead:>9}{d['collectives']:7d}{d['bytes'] / 2**20:9.2f}"
            )
    lines.append(
        "\ncomm ms = median step minus its no-communication floor: floor_torch for ddp, floor_gav for the "
        "grad_and_value modes, floor_fddp for the rest"
    )
    print("\n".join(lines))


# Chart labels and colours: one hue family per kind of mode, grey for the no-communication floors.
PLOT_MODES = {
    "ddp": ("torch DDP (the reference)", "#222222"),
    "grad_and_value": ("fddp.grad_and_value, overlapped", "#1b7837"),
    "grad_and_value_donated": ("  the same, apply_gradients(donate=True)", "#5aae61"),
    "grad_and_value_optax": ("  the same, opt.update + apply_updates", "#a6dba0"),
    "grad_and_value_bf16": ("  the same, bf16 buckets", "#66bd63"),
    "grad_and_value_psgd1": ("  the same, PowerSGD rank 1", "#1a9850"),
    "grad_and_value_auto": ("  the same, automatic bucket cap", "#b8e186"),
    "grad_and_value_bf16_auto": ("  bf16, automatic bucket cap", "#d9f0a3"),
    "grad_and_value_psgd1_auto": ("  PowerSGD rank 1, automatic bucket cap", "#7fbc41"),
    "grad_and_value_noagree": ("  agreement off (set_checks)", "#f4a582"),
    "grad_and_value_lean": ("  no error channel, no fingerprint", "#fddbc7"),
    "ddp_step": ("fddp.ddp_step after torch.func.grad", "#2166ac"),
    "compiled": ("  the same, torch.compile'd", "#4393c3"),
    "ddp_step_bf16": ("  the same, bf16 buckets", "#92c5de"),
    "ddp_step_fp16": ("  the same, fp16 buckets", "#b2abd2"),
    "ddp_step_psgd1": ("  the same, PowerSGD rank 1", "#8073ac"),
    "ddp_step_psgd4": ("  the same, PowerSGD rank 4", "#542788"),
    "ddp_step_noagree": ("  the same, agreement off", "#f4a582"),
    "ddp_step_lean": ("  the same, no error channel", "#fddbc7"),
    "per_tensor": ("one all-reduce per tensor (no buckets)", "#b35806"),
    "floor_torch": ("floor: torch, no communication", "#bdbdbd"),
    "floor_gav": ("floor: grad_and_value, one-rank group", "#9e9e9e"),
    "floor_fddp": ("floor: torch.func.grad + fddp.optim", "#d9d9d9"),
}


def plot(data: dict[str, Any], path: str) -> None:
    """Draw ``step.json``'s ratios: one panel per model, a horizontal bar per mode, DDP = 1 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = data["results"]
    names = list(results)
    present = list(dict.fromkeys(m for n in names for m in results[n]["modes"]))
    modes = [m for m in PLOT_MODES if m in present] + [m for m in present if m not in PLOT_MODES]
    unlabelled = [m for m in modes if m not in PLOT_MODES]
    if unlabelled:  # a mode's name in snake_case is not a label a reader of the docs can read
        raise ValueError(f"benchmarks/step.py: no chart label for modes {unlabelled}: add them to PLOT_MODES")
    labels = [PLOT_MODES[m][0] for m in modes]
    colours = [PLOT_MODES[m][1] for m in modes]
    top = max(d["ratio_to_ddp"] for n in names for d in results[n]["modes"].values())
    # Two panels a row: four side by side made a figure that a docs page shrinks until its labels
    # are a few pixels high.
    ncols = min(2, len(names))
    nrows = -(-len(names) // ncols)
    fig, grid = plt.subplots(
        nrows, ncols, figsize=(4.6 + 3.4 * ncols, nrows * (0.3 * len(modes) + 1.3) + 0.9), sharey=True, squeeze=False
    )
    axes = [ax for row in grid for ax in row]
    ys = list(range(len(modes)))
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(axes, names):
        r = results[name]
        ratios = [r["modes"][m]["ratio_to_ddp"] if m in r["modes"] else 0.0 for m in modes]
        ax.barh(ys, ratios, color=colours, edgecolor="white", height=0.78)
        for y, v in zip(ys, ratios):
            if v >= 1.0:  # right of the bar; a bar that ends left of the DDP line gets it inside
                ax.text(v + 0.03, y, f"{v:.2f}", va="center", fontsize=10)
            elif v:
                ax.text(v - 0.03, y, f"{v:.2f}", va="center", ha="right", fontsize=10, color="#111111")
        ax.axvline(1.0, color="#222222", lw=1, ls="--")
        ax.set_xlim(0, top * 1.2)
        ax.set_title(f"{name}: {r['values'] / 1e6:.1f}M values, {r['tensors']} tensors", fontsize=12)
        # The reference is named under the axis: a label above the top bar ran into the panel's title.
        ax.set_xlabel("step time ÷ torch DDP's (dashed: DDP = 1)", fontsize=11)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="y", length=0)
        ax.tick_params(axis="x", labelsize=10)
    for row in grid:
        row[0].set_yticks(ys, labels, fontsize=11)
    axes[0].invert_yaxis()  # the reference on top (shared: every panel)
    args = data.get("args", {})
    fig.suptitle(
        "One data-parallel training step, relative to torch DDP (left of the dashed line: faster)",
        fontsize=14, x=0.01, y=0.995, ha="left",
    )  # fmt: skip
    fig.text(
        0.01, 1 - 0.62 / fig.get_figheight(),
        f"{data.get('world_size', '?')} gloo processes on CPU, torch {data.get('torch', '?')}, SGD with momentum; "
        f"medians of {args.get('repeats', '?')} repeats of {args.get('steps', '?')} steps (the slowest rank's)",
        fontsize=11, color="#444444", ha="left",
    )  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / fig.get_figheight()))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps per timed block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=None, help="run only these modes (and the floors and ddp)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None, help="bucket cap of the fddp modes but the _auto ones (default 25)")
    parser.add_argument("--first-bucket-mb", type=float, default=None, help="first bucket's cap of those modes (default 1)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "step"))
    parser.add_argument("--replot", action="store_true", help="redraw <out>.png from <out>.json; measure nothing")
    args = parser.parse_args()
    if args.replot:
        with open(args.out + ".json") as f:
            plot(json.load(f), args.out + ".png")
        return
    torch.set_num_threads(1)  # 2 ranks share 2 cores, for DDP and fddp alike
    fddp.init()
    load_before = os.getloadavg()  # a figure for the README needs an idle machine: record how idle
    results = {}
    for name in args.models:
        caps = {k: v for k, v in (("bucket_cap_mb", args.bucket_cap_mb), ("first_bucket_mb", args.first_bucket_mb)) if v is not None}
        results[name] = bench_model(name, args.repeats, args.steps, args.warmup, args.modes, caps)
    if fddp.is_main():
        report(results, args)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            meta = {
                "world_size": dist.get_world_size(),
                "torch": torch.__version__,
                "allocator": allocator(),
                "args": vars(args),
                "load_avg": {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()},
            }
            data = {**meta, "results": results}
            json.dump(data, f, indent=1)
        plot(data, args.out + ".png")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
