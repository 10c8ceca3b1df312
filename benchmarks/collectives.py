"""What each differentiable collective returns under each torch.func transform, fddp's and torch's.

    torchrun --standalone --nproc-per-node=2 benchmarks/collectives.py

For a sum, a gather and a reduce-scatter, three implementations side by side: fddp's
(``fddp.psum``, ``fddp.all_gather``, ``fddp.reduce_scatter``), torch's functional collectives
(``torch.distributed._functional_collectives``: ``all_reduce``, ``all_gather_tensor_autograd``,
``reduce_scatter_tensor_autograd``) and ``torch.distributed.nn.functional`` (``all_reduce``,
``all_gather``, ``reduce_scatter``). Each runs ``f(x) = post(x, C(x * x))`` under each transform,
and the result is compared with a one-process run of every rank at once (the ranks stacked on a
leading axis, each collective spelled out as a sum, a stack or a chunk of a sum; the transform
applied to that stacked program with every rank's seeds alike). A cell says ``correct``,
``wrong`` (with the largest difference) or the exception's type and first words; float64
integer-valued data, so ``correct`` is bitwise.

Then the per-call cost of a small ``fddp.psum`` (its agreement included) against
``torch.distributed.all_reduce`` of the same tensor, median of ``--repeats`` interleaved calls.

Prints both tables and writes ``benchmarks/results/collectives.json`` (``--out``), which the docs
page "Collectives under transforms" shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.nn.functional as dnn
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import fddp

K = 2  # values per rank


def _implementations(n: int) -> dict[str, dict[str, Callable[[torch.Tensor], torch.Tensor]]]:
    world = dist.group.WORLD

    def dnn_scatter(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape[0] // n, dtype=t.dtype)
        return dnn.reduce_scatter(out, list(t.chunk(n)))

    return {
        "fddp": {
            "sum": fddp.psum,
            "gather": lambda t: fddp.all_gather(t, tiled=True),
            "scatter": lambda t: fddp.reduce_scatter(t, tiled=True),
        },
        "torch funcol": {
            "sum": lambda t: funcol.wait_tensor(funcol.all_reduce(t, "sum", world)),
            "gather": lambda t: funcol.wait_tensor(funcol.all_gather_tensor_autograd(t, 0, world)),
            "scatter": lambda t: funcol.wait_tensor(funcol.reduce_scatter_tensor_autograd(t, "sum", 0, world)),
        },
        "torch.distributed.nn": {
            "sum": dnn.all_reduce,
            "gather": lambda t: torch.cat(dnn.all_gather(t)),
            "scatter": dnn_scatter,
        },
    }


def _stacked(kind: str, x: torch.Tensor) -> torch.Tensor:
    """The collective on rank-stacked ``x`` (row r: rank r's value), as rank-stacked results."""
    n = x.shape[0]
    if kind == "sum":
        return x.sum(0, keepdim=True).expand_as(x)
    if kind == "gather":
        return x.reshape(1, -1).expand(n, -1)
    return torch.stack(x.sum(0).chunk(n))


def _post(kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The local part after the collective: it weighs every rank's values by this rank's."""
    if kind == "gather":
        return y.reshape(-1, x.shape[0]).sum(0) * x + y[: x.shape[0]]
    return y.sum() * x + x * y.repeat(x.shape[0] // y.shape[0]) if kind == "scatter" else y * x + y


def _data(kind: str, n: int, r: int, batch: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + r)
    shape = (K * n,) if kind == "scatter" else (K,)
    return torch.randint(-3, 4, shape if batch is None else (batch, *shape), generator=g).double()


def _cells(kind: str, C: Callable, n: int, r: int) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """transform -> (this rank's result with ``C``, the reference's for this rank), both lazy."""
    f = lambda x: _post(kind, x, C(x * x))  # noqa: E731
    F = lambda xs: vmap(lambda x, y: _post(kind, x, y))(xs, _stacked(kind, xs * xs))  # noqa: E731 - every rank at once
    x, xs = _data(kind, n, r), torch.stack([_data(kind, n, s) for s in range(n)])
    xb, xsb = _data(kind, n, r, 3), torch.stack([_data(kind, n, s, 3) for s in range(n)])
    zero, t, ts = torch.zeros_like(x), torch.ones_like(x) * (r + 1), torch.stack([torch.ones_like(x) * (s + 1) for s in range(n)])
    g_all = lambda v: grad(lambda w: F(w).sum())(v)  # noqa: E731 - every rank's gradient
    return {
        "forward": (lambda: f(x), lambda: F(xs)[r]),
        "backward()": (lambda: _backward(f, x), lambda: g_all(xs)[r]),
        "grad": (lambda: grad(lambda v: f(v).sum())(x), lambda: g_all(xs)[r]),
        "vjp": (lambda: vjp(f, x)[1](t)[0], lambda: vjp(F, xs)[1](ts)[0][r]),
        "jvp": (lambda: jvp(f, (x,), (t,))[1], lambda: jvp(F, (xs,), (ts,))[1][r]),
        "vmap": (lambda: vmap(f)(xb), lambda: vmap(F, in_dims=1, out_dims=1)(xsb)[r]),
        "jacrev": (lambda: jacrev(f)(x), lambda: jacrev(lambda v: F(v).sum(0))(xs)[:, r]),
        "jacfwd": (lambda: jacfwd(f)(x), lambda: jacfwd(lambda u: F(xs + u))(zero)[r]),
        "hessian": (lambda: hessian(lambda v: f(v).sum())(x), lambda: jacfwd(lambda u: g_all(xs + u))(zero)[r]),
        "torch.compile": (lambda: _compiled(f, x), lambda: (F(xs)[r], g_all(xs)[r])),
    }


def _backward(f: Callable, x: torch.Tensor) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    f(leaf).sum().backward()
    return leaf.grad


def _compiled(f: Callable, x: torch.Tensor) -> tuple:
    leaf = x.clone().requires_grad_(True)
    y = torch.compile(f, backend="aot_eager")(leaf)
    y.sum().backward()
    return y.detach(), leaf.grad


def _outcome(got: Callable[[], Any], want: Callable[[], Any]) -> str:
    try:
        a = got()
    except Exception as e:  # noqa: BLE001 - what each implementation does is the result
        text = " ".join(str(e).split())
        if "setup_context" in text:  # torch's words for it run to a paragraph
            return f"raises {type(e).__name__}: an autograd.Function without setup_context, which torch.func refuses"
        return f"raises {type(e).__name__}: {text[:100]}"
    a, b = _flat(a), _flat(want())
    if len(a) != len(b) or any(u.shape != v.shape for u, v in zip(a, b)):
        return "wrong shape"
    if a[0].grad_fn is None and b[0].grad_fn is not None:
        return "no gradient"
    err = max((u.detach() - v.detach()).abs().max().item() for u, v in zip(a, b))
    return "correct" if err == 0 else f"wrong (off by {err:g})"


def _flat(t: Any) -> list[torch.Tensor]:
    return [t] if isinstance(t, torch.Tensor) else [u for v in t for u in _flat(v)]


def _timings(repeats: int) -> dict[str, float]:
    """Median microseconds a call: fddp.psum of 64 float32 (its agreement included) against
    torch.distributed.all_reduce of the same."""
    t = torch.ones(64)
    rows = {"torch.distributed.all_reduce": lambda: dist.all_reduce(t.clone()), "fddp.psum": lambda: fddp.psum(t)}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, call in rows.items():
            dist.barrier()
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e6)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "collectives.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    fddp.init()
    n, r = fddp.world_size(), fddp.rank()
    table: dict[str, dict[str, dict[str, str]]] = {}
    for impl, fns in _implementations(n).items():
        for kind, C in fns.items():
            for transform, (got, want) in _cells(kind, C, n, r).items():
                table.setdefault(kind, {}).setdefault(transform, {})[impl] = _outcome(got, want)
            dist.barrier()  # an implementation that failed midway leaves no collective behind on one rank
    timings = _timings(args.repeats)
    if r == 0:
        for kind, rows in table.items():
            print(f"\n{kind} ({n} gloo ranks)")
            for transform, cells in rows.items():
                print(f"  {transform:<14}" + " | ".join(f"{impl}: {cell}" for impl, cell in cells.items()))
        print("\nper call (us, median of", args.repeats, "):", {k: round(v, 1) for k, v in timings.items()})
        data = {"world_size": n, "torch": torch.__version__, "table": table, "per_call_us": timings, "repeats": args.repeats,
                "load_avg": os.getloadavg()}  # fmt: skip
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    fddp.shutdown()


if __name__ == "__main__":
    main()
