"""``ddp_step`` as a citizen of autograd and torch.func, with JAX's ``lax.pmean`` semantics.

The mean over ranks is linear, so its derivatives are means too. Following JAX's convention, the
objective being differentiated is the *sum of every rank's objective*: the VJP of the mean over
ranks is the same mean over ranks of the cotangents (one bucketed all-reduce in backward, with the
forward's buckets, order and dtypes), and forward mode averages the tangents. For the weighted
mean ``sum_r w_r g_r / W`` the VJP on rank ``r`` is ``w_r / W * sum_s ct_s`` and the JVP is the
weighted mean of the tangents; the weights themselves are constants. Compressed modes (casts,
PowerSGD, user hooks) have no derivative and raise when differentiated. Under ``vmap`` the
members of an ensemble are stacked in each bucket, so one collective per bucket carries them all.

Three paths, chosen per call:

- no transform, no forward-mode level, nothing requiring grad: the plain eager sync, untouched
  (``needed`` is false and ``ddp_step`` never comes here);
- eagerly otherwise: :class:`_Mean`, an ``autograd.Function`` with ``setup_context``, a
  ``backward`` and a ``jvp`` that call it again (so it is differentiable to any order) and a
  ``vmap`` rule that runs it once on the stacked members;
- while ``torch.compile`` traces: :class:`_TracedMean`, an old-style Function over functional
  collectives (dynamo traces neither custom ``jvp`` nor ``vmap`` rules, nor eager async
  collectives). There only the plain mean is differentiable, and ``jvp``/``vmap`` raise.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
from typing import Any, Sequence

import optree
import torch
import torch.distributed as dist
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch.autograd import forward_ad

from fddp import _dist, _layout
from fddp._tree import LeafSpec
from fddp.sync._comm import on_host
from fddp.sync._reducer import SyncInfo
from fddp.sync._setup import SyncOptions, setup
from fddp.sync.hooks import LOW_PRECISION, Mean, WeightedMean

__all__ = [
    "needed", "ddp_step", "active_transforms", "transform_levels", "transform_stack", "derivatives", "refuse_under_transforms",
    "refuse_compiled_rules", "zeros_for_none",
]

_functorch = torch._C._functorch
_TT = _functorch.TransformType
_TRANSFORM_NAMES = {
    _TT.Grad: "torch.func.grad (or vjp, jacrev)",
    _TT.Jvp: "torch.func.jvp (or jacfwd)",
    _TT.Vmap: "torch.func.vmap",
    _TT.Functionalize: "torch.func.functionalize",
}
_TINY = torch.finfo(torch.float64).tiny


def active_transforms() -> list[Any]:
    """The active torch.func transforms, innermost first (eagerly and while dynamo traces)."""
    keys: list[Any] = []

    def walk() -> None:
        if not torch._C._are_functorch_transforms_active():
            return
        interp = retrieve_current_functorch_interpreter()
        keys.append(interp.key())
        with interp.lower():
            walk()

    walk()
    return keys


def transform_levels() -> tuple[tuple[int, str], ...]:
    """The active torch.func levels, innermost first: each level's number and its transform in
    words, a ``vmap``'s with its batch size (what shapes a batched call's collectives)."""
    levels: list[tuple[int, str]] = []

    def walk() -> None:
        if not torch._C._are_functorch_transforms_active():
            return
        interp = retrieve_current_functorch_interpreter()
        key = interp.key()
        levels.append((interp.level(), f"vmap({interp.batch_size()})" if key == _TT.Vmap else _name(key)))
        with interp.lower():
            walk()

    walk()
    return tuple(levels)


def transform_stack(levels: tuple[tuple[int, str], ...] | None = None) -> tuple[str, ...]:
    """The active torch.func transforms in words, innermost first, with each ``vmap``'s batch size,
    and whether a forward-mode dual level is open. ``levels``: :func:`transform_levels`, where the
    caller has them."""
    stack = [word for _, word in (transform_levels() if levels is None else levels)]
    if forward_ad._current_level >= 0:
        stack.append("dual level")
    return tuple(stack)


def derivatives(tensors: Sequence[torch.Tensor], levels: tuple[tuple[int, str], ...] | None = None) -> list[str]:
    """What each active torch.func level (innermost first) makes of each tensor, in words:
    ``batched`` (a ``vmap`` level), ``tracked`` (a grad level differentiates it), ``tangent`` (a
    ``jvp`` level gives it one; the levels below that batch the tangent or give it a tangent of
    its own follow in brackets), ``-`` (the level passes it by); then, below every level,
    ``tracked`` where it requires grad and ``dual`` where a forward-mode dual level gives it a
    tangent. ``levels``: :func:`transform_levels`, where the caller has them.

    A function whose derivative rules issue collectives (a fully sharded gather: its tangent is
    gathered too, its cotangent reduced) issues them according to this, not to the stack alone:
    ``jvp`` with respect to the input and with respect to the parameters run under the same
    stack, and only the second gathers tangents.

    Example:
        >>> jacfwd(lambda s: derivatives([s]) and s)(s)  # ['jvp: tangent [vmap: batched], vmap: -']
    """
    levels = transform_levels() if levels is None else levels
    if any(word == "jvp" for _, word in levels):
        out = []
        for t in tensors:  # a tangent is unpacked with the interpreters lowered to its level
            words: list[str] = []
            _describe(t, words)
            out.append(", ".join(words))
        return out
    return [_describe_levels(t, levels) for t in tensors]


def _base(t: torch.Tensor, words: list[str]) -> None:
    """Below every level: tracked by autograd, a tangent of a forward-mode dual level."""
    if t.requires_grad:
        words.append("tracked")
    if forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None:
        words.append("dual")


def _describe_levels(t: torch.Tensor, levels: tuple[tuple[int, str], ...]) -> str:
    """:func:`derivatives` of one tensor without a ``jvp`` level: its wrappers peeled level by
    level, without entering the interpreters (a seventh of the cost, on the training path)."""
    words: list[str] = []
    for level, word in levels:
        name = "vmap" if word.startswith("vmap") else word
        if _functorch.maybe_get_level(t) != level:
            words.append(f"{name}: -")
        elif name == "vmap":
            t = _functorch.get_unwrapped(t)
            words.append("vmap: batched")
        elif name == "grad":
            words.append("grad: tracked" if t.requires_grad else "grad: -")
            t = _functorch._unwrap_for_grad(t, level)
        else:  # functionalize: its wrapper kept, which no level below unwraps
            words.append(f"{name}: -")
    _base(t, words)
    return ", ".join(words)


def _describe(t: torch.Tensor, words: list[str]) -> None:
    if not torch._C._are_functorch_transforms_active():
        _base(t, words)
        return
    interp = retrieve_current_functorch_interpreter()
    level, key = interp.level(), interp.key()
    inner, word = t, "-"
    if _functorch.maybe_get_level(t) == level:  # wrapped by this level (else it passes it by)
        if key == _TT.Vmap:
            inner, word = _functorch.get_unwrapped(t), "batched"
        elif key == _TT.Jvp:
            primal, tangent = forward_ad.unpack_dual(t)
            inner = _functorch._unwrap_for_grad(primal, level)
            if tangent is not None:
                below: list[str] = []
                with interp.lower():
                    _describe(_functorch._unwrap_for_grad(tangent, level), below)
                shown = [w for w in below if not w.endswith(": -")]
                word = f"tangent [{', '.join(below)}]" if shown else "tangent"
        elif key == _TT.Grad:
            inner, word = _functorch._unwrap_for_grad(t, level), "tracked" if t.requires_grad else "-"
    words.append(f"{_name(key)}: {word}")
    with interp.lower():
        _describe(inner, words)


def _name(key: Any) -> str:
    return "vmap" if key == _TT.Vmap else str(key).rsplit(".", 1)[-1].lower()


def refuse_under_transforms(what: str, instead: str = "") -> None:
    """Raise, naming ``fddp.<what>`` and the transform, if a torch.func transform is active.

    Every rank runs the same code, so every rank raises here, before any collective: no hang.
    """
    if torch.compiler.is_compiling() or not torch._C._are_functorch_transforms_active():
        return
    name = _TRANSFORM_NAMES.get(active_transforms()[0], "a torch.func transform")
    raise RuntimeError(f"fddp.{what} cannot run inside {name}{'; ' + instead if instead else ''}")


def refuse_compiled_rules(what: str, leaves: Sequence[torch.Tensor] = ()) -> None:
    """Raise, naming ``fddp.<what>``, where a ``jvp`` or ``vmap`` level is active while dynamo
    traces: it traces neither a custom Function's forward-mode nor its batching rule. Nested
    ``grad`` levels too: dynamo traces the derivative of the innermost one only, and the outer
    level's gradient through the collective comes out wrong without an error (measured on
    ``grad(grad(...))`` of ``psum`` and of ``ddp_step``). For the same reason, a ``grad`` level
    whose inputs (``leaves``) autograd also tracks beneath it: the compiled function's result
    differentiated again by ``backward()``."""
    keys = active_transforms()
    for key in keys:
        if key in (_TT.Jvp, _TT.Vmap):
            raise NotImplementedError(
                f"fddp.{what} cannot run inside {_TRANSFORM_NAMES[key]} within torch.compile (torch "
                f"{torch.__version__} traces neither its forward-mode nor its batching rule); call it eagerly there"
            )
    if keys.count(_TT.Grad) > 1:
        raise NotImplementedError(
            f"fddp.{what} cannot run inside nested torch.func.grad levels (grad of grad, hessian by jacrev(jacrev)) "
            f"within torch.compile: torch {torch.__version__}'s dynamo keeps the custom derivative of one level only, "
            "and the other's would be wrong; differentiate twice eagerly, or compile the inner grad alone"
        )
    if _TT.Grad in keys and leaves:
        level = next(lv for lv, word in transform_levels() if word == "grad")  # the one grad level
        if _any_requires_grad_py(*(_functorch._unwrap_for_grad(t, level) for t in leaves)):
            raise NotImplementedError(
                f"fddp.{what} cannot run inside torch.func.grad within torch.compile on an input that autograd also "
                "tracks beneath that grad (a tensor that requires grad, such as a module's parameter, passed to the "
                f"compiled function): backward() through the result would be wrong, as torch {torch.__version__}'s "
                "dynamo keeps one level's custom derivative only; pass detached tensors (fddp.functionalize's "
                "params are), or differentiate twice eagerly"
            )


def zeros_for_none(ts: Sequence[torch.Tensor | None], metas: Sequence[tuple]) -> list[torch.Tensor]:
    """Tangents or cotangents with a zero one, of ``(shape, dtype, device)`` from ``metas``, in
    place of each ``None`` (an input or output the transform does not carry)."""
    return [torch.zeros(s, dtype=d, device=v) if t is None else t for t, (s, d, v) in zip(ts, metas)]


def needed(leaves: list[Any]) -> bool:
    """Whether ``ddp_step`` must take a differentiable path for these gradient leaves."""
    if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
        return True
    if forward_ad._current_level >= 0:  # a dual level is open: tangents may ride on the leaves
        return True
    if not torch.is_grad_enabled():
        return False
    if any(map(operator.is_, leaves, itertools.repeat(None))):
        leaves = [t for t in leaves if t is not None]
    return _any_requires_grad(*leaves)


def _any_requires_grad_py(*tensors: torch.Tensor) -> bool:
    return any(t.requires_grad for t in tensors)


_any_requires_grad = getattr(torch._C, "_any_requires_grad", _any_requires_grad_py)


@dataclasses.dataclass(frozen=True, eq=False)
class _Call:
    """One application of the mean: everything but the tensors.

    ``members`` are one member's leaf specs (the shapes at the ``ddp_step`` call), which fix the
    buckets under any number of ``vmap`` levels. ``infos`` receives the forward's ``SyncInfo``.
    """

    options: SyncOptions
    spec: optree.PyTreeSpec
    members: tuple[LeafSpec, ...]
    state: Any = None
    weight: torch.Tensor | None = None
    infos: list = dataclasses.field(default_factory=list)
    plan: _layout.BucketPlan | None = None  # while dynamo traces: the buckets, planned outside the Function
    what: str = "ddp_step"  # its own name in the agreement: a backward on one rank only is a mismatch

    def derived(self, *, weighted: bool, mode: str) -> "_Call":
        """The call that averages cotangents (``mode="backward"``) or tangents (``"forward mode"``):
        the same buckets, no finite check, its own name in the agreement."""
        o = self.options
        weighted = weighted and self.weight is not None
        hook = WeightedMean() if weighted else Mean()
        options = dataclasses.replace(o, hook=hook, weighted=weighted, check_finite=False)
        what = f"{self.what.split(' (')[0]} ({mode})"
        return _Call(options, self.spec, self.members, weight=self.weight if weighted else None, plan=self.plan, what=what)

    def describe(self) -> str:
        return f"compression={self.options.hook!r}"


def _differentiable(options: SyncOptions) -> bool:
    return type(options.hook) in (Mean, WeightedMean)


def _sync(call: _Call, leaves: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The eager sync of plain tensors: the same setup, reducer and hook as ``ddp_step``'s."""
    tree = optree.tree_unflatten(call.spec, list(leaves))
    with _dist.call(call.options.group, call.what):  # a backward runs outside ddp_step's own call
        sync = setup(tree, call.options, call.what, call.state, weight=call.weight, members=call.members, agree=False)
        sync.announce()
        reducer = sync.reducer(call.state)
        reducer.push([t.detach() for t in leaves])
        flats, info = sync.close(reducer)
    call.infos.append(info)
    return _layout.unflatten(sync.plan, flats)


class _Mean(torch.autograd.Function):
    @staticmethod
    def forward(call: _Call, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_sync(call, leaves))  # functorch has unwrapped every level: plain tensors

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        call = inputs[0]
        ctx.call = call
        ctx.metas = [(t.shape, t.dtype, t.device) for t in inputs[1:]]
        if any(ctx.needs_input_grad[1:]) and not _differentiable(call.options):
            raise RuntimeError(
                f"fddp.ddp_step: {call.describe()} has no derivative, but its input is being "
                "differentiated (torch.func.grad, vjp, jacrev or backward); use the plain or weighted "
                "mean (compression=None) there, or detach the gradients"
            )
        if call.weight is not None:
            ctx.weight_sum = call.infos[-1].weight

    @staticmethod
    def backward(ctx: Any, *cts: torch.Tensor) -> tuple:
        call = ctx.call
        out = _Mean.apply(call.derived(weighted=False, mode="backward"), *cts)
        w = call.weight
        if w is not None:
            # d/dg_r of sum_s w_s g_s / W is w_r / W times the sum of the cotangents, which is
            # n times their mean. W is the forward's weight sum, identical on every rank.
            n = dist.get_world_size(call.options.group)
            c = w * n / ctx.weight_sum.clamp_min(_TINY)
            if on_host(c):
                c = c.item()  # a Python number: read in the kernels' float math, whatever the cotangents' dtype
                out = tuple(t * c for t in out)
            else:  # on the device, no host read; low precision in float32, one rounding as the number's kernels
                out = tuple(t * c if t.dtype.itemsize >= 4 else t.float().mul_(c).to(t.dtype) for t in out)
        return (None, *out)

    @staticmethod
    def jvp(ctx: Any, _call_tangent: Any, *tangents: torch.Tensor | None) -> tuple:
        call = ctx.call
        if not _differentiable(call.options):
            raise RuntimeError(
                f"fddp.ddp_step: {call.describe()} has no derivative, but forward mode (torch.func.jvp, jacfwd) asked for one"
            )
        filled = zeros_for_none(tangents, ctx.metas)
        return tuple(_Mean.apply(call.derived(weighted=True, mode="forward mode"), *filled))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, call: _Call, *leaves: torch.Tensor) -> tuple:
        if not call.options.hook.batchable:
            raise RuntimeError(
                f"fddp.ddp_step: {call.describe()} cannot run under torch.func.vmap (it does not treat "
                "every element alike); call ddp_step per member, or use the mean or a cast"
            )
        moved = [t if d is None else t.movedim(d, 0) for t, d in zip(leaves, in_dims[1:])]
        # Apply again rather than sync here: under grad(vmap(...)) the leaves are still wrapped.
        out = _Mean.apply(call, *moved)
        return out, tuple(None if d is None else 0 for d in in_dims[1:])


def _traced_mean(call: _Call, leaves: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """The plain mean with functional collectives, for dynamo: the same arithmetic as ``Mean``."""
    group = call.options.group if call.options.group is not None else dist.group.WORLD
    n = dist.get_world_size(group)
    pow2 = n & (n - 1) == 0
    plan = call.plan
    reduced = []
    for b in plan.buckets:
        flat = torch.cat([leaves[i].reshape(-1) for i in b.indices])
        if pow2:
            flat = flat * (1.0 / n)
        elif flat.dtype in LOW_PRECISION:
            flat = flat / n
        reduced.append(torch.ops._c10d_functional.all_reduce(flat, "sum", group.group_name))
    out: list[Any] = [None] * len(leaves)
    for b, red in zip(plan.buckets, reduced):
        red = torch.ops._c10d_functional.wait_tensor(red)
        if not pow2 and red.dtype not in LOW_PRECISION:
            red = red / n
        for i, piece, shape in zip(b.indices, red.split(b.numels), b.shapes):
            out[i] = piece.view(shape)
    return out


class _TracedMean(torch.autograd.Function):
    # Old-style forward(ctx, ...) on purpose: dynamo (torch 2.13) binds ctx wrongly for
    # setup_context-style Functions that take *args, and rejects custom jvp/vmap rules.
    @staticmethod
    def forward(ctx: Any, call: _Call, *args: Any) -> tuple[torch.Tensor, ...]:
        n = len(call.members)
        ctx.call, ctx.extra = call, len(args) - n
        return tuple(_traced_mean(call, args[:n]))

    @staticmethod
    def backward(ctx: Any, *cts: torch.Tensor) -> tuple:
        return (None, *_traced_apply(ctx.call, cts), *([None] * ctx.extra))


def _traced_apply(call: _Call, leaves: Any) -> list[torch.Tensor]:
    # With exactly two leaves dynamo's inlining drops ctx (its arity heuristic); one trailing
    # None keeps the arity away from that case.
    pad = (None,) if len(leaves) == 2 else ()
    return list(_TracedMean.apply(call, *leaves, *pad))


def ddp_step(params: Any, grads: Any, options: SyncOptions, state: Any, weight: torch.Tensor | None) -> tuple[Any, SyncInfo | None]:
    """``ddp_step`` on the differentiable paths; returns ``(grads, info)``."""
    p_leaves, spec = optree.tree_flatten(params, none_is_leaf=True)
    members = tuple(LeafSpec.of(p) for p in p_leaves)
    if grads is None:
        g_leaves = [None] * len(p_leaves)
    else:
        g_leaves, _ = optree.tree_flatten(grads, none_is_leaf=True)
    # A missing gradient is a zero one (an unused parameter), as on the plain path.
    leaves = [torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g for g, m in zip(g_leaves, members)]
    call = _Call(options, spec, members, state, weight)
    if torch.compiler.is_compiling():
        return _compiled(call, leaves, spec)
    out = _Mean.apply(call, *leaves)
    info = call.infos[-1] if call.infos else None
    return optree.tree_unflatten(spec, list(out)), info


def _compiled(call: _Call, leaves: list[torch.Tensor], spec: Any) -> tuple[Any, SyncInfo | None]:
    refuse_compiled_rules("ddp_step", leaves)
    o = call.options
    sync = setup(optree.tree_unflatten(spec, leaves), o, "ddp_step", call.state, weight=call.weight, agree=False)
    sync.announce()  # traced: the header is in the graph (fddp._dist's compiled agreement)
    if type(o.hook) is not Mean or o.check_finite:
        # Compressed and weighted means trace through the reducer, without a derivative.
        reducer = sync.reducer(call.state)
        reducer.push(leaves)
        flats, info = sync.close(reducer)
        return sync.tree(flats), info
    traced = dataclasses.replace(call, plan=sync.plan)
    info = SyncInfo(None, None, sync.plan.nbytes, len(sync.plan.buckets))
    views = [t.view_as(t) for t in leaves]  # seen afresh by dynamo: fddp.sync._lax._run says why
    return optree.tree_unflatten(spec, _traced_apply(traced, views)), info
