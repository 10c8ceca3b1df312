"""The pickles fddp reads, and the exact list of globals each may name: nothing else is ever imported.

Two pickles reach fddp from disk: the ``data.pkl`` inside every ``torch.save`` file (fddp's own
checkpoints and manifests: the tree's structure and Python values, and references to the tensors'
bytes) and torch.distributed.checkpoint's ``.metadata`` index (its dataclasses). A pickle runs code
through the globals it names (a ``REDUCE`` of ``os.system``, an ``INST`` of a class whose
constructor acts, a ``BUILD`` that calls ``__setstate__``); every such opcode looks its callable
up by ``(module, name)`` first. So each reader here resolves exact ``(module, name)`` pairs from
a fixed table: no dotted names resolved through an allowed module (protocol 4's
``torch.distributed.checkpoint.filesystem`` + ``os.system`` reaches ``os.system`` through any
module that imports ``os``), no module wildcards, no persistent ids beyond torch's own.

- :func:`load_metadata` unpickles DCP's ``.metadata`` with :data:`METADATA`'s table.
- :func:`check_torch_save` replays a ``data.pkl`` with inert stand-ins for :data:`TORCH_SAVE`'s
  globals, before ``torch.load(weights_only=True)`` reads it: the allow-list is fddp's, not the
  process-wide one that ``torch.serialization.add_safe_globals`` widens, and nothing the file
  names is called even if torch's own checks had a gap.
"""

from __future__ import annotations

import _compat_pickle
import importlib
import io
import pickle
import sys
from typing import Any

import torch

__all__ = ["METADATA", "TORCH_SAVE", "check_torch_save", "load_metadata"]

METADATA: dict[str, tuple[str, ...]] = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.distributed._shard.sharded_tensor.metadata": ("TensorProperties", "MEM_FORMAT_ENCODING"),  # DCP of torch < 2.2
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),  # a layout's name to torch.strided & co. (a table lookup)
    "pathlib": ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"),  # the checkpoint id
    "collections": ("OrderedDict",),
    "builtins": ("set", "frozenset", "slice"),
}
"""DCP's metadata: its dataclasses, sizes, and plain containers (plus every torch dtype, layout and memory format)."""

TORCH_SAVE: dict[str, tuple[str, ...]] = {
    "torch._utils": ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_sparse_tensor", "_rebuild_qtensor"),
    "torch.storage": ("UntypedStorage",),
    "torch": ("Size",),
    "torch.serialization": ("_get_layout",),
    "collections": ("OrderedDict",),  # a tensor's (empty) backward hooks
    "_codecs": ("encode",),  # bytes, at pickle protocol 2
    "builtins": ("complex",),
}
"""What ``torch.save`` writes for fddp's payloads: tensors, bytes and complex numbers (plus every
torch dtype, layout, qscheme and legacy storage class)."""


def _table(names: dict[str, tuple[str, ...]]) -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {}
    for module, members in names.items():
        mod = sys.modules.get(module)
        if mod is None:
            try:
                mod = importlib.import_module(module)
            except ImportError:  # pragma: no cover - a torch without this module
                continue
        for name in members:
            if name in vars(mod):  # vars, not getattr: a name is an attribute of the module itself
                table[(module, name)] = vars(mod)[name]
    kinds = (torch.dtype, torch.layout, torch.memory_format, torch.qscheme)
    for name, value in vars(torch).items():  # pickled by name: torch.float32, torch.FloatStorage
        if isinstance(value, kinds) or (name.endswith("Storage") and isinstance(value, type)):
            table[("torch", name)] = value
    return table


_TABLES = {"metadata": _table(METADATA), "torch_save": _table(TORCH_SAVE)}  # constants, built once at import


def _allowed(which: str) -> dict[tuple[str, str], Any]:
    return _TABLES[which]


def _exact(module: str, name: str) -> tuple[str, str]:
    """``(module, name)`` as Python 3 names it: protocols 0 to 2 write ``__builtin__`` for ``builtins``."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _refuse(module: str, name: str, what: str) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"unsupported GLOBAL {module}.{name}: not part of {what}")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed("metadata").get(_exact(module, name))
        if found is None:
            raise _refuse(module, name, "DCP's checkpoint metadata")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id: not part of DCP's checkpoint metadata")


def load_metadata(data: bytes) -> Any:
    """Unpickle DCP's ``.metadata`` bytes, resolving only :data:`METADATA`'s globals.

    Raises:
        pickle.UnpicklingError: the pickle names another global (``unsupported GLOBAL os.system``),
            or anything a damaged pickle raises.

    Example:
        >>> load_metadata(pickle.dumps(torch.Size([2, 3])))
        torch.Size([2, 3])
    """
    return _MetadataUnpickler(io.BytesIO(data)).load()


class _Inert:
    """What a replayed pickle gets for every allowed global, and builds from it: takes anything, does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Inert":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _Replay(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if _exact(module, name) not in _allowed("torch_save"):
            raise _refuse(module, name, "an fddp checkpoint")
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        # torch.save's only persistent ids: ("storage", storage class, key, location, numel).
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"a persistent id {str(pid)[:80]!r}: not part of an fddp checkpoint")
        return _Inert()


def check_torch_save(data: bytes) -> None:
    """Replay a ``torch.save`` file's ``data.pkl`` with inert stand-ins for :data:`TORCH_SAVE`'s
    globals; raise at the first global outside it. Nothing the pickle names is called.

    Raises:
        pickle.UnpicklingError: the pickle names another global (``unsupported GLOBAL posix.system``)
            or a foreign persistent id; or whatever a damaged pickle raises.

    Example:
        >>> buf = io.BytesIO(); torch.save({"w": torch.ones(2)}, buf)  # its data.pkl passes
    """
    _Replay(io.BytesIO(data)).load()
