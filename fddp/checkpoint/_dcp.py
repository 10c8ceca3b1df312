"""torch.distributed.checkpoint's files, with every piece's checksum recorded and verified, read
without running code.

DCP writes one ``.distcp`` file per rank (each item a ``torch.save`` of a tensor, at an offset) and
a ``.metadata`` index, a pickle. :class:`Writer` is DCP's file writer that also records, per rank,
a CRC-32 of the bytes of every item as they lie in its file, and this rank's per-rank Python
values; :class:`Reader` is DCP's file reader that checks each item against its CRC-32 before DCP
deserialises any of it. :func:`read_metadata` unpickles ``.metadata`` with an unpickler that
accepts DCP's own metadata classes and nothing else. Every failure is a :class:`CheckpointError`
naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
import zlib
from typing import Any

import torch

from fddp.checkpoint import _codec
from fddp.checkpoint._codec import CheckpointError

__all__ = ["CHECKSUMS", "MANIFEST", "Reader", "Writer", "crc_of_file", "dcp", "read_file", "read_metadata", "write_file"]

MANIFEST = "fddp-manifest.pt"
CHECKSUMS = "fddp-checksums-{rank}.pt"  # one per rank while saving; merged into the manifest

try:  # DCP and its metadata types (torch >= 2.4 has them)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
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
            self._fddp_crcs: dict[str, dict[tuple[int, int], tuple[int, ...]]] = {}

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # Read and checked by read_metadata before DCP starts, so that its errors reach the
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
                elif len(data) != sinfo.length:
                    what = f"the file ends {sinfo.length - len(data)} bytes short of it: cut short"
                else:
                    k = next((k for k, (a, b) in enumerate(zip(found, saved)) if a != b), 0)
                    what = f"at byte {k * _codec.BLOCK} of it, saved CRC-32 {saved[k]:#010x}, now {found[k]:#010x}"
                offset = tuple(index.offset) if index.offset is not None else ()
                raise CheckpointError(
                    f"{where}: damaged: the piece of leaf {index.fqn!r} at offset {offset} "
                    f"(bytes {sinfo.offset}..{sinfo.offset + sinfo.length} of the file) fails its check ({what}); "
                    "use another copy or an older checkpoint"
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


def read_metadata(directory: str, saved_crc: int | None, tensors_only: bool) -> Any:
    """DCP's ``.metadata`` of ``directory``, unpickled by :class:`_Unpickler`, checked against its CRC-32.

    Args:
        saved_crc: the CRC-32 fddp's manifest holds for the file (None: unchecked).
        tensors_only: refuse metadata that describes anything but tensors (fddp writes tensors only;
            other tools' checkpoints also hold pickled objects, which are never read).
    """
    path = os.path.join(directory, ".metadata")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read DCP's index of the pieces ({e})") from None
    changed = saved_crc is not None and zlib.crc32(data) != saved_crc
    damaged = "damaged: it does not match the CRC-32 saved in the manifest (the file changed after it was written)"
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except Exception as e:
        why = f"; {damaged}" if changed else ""
        raise CheckpointError(f"{path}: refused to load the checkpoint's metadata ({type(e).__name__}: {e}){why}") from None
    if changed:
        raise CheckpointError(f"{path}: {damaged}; use another copy or an older checkpoint")
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(metadata, Metadata) or not isinstance(entries, dict):
        raise CheckpointError(f"{path}: not DCP's checkpoint metadata")
    if tensors_only and not all(isinstance(v, TensorStorageMetadata) for v in entries.values()):
        # fddp writes tensors only; DCP would unpickle anything else (torch.load, weights_only=False).
        raise CheckpointError(f"{path}: refused to load: the checkpoint holds entries other than tensors")
    return metadata
