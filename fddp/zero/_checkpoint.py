"""Checkpoints of sharded trees with torch.distributed.checkpoint (DCP): per-rank files that reshard.

Every leaf of every tree is stored under its own key, its path (``opt/exp_avg/0.weight``), as one
1-D tensor of the leaf's elements; each rank writes the pieces its shards hold, at their offsets in
the leaf. Neither the world size nor the bucket plan appears in the keys, so a checkpoint saved on
4 ranks loads on 2, on 1, or into a replicated tree: DCP reads the saved pieces that overlap the
pieces each rank asks for straight into its new shard buffers. Leaves that are not sharded (a step
count) are the same on every rank and are stored once; Python scalars go into a small manifest
written with :func:`fddp.checkpoint.save` (weights only).

Pieces of a leaf at arbitrary offsets are not something DTensor can describe (its ``Shard(0)`` is a
``torch.chunk`` range), so :class:`_FlatPieces` implements DCP's checkpointable protocol directly
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, as torch's own
``LocalShardsWrapper`` does).

Atomic: every rank writes into ``<directory>.tmp-<token>``; once DCP's last collective has
returned (its ``.metadata`` is written), rank 0 adds the manifest and renames the directory into
place. A directory is never overwritten. DCP's ``.metadata`` is a pickle; it is read with an
unpickler that accepts DCP's own metadata classes and nothing else, so loading runs no code from
the files, as :func:`fddp.checkpoint.load` promises.
"""

from __future__ import annotations

import collections
import inspect
import io
import os
import pickle
import uuid
from typing import Any

import torch
import torch.distributed as dist

from fddp import _shard, checkpoint
from fddp._shard import Sharded
from fddp.checkpoint import CheckpointError

__all__ = ["save_sharded", "load_sharded"]  # public as fddp.checkpoint.save_sharded / load_sharded

_FORMAT = "fddp-sharded-checkpoint"
_VERSION = 1
_MANIFEST = "fddp-manifest.pt"
_PRIMITIVES = (bool, int, float, complex, str, bytes, type(None))

try:  # DCP and its planner types (torch >= 2.4 has them; the protocol hooks are duck-typed)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
except ImportError:  # pragma: no cover - builds without torch.distributed
    dcp = None


def _no_dist(distributed: bool) -> dict[str, bool]:
    """``dcp.save``/``dcp.load``'s ``no_dist=`` where torch takes it (2.13 does, 2.6 does not).

    Without a process group DCP must not run collectives. Older versions take no such keyword and
    decide it themselves from ``dist.is_initialized()``, the very test ``distributed`` comes from.
    """
    return {"no_dist": not distributed} if _TAKES_NO_DIST else {}


_TAKES_NO_DIST = dcp is not None and "no_dist" in inspect.signature(dcp.save).parameters


class _FlatPieces(torch.Tensor):
    """A 1-D tensor of ``numel`` elements of which this rank holds some ranges; for DCP only."""

    @staticmethod
    def __new__(cls, numel: int, pieces: list[tuple[int, torch.Tensor]], dtype: torch.dtype, device: torch.device) -> "_FlatPieces":
        r = torch.Tensor._make_wrapper_subclass(cls, (numel,), dtype=dtype, device=device)
        r._pieces = [(int(a), t) for a, t in pieces if t.numel() > 0]
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:  # DCP may detach what it is given
            return args[0]
        raise NotImplementedError(f"fddp's checkpoint pieces support no tensor operations (got {func})")

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        props = TensorProperties.create_from_tensor(self._pieces[0][1]) if self._pieces else TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([a])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([a]), sizes=torch.Size([t.numel()])),
                    properties=props,
                    size=self.size(),
                ),
            )
            for a, t in self._pieces
        ]

    def __create_chunk_list__(self) -> list:
        return [ChunkStorageMetadata(offsets=torch.Size([a]), sizes=torch.Size([t.numel()])) for a, t in self._pieces]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for a, t in self._pieces:
            if index.offset is not None and index.offset[0] == a:
                return t
        raise ValueError(f"fddp checkpoint: no piece of {index.fqn} at offset {index.offset}")


def _key(prefix: str, part: Any) -> str:
    return f"{prefix}/{part}" if prefix else str(part)


def _leaf_specs(lay: _shard.ShardLayout) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
    specs: list[Any] = [None] * lay.plan.num_leaves
    for b in lay.plan.buckets:
        for i, shape in zip(b.indices, b.shapes):
            specs[i] = (shape, b.dtype, b.device)
    return specs


def _walk(node: Any, prefix: str, tensors: dict, scalars: dict, shards_for: Any, what: str) -> Any:
    """Put ``node``'s leaves into ``tensors`` (key -> 1-D tensor or pieces) and ``scalars``.

    ``shards_for(sharded)`` gives the shard buffers to describe (the node's own when saving, new
    zeroed ones when loading). Returns the node rebuilt around what was put in (for loading).
    """
    if isinstance(node, Sharded):
        lay = node.layout
        lay.check_group(what)
        shards = shards_for(node)
        paths = _leaf_paths(lay)
        for i, ((shape, dtype, device), pieces) in enumerate(zip(_leaf_specs(lay), _shard.leaf_pieces(lay))):
            held = [(a, shards[k][x : x + n]) for k, a, x, n in pieces]
            tensors[_key(prefix, paths[i])] = (_FlatPieces(_numel(shape), held, dtype, device), shape)
        return Sharded(shards, lay)
    if isinstance(node, torch.Tensor):
        t = shards_for(node)
        tensors[prefix or "<root>"] = (t.reshape(-1), tuple(node.shape))
        return t
    if type(node) in _PRIMITIVES:
        scalars[prefix or "<root>"] = node
        return node
    if isinstance(node, dict):
        out = {k: _walk(v, _key(prefix, k), tensors, scalars, shards_for, what) for k, v in node.items()}
        return collections.OrderedDict(out) if isinstance(node, collections.OrderedDict) else out
    if isinstance(node, tuple) and hasattr(type(node), "_fields"):
        return type(node)(*(_walk(v, _key(prefix, f), tensors, scalars, shards_for, what) for f, v in zip(node._fields, node)))
    if isinstance(node, (list, tuple)):
        items = [_walk(v, _key(prefix, i), tensors, scalars, shards_for, what) for i, v in enumerate(node)]
        return items if isinstance(node, list) else tuple(items)
    raise TypeError(
        f"fddp.checkpoint.{what}: leaf at {prefix or '<root>'!r} has unsupported type {type(node).__qualname__}; "
        "expected tensors, fddp.zero.Sharded trees and Python scalars inside dicts, lists, tuples and NamedTuples"
    )


def _leaf_paths(lay: _shard.ShardLayout) -> tuple[str, ...]:
    from fddp._tree import paths

    return paths(lay.spec)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _group_rank(group: dist.ProcessGroup | None) -> tuple[bool, int]:
    distributed = dist.is_available() and dist.is_initialized()
    return distributed, (dist.get_rank(group) if distributed else 0)


def save_sharded(directory: str | os.PathLike, tree: Any, /, *, group: dist.ProcessGroup | None = None) -> str:
    """See :func:`fddp.checkpoint.save_sharded`."""
    if dcp is None:  # pragma: no cover
        raise RuntimeError("fddp.checkpoint.save_sharded needs torch.distributed.checkpoint")
    directory = os.path.abspath(os.fspath(directory))
    distributed, rank = _group_rank(group)
    if os.path.exists(directory):  # every rank sees the same file system: all raise, no one waits
        raise FileExistsError(
            f"fddp.checkpoint.save_sharded: {directory} exists; sharded checkpoints are never overwritten "
            "(write each to a new directory, e.g. one per step, and delete old ones after)"
        )
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    _walk(tree, "", tensors, scalars, lambda node: node.shards if isinstance(node, Sharded) else node.detach(), "save_sharded")
    token = [uuid.uuid4().hex if rank == 0 else None]
    if distributed and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    tmp = f"{directory}.tmp-{token[0]}"
    state = {k: (t if isinstance(t, _FlatPieces) else t.contiguous()) for k, (t, _) in tensors.items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), process_group=group, **_no_dist(distributed))
    if rank == 0:
        manifest = {
            "format": _FORMAT,
            "version": _VERSION,
            "world_size": dist.get_world_size(group) if distributed else 1,  # informational
            "tensors": {k: (list(shape), str(t.dtype)) for k, (t, shape) in tensors.items()},
            "scalars": scalars,
        }
        checkpoint.save(os.path.join(tmp, _MANIFEST), manifest, group=group if distributed else None)
        os.replace(tmp, directory)
        checkpoint._fsync_dir(os.path.dirname(directory))
    if distributed:
        dist.barrier(group)
    return directory


class _Unpickler(pickle.Unpickler):
    """Reads DCP's metadata: its own dataclasses, torch sizes, dtypes and layouts, plain containers."""

    _ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a name to torch.strided & co.
        ("pathlib", "PosixPath"),  # the checkpoint id DCP records
        ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module in self._ALLOWED_MODULES or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: not part of DCP's checkpoint metadata")


if dcp is not None:

    class _SafeReader(dcp.FileSystemReader):
        """DCP's file reader, with its metadata read by :class:`_Unpickler`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = os.path.join(os.fspath(self.path), ".metadata")
            with open(path, "rb") as f:
                data = f.read()
            try:
                metadata = _Unpickler(io.BytesIO(data)).load()
            except Exception as e:
                raise CheckpointError(f"{path}: refused to load the checkpoint's metadata ({e})") from None
            from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

            if not isinstance(metadata, Metadata) or not all(
                isinstance(v, TensorStorageMetadata) for v in metadata.state_dict_metadata.values()
            ):
                # fddp writes tensors only; DCP would unpickle anything else (torch.load, weights_only=False).
                raise CheckpointError(f"{path}: refused to load: the checkpoint holds entries other than tensors")
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata


def load_sharded(directory: str | os.PathLike, /, like: Any, *, group: dist.ProcessGroup | None = None) -> Any:
    """See :func:`fddp.checkpoint.load_sharded`."""
    if dcp is None:  # pragma: no cover
        raise RuntimeError("fddp.checkpoint.load_sharded needs torch.distributed.checkpoint")
    directory = os.fspath(directory)
    manifest_path = os.path.join(directory, _MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"{directory}: not a sharded fddp checkpoint (no {_MANIFEST}; is the save complete?)")
    manifest = checkpoint.load(manifest_path)
    if not (isinstance(manifest, dict) and manifest.get("format") == _FORMAT):
        raise CheckpointError(f"{manifest_path}: not an fddp sharded-checkpoint manifest")
    if manifest.get("version") != _VERSION:
        raise CheckpointError(f"{manifest_path}: version {manifest.get('version')!r}; this fddp reads version {_VERSION}")

    def fresh(node: Any) -> Any:
        if isinstance(node, Sharded):
            return _shard.new_shards(node.layout)
        return torch.zeros_like(node, memory_format=torch.contiguous_format).detach()

    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    out = _walk(like, "", tensors, scalars, fresh, "load_sharded")
    saved_tensors, saved_scalars = manifest["tensors"], manifest["scalars"]
    for key, (t, shape) in tensors.items():
        if key not in saved_tensors:
            raise CheckpointError(f"{directory}: checkpoint does not match `like` at {key!r}: expected a tensor, found no such key")
        saved_shape, saved_dtype = saved_tensors[key]
        if _numel(tuple(saved_shape)) != _numel(shape) or saved_dtype != str(t.dtype):
            raise CheckpointError(
                f"{directory}: checkpoint does not match `like` at {key!r}: expected shape {tuple(shape)} and dtype "
                f"{t.dtype}, found shape {tuple(saved_shape)} and dtype {saved_dtype}"
            )
    extra = [k for k in saved_tensors if k not in tensors] + [k for k in saved_scalars if k not in scalars]
    if extra:
        raise CheckpointError(f"{directory}: checkpoint does not match `like`: it holds {extra[0]!r}, which `like` lacks")
    for key, value in scalars.items():
        if key not in saved_scalars:
            raise CheckpointError(f"{directory}: checkpoint does not match `like` at {key!r}: expected a {type(value).__name__}, found no such key")
        if type(saved_scalars[key]) is not type(value):
            raise CheckpointError(
                f"{directory}: checkpoint does not match `like` at {key!r}: expected a {type(value).__name__}, "
                f"found {type(saved_scalars[key]).__name__} {saved_scalars[key]!r}"
            )
    distributed, _ = _group_rank(group)
    state = {k: t for k, (t, _) in tensors.items()}
    try:
        dcp.load(state, storage_reader=_SafeReader(directory), process_group=group, **_no_dist(distributed))
    except _CheckpointException as e:  # a BaseException, with every failed rank's error inside
        first = next(iter(e.failures.values()))[0]
        raise CheckpointError(f"{directory}: torch.distributed.checkpoint could not load it: {first}") from None
    return _put_scalars(out, "", saved_scalars)


def _put_scalars(node: Any, prefix: str, scalars: dict) -> Any:
    if isinstance(node, (Sharded, torch.Tensor)):
        return node
    if type(node) in _PRIMITIVES:
        return scalars[prefix or "<root>"]
    if isinstance(node, dict):
        items = [(k, _put_scalars(v, _key(prefix, k), scalars)) for k, v in node.items()]
        return type(node)(items) if isinstance(node, collections.OrderedDict) else dict(items)
    if isinstance(node, tuple) and hasattr(type(node), "_fields"):
        return type(node)(*(_put_scalars(v, _key(prefix, f), scalars) for f, v in zip(node._fields, node)))
    items = [_put_scalars(v, _key(prefix, i), scalars) for i, v in enumerate(node)]
    return items if isinstance(node, list) else tuple(items)
