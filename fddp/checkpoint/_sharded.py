"""Checkpoints of sharded trees with torch.distributed.checkpoint (DCP): per-rank files that reshard.

Every leaf of every tree is stored under its own key, its path (``opt/exp_avg/0.weight``), as one
1-D tensor of the leaf's elements; each rank writes the pieces its shards hold, at their offsets in
the leaf. Neither the world size nor the bucket plan appears in the keys, so a checkpoint saved on
4 ranks loads on 2, on 1, or into a replicated tree: DCP reads the saved pieces that overlap the
pieces each rank asks for straight into its new shard buffers. Leaves that are not sharded (a step
count) are the same on every rank and are stored once; Python scalars go into a small manifest,
a file of :mod:`fddp.checkpoint._codec`'s format.

Pieces of a leaf at arbitrary offsets are not something DTensor can describe (its ``Shard(0)`` is a
``torch.chunk`` range), so :class:`_FlatPieces` implements DCP's checkpointable protocol directly
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``, as torch's own
``LocalShardsWrapper`` does).

Damage is detected, not loaded: each rank records a CRC-32 of the bytes of every piece it wrote
(as they lie in its ``.distcp`` file), rank 0 gathers them with a CRC-32 of DCP's ``.metadata``
into the manifest, and every piece is verified as it is read back, before DCP copies any of it.

Atomic: every rank writes into ``<directory>.tmp-<host id>-<pid>-<random>`` (rank 0's name, see
:mod:`fddp.checkpoint._temp`); once DCP's last collective has returned (its ``.metadata`` is
written), rank 0 adds the manifest and renames the directory into place. A directory is never
overwritten. DCP's ``.metadata`` is a pickle; it is read with an unpickler that accepts DCP's own
metadata classes and nothing else, so loading runs no code from the files.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import zlib
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp._tree import article, paths
from fddp.checkpoint import _codec, _ranks, _temp
from fddp.checkpoint._codec import PRIMITIVES, CheckpointError
from fddp.zero import _layout as _shard

__all__ = ["load_sharded", "save_sharded"]

_FORMAT = "fddp-sharded-checkpoint"
_VERSION = 1  # manifests without "checksums" (written before they existed) load unverified
_MANIFEST = "fddp-manifest.pt"
_CHECKSUMS = "fddp-checksums-{rank}.pt"  # one per rank while saving; merged into the manifest

try:  # DCP and its planner types (torch >= 2.4 has them; the protocol hooks are duck-typed)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
except ImportError:  # pragma: no cover - builds without torch.distributed
    dcp = None


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


# --------------------------------------------------------------------------------------------
# The tree as DCP entries: one key per leaf, fddp's path format
# --------------------------------------------------------------------------------------------


def _flatten(tree: Any) -> tuple[list[Any], optree.PyTreeSpec, tuple[str, ...]]:
    """The tree's leaves (a :class:`Sharded` is one), its structure and every leaf's path."""
    leaves, spec = optree.tree_flatten(tree, is_leaf=lambda x: isinstance(x, _shard.Sharded), none_is_leaf=True)
    return leaves, spec, paths(spec)


def _join(outer: str, inner: str) -> str:
    """The key of leaf ``inner`` of a Sharded tree found at ``outer``."""
    if outer == "<root>":
        return inner
    return outer if inner == "<root>" else f"{outer}/{inner}"


def _entries(leaves: list, keys: tuple[str, ...], shards_for: Any, what: str) -> tuple[dict, dict, list]:
    """Describe the leaves for DCP: ``tensors`` (key -> 1-D tensor or pieces, leaf shape), ``scalars``.

    ``shards_for(leaf)`` gives the buffers to describe (the leaf's own when saving, new zeroed ones
    when loading). Also returns the leaves rebuilt around those buffers (for loading).
    """
    tensors: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    rebuilt = []
    for key, leaf in zip(keys, leaves):
        if isinstance(leaf, _shard.Sharded):
            lay = leaf.layout
            lay.check_group(what)
            shards = shards_for(leaf)
            inner = paths(lay.spec)
            for i, ((shape, dtype, device), pieces) in enumerate(zip(_leaf_specs(lay), _shard.leaf_pieces(lay))):
                held = [(a, shards[k][x : x + n]) for k, a, x, n in pieces]
                tensors[_join(key, inner[i])] = (_FlatPieces(_numel(shape), held, dtype, device), shape)
            rebuilt.append(_shard.Sharded(shards, lay))
        elif isinstance(leaf, torch.Tensor):
            t = shards_for(leaf)
            tensors[key] = (t.reshape(-1), tuple(leaf.shape))
            rebuilt.append(t)
        elif type(leaf) in PRIMITIVES:
            scalars[key] = leaf
            rebuilt.append(leaf)
        else:
            raise TypeError(
                f"fddp.checkpoint.{what}: leaf at {key!r} has unsupported type {type(leaf).__qualname__}; "
                "expected tensors, fddp.zero.Sharded trees and Python scalars inside dicts, lists, tuples and NamedTuples"
            )
    return tensors, scalars, rebuilt


def _leaf_specs(lay: _shard.ShardLayout) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
    specs: list[Any] = [None] * lay.plan.num_leaves
    for b in lay.plan.buckets:
        for i, shape in zip(b.indices, b.shapes):
            specs[i] = (shape, b.dtype, b.device)
    return specs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# --------------------------------------------------------------------------------------------
# Checksums of the pieces, as stored
# --------------------------------------------------------------------------------------------


def _crc_of_file(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _stored_checksums(root: str, results: list) -> dict[str, dict[str, torch.Tensor]]:
    """Per ``.distcp`` file, the CRC-32s of every item written, read back as it lies in the file.

    ``items`` holds one row ``(byte offset, length, index of its first CRC)`` per item, ``crcs``
    the CRC-32 of every 4 MiB block of every item (:func:`fddp.checkpoint._codec.crc32s`).
    """
    per_file: dict[str, list[tuple[int, int]]] = {}
    for wr in results:
        info = wr.storage_data
        per_file.setdefault(info.relative_path, []).append((info.offset, info.length))
    out = {}
    for name, items in per_file.items():
        rows, crcs = [], []
        with open(os.path.join(root, name), "rb") as f:
            for offset, length in items:
                f.seek(offset)
                rows.append((offset, length, len(crcs)))
                crcs.extend(_codec.crc32s([f.read(length)])[0])
        out[name] = {"items": torch.tensor(rows, dtype=torch.int64).reshape(-1, 3), "crcs": torch.tensor(crcs, dtype=torch.int64)}
    return out


def _saved_crcs(per_file: dict) -> dict[tuple[int, int], tuple[int, ...]]:
    """``(byte offset, length) -> CRC-32s`` of one file's items, from :func:`_stored_checksums`' record."""
    items, crcs = per_file["items"].tolist(), per_file["crcs"].tolist()
    ends = [first for _, _, first in items[1:]] + [len(crcs)]
    return {(offset, length): tuple(crcs[first:end]) for (offset, length, first), end in zip(items, ends)}


def _write_file(path: str, tree: Any) -> None:
    with open(path, "wb") as f:
        _codec.write(f, _codec.encode(tree))


def _read_file(path: str) -> Any:
    return _codec.decode(_codec.read(path), None, path)


if dcp is not None:

    class _Writer(dcp.FileSystemWriter):
        """DCP's file writer; each rank also records the CRC-32 of every piece it wrote."""

        def __init__(self, path: str, rank: int) -> None:
            super().__init__(path)
            self._fddp_rank = rank

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)  # already complete: DCP's writer is synchronous
            root = os.fspath(self.path)
            sums = _stored_checksums(root, fut.wait())
            _write_file(os.path.join(root, _CHECKSUMS.format(rank=self._fddp_rank)), sums)
            return fut

    class _Reader(dcp.FileSystemReader):
        """DCP's file reader, with the metadata :func:`_read_metadata` checked, and every piece verified."""

        def __init__(self, path: str, manifest: dict, metadata: Any) -> None:
            super().__init__(path)
            self._fddp_sums = manifest.get("checksums")  # None: written before checksums existed
            self._fddp_metadata = metadata
            self._fddp_names: dict[tuple[str, int], Any] = {}
            self._fddp_crcs: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {}

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # Read and checked by _read_metadata before DCP starts, so that its errors reach the
            # caller as they are (DCP would wrap them, after logging two tracebacks).
            metadata = self._fddp_metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            if self._fddp_sums is None:
                return super()._slice_file(file, sinfo)
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            saved = self._saved(sinfo.relative_path).get((sinfo.offset, sinfo.length))
            found = _codec.crc32s([data])[0]
            if len(data) != sinfo.length or found != saved:
                index = self._index_of(sinfo)
                where = os.path.join(os.fspath(self.path), sinfo.relative_path)
                if saved is None:
                    what = "no CRC-32 was saved for it"
                else:
                    k = next((k for k, (a, b) in enumerate(zip(found, saved)) if a != b), 0)
                    what = f"at byte {k * _codec.BLOCK} of it, saved CRC-32 {saved[k]:#010x}, now {found[k]:#010x}"
                raise CheckpointError(
                    f"{where}: damaged: the piece of leaf {index.fqn!r} starting at element "
                    f"{index.offset[0] if index.offset else 0} (bytes {sinfo.offset}..{sinfo.offset + sinfo.length} "
                    f"of the file) fails its check ({what}); use another copy or an older checkpoint"
                )
            return io.BytesIO(data)

        def _saved(self, relative_path: str) -> dict[tuple[int, int], tuple[int, ...]]:
            if relative_path not in self._fddp_crcs:
                per_file = self._fddp_sums.get(relative_path)
                self._fddp_crcs[relative_path] = {} if per_file is None else _saved_crcs(per_file)
            return self._fddp_crcs[relative_path]

        def _index_of(self, sinfo: Any) -> Any:
            if not self._fddp_names:
                self._fddp_names = {(i.relative_path, i.offset): k for k, i in self.storage_data.items()}
            return self._fddp_names.get((sinfo.relative_path, sinfo.offset), MetadataIndex("<unknown>"))


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


def _read_metadata(directory: str, manifest: dict) -> Any:
    """DCP's ``.metadata`` of ``directory``, unpickled by :class:`_Unpickler` and checked against the manifest."""
    path = os.path.join(directory, ".metadata")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read DCP's index of the pieces ({e})") from None
    saved = manifest.get("metadata_crc32")
    changed = saved is not None and zlib.crc32(data) != saved
    damaged = f"damaged: it does not match the CRC-32 saved in {_MANIFEST} (the file changed after it was written)"
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except Exception as e:
        why = f"; {damaged}" if changed else ""
        raise CheckpointError(f"{path}: refused to load the checkpoint's metadata ({e}){why}") from None
    if changed:
        raise CheckpointError(f"{path}: {damaged}; use another copy or an older checkpoint")
    if not isinstance(metadata, Metadata) or not all(
        isinstance(v, TensorStorageMetadata) for v in metadata.state_dict_metadata.values()
    ):
        # fddp writes tensors only; DCP would unpickle anything else (torch.load, weights_only=False).
        raise CheckpointError(f"{path}: refused to load: the checkpoint holds entries other than tensors")
    return metadata


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def save_sharded(directory: str | os.PathLike, tree: Any, /, *, group: dist.ProcessGroup | None = None) -> str:
    """Write a tree holding :class:`fddp.zero.Sharded` parts into ``directory``, every rank its own pieces.

    The format is torch.distributed.checkpoint's (DCP): one file per rank plus a ``.metadata``
    index, and a small ``fddp-manifest.pt`` (the format of :func:`save`) holding the Python scalars,
    every leaf's shape and dtype, and a CRC-32 of every piece as stored, which
    :func:`load_sharded` verifies. Each leaf is stored whole under its path
    (``opt/exp_avg/0.weight``), each rank writing the pieces its shards hold, so nothing in the
    checkpoint depends on the world size or the bucket plan: :func:`load_sharded` reads it back
    on any number of ranks, resharding, or into a replicated tree. Tensors that are not sharded (a
    step count) must be equal on every rank; one copy is stored.

    Atomic: the ranks write into ``<directory>.tmp-<host id>-<pid>-<random>`` and rank 0 renames it
    to ``directory`` once everything is written, so ``directory`` either does not exist or is
    complete. An existing ``directory`` is never overwritten (:class:`FileExistsError`): write
    each checkpoint to a new one (say, per step) and delete old ones afterwards. Every rank of
    ``group`` must call this, with trees of the same structure.

    A save killed before the rename (``SIGKILL``, a lost node) leaves its temporary directory, as
    large as the checkpoint. The next ``save_sharded`` to the same ``directory`` (say, the same
    step, reached again after resuming from an older checkpoint) deletes it on rank 0 if it is
    provably abandoned: created on rank 0's host by a process that is no longer running. One made
    from another host or container is never deleted automatically (its writer may be alive there);
    delete such leftovers by hand once no job writes to them: ``rm -r <directory>.tmp-*``. A save
    that fails with an exception removes its temporary itself.

    Args:
        directory: the checkpoint directory to create (on a file system every rank sees).
        tree: nested dicts, lists, tuples and NamedTuples of :class:`fddp.zero.Sharded` trees,
            tensors and Python scalars: say ``{"params": shards, "opt": opt_state, "step": step}``.
        group: the process group the tree is sharded over; ``None`` for the default group.
            Without an initialised process group, one process writes everything.

    Returns:
        ``directory`` (absolute), on every rank.

    Raises:
        FileExistsError: ``directory`` exists (on every rank, before any rank writes).
        RuntimeError: a sharded part was made for another world size or rank; or a peer did not
            arrive within the process group's timeout.
        CheckpointError: on the other ranks, rank 0 failed to finish the checkpoint (its own
            error says why).

    Example:
        >>> fddp.checkpoint.save_sharded(f"ckpt/step-{step:08d}", {"params": shards, "opt": opt_state, "step": step})
    """
    if dcp is None:  # pragma: no cover
        raise RuntimeError("fddp.checkpoint.save_sharded needs torch.distributed.checkpoint")
    directory = os.path.abspath(os.fspath(directory))
    rank, world = _ranks.rank(group), _ranks.world_size(group)
    if os.path.exists(directory):  # every rank sees the same file system: all raise, no one waits
        raise FileExistsError(
            f"fddp.checkpoint.save_sharded: {directory} exists; sharded checkpoints are never overwritten "
            "(write each to a new directory, e.g. one per step, and delete old ones after)"
        )
    leaves, _, keys = _flatten(tree)
    tensors, scalars, _ = _entries(leaves, keys, lambda x: x.shards if isinstance(x, _shard.Sharded) else x.detach(), "save_sharded")
    parent, name = os.path.split(directory)
    if rank == 0:
        _temp.clean(parent, lambda base: base == name)
    # Rank 0 names the temporary; the others learn its name (host id, pid, random token).
    mine = [_temp.HOST_ID, os.getpid(), int.from_bytes(os.urandom(7), "big")] if rank == 0 else [0, 0, 0]
    tmp = _temp.new_name(directory, *_ranks.agree(mine, group, "checkpoint.save_sharded", "agreeing on the temporary directory"))
    state = {k: (t if isinstance(t, _FlatPieces) else t.contiguous()) for k, (t, _) in tensors.items()}
    error: BaseException | None = None
    with _temp.writing(tmp):
        try:
            dcp.save(state, storage_writer=_Writer(tmp, rank), process_group=group, no_dist=not _ranks.is_distributed())
            if rank == 0:
                _finish(tmp, directory, tensors, scalars, world)
        # DCP's CheckpointException is a BaseException (it holds every failed rank's error); an
        # interrupt is not caught: the process is going away, and the next save removes its temporary.
        except (Exception, _CheckpointException) as e:  # noqa: BLE001 - every rank learns below whether the checkpoint is complete
            error = e
        (failed,) = _ranks.agree([error is not None], group, "checkpoint.save_sharded", f"the barrier after writing {directory}")
    if failed:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank is past its writes
        if error is not None:
            raise error
        raise CheckpointError(f"{directory}: not written: {failed} rank(s) of the group failed to write it (their own errors say why)")
    return directory


def _finish(tmp: str, directory: str, tensors: dict, scalars: dict, world: int) -> None:
    """On rank 0, after DCP's save: write the manifest with every rank's checksums, rename into place."""
    sums: dict[str, dict[str, torch.Tensor]] = {}
    for r in range(world):
        part = os.path.join(tmp, _CHECKSUMS.format(rank=r))
        sums.update(_read_file(part))
        os.remove(part)
    manifest = {
        "format": _FORMAT,
        "version": _VERSION,
        "world_size": world,  # informational
        "tensors": {k: (list(shape), str(t.dtype)) for k, (t, shape) in tensors.items()},
        "scalars": scalars,
        "checksums": sums,
        "metadata_crc32": _crc_of_file(os.path.join(tmp, ".metadata")),
    }
    _write_file(os.path.join(tmp, _MANIFEST), manifest)
    _codec.fsync_dir(tmp)
    os.replace(tmp, directory)
    _codec.fsync_dir(os.path.dirname(directory))


def load_sharded(directory: str | os.PathLike, /, like: Any, *, group: dist.ProcessGroup | None = None) -> Any:
    """Read a checkpoint written by :func:`save_sharded` into the shape of ``like``, on any world size.

    ``like`` says what to load and how it is cut here: make it as for a fresh start on the ranks
    that load, ``shards = fddp.zero.shard(params)`` and ``opt.init(shards)``, and every rank reads
    the pieces of the saved leaves that its new shards cover, whatever the world size at save. A
    replicated ``like`` (full trees, say on one process for evaluation) loads whole leaves. The
    structure, every leaf's number of elements and dtype, and every Python scalar's type must match;
    the first difference raises :class:`CheckpointError`. No code from the checkpoint runs: its
    manifest is read with :func:`load` and DCP's ``.metadata`` with an unpickler that accepts DCP's
    own metadata classes only. Every piece read is checked against the CRC-32 saved for it (and
    ``.metadata`` against its own) before DCP copies it, so a damaged file is an error naming the
    file and the leaf; checkpoints written before checksums existed load unverified. Every rank
    of ``group`` must call this.

    Args:
        directory: a directory written by :func:`save_sharded`.
        like: the tree to fill, e.g. ``{"params": shards, "opt": opt.init(shards), "step": 0}``; its
            values are not used, only its structure, layouts, dtypes and devices.
        group: the process group ``like``'s shards were made on; ``None`` for the default group.

    Returns:
        A tree like ``like`` holding the checkpoint's values (new tensors; ``like`` is not modified).

    Raises:
        CheckpointError: ``directory`` is not a complete sharded checkpoint, is damaged, does not
            match ``like``, holds anything but tensors, or DCP cannot read it (the message says why).

    Example:
        >>> shards = fddp.zero.shard(params)  # on the new number of ranks
        >>> like = {"params": shards, "opt": opt.init(shards), "step": 0}
        >>> state = fddp.checkpoint.load_sharded("ckpt/step-00001000", like)
        >>> params = fddp.zero.gather(state["params"]).wait()
    """
    if dcp is None:  # pragma: no cover
        raise RuntimeError("fddp.checkpoint.load_sharded needs torch.distributed.checkpoint")
    directory = os.fspath(directory)
    manifest = _read_manifest(directory)

    def fresh(leaf: Any) -> Any:
        if isinstance(leaf, _shard.Sharded):
            return _shard.new_shards(leaf.layout)
        return torch.zeros_like(leaf, memory_format=torch.contiguous_format).detach()

    leaves, spec, keys = _flatten(like)
    tensors, scalars, rebuilt = _entries(leaves, keys, fresh, "load_sharded")
    _check_against(directory, manifest, tensors, scalars)
    state = {k: t for k, (t, _) in tensors.items()}
    reader = _Reader(directory, manifest, _read_metadata(directory, manifest))
    try:
        dcp.load(state, storage_reader=reader, process_group=group, no_dist=not _ranks.is_distributed())
    except _CheckpointException as e:  # a BaseException, with every failed rank's error inside
        first = next(iter(e.failures.values()))[0]
        if isinstance(first, CheckpointError):
            raise CheckpointError(str(first)) from None
        raise CheckpointError(f"{directory}: torch.distributed.checkpoint could not load it: {first}") from None
    saved_scalars = manifest["scalars"]
    out = [saved_scalars[k] if type(x) in PRIMITIVES else x for k, x in zip(keys, rebuilt)]
    return optree.tree_unflatten(spec, out)


def _read_manifest(directory: str) -> dict:
    path = os.path.join(directory, _MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointError(f"{directory}: not a sharded fddp checkpoint (no {_MANIFEST}; is the save complete?)")
    manifest = _read_file(path)
    if not (isinstance(manifest, dict) and manifest.get("format") == _FORMAT):
        raise CheckpointError(f"{path}: not an fddp sharded-checkpoint manifest")
    if manifest.get("version") != _VERSION:
        raise CheckpointError(f"{path}: version {manifest.get('version')!r}; this fddp reads version {_VERSION}")
    return manifest


def _check_against(directory: str, manifest: dict, tensors: dict, scalars: dict) -> None:
    """Raise at the first leaf where ``like`` (its tensors and scalars) and the manifest differ."""
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
            raise CheckpointError(
                f"{directory}: checkpoint does not match `like` at {key!r}: expected {article(type(value).__name__)}, found no such key"
            )
        if type(saved_scalars[key]) is not type(value):
            raise CheckpointError(
                f"{directory}: checkpoint does not match `like` at {key!r}: expected {article(type(value).__name__)}, "
                f"found {type(saved_scalars[key]).__name__} {saved_scalars[key]!r}"
            )
