"""ZeRO stage 3: fully sharded parameters, gathered unit by unit inside a pure forward.

:func:`fully_shard` cuts a module's trainable parameters into *units* (transformer blocks, the
embedding, the head: submodules whose forward uses only their own parameters), lays each unit's
parameters out as one bucket per dtype, in forward order, and cuts every bucket across the ranks
exactly as stage 2 cuts its buckets (``fddp.shard_layout.cut``: 64-element blocks, zero padding). The
shards are a :class:`fddp.zero.Sharded` whose layout (a :class:`UnitLayout`) records the units,
so ``fddp.optim``, ``save_sharded`` and ``load_sharded`` take them as they take stage 2's.

The returned ``apply_fn(shards, *args)`` runs the module with, for each unit, its parameters
all-gathered just before the unit runs and let go right after (``fddp.zero._gather``: a
differentiable gather whose backward reduce-scatters). torch.func has no saved-tensor hooks
(pytorch #122729), so backward gets each unit's parameters back in one of two ways:

- ``remat="params"`` (the default): the unit's full buffer gives its memory back after the unit's
  forward (its storage resized to nothing) and an identity Function on the unit's outputs gathers
  the bucket back into that memory before the unit's backward: autograd's saved views read the
  same values again, and nothing is recomputed (FSDP's way, without module hooks);
- ``remat="unit"``: the unit's call is one Function (:class:`Remat`) that keeps only its inputs
  and shards; its backward gathers again and differentiates the recomputed unit (autograd, or
  ``torch.func.vjp`` where a transform wraps the tensors), its forward-mode rule the same with
  ``torch.func.jvp``, its vmap rule functorch's (every collective inside has its own);

or not at all (``remat=None``: autograd keeps the full parameters). Parameters that no unit holds
form the *root* unit, gathered at the start of the call and kept until backward (as FSDP2 keeps
its root's).

The gathers are prefetched (the next ``prefetch`` buckets, one per unit and dtype, start before
the current unit runs, in the order the previous call ran them; in backward, the previous ones),
the reductions run behind the backward pass, and with a ``replica_group`` (hybrid sharding) each
shard is all-reduced across the replicas after its reduce-scatter within the shard group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Iterable, Sequence

import optree
import torch
import torch.distributed as dist
import torch.utils._pytree as torch_pytree
from torch import nn
from torch.autograd import forward_ad

from fddp import _dist, _layout
from fddp._tree import paths
from fddp.sync._differentiable import derivatives, transform_levels, transform_stack
from fddp.zero import _autograd, _gather, _units, _window
from fddp.zero import _layout as shard_layout
from fddp.zero._autograd import GatherCall
from fddp.zero._gather import Counters, Pipeline, Precision
from fddp.zero._unit_call import Remat, UnitCall, flatten_call
from fddp.zero._units import Unit, UnitLayout

__all__ = ["FullyShardedForward", "fully_shard", "unshard"]


def _torch_flatten(s: shard_layout.Sharded) -> tuple[list[Any], Any]:
    return list(s.shards), s.layout


def _torch_unflatten(children: Iterable[Any], layout: Any) -> shard_layout.Sharded:
    return shard_layout.Sharded(tuple(children), layout)


# torch.func's transforms (grad, vjp, jvp, vmap) find tensors with torch's own pytrees, not optree's:
# registered there too, a Sharded is differentiated and batched shard by shard.
if shard_layout.Sharded not in torch_pytree.SUPPORTED_NODES:
    torch_pytree.register_pytree_node(shard_layout.Sharded, _torch_flatten, _torch_unflatten, serialized_type_name="fddp.zero.Sharded")


def _agree(what: str, key: Any, rows: Callable[[], list[tuple]], groups: Sequence[Any], sequenced: bool = False) -> list[Any]:
    """Raise ``fddp.MismatchError`` on every rank of each group unless its ranks hold the same rows;
    return each group's agreed sequence (``fddp._dist.Segment``, with ``sequenced``; else None)."""
    return [
        _dist.agree(g, what, rows, key=(what, key), sequenced=sequenced).segment
        for g in groups
    ]


def _agree_on(
    lay: UnitLayout, what: str, kind: tuple[tuple, ...] = (), sequenced: bool = False,
    precision: Precision = _gather.FULL_PRECISION,
) -> list[Any]:  # fmt: skip
    """Agree on a call across the shard group and, with hybrid sharding, across the replica group,
    whose members must also hold the same place in their shard groups. ``kind``: rows that say
    which model and what kind of call (a forward's): part of the signature. ``sequenced``: the
    collectives that follow are learnt and checked as a sequence; returns the groups' segments.
    ``precision``: the mixed-precision policy, whose rows are part of the signature too."""
    segments = _agree(what, (lay, kind, precision), lambda: [*kind, *lay.describe(), *precision.rows()], [lay.group], sequenced)
    if lay.replica_group is not None:
        rows = lambda: [*kind, *lay.describe(), *precision.rows(), ("shard rank", str(lay.rank), None)]  # noqa: E731
        segments += _agree(what, (lay, kind, precision, "replica"), rows, [lay.replica_group], sequenced)
    return segments


def _differentiated(leaves: Sequence[torch.Tensor]) -> bool:
    """Whether a backward or forward-mode pass may follow (then the collectives are differentiable)."""
    if torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0:
        return True
    return torch.is_grad_enabled() and any(t.requires_grad for t in leaves)


def _derivatives(shards: Sequence[torch.Tensor], args: tuple, kwargs: dict, levels: tuple) -> tuple[bool, str]:
    """How the active transforms (``levels``) carry the shards and the inputs, in words, and whether
    a reverse pass may run through the forward (then it owes its backward's collectives until that
    runs or its graph is freed).

    The collectives depend on both, not on the transforms alone: a shard with a tangent has its
    tangent gathered after it, a batched one is gathered with its members, a tracked one has its
    cotangent reduced; and with ``remat="unit"`` a unit whose inputs carry a tangent gathers its
    parameters again for its forward-mode rule. ``jvp`` with respect to the input and with respect
    to the shards run under the same stack, but only the second gathers tangents: the words are
    part of the call's kind, so each learns and checks its own sequence. A backward follows only
    where some shard is tracked (a grad level differentiates it, or it requires grad): the
    gradient of the input alone needs none of the shards' reductions, and keeps its gathered
    parameters in its graph instead of gathering them again.
    """
    each = derivatives(shards, levels)
    backward = any("tracked" in w for w in each)
    if not levels:
        return backward, f"shards: {', '.join(sorted(set(each))) or 'none'}"  # autograd, a dual level
    shown = f"every shard {each[0]}" if len(set(each)) == 1 else "; ".join(f"shard {k} {w}" for k, w in enumerate(each))
    leaves = [t for t in torch_pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    inputs = [f"input {i} {w}" for i, w in enumerate(derivatives(leaves, levels)) if any(not p.endswith(": -") for p in w.split(", "))]
    return backward, "; ".join([shown, *inputs])


_serials = itertools.count()


class _BufferWrites:
    """Which floating-point buffers a fully sharded forward writes (BatchNorm's running
    statistics), learnt at the first call in each train/eval mode: on several ranks each would
    keep its own, silently, so that is an error (``fddp.functionalize`` refuses the same)."""

    def __init__(self, model: nn.Module, ranks: int) -> None:
        self.floating = {n: b for n, b in model.named_buffers() if b.is_floating_point() or b.is_complex()} if ranks > 1 else {}
        self.learnt: dict[tuple[bool, ...], tuple[str, ...]] = {}
        self.before: list | None = None

    def start(self, model: nn.Module) -> None:
        mode = tuple(m.training for m in model.modules())
        if self.floating and mode not in self.learnt:
            self.before = [(n, b, b._version, b.detach().clone()) for n, b in self.floating.items()]

    def check(self, model: nn.Module) -> None:
        mode = tuple(m.training for m in model.modules())
        if self.before is not None:
            now = dict(model.named_buffers())
            written = [n for n, b, v, copy in self.before if now.get(n) is not b or b._version != v or not torch.equal(b, copy)]
            self.learnt[mode] = tuple(written)
            self.before = None
        written = self.learnt.get(mode, ())
        if written:
            shown = ", ".join(repr(n) for n in written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
            raise _dist.collective(RuntimeError(  # the same model on every rank: every rank raises here
                f"fddp.zero.fully_shard's apply_fn: the forward writes the model's floating-point buffers {shown} "
                "(BatchNorm's running statistics, say); on several ranks each would keep its own, silently. Run those "
                "layers in eval mode (model.eval() on them, or track_running_stats=False), or replace them with a "
                "normalisation without state (LayerNorm, GroupNorm)."
            ))


class FullyShardedForward:
    """The module as a pure function of its shards: ``apply_fn(shards, *args, **kwargs)``.

    Made by :func:`fully_shard`; returns what ``model(*args, **kwargs)`` returns, computed with the
    parameters in ``shards``, gathered unit by unit. Differentiable with ``torch.func.grad``,
    ``vjp``, ``jvp``, ``vmap`` (ensembles of stacked shards, per-sample gradients), plain
    ``.backward()`` and ``torch.autograd.grad``: the gradient of the shards is this rank's shard of
    the mean over the ranks of their gradients, the same as stage 2's ``ReduceScatter`` gives.

    Attributes:
        layout: the shards' :class:`UnitLayout`.
        units: the units' names, in forward order (``""``: the root unit).
        prefetch: how many buckets' gathers run ahead of the one in use.
        remat: what backward gathers again: ``"params"`` (each unit's parameters, into the memory
            the forward's autograd views look into), ``"unit"`` (the parameters, and the unit is
            recomputed: its activations are not kept either), ``None`` (nothing: autograd keeps
            each unit's full parameters from the forward until backward).
        counters: a :class:`fddp.zero.Counters` of what the collectives moved.
        param_dtype: the dtype floating-point parameters are gathered and computed in (``None``:
            their own); see :func:`fully_shard`.
        reduce_dtype: the dtype their gradients are reduced in (``None``: ``param_dtype``'s).

    Example:
        >>> apply_fn, shards = fddp.zero.fully_shard(model)
        >>> loss = lambda s, x, y: F.cross_entropy(apply_fn(s, x), y)
        >>> grads, value = torch.func.grad_and_value(loss)(shards, x, y)
    """

    def __init__(
        self, model: nn.Module, layout: UnitLayout, units: list[Unit], prefetch: int, remat: str | None, invariant: bool,
        precision: Precision = _gather.FULL_PRECISION,
    ) -> None:  # fmt: skip
        self.model, self.layout, self._units = model, layout, units
        self.units = layout.units
        self.prefetch, self.remat, self.invariant = prefetch, remat, invariant
        self._precision = precision
        self.param_dtype, self.reduce_dtype = precision.param_dtype, precision.reduce_dtype
        self.counters = Counters()
        self._root = next((u for u in units if u.name == ""), None)
        self._order: list[int] = [k for u in units for k in u.buckets]  # refined by each call
        self._remat_buckets = frozenset(k for u in units if u.name for k in u.buckets) if remat else frozenset()
        self._run: _Call | None = None
        self._owner: dict[str, str] = {}  # every name of every trainable parameter: its unit's name
        self._placeholders: list[tuple[nn.Module, str, _units.Released]] = []  # (module, attribute, what it holds)
        self.serial = next(_serials)  # the same on every rank: fully_shard is a collective call
        self._buffers = _BufferWrites(model, layout.world * layout.replicas)
        self._window: _window.Window | None = None  # an accumulation window, open or awaiting its closing backward

    @contextlib.contextmanager
    def no_sync(self, *, keep_gathered: bool = False):
        """Accumulate gradients locally: torch DDP's ``no_sync()``, FSDP2's ``set_requires_gradient_sync(False)``.

        Inside the ``with`` block every backward through this forward keeps its gradients local:
        each bucket's full-size gradient is added into the window's sum (one full-size buffer per
        bucket, as FSDP2's unsharded ``.grad``), nothing is reduced, and the gradient shards it
        returns are zeros. The first backward after the block (the window's last micro-batch, run
        outside it) adds the window's sum to its own gradients and reduces each bucket once, as its
        backward reaches it: its gradient shards are the mean over the ranks of every micro-batch's
        gradients summed, one reduction for the whole window, overlapped with that backward.

        With a loss that is a mean over its micro-batch, divide it by the number of micro-batches
        (``k``) for the mean over the window (exact for a power-of-two ``k``), as with DDP and FSDP2.
        Blocks may be entered again before the closing backward: the sums go on.

        Args:
            keep_gathered: gather each unit's parameters once, in the window's first forward, and
                keep them until the closing backward has run (FSDP2's ``reshard_after_backward=False``):
                the later micro-batches gather nothing, at the cost of the full parameters held for
                the window (on top of the sums). A bucket is reused only while its shard tensor is
                the one it was gathered from, unchanged.

        Example:
            >>> for i, (x, y) in enumerate(micro_batches):  # k of them, one optimizer step
            ...     with apply_fn.no_sync() if i < k - 1 else contextlib.nullcontext():
            ...         grads, loss = torch.func.grad_and_value(lambda s: loss_fn(s, x, y) / k)(shards)
            >>> shards, state = fddp.optim.apply_gradients(opt, grads, state, shards)  # the last grads
        """
        if not isinstance(keep_gathered, bool):
            raise TypeError(f"fddp.zero.fully_shard's apply_fn.no_sync: keep_gathered must be True or False, got {keep_gathered!r}")
        if self.invariant:
            raise ValueError(
                "fddp.zero.fully_shard's apply_fn.no_sync: an invariant forward reduces nothing (each rank's gradient is "
                "its own objective's); accumulate its gradient shards yourself (fddp.accumulate_grads)"
            )
        window = self._window
        if window is None:
            window = self._window = _window.Window(keep_gathered, open=False)
        elif window.keep_gathered != keep_gathered:
            raise ValueError(
                f"fddp.zero.fully_shard's apply_fn.no_sync: this window was opened with keep_gathered={window.keep_gathered} "
                f"and its closing backward has not run yet; enter it again with the same keep_gathered"
            )
        was_open, window.open = window.open, True
        try:
            yield
        finally:
            window.open = was_open

    def __repr__(self) -> str:
        mixed = f", param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}" if self._precision.rows() else ""
        return f"FullyShardedForward({type(self.model).__name__}, {self.layout!r}, prefetch={self.prefetch}, remat={self.remat}{mixed})"

    def _check(self, shards: Any) -> None:
        lay = self.layout
        if not isinstance(shards, shard_layout.Sharded):
            raise TypeError(
                f"fddp.zero.fully_shard's apply_fn: expected the fddp.zero.Sharded that fully_shard returned (or "
                f"the optimizer's new shards of it), got {type(shards).__name__}"
            )
        got = shards.layout
        if got is not lay and got != lay:
            if getattr(got, "stage", 2) != 3:
                raise ValueError(
                    "fddp.zero.fully_shard's apply_fn: these shards are stage 2's (fddp.zero.shard: buckets cut "
                    "for the gradients' sync), not this forward's units; pass the shards fully_shard returned"
                )
            got.check_group("zero.fully_shard")
            raise ValueError(
                f"fddp.zero.fully_shard's apply_fn: these shards have another layout ({got!r}) than this "
                f"forward's ({lay!r}): they come from another fully_shard call (other units, groups or model)"
            )
        lay.check_group("zero.fully_shard")
        for k, (b, c, t) in enumerate(zip(lay.plan.buckets, lay.cuts, shards.shards)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (c.size,) or t.dtype != b.dtype:
                got_t = f"shape {tuple(t.shape)}, dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"fddp.zero.fully_shard's apply_fn: shard {k} (unit {self._unit_of(k)!r}) must be a tensor of "
                    f"shape ({c.size},) and dtype {b.dtype}; got {got_t}"
                )

    def _unit_of(self, k: int) -> str:
        return next(u.name for u in self._units if k in u.buckets) or "<root>"

    @contextlib.contextmanager
    def _swapped(self, unit: Unit, fulls: Sequence[torch.Tensor]):
        """The unit's parameter slots hold views of ``fulls`` for the block."""
        lay = self.layout
        views = [_layout.views(f, lay.plan.buckets[k]) for f, k in zip(fulls, unit.buckets)]
        saved = []
        for module, attr, j, pos in unit.slots:
            saved.append(module._parameters[attr])
            module._parameters[attr] = views[j][pos]
        try:
            yield
        finally:
            for (module, attr, _, _), old in zip(unit.slots, saved):
                module._parameters[attr] = old

    def __call__(self, shards: shard_layout.Sharded, /, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            raise NotImplementedError(
                "fddp.zero.fully_shard's apply_fn cannot run under torch.compile (its gathers and reductions are eager); "
                "call it eagerly, and pass compile=True to fully_shard to compile each unit's compute"
            )
        if self._run is not None:
            raise RuntimeError(
                "fddp.zero.fully_shard's apply_fn: called again while running (from another thread, or from inside the module)"
            )
        lay = self.layout
        # One fddp call from the first check to the end of the forward: a rank that fails before its
        # header tells its peers; one that fails after it (inside a unit) takes the group down on
        # every rank at once, since its peers are in gathers it will never join (fddp._dist.call).
        with _dist.call(lay.group, "zero.fully_shard"):
            self._check(shards)
            # Every call agrees (one small all-reduce per group; fddp.set_checks(agreement=False)
            # keeps only the first): a rank that skipped or reordered a forward is named here,
            # not left to time out inside a gather.
            _dist.count_call(lay.group, "zero.fully_shard")
            differentiated = _differentiated(shards.shards)
            levels = transform_levels() if differentiated else ()  # walked once a call: the kind, the words, the pipeline's
            backward, carried = _derivatives(shards.shards, args, kwargs, levels) if differentiated else (False, "")
            window = self._window if backward else None
            if window is not None and not window.open:
                self._window = None  # this call closes the window: later ones are plain again
            # The header names the model and the kind of forward, and the collectives that follow
            # (the gathers, and the backward's) are agreed as a sequence: learnt the first time a
            # kind of call runs, then checked before each one, so that a rank that runs its units
            # otherwise fails at once instead of pairing them with its peers' other units.
            kind = self._kind(differentiated, backward, window, shards.shards, carried, levels)
            segments = _agree_on(lay, "zero.fully_shard", kind, sequenced=True, precision=self._precision)
            self._buffers.start(self.model)
            out = self._forward(lay, shards, differentiated, backward, window, segments, args, kwargs, levels)
            self._buffers.check(self.model)
            return out

    def _kind(
        self, differentiated: bool, backward: bool, window: _window.Window | None = None, shards: Sequence[torch.Tensor] = (),
        carried: str = "", levels: tuple = (),
    ) -> tuple[tuple, ...]:
        """This call's kind as signature rows: the model, the forward's kind and what its transforms
        carry (:func:`_derivatives`), the prefetch order."""
        if backward:
            forward = "a training forward (its backward gathers and reduces)"
        elif differentiated:
            forward = "a forward whose derivatives it computes itself (forward mode, vmap: no backward)"
        else:
            forward = "an evaluation forward (no gradients)"
        return (
            ("model", f"fully_shard's model #{self.serial}, {type(self.model).__name__}", None),
            ("forward", f"{forward}, remat={self.remat!r}, under {', '.join(transform_stack(levels)) or 'no transform'}", None),
            *((("derivatives", carried, None),) if carried else ()),
            ("prefetch order", f"{_dist.digest(tuple(self._order)):016x}", None),
            *(window.rows([_gather.plain(t) for t in shards]) if window is not None else ()),
        )

    def _forward(
        self, lay: UnitLayout, shards: shard_layout.Sharded, differentiated: bool, backward: bool,
        window: _window.Window | None, segments: list[Any], args: tuple, kwargs: dict, levels: tuple = (),
    ) -> Any:  # fmt: skip
        keep = window is not None and window.keep_gathered
        pipe = Pipeline(
            lay, "zero.fully_shard", shards.shards, self.prefetch, self._order, self.counters, self._remat_buckets,
            release=backward and self.remat == "params" and not keep, precision=self._precision, segments=segments,
            window=window, levels=levels,
        )  # fmt: skip
        leaves = _autograd.boundary(pipe, shards.shards) if backward else tuple(shards.shards)
        run = _Call(self, pipe, leaves, differentiated, backward)
        patched = [u for u in self._units if u.name]
        if self.param_dtype is not None:  # the model's inputs in the compute dtype, as every unit's
            args, kwargs = torch_pytree.tree_map(self._precision.cast, (args, kwargs))
        self._run = run
        try:
            for u in patched:
                u.module.forward = _patched_forward(self, u)
            root = self._root
            if root is None:
                out = self.model(*args, **kwargs)
            else:
                fulls = [run.gather(k) for k in root.buckets]
                with self._swapped(root, fulls):
                    del fulls
                    out = self.model(*args, **kwargs)
        except _units.ReleasedUse as e:
            unit = self._owner.get(e.name)
            if unit is None or unit in run.entered:
                raise
            raise RuntimeError(
                f"fddp.zero.fully_shard's apply_fn: parameter {e.name!r} belongs to unit {unit!r}, whose forward was not "
                f"called in this forward: a unit's parameters are gathered only while its forward runs, and the model "
                f"uses the submodules or parameters of {unit!r} without calling it (iterating over a Sequential, say). "
                f"Make the modules that are called the units (units=[...], or their class), or call {unit!r} itself"
            ) from e
        finally:
            for u in patched:
                u.module.__dict__.pop("forward", None)
            self._run = None
        pipe.end_forward(will_backward=backward)
        self._order = pipe.seq or self._order
        return out


@dataclasses.dataclass(eq=False)
class _Call:
    """One call of a :class:`FullyShardedForward`: its pipeline and its shards as the units see them."""

    owner: FullyShardedForward
    pipe: Pipeline
    leaves: Sequence[torch.Tensor]
    differentiated: bool  # the gathers are differentiable (a backward, forward mode or vmap follows)
    backward: bool  # a reverse pass may follow: the units keep what it needs (remat)
    entered: set[str] = dataclasses.field(default_factory=set)  # the units whose forward this call ran

    def gather(self, k: int) -> torch.Tensor:
        call = GatherCall(self.pipe, k, self.owner.invariant)
        if not self.differentiated:
            return _autograd.gather_plain(call, _gather.plain(self.leaves[k]))
        return _autograd.gather(call, self.leaves[k])


def _patched_forward(owner: FullyShardedForward, unit: Unit) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        run = owner._run
        if run is None:  # called outside apply_fn (the module's own forward is patched only during it)
            return unit.forward(*args, **kwargs)
        run.entered.add(unit.name)
        flat, spec = flatten_call(args, kwargs)
        pos = tuple(i for i, t in enumerate(flat) if isinstance(t, torch.Tensor))
        calls = tuple(GatherCall(run.pipe, k, owner.invariant) for k in unit.buckets)
        ucall = UnitCall(owner, unit, calls, spec, [None if i in pos else t for i, t in enumerate(flat)], pos)
        fulls = [run.gather(k) for k in unit.buckets]
        tensors = [owner._precision.cast(flat[i]) for i in pos]  # mixed precision: inputs in the compute dtype
        if run.backward and owner.remat == "unit":
            shards = [run.leaves[k] for k in unit.buckets]
            outs = Remat.apply(ucall, *shards, *fulls, *tensors)
        elif run.backward and owner.remat == "params":
            outs = ucall.run(fulls, tensors)
            if outs:
                outs = _autograd.refill_before_backward(run.pipe, unit.buckets, outs)
            for k, full in zip(unit.buckets, fulls):
                run.pipe.release(k, _gather.plain(full))
        else:
            outs = ucall.run(fulls, tensors)
        del fulls
        return ucall.rebuild(outs)

    return forward


# --------------------------------------------------------------------------------- the public calls


@_dist.entry("zero.fully_shard")
def fully_shard(
    model: nn.Module,
    /,
    *,
    units: Sequence[str | nn.Module | type] | None = None,
    group: dist.ProcessGroup | None = None,
    replica_group: dist.ProcessGroup | None = None,
    prefetch: int = 1,
    remat: str | None = "params",
    invariant: bool = False,
    min_unit_mb: float = 0.5,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    compile: bool | dict[str, Any] = False,  # noqa: A002 - torch's word for it (nn.Module.compile)
) -> tuple[FullyShardedForward, shard_layout.Sharded]:
    """Shard a module's trainable parameters unit by unit (ZeRO stage 3); return ``(apply_fn, shards)``.

    ``shards`` is this rank's ``1/N`` of every unit's parameters, a :class:`fddp.zero.Sharded` that
    ``fddp.optim``, :func:`fddp.zero.gather`, ``fddp.checkpoint.save_sharded`` and ``load_sharded``
    take as they take stage 2's. ``apply_fn(shards, *args, **kwargs)`` returns what
    ``model(*args, **kwargs)`` would, gathering each unit's parameters just before the unit runs
    and letting them go after it; differentiate it with ``torch.func.grad`` (or ``vjp``, ``jvp``,
    ``vmap``, ``.backward()``, ``torch.autograd.grad``) and the gradient is this rank's shard of the
    mean over the ranks of their gradients, what stage 2's ``ReduceScatter`` gives, ready for
    ``fddp.optim.apply_gradients(opt, grads, state, shards)``. No full tree is ever built.

    The module keeps its frozen parameters and buffers; its trainable parameters are released
    (the module holds shape-only placeholders that refuse to compute): the shards are the
    parameters now. The values need not be the same on every rank beforehand: each rank
    contributes its own slices and every rank computes with the same gathered values (with a
    replica group, the first replica's shards are broadcast to the others).

    A *unit* is a submodule whose forward uses only its own parameters (a transformer block, an
    embedding, a head), run through its ``__call__``. ``units=None`` chooses them by size, as
    FSDP's ``size_based_auto_wrap_policy`` does: from the finest units (the children of every
    ``ModuleList`` / ``Sequential`` / ``ModuleDict``, and every other module that owns parameters
    itself, with its whole subtree), a module of at least ``min_unit_mb`` is a unit; smaller ones
    merge into their enclosing module (a unit when its leftovers reach ``min_unit_mb`` and nothing
    inside it is one) and, at the top, into the root unit, gathered for the whole forward (as
    FSDP2's root); modules whose weights are tied together land in one that holds them all.
    Every rank must run the units in the same order (they do when they run the same code).

    Args:
        model: the module; its trainable parameters (``requires_grad=True``) are taken.
        units: the units: submodule names (``""``: the root, for parameters in no other unit),
            submodules, or module classes (every outermost submodule of the class); ``None``: by
            size, as above. A parameter must belong to exactly one unit (tied weights: put the
            modules that share them in one unit).
        group: the process group to shard over (``None``: the default group).
        replica_group: hybrid sharding: replicate the shards across this group (e.g. shard within
            a host, replicate across hosts); gradients are reduce-scattered within ``group`` and
            all-reduced across ``replica_group``.
        prefetch: how many buckets' all-gathers run ahead of the one in use (0: none). A unit is
            one bucket per dtype and device of its parameters, so for a model in one dtype this
            counts units: ``prefetch=1`` gathers the next unit while one runs.
        remat: what backward gathers again. ``"params"``: each unit's parameters, gathered back
            into the memory its forward's autograd views look into (the activations are kept, as
            in stage 2 and FSDP2); ``"unit"``: the parameters, and the unit is recomputed (its
            activations are not kept either: activation checkpointing, one more forward of
            compute); ``None``: nothing, autograd keeps every unit's full parameters from the
            forward until backward. Every mode gives the same gradients.
        invariant: gradients of this rank's objective alone, the other ranks' shards held
            constant: each bucket's cotangent is cut to this rank's slice, with no reduction
            (per-sample gradients; see :func:`unshard`).
        min_unit_mb: with ``units=None``, the fewest MiB of trainable parameters a unit holds
            (each unit costs three collectives a step; 0.5 MiB is about four times a gloo
            all-gather's latency at its bandwidth on a CPU host); 0: every finest unit is one
            (one per block, however small).
        param_dtype: mixed precision, as FSDP2's ``MixedPrecisionPolicy``: gather the floating-point
            parameters in this dtype (half the bytes for ``torch.bfloat16``) and compute in it (the
            floating-point inputs of the model and of every unit are cast to it). The shards,
            their gradients and the optimizer state keep the parameters' own dtype (float32 master
            weights). ``None``: the parameters' dtype.
        reduce_dtype: the dtype gradients are reduced in (then written into the shards' dtype):
            ``torch.float32`` sums bf16 gradients in float32, as FSDP2 with
            ``reduce_dtype=torch.float32``; ``None``: ``param_dtype`` (FSDP2's default).
        compile: compile each unit's compute with ``torch.compile`` (``True``: its defaults; a
            dict: its keyword arguments, ``{"backend": "aot_eager"}`` say), as FSDP2's users
            compile each block: the unit's own ``forward``, on the gathered parameters, is one
            compiled region; the gathers, the reductions and everything between the units stay
            eager around it (the root unit's forward, which calls the others, too). Differentiate
            with autograd (``fddp.grad_and_value``, ``.backward()``): torch.func's transforms do
            not enter compiled code.

    Returns:
        ``(apply_fn, shards)``: a :class:`FullyShardedForward` and this rank's shards.

    Raises:
        fddp.MismatchError: on every rank, if ranks' units, trees or groups differ.
        ValueError: on every rank, for a unit list that misses or repeats a parameter, or names
            what is not a submodule.

    Example:
        >>> apply_fn, shards = fddp.zero.fully_shard(model)  # units of at least 0.5 MiB
        >>> opt_state = opt.init(shards)
        >>> grads, loss = torch.func.grad_and_value(loss_fn)(shards, x, y)  # loss_fn calls apply_fn
        >>> shards, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, shards)
    """
    what = "zero.fully_shard"
    if not isinstance(model, nn.Module):
        raise TypeError(f"fddp.{what}: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(invariant, bool):
        raise TypeError(f"fddp.{what}: invariant must be True or False, got {invariant!r}")
    if remat not in ("params", "unit", None):
        raise ValueError(f"fddp.{what}: remat must be 'params', 'unit' or None, got {remat!r}")
    if isinstance(min_unit_mb, bool) or not isinstance(min_unit_mb, (int, float)) or not min_unit_mb >= 0:
        raise ValueError(f"fddp.{what}: min_unit_mb must be a number of MiB >= 0, got {min_unit_mb!r}")
    if not isinstance(compile, (bool, dict)):
        raise TypeError(f"fddp.{what}: compile must be True, False or a dict of torch.compile's keyword arguments, got {compile!r}")
    compile_options = ({} if compile is True else dict(compile)) if compile else None
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"fddp.{what}: prefetch must be a whole number of buckets >= 0, got {prefetch!r}")
    for name, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise TypeError(f"fddp.{what}: {name} must be a floating-point torch.dtype (torch.bfloat16, say) or None, got {dt!r}")
    precision = Precision(param_dtype, reduce_dtype)
    if not dist.is_initialized():
        raise RuntimeError(f"fddp.{what}: no process group; call fddp.init() first")
    if torch._C._are_functorch_transforms_active():
        raise RuntimeError(f"fddp.{what} cannot run inside a torch.func transform; shard once, before the transforms")
    # Before any collective (every rank holds the same model): announced, and the group goes on.
    writer = next((n for n, m in model.named_modules() if _units.writes_in_place(m)), None)
    if writer is not None:
        m = model.get_submodule(writer)
        raise ValueError(
            f"fddp.{what}: module {writer!r} ({type(m).__name__}, max_norm={m.max_norm}) renormalises the rows it "
            "looks up in its weight, in place, at every forward, and the plain module keeps that write; sharded, "
            "each rank would renormalise only its own batch's rows of a gathered copy, and the training would "
            "differ from the plain module's without an error. Set its max_norm=None (to bound the norms, scale the "
            "looked-up vectors in the forward instead), or freeze that weight (requires_grad=False: not sharded)"
        )
    world, rank, replicas = _gather.check_groups(group, replica_group, what)
    groups = [group] + ([replica_group] if replica_group is not None else [])

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    trainable: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.requires_grad:
            trainable.setdefault(id(p), []).append(n)

    # Everything that can be wrong with the units is found here, and agreed on, before any
    # raise: a rank alone with a bad list would otherwise leave its peers waiting.
    problem: Exception | None = None
    units_: list[Unit] = []
    try:
        taken = next((n for n, p in model.named_parameters() if isinstance(p, _units.Released)), None)
        if taken is not None:
            raise ValueError(
                f"fddp.{what}: {type(model).__name__} is already sharded: parameter {taken!r} was taken by an earlier "
                "fully_shard call and lives in its shards. Use the apply_fn and shards that call returned (its "
                "units cannot change), or put the values back first (fddp.zero.write_back(apply_fn, shards)) and "
                "shard it anew"
            )
        leaves, spec = optree.tree_flatten({n: p.detach() for n, p in params.items()}, none_is_leaf=True)
        flat_names = list(paths(spec))
        index = {n: i for i, n in enumerate(flat_names)}
        units_ = _units.resolve(model, units, params, trainable, index, what, int(min_unit_mb * 2**20))
        if not units_:
            raise ValueError(f"fddp.{what}: {type(model).__name__} has no trainable parameters")
        compiled = next((u.name or "<root>" for u in units_ if getattr(u.module, "_compiled_call_impl", None) is not None), None)
        if compiled is not None:
            raise ValueError(
                f"fddp.{what}: unit {compiled!r} was compiled (nn.Module.compile), which would trace its gathers too; "
                "pass compile=True (or torch.compile's options) to fully_shard instead: each unit's compute is compiled, "
                "its gathers stay outside"
            )
    except (TypeError, ValueError) as e:
        problem = e
    if problem is not None:
        verdict = [("fully_shard units", f"{type(problem).__name__}: {problem}", None)]
        _agree(what, ("error", str(problem)), lambda: verdict, groups)
        raise problem

    specs = [(tuple(t.shape), t.dtype, t.device) for t in leaves]
    plan = _units.plan(units_, specs)
    lay = _units.UnitLayout(
        plan, spec, world, rank, group, shard_layout.ALIGN, units=tuple(u.name for u in units_),
        unit_buckets=tuple(u.buckets for u in units_), replica_group=replica_group, replicas=replicas,
    )  # fmt: skip
    _dist.count_call(group, what)
    _agree_on(lay, what, precision=precision)

    out = shard_layout.new_shards(lay)
    for leaf, pieces in zip(leaves, shard_layout.leaf_pieces(lay)):
        for k, a, x, n in pieces:
            out[k][x : x + n].copy_(leaf.reshape(-1)[a : a + n])
    if replica_group is not None:
        _broadcast_replicas(lay, out)
    del leaves

    # The module's slots: every name of every trainable parameter, each unit's own.
    for u in units_:
        u.forward = u.module.forward
        if compile_options is not None and u.name:  # the root's forward calls the other units: it stays eager
            u.forward = torch.compile(u.module.forward, **compile_options)
        for j, k in enumerate(u.buckets):
            for pos, i in enumerate(plan.buckets[k].indices):
                for n in trainable[id(params[flat_names[i]])]:
                    prefix, _, attr = n.rpartition(".")
                    u.slots.append((model.get_submodule(prefix), attr, j, pos))
    placeholders = []
    for names_ in trainable.values():
        like = params[names_[0]]
        ghost = _units.Released(names_[0], like)
        for n in names_:
            prefix, _, attr = n.rpartition(".")
            model.get_submodule(prefix)._parameters[attr] = ghost
            placeholders.append((model.get_submodule(prefix), attr, ghost))
    apply_fn = FullyShardedForward(model, lay, units_, prefetch, remat, invariant, precision)
    apply_fn._placeholders = placeholders
    for u in units_:
        for i in u.leaves:
            for n in trainable[id(params[flat_names[i]])]:
                apply_fn._owner[n] = u.name
    return apply_fn, shard_layout.Sharded(out, lay)


def _broadcast_replicas(lay: UnitLayout, shards: list[torch.Tensor]) -> None:
    """Give every replica the first replica's shards (one broadcast per flat buffer)."""
    bases = {}
    for t in shards:
        base = t._base if t._base is not None else t
        bases[id(base)] = base
    src = dist.get_global_rank(lay.replica_group, 0)
    for base in bases.values():
        work = dist.broadcast(base, src=src, group=lay.replica_group, async_op=True)
        _dist.wait(work, lay.replica_group, "zero.fully_shard", "the broadcast of the first replica's shards", host=base.is_cpu)


_UNSHARD = Counters()


@_dist.entry("zero.unshard", lambda shards, /, **_: shards.layout.group)
def unshard(shards: shard_layout.Sharded, /, *, invariant: bool = False) -> Any:
    """The full tree of ``shards``, as a differentiable function of them (one all-gather per bucket).

    The gather ``fddp.zero.gather`` does, made differentiable: its backward reduce-scatters the
    cotangents into gradient shards with ``fddp.ddp_step``'s mean (for stage 2's shards, in stage
    2's very buckets: the gradients equal ``ReduceScatter``'s to the bit), its forward mode gathers
    the tangents, and under ``vmap`` one collective carries every member. Works on any sharded tree
    (``fddp.zero.shard``'s or ``fully_shard``'s); it holds the whole tree at once, where
    ``fully_shard``'s ``apply_fn`` holds a unit at a time.

    With ``invariant=True`` the gradient is that of this rank's objective alone (the other ranks'
    shards held constant): each cotangent's slice, with no collective. That is what per-sample
    gradients need when every rank of the group differentiates the same samples: ``vmap(grad)``
    gives each rank its slice of every sample's gradient, and one all-reduce of the per-sample
    squared norms then clips them exactly (DP-SGD; ``tests/test_stage3.py``).

    Args:
        shards: a :class:`fddp.zero.Sharded` made on this group.
        invariant: differentiate this rank's objective alone (see above).

    Returns:
        The full tree; its leaves are views of one gathered buffer per bucket.

    Example:
        >>> shards = fddp.zero.shard(params)
        >>> grads = torch.func.grad(lambda s: loss_fn(fddp.zero.unshard(s), x, y))(shards)
    """
    if not isinstance(shards, shard_layout.Sharded):
        raise TypeError(f"fddp.zero.unshard: expected a fddp.zero.Sharded, got {type(shards).__name__}")
    if not isinstance(invariant, bool):
        raise TypeError(f"fddp.zero.unshard: invariant must be True or False, got {invariant!r}")
    lay = shards.layout
    lay.check_group("zero.unshard")
    _dist.count_call(lay.group, "zero.unshard")
    _agree("zero.unshard", lay, lay.describe, [lay.group])
    n = len(lay.cuts)
    differentiated = _differentiated(shards.shards)
    pipe = Pipeline(lay, "zero.unshard", shards.shards, n, range(n), _UNSHARD)
    leaves = _autograd.boundary(pipe, shards.shards) if differentiated else tuple(shards.shards)
    fulls = []
    for k in range(n):
        call = GatherCall(pipe, k, invariant)
        fulls.append(_autograd.gather(call, leaves[k]) if differentiated else _autograd.gather_plain(call, _gather.plain(leaves[k])))
    pipe.end_forward(will_backward=False)
    return optree.tree_unflatten(lay.spec, _layout.unflatten(lay.plan, fulls))
