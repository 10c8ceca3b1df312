"""A fully sharded unit's call as an autograd Function: its arguments and results flattened, the
random state it drew from, and recomputation (``remat="unit"``).

:class:`_Remat` keeps only a unit's inputs and gathers its parameters again in backward to
recompute the forward, with the random states of every device its tensors use restored (as
``torch.utils.checkpoint`` does), so a recomputed dropout draws the same mask.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import torch
import torch.utils._pytree as torch_pytree
import torch.utils.checkpoint as checkpoint
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack
from torch.autograd import forward_ad

from fddp.sync._differentiable import active_transforms
from fddp.zero import _autograd, _gather
from fddp.zero._autograd import GatherCall
from fddp.zero._units import Unit

__all__ = ["UnitCall", "Remat", "flatten_call"]

_functorch = torch._C._functorch


def _forward_mode() -> bool:
    """Whether forward-mode AD is on (a dual level, or a torch.func.jvp transform): save for jvp."""
    if forward_ad._current_level >= 0:
        return True
    return torch._C._are_functorch_transforms_active() and _functorch.TransformType.Jvp in active_transforms()


@dataclasses.dataclass(eq=False)
class UnitCall:
    """One call of one unit: the non-tensor arguments, the output's structure, the RNG state."""

    owner: Any  # the FullyShardedForward whose unit this is
    unit: Unit
    calls: tuple[GatherCall, ...]
    in_spec: Any
    in_leaves: list[Any]
    in_pos: tuple[int, ...]
    out_spec: Any = None
    out_leaves: list[Any] | None = None
    out_pos: tuple[int, ...] = ()
    rng: "_RngState | None" = None

    @property
    def nb(self) -> int:
        return len(self.calls)

    def run(self, fulls: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The unit's forward on these full buckets and tensor arguments; its output's tensors."""
        leaves = list(self.in_leaves)
        for p, t in zip(self.in_pos, tensors):
            leaves[p] = t
        args, kwargs = _unflatten_call(leaves, self.in_spec)
        with self.owner._swapped(self.unit, fulls):
            out = self.unit.forward(*args, **kwargs)
        out_leaves, self.out_spec = _flatten_out(out)
        self.out_pos = tuple(i for i, t in enumerate(out_leaves) if isinstance(t, torch.Tensor))
        self.out_leaves = [None if i in self.out_pos else t for i, t in enumerate(out_leaves)]
        return tuple(out_leaves[i] for i in self.out_pos)

    def rebuild(self, outs: Sequence[torch.Tensor]) -> Any:
        leaves = list(self.out_leaves)
        for p, t in zip(self.out_pos, outs):
            leaves[p] = t
        return _unflatten_out(leaves, self.out_spec)


# A unit's arguments and results, flattened to find their tensors: directly when they are flat
# (tensors and plain constants: the common case, a tenth of torch's pytree's cost), else by pytree.
_FLAT = (torch.Tensor, type(None), bool, int, float, str)


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    if all(isinstance(a, _FLAT) for a in args) and all(isinstance(v, _FLAT) for v in kwargs.values()):
        return [*args, *kwargs.values()], (len(args), tuple(kwargs))
    return torch_pytree.tree_flatten((args, kwargs))


def _unflatten_call(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    if type(spec) is tuple:
        n, keys = spec
        return tuple(leaves[:n]), dict(zip(keys, leaves[n:]))
    return torch_pytree.tree_unflatten(leaves, spec)


def _flatten_out(out: Any) -> tuple[list[Any], Any]:
    if isinstance(out, torch.Tensor):
        return [out], None
    if type(out) is tuple and all(isinstance(o, _FLAT) for o in out):
        return list(out), len(out)
    return torch_pytree.tree_flatten(out)


def _unflatten_out(leaves: list[Any], spec: Any) -> Any:
    if spec is None:
        return leaves[0]
    if type(spec) is int:
        return tuple(leaves)
    return torch_pytree.tree_unflatten(leaves, spec)


@dataclasses.dataclass(frozen=True, eq=False)
class _RngState:
    """The random states a unit's forward drew from: the CPU generator's and, as
    ``torch.utils.checkpoint`` saves them, each accelerator's its tensors live on."""

    cpu: torch.Tensor
    device_type: str
    devices: tuple[int, ...]
    states: tuple[torch.Tensor, ...]


def _save_rng(tensors: Sequence[torch.Tensor]) -> _RngState:
    one_each = list({t.device: t for t in tensors}.values())  # a device's state once, however many tensors live there
    devices, states = checkpoint.get_device_states(*one_each)
    device_type = checkpoint._infer_device_type(*one_each) if devices else "cpu"
    return _RngState(torch.get_rng_state(), device_type, tuple(devices), tuple(states))


@contextlib.contextmanager
def _rng(state: _RngState | None):
    """Run with the random states the forward saw (a unit with dropout recomputes the same mask on
    every device), leaving the surrounding states as they were."""
    if state is None:
        yield
        return
    with torch.random.fork_rng(devices=list(state.devices), device_type=state.device_type if state.devices else "cuda"):
        torch.set_rng_state(state.cpu)
        if state.devices:
            checkpoint.set_device_states(list(state.devices), list(state.states), device_type=state.device_type)
        yield


class Remat(torch.autograd.Function):
    """A unit's call that keeps neither its full parameters nor its activations for backward.

    ``apply(ucall, *shards, *fulls, *tensors)``: ``fulls`` are the gathered buckets (the gradient
    flows to them, and from there through the gather's backward to the shards); ``shards`` ride
    along only to be gathered again in backward.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(ucall: UnitCall, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        nb = ucall.nb
        ucall.rng = _save_rng(args)
        outs = ucall.run(args[nb : 2 * nb], args[2 * nb :])
        # An output that is an input would make autograd treat it as a view of it: a copy instead.
        return tuple(o.clone() if any(o is a for a in args) else o for o in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ucall = inputs[0]
        nb = ucall.nb
        ctx.ucall = ucall
        ctx.set_materialize_grads(False)
        saved = (*inputs[1 : 1 + nb], *inputs[1 + 2 * nb :])
        ctx.save_for_backward(*saved)
        if _forward_mode():
            ctx.save_for_forward(*saved)

    @staticmethod
    def backward(ctx: Any, *cts: torch.Tensor | None) -> tuple:
        ucall = ctx.ucall
        nb = ucall.nb
        saved = ctx.saved_tensors
        shards, tensors = saved[:nb], list(saved[nb:])
        live = [j for j, ct in enumerate(cts) if ct is not None]
        if not live:
            return (None,) * (1 + 2 * nb + len(tensors))
        ucall.calls[0].pipe.enter_backward()
        # Gathered again: plainly when nothing wraps the shards; else through the Function, whose
        # jvp carries an outer forward-mode level's tangents (forward-over-reverse).
        plain = _gather.constants((*shards, *cts))
        fulls = tuple(
            _autograd.gather_plain(c.again(), _gather.plain(s)) if plain else _autograd.gather(c.again(), s)
            for c, s in zip(ucall.calls, shards)
        )
        needs = ctx.needs_input_grad[1 + 2 * nb :]
        diff = [i for i, t in enumerate(tensors) if needs[i] and (t.is_floating_point() or t.is_complex())]

        def f(fulls_: tuple, diff_: tuple) -> tuple:
            ts = list(tensors)
            for i, t in zip(diff, diff_):
                ts[i] = t
            with _rng(ucall.rng):
                outs = ucall.run(fulls_, ts)
            return tuple(outs[j] for j in live)

        primals = tuple(tensors[i] for i in diff)
        if plain:
            # Plain tensors, constants for every active transform (torch.func.grad's backward runs
            # below its own level, and so does .backward()): autograd itself, eagerly, without
            # torch.func.vjp's wrapping of every op (a third of the step on the benchmark transformer).
            with temporarily_clear_interpreter_stack(), torch.enable_grad():
                ins = [t.detach().requires_grad_() for t in (*fulls, *primals)]
                outs = f(tuple(ins[:nb]), tuple(ins[nb:]))
                got = torch.autograd.grad(outs, ins, [cts[j].detach() for j in live], allow_unused=True)
            got = [torch.zeros_like(t) if g is None else g for t, g in zip(ins, got)]
            g_fulls, g_diff = got[:nb], got[nb:]
        else:
            with torch.enable_grad():
                _, vjp_fn = torch.func.vjp(f, fulls, primals)
                g_fulls, g_diff = vjp_fn(tuple(cts[j] for j in live))
        grads: list[Any] = [None] * len(tensors)
        for i, g in zip(diff, g_diff):
            grads[i] = g
        return (None, *([None] * nb), *g_fulls, *grads)

    @staticmethod
    def jvp(ctx: Any, _ucall_tangent: Any, *tangents: torch.Tensor | None) -> tuple:
        ucall = ctx.ucall
        nb = ucall.nb
        saved = ctx.saved_tensors
        shards, tensors = saved[:nb], list(saved[nb:])
        fulls = tuple(_autograd.gather(c.plain_call(), s) for c, s in zip(ucall.calls, shards))
        t_fulls = tuple(torch.zeros_like(f) if t is None else t for f, t in zip(fulls, tangents[nb : 2 * nb]))
        diff = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]
        t_tensors = tangents[2 * nb :]
        t_diff = tuple(torch.zeros_like(tensors[i]) if t_tensors[i] is None else t_tensors[i] for i in diff)

        def f(fulls_: tuple, diff_: tuple) -> tuple:
            ts = list(tensors)
            for i, t in zip(diff, diff_):
                ts[i] = t
            with _rng(ucall.rng):
                return ucall.run(fulls_, ts)

        _, t_out = torch.func.jvp(f, (fulls, tuple(tensors[i] for i in diff)), (t_fulls, t_diff))
        return tuple(t if t.is_floating_point() or t.is_complex() else None for t in t_out)


# -------------------------------------------------------------------------------- the sharded forward
