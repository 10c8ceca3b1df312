"""What torch's own sharding wrappers give under torch.func, per torch version: the docs' claim, re-measured.

    torchrun --standalone --nproc-per-node=2 benchmarks/fsdp2_transforms.py

A 2-layer MLP wrapped by FSDP2 (``torch.distributed.fsdp.fully_shard``, each layer and the root)
goes through ``torch.func.grad``: with respect to its own (DTensor) parameters through
``torch.func.functional_call``, with respect to full plain parameters handed to
``functional_call``, and with respect to its input; the same model wrapped by ``replicate``
(torch's composable DDP) through ``torch.func.jvp`` with respect to its parameters and to its
input. Each outcome is compared with the unwrapped model: "equal", "all zero", the largest
difference, or the exception. Prints JSON and
writes it to ``benchmarks/results/fsdp2_transforms_<torch version>.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def _make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _outcome(run) -> str:
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - what torch does is the result
        return f"raises {type(e).__name__}: {' '.join(str(e).split())[:160]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    r = dist.get_rank()
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1 + r))
    ref = _make()
    rp = dict(ref.named_parameters())
    ref_g = torch.func.grad(lambda p: torch.func.functional_call(ref, p, (x,)).pow(2).sum())(rp)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    def fsdp2_grad() -> str:
        m = _make()
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        g = torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).pow(2).sum())(dict(m.named_parameters()))
        full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in g.items()}
        if all(float(v.abs().max()) == 0 for v in full.values()):
            return "all zero"
        err = max(float((full[k] - ref_g[k]).abs().max()) for k in full)
        return "equal" if err == 0 else f"largest difference {err:.2e}"

    def fsdp2_grad_full() -> str:  # the parameters handed to functional_call as plain full tensors
        m = _make()
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        full_params = {k: v.full_tensor().detach() for k, v in m.named_parameters()}
        g = torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).pow(2).sum())(full_params)
        if all(float(v.abs().max()) == 0 for v in g.values()):
            return "all zero"
        err = max(float((g[k] - ref_g[k]).abs().max()) for k in g)
        return "equal" if err == 0 else f"largest difference {err:.2e}"

    def fsdp2_input_grad() -> str:
        m = _make()
        fully_shard(m[0], mesh=mesh)
        fully_shard(m, mesh=mesh)
        g = torch.func.grad(lambda v: m(v).pow(2).sum())(x)
        r = torch.func.grad(lambda v: ref(v).pow(2).sum())(x)
        return "all zero" if float(g.abs().max()) == 0 else f"largest difference {float((g - r).abs().max()):.2e}"

    def replicate_input_jvp() -> str:
        from torch.distributed._composable.replicate import replicate

        m = replicate(_make())
        y, ty = torch.func.jvp(lambda v: m(v).sum(), (x,), (torch.ones_like(x),))
        ry, rty = torch.func.jvp(lambda v: ref(v).sum(), (x,), (torch.ones_like(x),))
        return f"value off by {float((y - ry).abs()):.2e}, tangent off by {float((ty - rty).abs()):.2e}"

    def replicate_jvp() -> str:
        from torch.distributed._composable.replicate import replicate

        m = replicate(_make())
        ones = {k: torch.ones_like(v) for k, v in rp.items()}
        y, ty = torch.func.jvp(lambda p: torch.func.functional_call(m, p, (x,)).sum(), (dict(m.named_parameters()),), (ones,))
        ry, rty = torch.func.jvp(lambda p: torch.func.functional_call(ref, p, (x,)).sum(), (rp,), (ones,))
        return f"value off by {float((y - ry).abs()):.2e}, tangent off by {float((ty - rty).abs()):.2e}"

    out = {
        "torch": torch.__version__,
        "fsdp2: torch.func.grad w.r.t. its DTensor parameters": _outcome(fsdp2_grad),
        "fsdp2: torch.func.grad w.r.t. full parameters given to functional_call": _outcome(fsdp2_grad_full),
        "fsdp2: torch.func.grad w.r.t. the input": _outcome(fsdp2_input_grad),
        "replicate: torch.func.jvp w.r.t. its parameters": _outcome(replicate_jvp),
        "replicate: torch.func.jvp w.r.t. the input": _outcome(replicate_input_jvp),
    }
    if r == 0:
        print(json.dumps(out, indent=1))
        version = torch.__version__.split("+")[0]
        path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"fsdp2_transforms_{version}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
