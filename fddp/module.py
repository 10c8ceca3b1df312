"""Turn an ``nn.Module`` into a pure function of a parameter pytree (and, optionally, of its buffers),
and write trained values back into the module."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from fddp._layout import MODULE_ALIAS
from fddp.batchnorm import SyncBatchNorm

__all__ = ["functionalize", "functionalize_with_buffers", "load_into"]

Params = dict[str, torch.Tensor]
Filter = Callable[[str, nn.Parameter], bool]
Slot = tuple[nn.Module, str, str]  # (owning module, attribute, the tensor's first name)


_functorch = torch._C._functorch


def _check_module(model: Any, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fddp.{what}: expected a torch.nn.Module, got {type(model).__name__}")


def functionalize(model: nn.Module, /, *, trainable: Filter | None = None) -> tuple[Callable[..., Any], Params]:
    """Split a module into a pure ``apply_fn`` and its trainable parameters.

    ``apply_fn(params, *args, **kwargs)`` returns exactly what ``model(*args, **kwargs)`` returns,
    with ``params`` in place of the module's own trainable parameters (as
    ``torch.func.functional_call`` does).

    Frozen parameters (``requires_grad=False``, as torch means it) are left out of ``params``, so
    they get no gradient, no optimizer update and no bytes in any all-reduce, as under torch DDP.
    ``apply_fn`` reads them from the module at each call, detached, so new values loaded into the
    module (``load_state_dict``) are seen. ``trainable`` picks the trainable parameters explicitly
    instead, as equinox's ``partition`` does with a filter. ``apply_fn`` also accepts any other
    subset of the module's parameter names; the missing ones come from the module.

    Buffers are read from the module as they are at call time; a layer that updates buffers in
    training mode (BatchNorm's running statistics) updates the module's buffers in place. In one
    process that is torch's own behaviour. On several ranks it would leave each rank with its own
    floating-point buffers, silently (torch DDP broadcasts rank 0's before every forward), so there
    ``apply_fn`` raises instead (not for :func:`fddp.sync_batchnorm`'s layers, whose statistics span
    every rank and are updated alike everywhere), on every rank, naming the buffers, before anything is synchronised
    and with the module's buffers as they were: use :func:`functionalize_with_buffers`, whose
    ``apply_fn`` returns the new buffers, and :func:`fddp.sync_buffers`. Which buffers a forward
    writes is learnt from its first call in each train/eval mode (one copy of the buffers); a
    buffer the forward only reads (a mask, BERT's ``position_ids``, BatchNorm's statistics in eval
    mode) and integer counters (``num_batches_tracked``) are fine. Under ``torch.compile``, which
    does not trace the check, nothing is checked.

    A parameter shared by several modules (tied weights) is one leaf, under its first name in
    ``named_parameters()``. :func:`load_into` writes trained values back into the module.

    Args:
        model: the module. Its parameters are not copied: ``params`` holds detached aliases, and
            fddp never writes into them (``fddp.optim.apply_gradients(..., donate=True)`` copies
            them on their first step); :func:`load_into` writes the module when you ask it to.
        trainable: ``trainable(name, parameter) -> bool`` picks the parameters that go into
            ``params``; ``None`` (the default) takes those with ``requires_grad=True``.

    Returns:
        ``(apply_fn, params)``, where ``params`` maps ``named_parameters()`` names to tensors.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> _ = model[0].requires_grad_(False)  # frozen: stays in the module
        >>> apply_fn, params = fddp.functionalize(model)
        >>> sorted(params)
        ['1.bias', '1.weight']
        >>> x = torch.randn(4, 3)
        >>> torch.equal(apply_fn(params, x), model(x))
        True
    """
    _check_module(model, "functionalize")
    params, frozen = _split_parameters(model, trainable, "functionalize")
    slots = _slots(model, model.named_parameters(remove_duplicate=False), set(params))
    names = params.keys()
    local = _LocalBuffers(model)

    def run(params: Params, args: tuple, kwargs: dict) -> Any:
        # functional_call's general machinery (walking the modules, accessors, strictness checks)
        # costs about 10 us per parameter per call, 1 ms a step on a 100-tensor transformer. With
        # exactly the names functionalize returned, swapping the tensors into the slots computed
        # once is the same thing; anything else, and tracing, goes through functional_call.
        if torch.compiler.is_compiling() or not isinstance(params, dict) or params.keys() != names:
            return functional_call(model, {**_detached(frozen), **_as_dict(params)}, args, kwargs)
        with _Swapped("_parameters", slots, params), _Swapped("_parameters", frozen, None):
            return model(*args, **kwargs)

    def apply_fn(params: Params, /, *args: Any, **kwargs: Any) -> Any:
        if local.slots and not torch.compiler.is_compiling():
            return local.call(run, params, args, kwargs)
        return run(params, args, kwargs)

    return apply_fn, params


def functionalize_with_buffers(
    model: nn.Module, /, *, trainable: Filter | None = None
) -> tuple[Callable[..., Any], Params, Params]:
    """Split a module into a pure ``apply_fn``, its trainable parameters and its buffers.

    ``apply_fn(params, buffers, *args, **kwargs)`` returns ``(output, new_buffers)``. The
    ``buffers`` passed in are never modified: a buffer that the forward writes in place
    (BatchNorm's running statistics in training mode) is copied first, and its updated value comes
    back in ``new_buffers``; a buffer the forward only reads (BERT's ``position_ids``, a causal
    mask, BatchNorm's statistics in eval mode) is passed as it is, without a copy, and comes back
    unchanged. Which buffers a forward writes is learnt from the first call in each train/eval
    mode, which copies them all and watches which copies change (their version counters, and
    their values: batch_norm writes its statistics without a version bump). Should a later call
    write a buffer that was passed uncopied (seen the same two ways), apply_fn gives the caller's
    tensor its value back from a copy it keeps of each such buffer (made once per tensor it is
    given) and copies that buffer from then on. Under
    ``torch.compile`` or with other names than these, every buffer is copied and the call goes
    through ``torch.func.functional_call``; under ``vmap`` over the buffers, every buffer is
    copied too. Pass ``new_buffers`` to the next step (and, across ranks, through
    :func:`fddp.sync_buffers` when the rank-local statistics should agree).

    DDP broadcasts rank 0's buffers when it wraps a module; here, ``buffers = fddp.broadcast(buffers)``
    does that, next to ``params = fddp.broadcast(params)``.

    Frozen parameters are left in the module, as in :func:`functionalize`.

    Args:
        model: the module; its own parameters and buffers are left untouched.
        trainable: as in :func:`functionalize`.

    Returns:
        ``(apply_fn, params, buffers)``, ``buffers`` mapping ``named_buffers()`` names to tensors.

    Example:
        >>> model = torch.nn.BatchNorm1d(3)
        >>> apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
        >>> buffers = fddp.broadcast(buffers)  # rank 0's buffers everywhere, as DDP starts
        >>> out, new_buffers = apply_fn(params, buffers, torch.randn(8, 3))
        >>> int(new_buffers["num_batches_tracked"]), int(buffers["num_batches_tracked"])
        (1, 0)
    """
    _check_module(model, "functionalize_with_buffers")
    params, frozen = _split_parameters(model, trainable, "functionalize_with_buffers")
    slots = _slots(model, model.named_parameters(remove_duplicate=False), set(params))
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    buffer_slots = _slots(model, model.named_buffers(remove_duplicate=False), set(buffers))
    # The modules whose train/eval flag may decide what their forward writes.
    owners = list({id(m): m for m, _, _ in buffer_slots}.values())
    names, buffer_names = params.keys(), buffers.keys()
    writes = _Writes()

    def apply_fn(params: Params, buffers: Params, /, *args: Any, **kwargs: Any) -> tuple[Any, Params]:
        fast = (
            not torch.compiler.is_compiling()
            and isinstance(params, dict)
            and params.keys() == names
            and isinstance(buffers, dict)
            and buffers.keys() == buffer_names
        )
        if not fast:
            # Layers update buffers in place (running_mean.mul_(...)): give them copies to update.
            new_buffers = {name: b.clone() for name, b in _as_dict(buffers).items()}
            out = functional_call(model, ({**_detached(frozen), **_as_dict(params)}, new_buffers), args, kwargs)
            return out, new_buffers
        mode = tuple(m.training for m in owners)
        written = writes.learnt.get(mode)
        traced = any(_functorch.is_functorch_wrapped_tensor(b) for b in buffers.values())
        given = {}
        for name, b in buffers.items():
            copy = written is None or traced or name in written
            given[name] = b.clone() if copy else b
        shared = [] if written is None or traced else [(name, b, writes.snapshot(b)) for name, b in buffers.items() if given[name] is b]
        versions = {name: t._version for name, t in given.items()} if not traced else None
        with _Swapped("_parameters", slots, params), _Swapped("_parameters", frozen, None):
            with _Swapped("_buffers", buffer_slots, given) as swap:
                out = model(*args, **kwargs)
                new_buffers = swap.current()
        if versions is not None:
            # A write shows in the version counter, except where a kernel skips it (batch_norm
            # updates its running statistics without a bump): compare the values too.
            learning = written is None
            changed = {
                name
                for name, t in given.items()
                if t._version != versions[name] or (learning and not torch.equal(t, buffers[name]))
            }
            # The uncopied buffers' values are compared on the CPU only: on a GPU each comparison is
            # a host sync per buffer and forward (torch.equal), and there the version counter alone
            # tells a write (batch_norm's statistics, written without a bump, are written by the
            # first call of a mode already, and copied from then on).
            changed |= {name for name, b, snap in shared if b.is_cpu and not torch.equal(b, snap)}
            for name, b, snap in shared:
                if name in changed:
                    # Written although the first call did not write it: keep the written value,
                    # give the caller's tensor its value back, and copy this buffer from now on.
                    with torch.no_grad():
                        if new_buffers[name] is b:
                            new_buffers[name] = b.clone()
                        b.copy_(snap)
            writes.learn(mode, changed)
        return out, new_buffers

    return apply_fn, params, buffers


def load_into(model: nn.Module, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor] | None = None, /) -> nn.Module:
    """Write trained parameters (and buffers) back into the module, in place; return the module.

    The way back from :func:`functionalize`, for what needs the module itself: ``torch.save`` of
    the module or its ``state_dict()``, Hugging Face's ``save_pretrained`` and ``generate``, export.
    Each value is copied into the module's own tensor of that name (``Tensor.copy_``, casting to
    the module's dtype and device, as ``load_state_dict`` does), so weights tied under several
    names stay one tensor and all of its names get the new value: a GPT-2's ``lm_head.weight``
    follows ``transformer.wte.weight``. Any subset of the names works: frozen parameters left out
    of ``params`` keep the module's values.

    Args:
        model: the module ``params`` came from (or one of the same architecture).
        params: parameter names (as ``named_parameters()``, any of a tied weight's names) to tensors.
        buffers: buffer names (as ``named_buffers()``) to tensors, e.g. from
            :func:`functionalize_with_buffers`'s ``apply_fn``; ``None`` leaves the buffers alone.

    Returns:
        ``model``.

    Raises:
        KeyError: a name that the module does not have.
        ValueError: a value whose shape differs from the module's tensor.

    Example:
        >>> model = torch.nn.Linear(3, 2)
        >>> apply_fn, params = fddp.functionalize(model)
        >>> trained = {k: v + 1 for k, v in params.items()}  # e.g. after training
        >>> _ = fddp.load_into(model, trained)
        >>> torch.equal(model.bias, trained["bias"])
        True
    """
    _check_module(model, "load_into")
    targets = [("params", params, dict(model.named_parameters(remove_duplicate=False)))]
    if buffers is not None:
        targets.append(("buffers", buffers, dict(model.named_buffers(remove_duplicate=False))))
    plan = []
    for what, values, own in targets:
        if not isinstance(values, Mapping):
            raise TypeError(f"fddp.load_into: {what} must be a dict of tensors by name, got {type(values).__name__}")
        for name, value in values.items():
            if name not in own:
                kind = "parameter" if what == "params" else "buffer"
                raise KeyError(
                    f"fddp.load_into: {what}[{name!r}]: {type(model).__name__} has no {kind} of that name "
                    f"(it has {_some(own)})"
                )
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"fddp.load_into: {what}[{name!r}] must be a tensor, got {type(value).__name__}")
            target = own[name]
            if value.shape != target.shape:
                raise ValueError(
                    f"fddp.load_into: {what}[{name!r}]: expected shape {tuple(target.shape)} (the module's), "
                    f"got {tuple(value.shape)}"
                )
            plan.append((target, value))
    with torch.no_grad():  # checked everything first: an error leaves the module as it was
        for target, value in plan:
            if target is not value:
                target.copy_(value)
    return model


# ---------------------------------------------------------------------------------------------- helpers


def _some(names: Iterable[str], n: int = 6) -> str:
    names = list(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "") if names else "none"


def _split_parameters(model: nn.Module, trainable: Filter | None, what: str) -> tuple[Params, list[Slot]]:
    """The trainable parameters as marked, detached aliases, and the slots of the left-out ones.

    ``apply_fn`` gives a left-out parameter that still requires grad (filtered out by
    ``trainable``) to the module as a detached alias at each call, so that no graph reaches it;
    one with ``requires_grad=False`` needs nothing, but the same treatment costs nothing either.
    """
    if trainable is not None and not callable(trainable):
        raise TypeError(f"fddp.{what}: trainable must be a function (name, parameter) -> bool, got {trainable!r}")
    params: Params = {}
    left_out = set()
    for name, p in model.named_parameters():
        if p.requires_grad if trainable is None else trainable(name, p):
            alias = p.detach()
            setattr(alias, MODULE_ALIAS, True)
            params[name] = alias
        elif p.requires_grad:
            left_out.add(name)
    return params, _slots(model, model.named_parameters(remove_duplicate=False), left_out)


def _slots(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], wanted: set[str]) -> list[Slot]:
    """``(module, attribute, name)`` for every registered tensor whose first name is in ``wanted``.

    ``name`` is the tensor's first name (``named_parameters()`` and ``named_buffers()`` keep only
    that one), so a tensor tied into several modules receives the same value in each, as
    functional_call's ``tie_weights`` does.
    """
    first: dict[int, str] = {}
    slots = []
    for name, t in named:
        prefix, _, attr = name.rpartition(".")
        owner = first.setdefault(id(t), name)
        if owner in wanted:
            slots.append((model.get_submodule(prefix), attr, owner))
    return slots


def _detached(frozen: list[Slot]) -> Params:
    return {name: module._parameters[attr].detach() for module, attr, name in frozen}


def _as_dict(tree: Any) -> Any:
    return dict(tree) if isinstance(tree, Mapping) else tree


class _Swapped:
    """Put tensors into a module's slots (``_parameters`` or ``_buffers``) for a call, then restore.

    ``values[name]`` goes into every slot of that name; with ``values=None``, each slot gets a
    detached alias of what it holds (left-out parameters).
    """

    def __init__(self, kind: str, slots: list[Slot], values: Mapping[str, torch.Tensor] | None) -> None:
        self.kind, self.slots, self.values = kind, slots, values
        self.saved: list = []

    def __enter__(self) -> "_Swapped":
        for module, attr, name in self.slots:
            table = getattr(module, self.kind)
            old = table[attr]
            self.saved.append(old)
            table[attr] = old.detach() if self.values is None else self.values[name]
        return self

    def current(self) -> Params:
        """What the slots hold now, by name: a forward may have replaced a buffer (``self.b = ...``)."""
        return {name: getattr(module, self.kind)[attr] for module, attr, name in self.slots}

    def __exit__(self, *exc: Any) -> None:
        for (module, attr, _), old in zip(self.slots, self.saved):
            getattr(module, self.kind)[attr] = old
        self.saved.clear()


class _LocalBuffers:
    """Which floating-point buffers ``functionalize``'s forward writes in the module, per
    train/eval mode, and the error for a run on several ranks, where each rank would keep its own.

    Learnt from the first call in each mode: every buffer is copied, the forward runs, and a buffer
    counts as written when its slot holds another tensor, its version counter moved, or its bits
    changed (batch_norm updates its running statistics without a version bump).
    """

    def __init__(self, model: nn.Module) -> None:
        named = dict(model.named_buffers())
        # A SyncBatchNorm's running statistics are updated alike on every rank: no rank keeps its own.
        synced = {
            f"{prefix}.{attr}" if prefix else attr
            for prefix, m in model.named_modules()
            if isinstance(m, SyncBatchNorm)
            for attr in ("running_mean", "running_var")
        }
        self.floating = {name for name, b in named.items() if (b.is_floating_point() or b.is_complex()) and name not in synced}
        # Every buffer's slots, integer ones too: an error puts them all back as they were.
        self.slots = _slots(model, model.named_buffers(remove_duplicate=False), set(named)) if self.floating else []
        self.owners = list({id(m): m for m, _, _ in self.slots}.values())  # whose train/eval flag may decide
        self.learnt: dict[tuple[bool, ...], tuple[str, ...]] = {}

    def call(self, run: Callable[[Params, tuple, dict], Any], params: Params, args: tuple, kwargs: dict) -> Any:
        mode = tuple(m.training for m in self.owners)
        written = self.learnt.get(mode)
        if written is None:
            return self._learn(mode, run, params, args, kwargs)
        if written and _several_ranks():
            raise RuntimeError(self._message(written, mode))
        return run(params, args, kwargs)

    def _learn(self, mode: tuple[bool, ...], run: Callable, params: Params, args: tuple, kwargs: dict) -> Any:
        before = [(module, attr, name, module._buffers[attr]) for module, attr, name in self.slots]
        kept = [(t, t._version, t.detach().clone()) for *_, t in before]
        out = run(params, args, kwargs)
        written = []
        for (module, attr, name, t), (_, version, copy) in zip(before, kept):
            now = module._buffers[attr]
            if name in self.floating and (now is not t or t._version != version or not _same_bits(t, copy)):
                written.append(name)
        written = list(dict.fromkeys(written))  # a tied buffer once, in the module's order
        self.learnt[mode] = tuple(written)
        if written and _several_ranks():
            with torch.no_grad():  # the error leaves the module as it was
                for (module, attr, _, t), (_, _, copy) in zip(before, kept):
                    module._buffers[attr] = t
                    t.copy_(copy)
            raise RuntimeError(self._message(written, mode))
        return out

    def _message(self, written: Sequence[str], mode: tuple[bool, ...]) -> str:
        shown = ", ".join(repr(n) for n in written[:4]) + (f" and {len(written) - 4} more" if len(written) > 4 else "")
        state = "training" if any(mode) else "eval"
        return (
            f"fddp.functionalize: the forward writes the module's floating-point buffers {shown} in {state} mode "
            f"(BatchNorm's running statistics, say); with {dist.get_world_size()} ranks each would keep its own, "
            "silently, where torch DDP broadcasts rank 0's before each forward. Use `apply_fn, params, buffers = "
            "fddp.functionalize_with_buffers(model)`: its apply_fn(params, buffers, ...) returns (output, "
            "new_buffers); pass `buffers = fddp.sync_buffers(buffers)` before each forward for DDP's behaviour (the "
            "loop is in the docs' Concepts page, \"BatchNorm and buffers\"). The module's buffers were left as they were."
        )


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: ``torch.equal`` calls two NaNs different, and would call an unwritten NaN buffer written."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


class _Writes:
    """Which buffers a module's forward writes in place, per train/eval mode, and snapshots of the
    buffers passed uncopied, to give a caller's tensor its value back should a forward write it."""

    def __init__(self) -> None:
        self.learnt: dict[tuple[bool, ...], frozenset[str]] = {}
        # id(tensor) -> (weak reference, version, copy). Not a WeakKeyDictionary: on a hash
        # collision it compares keys with ==, which is elementwise for tensors.
        self._snapshots: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def learn(self, mode: tuple[bool, ...], written: set[str]) -> None:
        self.learnt[mode] = self.learnt.get(mode, frozenset()) | written

    def snapshot(self, b: torch.Tensor) -> torch.Tensor:
        """A copy of ``b``'s current value, made once per tensor and version."""
        kept = self._snapshots.get(id(b))
        if kept is None or kept[0]() is not b or kept[1] != b._version:
            key = id(b)
            ref = weakref.ref(b, lambda _, key=key, table=self._snapshots: table.pop(key, None))
            kept = (ref, b._version, b.detach().clone())
            self._snapshots[key] = kept
        return kept[2]
