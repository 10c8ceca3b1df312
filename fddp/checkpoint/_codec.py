"""The checkpoint file codec: a tree as plain data, and one file of it read without running code.

A tree is encoded as a payload dict of plain data: its leaves (tensors and Python scalars) in
depth-first order, each leaf's path (fddp's ``a/b/0`` format), CRC-32s of every tensor's bytes (one per 4 MiB),
and the tree's structure described with tuples, strings and ints (nothing names a class, so the
file loads with ``torch.load(..., weights_only=True)``). Decoding rebuilds the tree, checks it
against an expected ``like`` tree when one is given, and verifies every tensor's checksum.

A container registered as a pytree node (``tensordict.TensorDict``, a dataclass passed to
``torch.utils._pytree.register_dataclass``, any type registered with torch's or optree's pytree
registry) is saved as its entries' keys and children: nothing of its class, constructor or
context goes to the file. Loading with a ``like`` of that type rebuilds it with ``like``'s own
registered unflatten (so ``like``'s batch size, device and other context, from the running
program, not the file); without ``like`` it comes back as a dict of its entries.

A file is one ``torch.save`` zip. Reading it checks, before unpickling anything, that it is a
whole zip (a truncated copy has no central directory) and that the pickle of its structure and
scalars passes the zip's own CRC-32; a tensor whose bytes changed after the write fails its own
checksum when it is decoded. Every failure is a :class:`CheckpointError` naming the file and, for
a leaf, its path.

This module knows nothing of ranks, temporaries or directories; ``fddp.checkpoint``'s single-file
and sharded modules build on it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import os
import pickle
import re
import zipfile
import zlib
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import optree
import torch

from fddp._errors import CheckpointError
from fddp._tree import adopt_torch_nodes, article, path_str
from fddp.checkpoint import _pickles

__all__ = [
    "BLOCK",
    "FORMAT",
    "PRIMITIVES",
    "VERSION",
    "CheckpointError",
    "check_archive",
    "crc32s",
    "decode",
    "encode",
    "fsync_dir",
    "is_namedtuple",
    "read",
    "tensor_bytes",
    "write",
]

FORMAT = "fddp-checkpoint"
VERSION = 1  # files without "checksums" (written before they existed) still load, unverified
PRIMITIVES = (bool, int, float, complex, str, bytes, type(None))
_MISSING = object()

Path = tuple  # a leaf's keys from the root; shown with fddp._tree.path_str


def _at(path: Path) -> str:
    return repr(path_str(path))


def is_namedtuple(x: Any) -> bool:
    """Whether ``x`` is a NamedTuple instance (a tuple whose class has ``_fields``)."""
    return isinstance(x, tuple) and isinstance(getattr(type(x), "_fields", None), tuple)


# --------------------------------------------------------------------------------------------
# Encoding: tree -> payload of plain data
# --------------------------------------------------------------------------------------------


def _compact(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """Return a detached CPU tensor whose storage holds exactly its own elements (with ``copy``,
    never the caller's memory: a snapshot that later in-place updates cannot change).

    ``torch.save`` writes a tensor's whole storage, so a 10-element view of a 100 MB gradient
    bucket would otherwise cost 100 MB on disk. Moving to the CPU first means the copy of a view
    never takes accelerator memory (torch.save copies to the host anyway), and the file loads on
    any machine.
    """
    source = t
    t = t.detach().cpu()
    if t.layout is not torch.strided:
        return t.clone() if copy and t.device == source.device else t
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    exact = (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )
    # A CPU tensor that is already compact is the caller's own memory: a snapshot copies it (one
    # from an accelerator is a fresh host copy already).
    shared = exact and t.untyped_storage().data_ptr() == source.detach().untyped_storage().data_ptr()
    t = t if exact and not (copy and shared) else t.clone(memory_format=torch.contiguous_format)
    # Parameters and other subclasses are stored as plain tensors; weights_only accepts those.
    return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)


BLOCK = 1 << 22  # bytes per CRC-32: the blocks of a big tensor are checked on several threads
_THREADS_FROM = 1 << 24  # bytes in all; below this one thread is quicker than starting more


def tensor_bytes(t: torch.Tensor) -> memoryview | None:
    """A tensor's bytes in memory order (copied to the CPU if it is elsewhere), or None for a
    tensor without plain bytes (meta, sparse, quantized)."""
    if t.layout is not torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    # Through ctypes, not numpy: a live transfer (fddp.ft) must not need a package it does not
    # declare. The array keeps the tensor alive as long as the view lives.
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    raw = (ctypes.c_char * n).from_address(t.data_ptr())
    raw._tensor = t  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")


def crc32s(buffers: Sequence[Any]) -> list[tuple[int, ...] | None]:
    """The CRC-32 of every 4 MiB block of every buffer (None stays None).

    CRC-32 catches every flipped byte and every burst of up to 32 bits. zlib releases the GIL, so
    the blocks of large buffers run on up to 8 threads; per block, not per buffer, so the check
    of one huge tensor spreads too.
    """
    views = [None if b is None else memoryview(b).cast("B") for b in buffers]
    jobs = [v[a : a + BLOCK] for v in views if v is not None for a in range(0, max(len(v), 1), BLOCK)]
    total = sum(len(v) for v in views if v is not None)
    threads = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, len(jobs))
    if total >= _THREADS_FROM and threads > 1:
        # A pool per call: a pool kept across calls would not survive a fork of the process.
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="fddp-crc") as pool:
            found = iter(pool.map(zlib.crc32, jobs))
    else:
        found = iter(map(zlib.crc32, jobs))
    return [None if v is None else tuple(next(found) for _ in range(0, max(len(v), 1), BLOCK)) for v in views]


def _checksums(leaves: list) -> list[tuple[int, ...] | None]:
    return crc32s([tensor_bytes(x) if isinstance(x, torch.Tensor) else None for x in leaves])


def encode(tree: Any, *, copy: bool = False, checksums: bool = True) -> dict:
    """The payload for ``tree``: format marker, structure, leaves, their paths and checksums.

    With ``copy``, every tensor leaf is a copy (a snapshot that an asynchronous write can take its
    time over while training updates the tree in place); without ``checksums``, they are left for
    :func:`add_checksums` (one pass over the bytes, which the writing thread makes).

    Raises:
        TypeError: a leaf or dict key of a type the format cannot hold, naming its path.
    """
    leaves: list = []
    paths: list[str] = []
    structure = _encode(tree, (), leaves, paths, copy)
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "structure": structure,
        "paths": paths,
        "leaves": leaves,
        "checksums": None,
    }
    return add_checksums(payload) if checksums else payload


def add_checksums(payload: dict) -> dict:
    """Fill in the CRC-32s of a payload that :func:`encode` made without them; return it."""
    payload["checksums"] = _checksums(payload["leaves"])
    return payload


def _encode(node: Any, path: Path, leaves: list, paths: list, copy: bool) -> tuple:
    if isinstance(node, torch.Tensor) or type(node) in PRIMITIVES:
        leaves.append(_compact(node, copy) if isinstance(node, torch.Tensor) else node)
        paths.append(path_str(path))
        return ("leaf",)
    if isinstance(node, PRIMITIVES):
        # numpy scalars and enums subclass int/float/str but pickle as their own class, which
        # weights_only refuses: fail now, not when the checkpoint is needed.
        base = next(b for b in PRIMITIVES if isinstance(node, b)).__name__
        raise TypeError(
            f"fddp.checkpoint: leaf at {_at(path)} is {article(type(node).__qualname__)}, a subclass of {base}; "
            "convert it to a plain Python value first"
        )
    if isinstance(node, dict):
        for k in node:
            if type(k) not in PRIMITIVES:
                raise TypeError(
                    f"fddp.checkpoint: dict key {k!r} at {_at(path)} is {article(type(k).__qualname__)}, not a plain "
                    "str/int/float/bool/bytes/None"
                )
        kind = "odict" if isinstance(node, collections.OrderedDict) else "dict"
        keys = tuple(node)
        return (kind, keys, tuple(_encode(node[k], path + (k,), leaves, paths, copy) for k in keys))
    if is_namedtuple(node):
        cls = type(node)
        fields = tuple(cls._fields)
        children = tuple(_encode(v, path + (f,), leaves, paths, copy) for f, v in zip(fields, node))
        return ("namedtuple", f"{cls.__module__}.{cls.__qualname__}", fields, children)
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        return (kind, tuple(_encode(v, path + (i,), leaves, paths, copy) for i, v in enumerate(node)))
    adopt_torch_nodes()
    if optree.register_pytree_node.get(type(node)) is not None:
        return _encode_registered(node, path, leaves, paths, copy)
    raise TypeError(
        f"fddp.checkpoint: leaf at {_at(path)} has unsupported type {type(node).__qualname__}; expected a "
        "tensor, a Python scalar, str, bytes or None, inside dicts, lists, tuples, NamedTuples or containers "
        "registered as pytree nodes (torch.utils._pytree.register_dataclass / register_pytree_node)"
    )


def _encode_registered(node: Any, path: Path, leaves: list, paths: list, copy: bool) -> tuple:
    """A registered container as ("node", its type's name, its entries' keys, their children)."""
    one = optree.tree_flatten_one_level(node, none_is_leaf=True)
    for k in one.entries:
        if type(k) not in PRIMITIVES:
            raise TypeError(
                f"fddp.checkpoint: entry {k!r} of the {type(node).__qualname__} at {_at(path)} is "
                f"{article(type(k).__qualname__)}, not a plain str/int/float/bool/bytes/None"
            )
    keys = tuple(one.entries)
    children = tuple(_encode(v, path + (k,), leaves, paths, copy) for k, v in zip(keys, one.children))
    return ("node", type(node).__qualname__, keys, children)


# --------------------------------------------------------------------------------------------
# Decoding: payload [+ like] -> tree
# --------------------------------------------------------------------------------------------


class _Source(NamedTuple):
    """What decoding reads from: the leaves, and the file, for messages."""

    leaves: Iterator[Any]
    where: str


def decode(payload: dict, like: Any, where: str) -> Any:
    """Rebuild the tree of a payload read by :func:`read`; check it against ``like`` unless None.

    Raises:
        CheckpointError: the payload is corrupt, a tensor fails its checksum, or the tree does
            not match ``like``; naming ``where`` and the leaf's path.
    """
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT):
        raise CheckpointError(f"{where}: not an fddp checkpoint (no '{FORMAT}' format marker)")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{where}: fddp checkpoint version {payload.get('version')!r}; this fddp reads version {VERSION}")
    leaves = payload.get("leaves")
    sums = payload.get("checksums", [None] * len(leaves) if isinstance(leaves, list) else None)
    if not isinstance(leaves, list) or not isinstance(sums, list) or len(sums) != len(leaves):
        raise CheckpointError(f"{where}: corrupt checkpoint: no leaf list, or one without a checksum per leaf")
    _verify(leaves, sums, payload.get("paths"), where)
    src = _Source(iter(leaves), where)
    tree = _decode(src, payload.get("structure"), _MISSING if like is None else like, ())
    if next(src.leaves, _MISSING) is not _MISSING:
        raise CheckpointError(f"{where}: corrupt checkpoint: more leaves than its structure")
    return tree


def _corrupt(src: _Source, path: Path, why: str = "") -> CheckpointError:
    return CheckpointError(f"{src.where}: corrupt checkpoint structure at {_at(path)}{': ' + why if why else ''}")


def _mismatch(src: _Source, path: Path, expected: str, found: str) -> CheckpointError:
    return CheckpointError(
        f"{src.where}: checkpoint does not match `like` at {_at(path)}: expected {expected}, found {found}"
    )


def _decode(src: _Source, node: Any, like: Any, path: Path) -> Any:
    if not isinstance(node, tuple) or not node or not isinstance(node[0], str):
        raise _corrupt(src, path)
    kind = node[0]
    if kind == "leaf":
        return _leaf(src, _next_leaf(src, path), like, path)
    if like is not _MISSING and isinstance(like, (torch.Tensor, *PRIMITIVES)):
        raise _mismatch(src, path, _describe(like), _describe_node(node))
    decoder = _NODES.get(kind)
    if decoder is None:
        raise _corrupt(src, path, f"unknown node {kind!r}")
    try:
        return decoder(src, node, like, path)
    except (IndexError, TypeError) as e:
        raise _corrupt(src, path, str(e)) from None


def _next_leaf(src: _Source, path: Path) -> Any:
    try:
        return next(src.leaves)
    except StopIteration:
        raise CheckpointError(f"{src.where}: corrupt checkpoint: fewer leaves than its structure") from None


def _verify(leaves: list, sums: list, paths: Any, where: str) -> None:
    """Raise, naming the leaf, if a tensor's bytes differ from the CRC-32s saved with it."""
    todo = [i for i, (x, s) in enumerate(zip(leaves, sums)) if s is not None and isinstance(x, torch.Tensor)]
    on_cpu = [i for i in todo if leaves[i].device.type == "cpu"]
    found = dict(zip(on_cpu, crc32s([tensor_bytes(leaves[i]) for i in on_cpu])))
    for i in todo:
        if i not in found:  # off the CPU: copied back one at a time, not all at once
            found[i] = crc32s([tensor_bytes(leaves[i])])[0]
        if found[i] is None or tuple(found[i]) == tuple(sums[i]):
            continue
        block = next((k for k, (a, b) in enumerate(zip(found[i], sums[i])) if a != b), 0)
        name = paths[i] if isinstance(paths, list) and len(paths) == len(leaves) else f"number {i}"
        raise CheckpointError(
            f"{where}: damaged: the data of leaf {name!r} ({_describe(leaves[i])}) does not match the CRC-32 "
            f"saved with it (at byte {block * BLOCK}: saved {sums[i][block]:#010x}, now {found[i][block]:#010x}); "
            "the file changed after it was written: use another copy or an older checkpoint"
        )


def _leaf(src: _Source, value: Any, like: Any, path: Path) -> Any:
    if like is _MISSING:
        return value
    if isinstance(like, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.shape != like.shape or value.dtype != like.dtype:
            raise _mismatch(src, path, _describe(like), _describe(value))
        # map_location semantics: the loaded leaf lives where the expected one does; a meta
        # `like` describes only shape and dtype, so the leaf stays on map_location.
        if like.device.type != "meta" and value.device != like.device:
            value = value.to(like.device)
        if like.requires_grad:
            # like's dtype was checked above, and only float/complex tensors can require grad.
            value.requires_grad_(True)
        return value
    if isinstance(like, PRIMITIVES):
        if type(value) is not type(like):
            raise _mismatch(src, path, article(type(like).__name__), _describe(value))
        return value
    raise _mismatch(src, path, _describe(like), _describe(value))


def _mapping(src: _Source, node: tuple, like: Any, path: Path) -> Any:
    kind, keys, children = node[0], node[1], node[2]
    if len(keys) != len(children):
        raise _corrupt(src, path)
    if like is _MISSING:
        values = {k: _decode(src, c, _MISSING, path + (k,)) for k, c in zip(keys, children)}
        return collections.OrderedDict(values) if kind == "odict" else values
    if not isinstance(like, dict):
        raise _mismatch(src, path, _describe(like), f"dict with keys {list(keys)}")
    missing = [k for k in like if k not in keys]
    if missing:
        raise _mismatch(src, path + (missing[0],), "an entry", "no such key in the checkpoint")
    extra = [k for k in keys if k not in like]
    if extra:
        raise _mismatch(src, path + (extra[0],), "no such key (like has none)", "an entry in the checkpoint")
    values = {k: _decode(src, c, like[k], path + (k,)) for k, c in zip(keys, children)}
    # The expected tree decides key order and dict flavour.
    ordered = [(k, values[k]) for k in like]
    return collections.OrderedDict(ordered) if isinstance(like, collections.OrderedDict) else dict(ordered)


def _namedtuple(src: _Source, node: tuple, like: Any, path: Path) -> Any:
    qualname, fields, children = node[1], tuple(node[2]), node[3]
    if len(fields) != len(children):
        raise _corrupt(src, path)
    if like is _MISSING:
        cls = _generated_namedtuple(qualname, fields, src.where)
        return cls(*(_decode(src, c, _MISSING, path + (f,)) for f, c in zip(fields, children)))
    # Fields are checked, the class name is not: a state class that moved module still loads.
    if not is_namedtuple(like) or tuple(type(like)._fields) != fields:
        raise _mismatch(src, path, _describe(like), f"NamedTuple {qualname.rsplit('.', 1)[-1]} with fields {fields}")
    return type(like)(*(_decode(src, c, getattr(like, f), path + (f,)) for f, c in zip(fields, children)))


def _registered(src: _Source, node: tuple, like: Any, path: Path) -> Any:
    name, keys, children = node[1], tuple(node[2]), node[3]
    if len(keys) != len(children):
        raise _corrupt(src, path)
    if like is _MISSING:  # no class is ever made from the file: its entries come back as a dict
        return {k: _decode(src, c, _MISSING, path + (k,)) for k, c in zip(keys, children)}
    adopt_torch_nodes()
    one = None if type(like).__qualname__ != name else optree.tree_flatten_one_level(like, none_is_leaf=True)
    if one is None or tuple(one.entries) != keys:
        raise _mismatch(src, path, _describe(like), f"{name} with keys {list(keys)}")
    values = [_decode(src, c, x, path + (k,)) for k, c, x in zip(keys, children, one.children)]
    # like's own registration rebuilds it, with like's context (a TensorDict's batch size and device)
    return one.unflatten_func(one.metadata, values)


def _sequence(src: _Source, node: tuple, like: Any, path: Path) -> Any:
    kind, children = node[0], node[1]
    if like is not _MISSING:
        want = list if kind == "list" else tuple
        if is_namedtuple(like) or not isinstance(like, want) or len(like) != len(children):
            raise _mismatch(src, path, _describe(like), f"{kind} of length {len(children)}")
    values = [_decode(src, c, _MISSING if like is _MISSING else like[i], path + (i,)) for i, c in enumerate(children)]
    return values if kind == "list" else tuple(values)


_NODES: dict[str, Callable[[_Source, tuple, Any, Path], Any]] = {
    "dict": _mapping,
    "odict": _mapping,
    "namedtuple": _namedtuple,
    "list": _sequence,
    "tuple": _sequence,
    "node": _registered,
}

# One generated class per (name, fields), so repeated loads give trees of the same type.
_GENERATED: dict[tuple[str, tuple[str, ...]], type] = {}


def _generated_namedtuple(qualname: str, fields: tuple[str, ...], where: str) -> type:
    key = (qualname, fields)
    if key not in _GENERATED:
        name = qualname.rsplit(".", 1)[-1]
        if not name.isidentifier():
            name = "CheckpointNamedTuple"
        try:
            _GENERATED[key] = collections.namedtuple(name, fields, module="fddp.checkpoint")
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: invalid NamedTuple fields {fields!r}: {e}") from None
    return _GENERATED[key]


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    if is_namedtuple(x):
        return f"NamedTuple {type(x).__name__} with fields {tuple(type(x)._fields)}"
    if isinstance(x, dict):
        return f"dict with keys {list(x)}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__} of length {len(x)}"
    if optree.register_pytree_node.get(type(x)) is not None:
        return f"{type(x).__qualname__} with keys {list(optree.tree_flatten_one_level(x, none_is_leaf=True).entries)}"
    return f"{type(x).__name__} {x!r}"


def _describe_node(node: tuple) -> str:
    kind = node[0]
    if kind in ("dict", "odict"):
        return f"dict with keys {list(node[1])}"
    if kind == "namedtuple":
        return f"NamedTuple {node[1].rsplit('.', 1)[-1]} with fields {node[2]}"
    if kind == "node":
        return f"{node[1]} with keys {list(node[2])}"
    return f"{kind} of length {len(node[1])}"


# --------------------------------------------------------------------------------------------
# One file
# --------------------------------------------------------------------------------------------


def write(f: Any, payload: Any) -> None:
    """``torch.save`` the payload into the open binary file ``f``, then flush and fsync it."""
    torch.save(payload, f)
    f.flush()
    os.fsync(f.fileno())


def fsync_dir(directory: str) -> None:
    """Make a rename or a new entry in ``directory`` durable, where the platform allows it.

    Some platforms and file systems cannot open or fsync a directory; there the rename is as
    durable as the OS makes it.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_ZIP_MAGIC = b"PK\x03\x04"


def read(path: str, map_location: Any = "cpu") -> Any:
    """Read one ``torch.save`` file with ``weights_only=True``, after checking the zip is whole and
    what its pickle names.

    Before anything is unpickled: the file must be a zip (fddp writes no other format; a bare
    pickle or a legacy torch file is refused unread), whole, its pickle must pass the zip's
    CRC-32, and every global that pickle names must be on :data:`fddp.checkpoint._pickles.TORCH_SAVE`'s
    exact list (checked by a replay that calls nothing). Only then does ``torch.load`` read it.

    Raises:
        FileNotFoundError, PermissionError, IsADirectoryError: the file cannot be opened.
        CheckpointError: the file is truncated or damaged, or would need to run code to load.
    """
    with open(path, "rb") as f:
        check_archive(f, path)
        try:
            return torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refused(path, _diagnosis(e)) from None
        except Exception as e:
            raise CheckpointError(f"{path}: truncated or damaged ({type(e).__name__}: {_diagnosis(e)})") from None


def check_archive(f: Any, path: str) -> None:
    """Check, unpickling nothing, that the open binary file ``f`` is a whole ``torch.save`` zip
    whose pickle passes its CRC-32 and names only the globals fddp's files need; rewind ``f``.

    Raises:
        CheckpointError: naming ``path``: not a zip, truncated or damaged, or it would run code.
    """
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    if f.read(4) != _ZIP_MAGIC:
        raise CheckpointError(
            f"{path}: refused to load: not a zip archive as torch.save writes ({size} bytes): truncated or damaged, "
            "or another format (a bare pickle, a legacy torch file), which fddp.checkpoint never writes and does not "
            "read, since it could run code"
        )
    f.seek(0)
    _check_zip(f, path, size)
    f.seek(0)
    _check_globals(f, path)
    f.seek(0)


def _refused(path: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"{path}: refused to load: it holds objects other than tensors and plain data, which could run "
        f"code ({why}); fddp.checkpoint.save never writes such objects, so the file is "
        "corrupt or was written by something else"
    )


def _check_globals(f: Any, path: str) -> None:
    """Raise unless the pickle ``torch.load`` would read (through torch's own zip reader, so both
    see the same bytes) names only the globals fddp's files need."""
    try:
        data = torch._C.PyTorchFileReader(f).get_record("data.pkl")
    except Exception as e:  # noqa: BLE001 - torch's reader raises RuntimeError for any archive it cannot use
        raise CheckpointError(f"{path}: truncated or damaged: no torch.save pickle in the archive ({_diagnosis(e)})") from None
    try:
        _pickles.check_torch_save(data)
    except pickle.UnpicklingError as e:
        raise _refused(path, str(e)) from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle raises what its first bad opcode does
        raise CheckpointError(f"{path}: truncated or damaged: its pickle cannot be read ({type(e).__name__}: {e})") from None


def _check_zip(f: Any, path: str, size: int) -> None:
    """Raise unless ``f`` is a whole zip whose pickles (structure and scalars) pass their CRC-32."""
    try:
        with zipfile.ZipFile(f) as z:
            names = [i.filename for i in z.infolist()]
            if len(set(names)) != len(names):
                twice = next(n for n in names if names.count(n) > 1)
                # Two readers may pick different copies: the one checked would not be the one loaded.
                raise CheckpointError(f"{path}: refused to load: the archive holds {twice} twice; torch.save never writes that")
            pickles = [i for i in z.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
            for info in pickles:
                try:
                    with z.open(info) as member:
                        while member.read(1 << 20):  # the CRC-32 is checked when the member is read to its end
                            pass
                except zipfile.BadZipFile:
                    raise CheckpointError(
                        f"{path}: damaged: the tree's structure and Python values ({info.filename}) fail the zip's "
                        "CRC-32 (the file changed after it was written); use another copy or an older checkpoint"
                    ) from None
    except CheckpointError:
        raise
    except zipfile.BadZipFile as e:
        what = "no zip central directory: cut short" if "central directory" in str(e) or "not a zip" in str(e) else str(e)
        raise CheckpointError(f"{path}: truncated or damaged: {what} ({size} bytes)") from None
    except Exception as e:
        # A damaged header makes zipfile raise what it would for a zip it cannot read: EOFError,
        # NotImplementedError ("That compression method is not supported"), RuntimeError ("encrypted"), struct.error, ...
        raise CheckpointError(f"{path}: truncated or damaged: {type(e).__name__}: {e} ({size} bytes)") from None


_ADVICE = ("weights_only", "Please file an issue", "Check the documentation", "safe_globals", "Please use")


def _diagnosis(e: BaseException) -> str:
    """torch's reason for refusing or failing a load, without its advice.

    torch's weights_only refusal opens with the advice to rerun with ``weights_only=False`` (which
    would run the file's code) and ends with a documentation link; its diagnosis (``unsupported
    GLOBAL posix.system``) sits in between.
    """
    text = str(e).split("WeightsUnpickler error:", 1)[-1]
    parts = [p.strip() for p in re.split(r"\n\s*\n|\n", text) if p.strip()]
    kept = [p for p in parts if not any(a in p for a in _ADVICE)]
    return " ".join(kept) if kept else type(e).__name__
