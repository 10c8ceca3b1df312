"""Benchmark fddp.optim against torch.optim in the same run.

1. AdamW on ~100 parameter tensors / ~10M values: ``fddp.optim.adamw`` (``apply_gradients``, which
   runs torch's fused kernel on new buffers, or in place with ``donate=True``; ``update`` +
   ``apply_updates``; ``update`` alone) against
   ``torch.optim.AdamW(foreach=True).step()``, the reference, and ``AdamW(fused=True)`` for context.
2. An ensemble of 16 small models: one ``vmap(opt.update)`` + apply against a Python loop of 16
   ``torch.optim.AdamW`` steps.
3. Issue 54's optimizers on the model of 1: each one's ``apply_gradients`` against its torch.optim
   counterpart's ``step()`` (foreach, or fused where torch has a fused kernel, whichever is faster:
   the faster is the reference), ``rmsprop``/``adagrad``/``nadam``/``radam``/``adafactor``;
   ``lamb``/``lars``/``lion``, which torch.optim lacks, against ``torch.optim.AdamW(foreach=True)``
   for scale. And on an ensemble of 8 MLPs: ``vmap(opt.update)`` + apply against 8 torch.optim
   instances stepped in a loop.

   Why some are over 1.10x torch: ``apply_gradients`` is pure (params and state come back as new
   tensors) and runs torch's single-tensor arithmetic op for op (to equal it to the bit), so each
   line writes a new flat buffer where torch updates a leaf in place while it is in the cache; and
   gradients that did not come from fddp's sync (this benchmark's plain dict) are copied into flat
   buffers first. Adagrad's reference is torch's fused CPU kernel, one pass where the single-tensor
   arithmetic takes five. ``lamb``/``lars``/``lion`` run leaf by leaf (per-leaf norms).

Prints a table of medians and ratios and writes JSON (default ``benchmarks/results/optim.json``).

Usage:
    python benchmarks/optim.py [--repeats 21] [--out benchmarks/results/optim.json] [--small]

``--small``: a model of 10 tensors / ~0.1M values and an ensemble of 8 tiny MLPs (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Callable

import torch
from torch.func import stack_module_state, vmap

from fddp import optim


def median_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median wall time of each function, interleaving them so that all see the same machine load."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _large_layers(small: bool) -> list[torch.nn.Module]:
    # 50 Linear layers of 447x447: 100 tensors, ~10.0M values (small: 5 of 100x100).
    return [torch.nn.Linear(100, 100) for _ in range(5)] if small else [torch.nn.Linear(447, 447) for _ in range(50)]


def bench_large(repeats: int, small: bool = False) -> dict:
    torch.manual_seed(0)
    layers = _large_layers(small)
    tparams = [p for layer in layers for p in layer.parameters()]
    for p in tparams:
        p.grad = torch.randn_like(p)
    topt = torch.optim.AdamW(tparams, lr=1e-3, foreach=True)
    # Its own copy of the parameters: both torch optimizers step in place.
    fparams = [p.detach().clone().requires_grad_() for p in tparams]
    for p, q in zip(fparams, tparams):
        p.grad = q.grad.clone()
    topt_fused = torch.optim.AdamW(fparams, lr=1e-3, fused=True)

    params = {f"p{i}": p.detach().clone() for i, p in enumerate(tparams)}
    grads = {f"p{i}": p.grad.clone() for i, p in enumerate(tparams)}
    opt = optim.adamw(lr=1e-3)
    box = {"params": params, "state": opt.init(params)}
    box2 = {"params": params, "state": opt.init(params)}
    own = {k: v.clone() for k, v in params.items()}  # donated: updated in place, so its own copy
    box3 = {"params": own, "state": opt.init(own)}

    def fddp_apply_gradients():
        box2["params"], box2["state"] = optim.apply_gradients(opt, grads, box2["state"], box2["params"])

    def fddp_apply_gradients_donated():
        box3["params"], box3["state"] = optim.apply_gradients(opt, grads, box3["state"], box3["params"], donate=True)

    def fddp_step():
        updates, box["state"] = opt.update(grads, box["state"], box["params"])
        box["params"] = optim.apply_updates(box["params"], updates)

    def fddp_update_only():
        opt.update(grads, box["state"], box["params"])

    t = median_times(
        {
            "torch": topt.step,
            "torch_fused": topt_fused.step,
            "apply_gradients": fddp_apply_gradients,
            "apply_gradients_donated": fddp_apply_gradients_donated,
            "step": fddp_step,
            "update": fddp_update_only,
        },
        repeats,
    )
    t_torch = t["torch"]
    return {
        "tensors": len(tparams),
        "values": sum(p.numel() for p in tparams),
        "torch_adamw_foreach_s": t_torch,
        "torch_adamw_fused_s": t["torch_fused"],
        "fddp_apply_gradients_s": t["apply_gradients"],
        "fddp_apply_gradients_donated_s": t["apply_gradients_donated"],
        "fddp_update_and_apply_s": t["step"],
        "fddp_update_only_s": t["update"],
        "ratio_apply_gradients": t["apply_gradients"] / t_torch,
        "ratio_apply_gradients_donated": t["apply_gradients_donated"] / t_torch,
        "ratio_update_and_apply": t["step"] / t_torch,
        "ratio_update_only": t["update"] / t_torch,
        "ratio_torch_fused": t["torch_fused"] / t_torch,
    }


def bench_ensemble(repeats: int, n_models: int = 16) -> dict:
    torch.manual_seed(0)

    def make():
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                   torch.nn.ReLU(), torch.nn.Linear(64, 10))

    models = [make() for _ in range(n_models)]
    topts = []
    for m in models:
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        topts.append(torch.optim.AdamW(m.parameters(), lr=1e-3))

    stacked, _ = stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    grads = {k: torch.randn_like(v) for k, v in stacked.items()}
    opt = optim.adamw(lr=1e-3)
    box = {"params": stacked, "state": vmap(opt.init)(stacked)}
    vupdate = vmap(opt.update)

    def fddp_step():
        updates, box["state"] = vupdate(grads, box["state"], box["params"])
        box["params"] = optim.apply_updates(box["params"], updates)

    def torch_loop():
        for o in topts:
            o.step()

    t = median_times({"torch": torch_loop, "fddp": fddp_step}, repeats)
    t_torch, t_fddp = t["torch"], t["fddp"]
    return {
        "models": n_models,
        "tensors_per_model": len(list(models[0].parameters())),
        "values_per_model": sum(p.numel() for p in models[0].parameters()),
        "torch_loop_s": t_torch,
        "fddp_vmap_s": t_fddp,
        "speedup": t_torch / t_fddp,
    }


# Issue 54: (fddp optimizer, torch.optim class or None, shared keywords, torch-only keywords).
ZOO = {
    "rmsprop": (lambda: optim.rmsprop(lr=1e-3, momentum=0.9), torch.optim.RMSprop, dict(lr=1e-3, momentum=0.9)),
    "adagrad": (lambda: optim.adagrad(lr=1e-2), torch.optim.Adagrad, dict(lr=1e-2)),
    "nadam": (lambda: optim.nadam(lr=1e-3), torch.optim.NAdam, dict(lr=1e-3)),
    "radam": (lambda: optim.radam(lr=1e-3), torch.optim.RAdam, dict(lr=1e-3)),
    "adafactor": (lambda: optim.adafactor(lr=1e-2), torch.optim.Adafactor, dict(lr=1e-2)),
    "lamb": (lambda: optim.lamb(lr=1e-3, weight_decay=1e-2), None, None),
    "lars": (lambda: optim.lars(lr=0.1, weight_decay=1e-4), None, None),
    "lion": (lambda: optim.lion(lr=1e-4), None, None),
}


def _torch_variants(T, kw: dict, make_params: Callable[[], list]) -> dict[str, Callable[[], object]]:
    """torch's step with foreach=True and, where torch has a fused kernel for the CPU, fused=True."""
    out = {}
    for how in ("foreach", "fused"):
        ps = make_params()
        try:
            o = T(ps, **kw, **{how: True})
            o.step()  # a fused kernel missing for this device raises here
        except (RuntimeError, TypeError, ValueError):
            continue
        out[how] = o.step
    return out


def bench_zoo(repeats: int, small: bool = False) -> dict:
    """Each issue-54 optimizer's apply_gradients against its torch.optim counterpart, on bench_large's model."""
    torch.manual_seed(0)
    tparams = [p.detach() for layer in _large_layers(small) for p in layer.parameters()]
    grads_list = [torch.randn_like(p) for p in tparams]

    def torch_params() -> list:
        ps = [p.clone().requires_grad_() for p in tparams]
        for p, g in zip(ps, grads_list):
            p.grad = g.clone()
        return ps

    params = {f"p{i}": p.clone() for i, p in enumerate(tparams)}
    grads = {f"p{i}": g.clone() for i, g in enumerate(grads_list)}
    adamw = torch.optim.AdamW(torch_params(), lr=1e-3, foreach=True)
    out = {}
    for name, (make, T, kw) in ZOO.items():
        opt = make()
        box = {"params": params, "state": opt.init(params)}

        def fddp_apply(opt=opt, box=box):
            box["params"], box["state"] = optim.apply_gradients(opt, grads, box["state"], box["params"])

        fns = {"fddp": fddp_apply}
        if T is not None:
            fns.update({f"torch_{k}": v for k, v in _torch_variants(T, kw, torch_params).items()})
        else:
            fns["torch_adamw_foreach"] = adamw.step
        t = median_times(fns, repeats)
        ref = min((k for k in t if k.startswith("torch")), key=t.__getitem__)
        out[name] = {"fddp_apply_gradients_s": t["fddp"], "reference": ref, "reference_s": t[ref],
                     "ratio": t["fddp"] / t[ref], **{f"{k}_s": v for k, v in t.items() if k != "fddp"}}  # fmt: skip
    return out


def bench_zoo_ensemble(repeats: int, n_models: int = 8, small: bool = False) -> dict:
    """vmap(opt.update) + apply_updates over 8 stacked MLPs against 8 torch.optim instances in a loop."""
    torch.manual_seed(0)
    width = 16 if small else 64

    def make():
        return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                   torch.nn.ReLU(), torch.nn.Linear(width, 10))  # fmt: skip

    models = [make() for _ in range(n_models)]
    for m in models:
        for p in m.parameters():
            p.grad = torch.randn_like(p)
    stacked, _ = stack_module_state(models)
    stacked = {k: v.detach() for k, v in stacked.items()}
    grads = {k: torch.randn_like(v) for k, v in stacked.items()}
    out = {}
    for name, (make_opt, T, kw) in ZOO.items():
        if T is None:
            continue
        opt = make_opt()
        box = {"params": stacked, "state": vmap(opt.init)(stacked)}
        vupdate = vmap(opt.update)

        def fddp_step(box=box, vupdate=vupdate):
            updates, box["state"] = vupdate(grads, box["state"], box["params"])
            box["params"] = optim.apply_updates(box["params"], updates)

        topts = [T(m.parameters(), **kw) for m in models]  # torch's default path on the CPU

        def torch_loop(topts=topts):
            for o in topts:
                o.step()

        t = median_times({"torch": torch_loop, "fddp": fddp_step}, repeats)
        out[name] = {"torch_loop_s": t["torch"], "fddp_vmap_s": t["fddp"], "speedup": t["torch"] / t["fddp"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "optim.json"))
    ap.add_argument("--small", action="store_true", help="small models: a smoke test of every row")
    args = ap.parse_args()

    large = bench_large(args.repeats, args.small)
    ens = bench_ensemble(args.repeats)
    zoo = bench_zoo(args.repeats, args.small)
    zoo_ens = bench_zoo_ensemble(args.repeats, small=args.small)
    size = f"{large['tensors']} tensors/{large['values'] / 1e6:.1f}M"
    rows = [
        (f"adamw {size}: torch AdamW(foreach=True).step", large["torch_adamw_foreach_s"], "1.00x"),
        (f"adamw {size}: torch AdamW(fused=True).step", large["torch_adamw_fused_s"],
         f"{large['ratio_torch_fused']:.2f}x torch foreach"),
        (f"adamw {size}: fddp apply_gradients (fused)", large["fddp_apply_gradients_s"],
         f"{large['ratio_apply_gradients']:.2f}x torch (target <= 1.0x)"),
        (f"adamw {size}: fddp apply_gradients(donate=True)", large["fddp_apply_gradients_donated_s"],
         f"{large['ratio_apply_gradients_donated']:.2f}x torch"),
        (f"adamw {size}: fddp update+apply_updates", large["fddp_update_and_apply_s"],
         f"{large['ratio_update_and_apply']:.2f}x torch"),
        (f"adamw {size}: fddp update only", large["fddp_update_only_s"],
         f"{large['ratio_update_only']:.2f}x torch"),
        ("ensemble 16 MLPs: loop of 16 torch AdamW.step", ens["torch_loop_s"], "1.00x"),
        ("ensemble 16 MLPs: fddp vmap(update)+apply", ens["fddp_vmap_s"],
         f"{ens['speedup']:.2f}x faster (target >= 3x)"),
    ]
    for name, r in zoo.items():
        against = r["reference"].removeprefix("torch_")
        if name in ("lamb", "lars", "lion"):
            rows.append((f"{name} {size}: fddp apply_gradients", r["fddp_apply_gradients_s"],
                         f"{r['ratio']:.2f}x torch AdamW(foreach) (torch.optim has no {name})"))  # fmt: skip
        else:
            rows.append((f"{name} {size}: torch {name}({against}).step", r["reference_s"], "1.00x"))
            rows.append((f"{name} {size}: fddp apply_gradients", r["fddp_apply_gradients_s"], f"{r['ratio']:.2f}x torch {against}"))
    for name, r in zoo_ens.items():
        rows.append((f"ensemble 8 MLPs, {name}: loop of 8 torch steps", r["torch_loop_s"], "1.00x"))
        rows.append((f"ensemble 8 MLPs, {name}: fddp vmap(update)+apply", r["fddp_vmap_s"], f"{r['speedup']:.2f}x faster"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'case':62s} {'median ms':>10s}  ratio")
    for name, t, ratio in rows:
        print(f"{name:62s} {t * 1e3:10.2f}  {ratio}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
                   "large": large, "ensemble": ens, "zoo": zoo, "zoo_ensemble": zoo_ens}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
