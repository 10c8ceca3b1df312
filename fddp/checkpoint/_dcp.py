"""torch.distributed.checkpoint's files, with every piece's checksum recorded and verified, read
without running code.

DCP writes one ``.distcp`` file per rank (each item a ``torch.save`` of a tensor, at an offset) and
a ``.metadata`` index, a pickle. :class:`Writer` is DCP's file writer that also records, per rank,
a CRC-32 of the bytes of every item as they lie in its file, and this rank's per-rank Python
values; :class:`Reader` is DCP's file reader that checks each item against its CRC-32 before DCP
deserialises any of it, and never lets DCP unpickle an object. :func:`read_metadata` checks
``.metadata`` against the CRC-32 in fddp's manifest before parsing any of it, then unpickles it
with an unpickler that resolves an exact list of ``(module, name)`` pairs (DCP's metadata classes,
torch sizes and dtypes, plain containers) and nothing else. Every failure is a
:class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import io
import os
import zlib
from typing import Any

import torch

from fddp.checkpoint import _codec, _pickles
from fddp.checkpoint._codec import CheckpointError

__all__ = ["CHECKSUMS", "MANIFEST", "Reader", "Writer", "crc_of_file", "dcp", "read_file", "read_metadata", "write_file"]

MANIFEST = "fddp-manifest.pt"
CHECKSUMS = "fddp-checksums-{rank}.pt"  # one per rank while saving; merged into the manifest

try:  # DCP and its metadata types (torch >= 2.4 has them)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import LoadItemType
except ImportError:  # pragma: no cover - builds without torch.distributed
    dcp = None


def write_file(path: str, tree: Any) -> None:
    """One file of :mod:`fddp.checkpoint._codec`'s format (not atomic: it lies in a temporary directory)."""
    with open(path, "wb") as f:
        _codec.write(f, _codec.encode(tree))


def read_file(path: str) -> Any:
    return _codec.decode(_codec.read(path), None, path)


def crc_of_file(path: str) -> int:
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


if dcp is not None:

    class Writer(dcp.FileSystemWriter):
        """DCP's file writer; each rank also writes the CRC-32 of every item it wrote and its per-rank
        Python values into ``fddp-checksums-<rank>.pt``, which rank 0 merges into the manifest."""

        def __init__(self, path: str, rank: int, scalars: dict[str, Any]) -> None:
            super().__init__(path)
            self._fddp_rank = rank
            self._fddp_scalars = scalars

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)  # already complete: DCP's writer is synchronous
            root = os.fspath(self.path)
            sums = _stored_checksums(root, fut.wait())
            write_file(os.path.join(root, CHECKSUMS.format(rank=self._fddp_rank)), {"checksums": sums, "scalars": self._fddp_scalars})
            return fut

    class Reader(dcp.FileSystemReader):
        """DCP's file reader, with the metadata :func:`read_metadata` checked, and every item verified
        against the CRC-32s in ``sums`` (``None``: a checkpoint without them, read unverified)."""

        def __init__(self, path: str, sums: dict | None, metadata: Any) -> None:
            super().__init__(path)
            self._fddp_sums = sums
            self._fddp_metadata = metadata
            self._fddp_names: dict[tuple[str, int], Any] = {}
            self._fddp_where: str | None = None  # the file being read, for errors
            self._fddp_crcs: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {}

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # Read and checked by read_metadata before DCP starts, so that its errors reach the
            # caller as they are (DCP would wrap them, after logging two tracebacks).
            metadata = self._fddp_metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            # DCP's planner loads a non-tensor entry with torch.load(weights_only=False), which runs
            # whatever the file names: fddp never asks for one, and refuses it if asked.
            for item in plan.items:
                if item.type != LoadItemType.TENSOR:
                    raise CheckpointError(
                        f"{os.fspath(self.path)}: refused to load {item.dest_index.fqn!r}: a pickled object, which fddp "
                        "does not load (it could run code)"
                    )
            try:
                return super().read_data(plan, planner)
            except CheckpointError:
                raise
            except Exception as e:  # torch.load of a piece: name the file it came from
                where = self._fddp_where or os.fspath(self.path)
                raise CheckpointError(f"{where}: truncated or damaged: cannot read it as a tensor ({type(e).__name__}: {e})") from None

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            file.seek(sinfo.offset)
            data = file.read(sinfo.length)
            file_name = os.path.join(os.fspath(self.path), sinfo.relative_path)
            self._fddp_where = file_name
            index = self._index_of(sinfo)
            piece = f"the piece of leaf {index.fqn!r} at offset {tuple(index.offset) if index.offset is not None else ()}"
            span = f"bytes {sinfo.offset}..{sinfo.offset + sinfo.length} of the file"
            if self._fddp_sums is not None:
                saved = self._saved(sinfo.relative_path).get((sinfo.offset, sinfo.length))
                found = _codec.crc32s([data])[0]
                if len(data) != sinfo.length or found != saved:
                    if saved is None:
                        what = "no CRC-32 was saved for it"
                    elif len(data) != sinfo.length:
                        what = f"the file ends {sinfo.length - len(data)} bytes short of it: cut short"
                    else:
                        k = next((k for k, (a, b) in enumerate(zip(found, saved)) if a != b), 0)
                        what = f"at byte {k * _codec.BLOCK} of it, saved CRC-32 {saved[k]:#010x}, now {found[k]:#010x}"
                    raise CheckpointError(
                        f"{file_name}: damaged: {piece} ({span}) fails its check ({what}); use another copy or an older checkpoint"
                    )
            if not getattr(sinfo, "transform_descriptors", None):
                # Each piece is a torch.save of a tensor that DCP then torch.loads: the same checks
                # as a single file (whole, its pickle's CRC-32, only the globals a tensor needs).
                # A compressed piece (DCP's optional transforms) is checked by weights_only alone.
                _codec.check_archive(io.BytesIO(data), f"{file_name} ({piece}, {span})")
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


def read_metadata(directory: str, saved_crc: int | None, tensors_only: bool) -> Any:
    """DCP's ``.metadata`` of ``directory``: its CRC-32 checked, then unpickled with an exact allow-list
    (:func:`fddp.checkpoint._pickles.load_metadata`).

    Args:
        saved_crc: the CRC-32 fddp's manifest holds for the file (None: a checkpoint DCP wrote,
            with no manifest; the allow-list alone guards it).
        tensors_only: refuse metadata that describes anything but tensors (fddp writes tensors only;
            other tools' checkpoints also hold pickled objects, which are never read).

    Raises:
        CheckpointError: the file cannot be read, fails its CRC-32 (then none of it is parsed),
            names anything but DCP's metadata types, or describes pieces that are not plain
            files of ``directory``; naming the file.
    """
    path = os.path.join(directory, ".metadata")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read DCP's index of the pieces ({e})") from None
    if saved_crc is not None and zlib.crc32(data) != saved_crc:
        # Before parsing: a file that changed after the write is not unpickled at all.
        raise CheckpointError(
            f"{path}: damaged: it does not match the CRC-32 saved in the manifest (the file changed after it was "
            "written), so it was not read; use another copy or an older checkpoint"
        )
    try:
        metadata = _pickles.load_metadata(data)
    except Exception as e:  # noqa: BLE001 - whatever a hostile or damaged pickle raises, it is this file's fault
        raise CheckpointError(f"{path}: refused to load the checkpoint's metadata ({type(e).__name__}: {e})") from None
    _check_metadata(metadata, path, tensors_only)
    return metadata


def _check_metadata(metadata: Any, path: str, tensors_only: bool) -> None:
    """Raise unless ``metadata`` is DCP's index in the shapes its reader relies on."""
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(metadata, Metadata) or not isinstance(entries, dict):
        raise CheckpointError(f"{path}: not DCP's checkpoint metadata")
    for key, md in entries.items():
        if not isinstance(key, str) or not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{path}: corrupt DCP metadata: entry {key!r} is a {type(md).__name__}")
        if isinstance(md, TensorStorageMetadata) and not (
            isinstance(md.size, torch.Size)
            and isinstance(getattr(md.properties, "dtype", None), torch.dtype)
            and isinstance(md.chunks, list)
            and all(isinstance(c, ChunkStorageMetadata) and isinstance(c.offsets, torch.Size) for c in md.chunks)
            and all(isinstance(c.sizes, torch.Size) for c in md.chunks)
        ):
            raise CheckpointError(f"{path}: corrupt DCP metadata: the tensor entry {key!r} lacks a size, dtype or chunk list")
    if tensors_only and not all(isinstance(v, TensorStorageMetadata) for v in entries.values()):
        # fddp writes tensors only; DCP would unpickle anything else (torch.load, weights_only=False).
        raise CheckpointError(f"{path}: refused to load: the checkpoint holds entries other than tensors")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise CheckpointError(f"{path}: corrupt DCP metadata: no table of where each piece lies")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        if not (
            isinstance(index, MetadataIndex)
            and isinstance(info, _StorageInfo)
            and isinstance(name, str)
            and name == os.path.basename(name)
            and name not in ("", ".", "..")
            and "\\" not in name
            and all(type(n) is int and n >= 0 for n in (info.offset, info.length))
        ):
            # A piece elsewhere (``../x``, ``/etc/...``) would make the reader open a file outside the checkpoint.
            raise CheckpointError(
                f"{path}: refused to load: a piece of {getattr(index, 'fqn', index)!r} is described as {info!r}, "
                "not a byte range of a file in the checkpoint's directory"
            )
