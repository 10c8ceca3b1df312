"""Full values into a sharded layout and out of it, one leaf or one unit at a time.

:func:`load_full` lays a full tree (a state dict, a ``safetensors`` file, a Hugging Face
checkpoint directory) into an existing layout: each rank reads only the slice of each leaf it
holds, so a lazy source (``safetensors``, ``torch.load(..., mmap=True)``) never puts the whole tree
on a rank. :func:`write_back` gathers a fully sharded module's units one at a time and writes their
full values into the module's parameters (for ``save_pretrained``, ``generate``, or any code that
wants the module itself); :func:`release` gives the values back to the shards.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fddp import _dist, _layout
from fddp._errors import CheckpointError
from fddp._tree import paths
from fddp.zero import _gather
from fddp.zero import _layout as shard_layout
from fddp.zero._gather import Counters, Pipeline
from fddp.zero._stage3 import FullyShardedForward, _agree, _agree_on

__all__ = ["load_full", "release", "write_back"]

# Reads ``n`` elements of leaf ``name`` (flattened) from element ``a`` on, given the leaf's shape.
Reader = Callable[[str, tuple[int, ...], int, int], torch.Tensor]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _mapping_reader(source: Any, what: str) -> tuple[Callable[[str], bool], Reader]:
    def read(name: str, shape: tuple[int, ...], a: int, n: int) -> torch.Tensor:
        t = source[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fddp.{what}: the source's value for {name!r} is a {type(t).__name__}, not a tensor")
        if tuple(t.shape) != shape:
            raise ValueError(
                f"fddp.{what}: leaf {name!r} has shape {shape} in the shards and {tuple(t.shape)} in the source; "
                "load values of the model's own shapes"
            )
        return t.detach().reshape(-1)[a : a + n]

    return (lambda name: name in source), read


def _safetensors_reader(handles: dict[str, Any], what: str) -> tuple[Callable[[str], bool], Reader]:
    """Readers over open ``safetensors`` files (name -> handle): whole rows, those the piece spans."""

    def read(name: str, shape: tuple[int, ...], a: int, n: int) -> torch.Tensor:
        sl = handles[name].get_slice(name)
        got = tuple(sl.get_shape())
        if got != shape:
            raise ValueError(
                f"fddp.{what}: leaf {name!r} has shape {shape} in the shards and {got} in the file; load values of the model's own shapes"
            )
        if not shape:
            return handles[name].get_tensor(name).reshape(-1)[a : a + n]
        row = _numel(shape[1:])
        r0, r1 = a // row, -(-(a + n) // row)
        return sl[r0:r1].reshape(-1)[a - r0 * row : a - r0 * row + n]

    return (lambda name: name in handles), read


_PICKLED = ("pytorch_model.bin", "model.pt", "model.pth", "pytorch_model.bin.index.json")


def _refuse_pickles(path: str, what: str) -> None:
    """A directory with no safetensors: say so, and never fall back on the pickles it may hold."""
    found = [n for n in _PICKLED if os.path.exists(os.path.join(path, n))]
    if found:
        raise CheckpointError(
            f"{os.path.join(path, found[0])}: refused to load: fddp.{what} reads safetensors only, and this is a "
            "pickle, which could run code. Convert it (transformers: from_pretrained(...).save_pretrained(dir, "
            "safe_serialization=True)), or pass the state dict yourself: torch.load(file, weights_only=True)"
        )
    raise FileNotFoundError(f"fddp.{what}: {path} holds neither model.safetensors nor model.safetensors.index.json")


def _index(index: str, path: str, what: str) -> dict[str, str]:
    """A Hugging Face safetensors index: leaf name -> file in ``path`` (never outside it)."""
    try:
        with open(index, "rb") as f:
            weight_map = json.loads(f.read().decode())["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index (JSON with a weight_map): {type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: its weight_map is not a table of leaf names to file names")
    files = {}
    for name, file in weight_map.items():
        rel = os.path.normpath(file)
        if os.path.isabs(rel) or rel == ".." or rel.startswith(".." + os.sep):
            raise CheckpointError(f"{index}: refused: leaf {name!r} is in {file!r}, outside the checkpoint's directory")
        files[name] = os.path.join(path, rel)
    return files


def _safe_open(file: str, what: str) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt")
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own SafetensorsError, or an OSError of the read
        raise CheckpointError(
            f"{file}: not a safetensors file, or damaged ({type(e).__name__}: {e}); fddp.{what} reads safetensors "
            "only (anything pickled could run code)"
        ) from None


def _open(source: str | os.PathLike, what: str) -> tuple[dict[str, Any], list[Any]]:
    """The ``safetensors`` files of a path: a file, or a directory holding ``model.safetensors`` or
    a Hugging Face index of several (``model.safetensors.index.json``). Nothing is unpickled:
    safetensors is a JSON header and raw bytes, the index is JSON."""
    path = os.fspath(source)
    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            files = _index(index, path, what)
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            files = None
            path = os.path.join(path, "model.safetensors")
        else:
            _refuse_pickles(path, what)
    else:
        files = None
    opened: dict[str, Any] = {}
    if files is None:
        h = _safe_open(path, what)
        return {n: h for n in h.keys()}, [h]
    handles = {}
    try:
        for name, file in files.items():
            if file not in opened:
                opened[file] = _safe_open(file, what)
            handles[name] = opened[file]
    except BaseException:
        for h in opened.values():  # the files opened before the one that failed
            h.__exit__(None, None, None)
        raise
    return handles, list(opened.values())


def _group_of(x: Any, *args: Any, **kwargs: Any) -> Any:
    """The shard group of ``load_full``'s shards or ``write_back``'s apply_fn (the call's scope)."""
    return x.layout.group


@_dist.entry("zero.load_full", _group_of)
def load_full(shards: shard_layout.Sharded, source: Any, /, *, strict: bool = True) -> shard_layout.Sharded:
    """Lay full values into the layout of ``shards``: new shards holding ``source``'s values.

    Each rank reads only its own slice of each leaf, one leaf at a time (for a ``safetensors``
    file, only the rows its slice spans), so with a lazy source the whole tree never lies on one
    rank: a Hugging Face checkpoint loads into a model that :func:`fddp.zero.fully_shard` sharded
    with random (or empty) values, a reference run's tree into a stage-3 layout. The values are
    cast to the shards' dtype (float32 master shards from a bf16 checkpoint). Every rank of the
    shard group calls it: after the reads the ranks agree (one small all-reduce), so a rank whose
    source lacks a leaf or is damaged raises its error and every peer a :class:`fddp.PeerError`
    naming it, at once, instead of waiting in the next collective. A path is read as safetensors
    and JSON only, never unpickled.

    Args:
        shards: a :class:`fddp.zero.Sharded` (stage 3's, or stage 2's); not modified.
        source: the full values by leaf name (the module's parameter names, as
            ``shards.layout.spec`` holds them): a mapping of tensors (a state dict, or
            ``torch.load(path, mmap=True)``), an open ``safetensors.safe_open`` handle, or the path
            of a ``.safetensors`` file or of a directory holding ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` (what ``save_pretrained`` writes).
        strict: every leaf must be in ``source`` (``False``: leaves it lacks keep their values).
            Keys of ``source`` that name no leaf (buffers, tied duplicates) are ignored.

    Returns:
        New shards with the same layout.

    Raises:
        ValueError: ``strict`` and ``source`` lacks leaves (the first are named), or a leaf's shape
            differs from the source's.
        fddp.checkpoint.CheckpointError: a path that is not safetensors (a pickle is refused unread),
            a damaged file or index, or an index that points outside its directory; naming the file.
        fddp.PeerError: on the other ranks, when one rank failed.

    Example:
        >>> model = transformers.GPT2LMHeadModel(config)  # random weights
        >>> apply_fn, shards = fddp.zero.fully_shard(model)
        >>> shards = fddp.zero.load_full(shards, "gpt2-checkpoint/")  # model.safetensors, slice by slice
    """
    what = "zero.load_full"
    if not isinstance(shards, shard_layout.Sharded):
        raise TypeError(f"fddp.{what}: expected a fddp.zero.Sharded, got {type(shards).__name__}")
    lay = shards.layout
    if lay.spec is None:
        raise ValueError(f"fddp.{what}: these shards have no tree structure to name their leaves")
    opened: list[Any] = []
    if isinstance(source, (str, os.PathLike)):
        handles, opened = _open(source, what)
        has, read = _safetensors_reader(handles, what)
    elif hasattr(source, "get_slice") and hasattr(source, "keys"):  # an open safetensors handle
        has, read = _safetensors_reader({n: source for n in source.keys()}, what)
    elif hasattr(source, "__getitem__") and hasattr(source, "__contains__"):
        has, read = _mapping_reader(source, what)
    else:
        raise TypeError(
            f"fddp.{what}: source must be a mapping of tensors (a state dict), a safetensors handle, or a path; got {type(source).__name__}"
        )
    try:
        names = paths(lay.spec)
        missing = [n for n in names if not has(n)]
        if strict and missing:
            shown = ", ".join(repr(n) for n in missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise ValueError(
                f"fddp.{what}: the source has no value for {len(missing)} of {len(names)} leaves: {shown}. Name them as the "
                "model's parameters are named (model.named_parameters()), or pass strict=False to keep their values"
            )
        shapes: dict[int, tuple[int, ...]] = {}
        for b in lay.plan.buckets:
            for i, shape in zip(b.indices, b.shapes):
                shapes[i] = tuple(shape)
        out = shard_layout.new_shards(lay)
        with torch.no_grad():
            for o, s in zip(out, shards.shards):
                o.copy_(_gather.plain(s).detach())
            pieces = shard_layout.leaf_pieces(lay)
            for b in lay.plan.buckets:  # bucket by bucket (unit by unit in stage 3), leaf by leaf
                for i in b.indices:
                    name = names[i]
                    if not has(name):
                        continue
                    for k, a, x, n in pieces[i]:
                        out[k][x : x + n].copy_(read(name, shapes[i], a, n))
    finally:
        for h in opened:
            close = getattr(h, "__exit__", None)
            if close is not None:
                close(None, None, None)
    # Every rank has read its slices: a rank that failed above announced it in place of this
    # agreement, so its peers raise here, not in whatever collective they would meet next.
    _agree(what, (lay, "load_full"), lay.describe, [lay.group])
    return shard_layout.Sharded(out, lay)


def _check(apply_fn: Any, shards: Any, what: str) -> None:
    if not isinstance(apply_fn, FullyShardedForward):
        raise TypeError(f"fddp.{what}: expected the apply_fn fddp.zero.fully_shard returned, got {type(apply_fn).__name__}")
    apply_fn._check(shards)


@_dist.entry("zero.write_back", _group_of)
def write_back(apply_fn: FullyShardedForward, shards: shard_layout.Sharded, /, *, rank: int | None = None) -> nn.Module:
    """Write the full values of ``shards`` into the module's parameters, one unit at a time; return the module.

    Every rank of the shard group must call it (one all-gather per bucket, unit after unit, so no
    more than one unit is gathered at once). Afterwards the module holds ordinary parameters with
    the shards' values (float32 masters under mixed precision; tied weights stay one parameter),
    as if it had never been sharded: ``save_pretrained``, ``generate`` and ``state_dict`` work on
    it. ``apply_fn`` keeps computing from the shards it is given; :func:`release` frees the
    module's values again, and ``fully_shard`` may shard the module anew.

    Args:
        apply_fn: the :class:`fddp.zero.FullyShardedForward` that ``fully_shard`` returned.
        shards: its shards (the optimizer's latest).
        rank: write into this rank's module only (the others take part in the gathers and keep
            nothing: memory of one unit); ``None``: every rank's.

    Returns:
        The module (``apply_fn.model``); on other ranks than ``rank``, still released.

    Example:
        >>> model = fddp.zero.write_back(apply_fn, shards, rank=0)
        >>> if fddp.rank() == 0:
        ...     model.save_pretrained("out/")  # a Hugging Face checkpoint of the trained weights
        >>> fddp.zero.release(apply_fn)  # the module's memory back
    """
    what = "zero.write_back"
    _check(apply_fn, shards, what)
    lay = apply_fn.layout
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < lay.world):
        raise ValueError(f"fddp.{what}: rank must be None or a rank of the shard group (0 to {lay.world - 1}), got {rank!r}")
    keep = rank is None or rank == lay.rank
    _dist.count_call(lay.group, what)
    _agree_on(lay, what)
    pipe = Pipeline(lay, what, shards.shards, 0, [], Counters())
    params: dict[int, nn.Parameter] = {}
    for unit in apply_fn._units:
        fulls = [pipe.gather_now(k, _gather.plain(shards.shards[k]).detach()) for k in unit.buckets]
        if not keep:
            continue
        views = [_layout.views(f, lay.plan.buckets[k]) for f, k in zip(fulls, unit.buckets)]
        for module, attr, j, pos in unit.slots:
            old = module._parameters[attr]
            key = id(old)  # the same placeholder for every name of a tied weight: one parameter
            if key not in params:
                params[key] = nn.Parameter(views[j][pos].clone(), requires_grad=old.requires_grad)
            module._parameters[attr] = params[key]
        del fulls, views
    return apply_fn.model


def release(apply_fn: FullyShardedForward, /) -> None:
    """Give the module's parameters back to the shards: the placeholders :func:`write_back` replaced.

    Local (no collective). Values written into the module since :func:`write_back` are dropped;
    the shards hold what ``apply_fn`` computes with.

    Example:
        >>> model = fddp.zero.write_back(apply_fn, shards)
        >>> tokens = model.generate(prompt, max_new_tokens=16)
        >>> fddp.zero.release(apply_fn)
    """
    if not isinstance(apply_fn, FullyShardedForward):
        raise TypeError(f"fddp.zero.release: expected the apply_fn fddp.zero.fully_shard returned, got {type(apply_fn).__name__}")
    for module, attr, placeholder in apply_fn._placeholders:
        module._parameters[attr] = placeholder
