"""Save and load pytrees of tensors: atomic, rank-0-only writes and code-free loads.

A checkpoint is one ``torch.save`` file holding only plain data: a dict with the leaves
(tensors and Python scalars) in depth-first order, each leaf's path as a string, and the tree's
structure described with tuples, strings and ints. Nothing in it names a Python class, so it loads
with ``torch.load(..., weights_only=True)``, and a file that would need to run code is refused.

Supported trees are nested ``dict`` (and ``OrderedDict``), ``list``, ``tuple`` and ``NamedTuple``
(optimizer states) nodes, with leaves that are tensors or ``int``, ``float``, ``complex``, ``bool``,
``str``, ``bytes`` or ``None`` (a step count, ``torch.get_rng_state()``, ``random.getstate()``).
Other dict subclasses are saved as dicts, other tuple/list subclasses as tuples/lists; subclasses
of the scalar types (numpy scalars, enums) are refused at save time, since loading them would need
their class. Tensors are stored on the CPU.

Writes are atomic: the file is written next to its destination under a temporary name, flushed,
fsynced and renamed over the destination, then the directory is fsynced. A writer killed at any
moment leaves either the old file or the new one, never a torn one.

Checkpoints of a run live in one directory as ``<prefix>-<step:08d>.pt``; :func:`save_step` writes
one and keeps only the newest few, :func:`latest` finds the newest, :func:`steps` lists them all.

Trees sharded by :mod:`fddp.zero` are saved per rank instead, into a directory that loads onto any
number of ranks: :func:`save_sharded` and :func:`load_sharded`.

Example:
    >>> import tempfile, torch, fddp.checkpoint as ckpt
    >>> d = tempfile.mkdtemp()
    >>> state = {"params": {"w": torch.ones(2)}, "step": 10}
    >>> _ = ckpt.save_step(d, 10, state, keep=3)
    >>> ckpt.load(ckpt.latest(d), like=state)["step"]
    10
"""

from __future__ import annotations

import collections
import errno
import os
import pickle
import re
import zipfile
from typing import Any

import torch
import torch.distributed as dist

from fddp._dist import collective_device

__all__ = ["CheckpointError", "save", "load", "save_step", "latest", "steps", "step_path", "save_sharded", "load_sharded"]

_FORMAT = "fddp-checkpoint"
_VERSION = 1
_PRIMITIVES = (bool, int, float, complex, str, bytes, type(None))
_MISSING = object()


class CheckpointError(ValueError):
    """A checkpoint file cannot be loaded, or does not match the expected ``like`` tree; or, on the
    ranks that did not write it, rank 0 failed to write it."""


# --------------------------------------------------------------------------------------------
# Encoding: tree -> (structure of plain data, leaves, paths)
# --------------------------------------------------------------------------------------------


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and isinstance(getattr(type(x), "_fields", None), tuple)


def _key_str(key: Any) -> str:
    return f"[{key!r}]"


def _compact(t: torch.Tensor) -> torch.Tensor:
    """Return a detached CPU tensor whose storage holds exactly its own elements.

    ``torch.save`` writes a tensor's whole storage, so a 10-element view of a 100 MB gradient
    bucket would otherwise cost 100 MB on disk. Moving to the CPU first means the copy of a view
    never takes accelerator memory (torch.save copies to the host anyway), and the file loads on
    any machine.
    """
    t = t.detach().cpu()
    if t.layout is not torch.strided:
        return t
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    exact = (
        t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )
    t = t if exact else t.clone(memory_format=torch.contiguous_format)
    # Parameters and other subclasses are stored as plain tensors; weights_only accepts those.
    return t if type(t) is torch.Tensor else t.as_subclass(torch.Tensor)


def _encode(node: Any, path: str, leaves: list, paths: list) -> tuple:
    if isinstance(node, torch.Tensor):
        leaves.append(_compact(node))
        paths.append(path)
        return ("leaf",)
    if type(node) in _PRIMITIVES:
        leaves.append(node)
        paths.append(path)
        return ("leaf",)
    if isinstance(node, _PRIMITIVES):
        # numpy scalars and enums subclass int/float/str but pickle as their own class, which
        # weights_only refuses: fail now, not when the checkpoint is needed.
        raise TypeError(
            f"checkpoint: leaf at {path} is a {type(node).__qualname__}, a subclass of "
            f"{next(b for b in _PRIMITIVES if isinstance(node, b)).__name__}; convert it to a plain "
            "Python value first"
        )
    if isinstance(node, dict):
        keys = tuple(node)
        for k in keys:
            if type(k) not in _PRIMITIVES:
                raise TypeError(
                    f"checkpoint: dict key {k!r} at {path} is a {type(k).__qualname__}, not a plain "
                    "str/int/float/bool/bytes/None"
                )
        kind = "odict" if isinstance(node, collections.OrderedDict) else "dict"
        children = tuple(_encode(node[k], path + _key_str(k), leaves, paths) for k in keys)
        return (kind, keys, children)
    if _is_namedtuple(node):
        cls = type(node)
        fields = tuple(cls._fields)
        children = tuple(
            _encode(v, f"{path}.{f}", leaves, paths) for f, v in zip(fields, node)
        )
        return ("namedtuple", f"{cls.__module__}.{cls.__qualname__}", fields, children)
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        children = tuple(_encode(v, f"{path}[{i}]", leaves, paths) for i, v in enumerate(node))
        return (kind, children)
    raise TypeError(
        f"checkpoint: leaf at {path} has unsupported type {type(node).__qualname__}; expected a "
        "tensor, a Python scalar, str, bytes or None, inside dicts, lists, tuples or NamedTuples"
    )


# --------------------------------------------------------------------------------------------
# Decoding: (structure, leaves) [+ like] -> tree
# --------------------------------------------------------------------------------------------

# One generated class per (name, fields), so repeated loads give trees of the same type.
_GENERATED: dict[tuple[str, tuple[str, ...]], type] = {}


def _generated_namedtuple(qualname: str, fields: tuple[str, ...], where: str) -> type:
    key = (qualname, fields)
    if key not in _GENERATED:
        name = qualname.rsplit(".", 1)[-1]
        if not name.isidentifier():
            name = "CheckpointNamedTuple"
        try:
            _GENERATED[key] = collections.namedtuple(name, fields, module=__name__)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: invalid NamedTuple fields {fields!r}: {e}") from None
    return _GENERATED[key]


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    if _is_namedtuple(x):
        return f"NamedTuple {type(x).__name__} with fields {tuple(type(x)._fields)}"
    if isinstance(x, dict):
        return f"dict with keys {list(x)}"
    if isinstance(x, (list, tuple)):
        return f"{type(x).__name__} of length {len(x)}"
    return f"{type(x).__name__} {x!r}"


def _describe_node(node: tuple) -> str:
    kind = node[0]
    if kind in ("dict", "odict"):
        return f"dict with keys {list(node[1])}"
    if kind == "namedtuple":
        return f"NamedTuple {node[1].rsplit('.', 1)[-1]} with fields {node[2]}"
    return f"{kind} of length {len(node[1])}"


class _Decoder:
    def __init__(self, leaves: list, where: str):
        self.leaves = iter(leaves)
        self.where = where  # the file, for messages

    def fail(self, path: str, expected: str, found: str) -> CheckpointError:
        return CheckpointError(
            f"{self.where}: checkpoint does not match `like` at {path}: "
            f"expected {expected}, found {found}"
        )

    def next_leaf(self) -> Any:
        try:
            return next(self.leaves)
        except StopIteration:
            raise CheckpointError(
                f"{self.where}: corrupt checkpoint: fewer leaves than its structure"
            ) from None

    def decode(self, node: Any, like: Any, path: str) -> Any:
        if not isinstance(node, tuple) or not node or not isinstance(node[0], str):
            raise CheckpointError(f"{self.where}: corrupt checkpoint structure at {path}")
        kind = node[0]
        if kind == "leaf":
            return self.leaf(self.next_leaf(), like, path)
        if like is not _MISSING and _is_leaf_like(like):
            raise self.fail(path, _describe(like), _describe_node(node))
        try:
            if kind in ("dict", "odict"):
                return self.mapping(kind, node[1], node[2], like, path)
            if kind == "namedtuple":
                return self.namedtuple(node[1], node[2], node[3], like, path)
            if kind in ("list", "tuple"):
                return self.sequence(kind, node[1], like, path)
        except (IndexError, TypeError) as e:
            raise CheckpointError(f"{self.where}: corrupt checkpoint structure at {path}: {e}") from None
        raise CheckpointError(f"{self.where}: corrupt checkpoint structure at {path}: unknown node {kind!r}")

    def leaf(self, value: Any, like: Any, path: str) -> Any:
        if like is _MISSING:
            return value
        if isinstance(like, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                raise self.fail(path, _describe(like), _describe(value))
            if value.shape != like.shape or value.dtype != like.dtype:
                raise self.fail(path, _describe(like), _describe(value))
            # map_location semantics: the loaded leaf lives where the expected one does; a meta
            # `like` describes only shape and dtype, so the leaf stays on map_location.
            if like.device.type != "meta" and value.device != like.device:
                value = value.to(like.device)
            if like.requires_grad:
                # like's dtype was checked above, and only float/complex tensors can require grad.
                value.requires_grad_(True)
            return value
        if isinstance(like, _PRIMITIVES):
            if type(value) is not type(like):
                raise self.fail(path, f"a {type(like).__name__}", _describe(value))
            return value
        raise self.fail(path, _describe(like), _describe(value))

    def mapping(self, kind: str, keys: tuple, children: tuple, like: Any, path: str) -> Any:
        if len(keys) != len(children):
            raise CheckpointError(f"{self.where}: corrupt checkpoint structure at {path}")
        if like is not _MISSING:
            if not isinstance(like, dict):
                raise self.fail(path, _describe(like), f"dict with keys {list(keys)}")
            missing = [k for k in like if k not in keys]
            extra = [k for k in keys if k not in like]
            if missing:
                raise self.fail(path + _key_str(missing[0]), "an entry", "no such key in the checkpoint")
            if extra:
                raise self.fail(
                    path + _key_str(extra[0]), "no such key (like has none)", "an entry in the checkpoint"
                )
        values = {
            k: self.decode(c, like[k] if like is not _MISSING else _MISSING, path + _key_str(k))
            for k, c in zip(keys, children)
        }
        if like is not _MISSING:
            # The expected tree decides key order and dict flavour.
            ordered = [(k, values[k]) for k in like]
            if isinstance(like, collections.OrderedDict):
                return collections.OrderedDict(ordered)
            return dict(ordered)
        return collections.OrderedDict(values) if kind == "odict" else values

    def namedtuple(self, qualname: str, fields: tuple, children: tuple, like: Any, path: str) -> Any:
        if len(fields) != len(children):
            raise CheckpointError(f"{self.where}: corrupt checkpoint structure at {path}")
        if like is _MISSING:
            cls = _generated_namedtuple(qualname, tuple(fields), self.where)
            return cls(*(self.decode(c, _MISSING, f"{path}.{f}") for f, c in zip(fields, children)))
        # Fields are checked, the class name is not: a state class that moved module still loads.
        if not _is_namedtuple(like) or tuple(type(like)._fields) != tuple(fields):
            raise self.fail(
                path, _describe(like), f"NamedTuple {qualname.rsplit('.', 1)[-1]} with fields {tuple(fields)}"
            )
        values = [self.decode(c, getattr(like, f), f"{path}.{f}") for f, c in zip(fields, children)]
        return type(like)(*values)

    def sequence(self, kind: str, children: tuple, like: Any, path: str) -> Any:
        if like is not _MISSING:
            want = list if kind == "list" else tuple
            if _is_namedtuple(like) or not isinstance(like, want) or len(like) != len(children):
                raise self.fail(path, _describe(like), f"{kind} of length {len(children)}")
        values = [
            self.decode(c, like[i] if like is not _MISSING else _MISSING, f"{path}[{i}]")
            for i, c in enumerate(children)
        ]
        return values if kind == "list" else tuple(values)


def _is_leaf_like(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, *_PRIMITIVES))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def _is_writer(group: dist.ProcessGroup | None) -> bool:
    # Without an initialised process group this is rank 0 of a 1-process world.
    if not (dist.is_available() and dist.is_initialized()):
        return True
    return dist.get_rank(group) == 0


def _fsync_dir(directory: str) -> None:
    # Makes the rename itself durable; some platforms and filesystems cannot open or fsync a
    # directory, and there the rename is as durable as the OS makes it.
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


def save(
    path: str | os.PathLike,
    tree: Any,
    /,
    *,
    group: dist.ProcessGroup | None = None,
    barrier: bool = False,
) -> str:
    """Write ``tree`` to ``path`` atomically, from rank 0 of ``group`` only.

    The file is written as ``<path>.tmp-<pid>`` in the same directory, flushed and fsynced, then
    renamed over ``path`` and the directory is fsynced, so ``path`` always holds either the old
    checkpoint or the complete new one. A write that fails (a full disk, say) removes the
    temporary file and leaves the old checkpoint as it was. Missing parent directories are
    created. Tensors are stored detached, compact (a view saves only its own elements, not its
    base's storage) and on the CPU, as plain ``torch.Tensor``; :func:`load` puts them back on a
    device.

    Args:
        path: destination file.
        tree: nested dicts/lists/tuples/NamedTuples of tensors and Python scalars, str, bytes, None.
        group: process group whose rank 0 writes; the default group when None. Other ranks return
            at once without touching the file system. Without ``torch.distributed`` initialised,
            the caller writes.
        barrier: if True, every rank of ``group`` must call ``save`` and returns only once the
            file is in place, so all ranks may read it afterwards (one small all-reduce that also
            carries rank 0's success: if rank 0 fails to write, it raises its error and every other
            rank raises :class:`CheckpointError`, instead of waiting). Leave it False when only
            rank 0 calls ``save``. :func:`save_step` does this by default.

    Returns:
        ``path`` as a string (on every rank).

    Raises:
        TypeError: a leaf or dict key of an unsupported type, naming its path.
        OSError: the file cannot be written, naming ``path``; a full disk says so (``ENOSPC``).
        CheckpointError: with ``barrier=True``, on the other ranks, when rank 0 failed to write.

    Example:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> save(p, {"w": torch.zeros(3), "step": 1})  # doctest: +ELLIPSIS
        '...model.pt'
    """
    path = os.fspath(path)
    error = _write(path, tree) if _is_writer(group) else None
    _agree(path, error, group, barrier)
    return path


def _write(path: str, tree: Any) -> BaseException | None:
    """Write the file (on the writing rank); return the exception that stopped it, if any."""
    try:
        leaves: list = []
        paths: list = []
        structure = _encode(tree, "tree", leaves, paths)
        payload = {
            "format": _FORMAT,
            "version": _VERSION,
            "structure": structure,
            "paths": paths,
            "leaves": leaves,
        }
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            # An exception (not a kill) must not leave a stray temporary file behind.
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise _write_error(e, path) from e
        _fsync_dir(directory)
    except BaseException as e:  # noqa: BLE001 - handed to _agree, which raises it
        return e
    return None


def _write_error(e: BaseException, path: str) -> BaseException:
    """The error to raise for a failed write: the OSError behind it, naming the path.

    torch.save reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc]
    unexpected pos ...``, with the real cause, ``OSError: [Errno 28] No space left on device``,
    only in the exception's context.
    """
    cause: BaseException | None = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None or cause.errno is None:
        return e
    what = os.strerror(cause.errno)
    if cause.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        what += " (the disk is full)"
    return OSError(
        cause.errno,
        f"checkpoint not written: {what}; the previous file at this path, if any, is intact and the "
        "partial temporary file was removed",
        path,
    )


def _agree(path: str, error: BaseException | None, group: dist.ProcessGroup | None, barrier: bool) -> None:
    """Raise the writer's error; with ``barrier``, first tell every rank whether the write succeeded."""
    if barrier and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # A barrier that carries the outcome: nobody waits for a writer that has already failed.
        failed = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=collective_device(group))
        dist.all_reduce(failed, group=group)
        if error is None and int(failed.item()):
            raise CheckpointError(
                f"{path}: not written: rank 0 of the group failed to write it (its own error says why)"
            )
    if error is not None:
        raise error


def _refusal_reason(e: BaseException) -> str:
    text = str(e)
    marker = "WeightsUnpickler error:"
    if marker in text:
        reason = text.split(marker, 1)[1].strip().split("\n", 1)[0].strip()
        # Keep torch's diagnosis, drop its advice to allowlist globals.
        return reason.split(" Please use", 1)[0]
    return text.strip().split("\n", 1)[0]


def load(
    path: str | os.PathLike,
    /,
    like: Any = None,
    *,
    map_location: Any = "cpu",
) -> Any:
    """Read a tree written by :func:`save`, without ever running code from the file.

    The file is read with ``torch.load(..., weights_only=True)``: a file holding anything but
    tensors and plain data (for example a pickled object whose ``__reduce__`` runs a command) is
    refused with :class:`CheckpointError` before any of it executes.

    Without ``like``, dicts, OrderedDicts, lists and tuples come back as such, and each NamedTuple
    as a namedtuple class generated from the saved class name and fields (one class per name and
    fields, shared across loads; it is not the original class, so ``isinstance`` checks against
    the original fail). Pass ``like`` to get the original types back.

    Args:
        path: a file written by :func:`save`.
        like: the expected tree, e.g. freshly initialised params and optimizer state. When given,
            the structure (dict keys, sequence lengths, NamedTuple fields) and every leaf (tensor
            shape and dtype; the type of a Python scalar) must match, and the result uses
            ``like``'s container types and key order. Tensors are moved to the device of
            ``like``'s leaf (unless that is ``meta``) and get its ``requires_grad``.
        map_location: passed to ``torch.load``; where tensors land before any move to ``like``.

    Returns:
        The tree.

    Raises:
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is corrupt, is not an fddp checkpoint, would need to unpickle
            arbitrary objects, or does not match ``like``; the message names the path and, for a
            mismatch, the first differing leaf with what was expected and what was found.

    Example:
        >>> import os, tempfile, torch
        >>> p = save(os.path.join(tempfile.mkdtemp(), "c.pt"), {"w": torch.ones(2), "step": 3})
        >>> load(p, like={"w": torch.zeros(2), "step": 0})
        {'w': tensor([1., 1.]), 'step': 3}
    """
    path = os.fspath(path)
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except OSError:
        raise
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path}: refused to load: the file is corrupt or holds objects other than tensors and "
            f"plain data, which could run code ({_refusal_reason(e)})"
        ) from None
    except Exception as e:
        raise CheckpointError(
            f"{path}: corrupt or not a checkpoint file ({type(e).__name__}: {_refusal_reason(e)})"
        ) from None
    if not (isinstance(payload, dict) and payload.get("format") == _FORMAT):
        raise CheckpointError(f"{path}: not an fddp checkpoint (no '{_FORMAT}' format marker)")
    if payload.get("version") != _VERSION:
        raise CheckpointError(
            f"{path}: fddp checkpoint version {payload.get('version')!r}; this fddp reads version {_VERSION}"
        )
    leaves = payload.get("leaves")
    if not isinstance(leaves, list):
        raise CheckpointError(f"{path}: corrupt checkpoint: no leaf list")
    decoder = _Decoder(leaves, path)
    tree = decoder.decode(payload.get("structure"), _MISSING if like is None else like, "tree")
    if next(decoder.leaves, _MISSING) is not _MISSING:
        raise CheckpointError(f"{path}: corrupt checkpoint: more leaves than its structure")
    return tree


def step_path(directory: str | os.PathLike, step: int, /, *, prefix: str = "ckpt") -> str:
    """Return the file name :func:`save_step` uses for ``step``: ``<directory>/<prefix>-<step:08d>.pt``.

    Example:
        >>> step_path("runs/a", 42)
        'runs/a/ckpt-00000042.pt'
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return os.path.join(os.fspath(directory), f"{prefix}-{int(step):08d}.pt")


def steps(directory: str | os.PathLike, /, *, prefix: str = "ckpt") -> list[tuple[int, str]]:
    """List the complete checkpoints in ``directory`` as ``(step, path)``, oldest step first.

    Only files named ``<prefix>-<digits>.pt`` that are whole zip archives count: temporary files
    of an interrupted write (``*.pt.tmp-<pid>``) and truncated copies are skipped. A missing
    directory has no checkpoints.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> _ = save_step(d, 5, {"w": torch.ones(1)})
        >>> [s for s, _ in steps(d)]
        [5]
    """
    directory = os.fspath(directory)
    pattern = re.compile(rf"{re.escape(prefix)}-(\d+)\.pt")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = pattern.fullmatch(name)
        if not m:
            continue
        full = os.path.join(directory, name)
        # torch.save writes a zip; its central directory is written last, so a file that was cut
        # short (by a copy, not by save, whose rename is atomic) fails this cheap check.
        if os.path.isfile(full) and zipfile.is_zipfile(full):
            found.append((int(m.group(1)), full))
    return sorted(found)


def latest(directory: str | os.PathLike, /, *, prefix: str = "ckpt") -> str | None:
    """Return the path of the newest complete checkpoint in ``directory``, or None if there is none.

    "Newest" means the highest step number in the file name, not the modification time.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> latest(d) is None
        True
        >>> _ = save_step(d, 7, {"w": torch.ones(1)})
        >>> latest(d).endswith("ckpt-00000007.pt")
        True
    """
    found = steps(directory, prefix=prefix)
    return found[-1][1] if found else None


def save_step(
    directory: str | os.PathLike,
    step: int,
    tree: Any,
    /,
    *,
    keep: int | None = 3,
    prefix: str = "ckpt",
    group: dist.ProcessGroup | None = None,
    barrier: bool = True,
) -> str:
    """Save ``tree`` as the checkpoint of ``step`` in ``directory`` and keep only the newest ``keep``.

    The write is :func:`save` (atomic, rank 0 of ``group`` only). Older checkpoints are deleted
    only after the new one is in place, so a crash never leaves fewer than before. Pruning keeps
    the file just written plus the ``keep - 1`` highest other steps. If higher steps exist (say,
    from an abandoned earlier run in the same directory) they count among those and
    :func:`latest` keeps returning them; clear the directory when restarting from an older step.

    Every rank of ``group`` calls ``save_step`` and, by default, returns only once the new file is
    in place and the old ones are pruned, so :func:`latest` then finds it on every rank.

    Args:
        directory: where checkpoints live; created if missing.
        step: training step, used in the file name (see :func:`step_path`).
        tree: the pytree to save.
        keep: how many checkpoints to keep (>= 1), or None to keep all.
        prefix: file name prefix.
        group: process group whose rank 0 writes and prunes.
        barrier: wait until rank 0 has written (see :func:`save`); True by default here. With
            False, the other ranks return at once, and may still find the previous checkpoint.

    Returns:
        The path of the checkpoint (on every rank).

    Raises:
        OSError: on rank 0, the file cannot be written (a full disk says so).
        CheckpointError: on the other ranks (with ``barrier``), rank 0 failed to write.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> for s in range(5):
        ...     _ = save_step(d, s, {"w": torch.full((1,), float(s))}, keep=2)
        >>> [s for s, _ in steps(d)]
        [3, 4]
    """
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None, got {keep}")
    path = step_path(directory, step, prefix=prefix)
    error = None
    if _is_writer(group):
        error = _write(path, tree)
        if error is None and keep is not None:
            others = [(s, p) for s, p in steps(directory, prefix=prefix) if s != step]
            # Keep the new file plus the (keep - 1) highest other steps.
            for _, old in others[: max(0, len(others) - (keep - 1))]:
                try:
                    os.remove(old)
                except FileNotFoundError:
                    pass
    _agree(path, error, group, barrier)
    return path


def save_sharded(directory: str | os.PathLike, tree: Any, /, *, group: dist.ProcessGroup | None = None) -> str:
    """Write a tree holding :class:`fddp.zero.Sharded` parts into ``directory``, every rank its own pieces.

    The format is torch.distributed.checkpoint's (DCP): one file per rank plus a ``.metadata``
    index, and a small ``fddp-manifest.pt`` (written with :func:`save`) holding the Python scalars
    and every leaf's shape and dtype. Each leaf is stored whole under its path
    (``opt/exp_avg/0.weight``), each rank writing the pieces its shards hold, so nothing in the
    checkpoint depends on the world size or the bucket plan: :func:`load_sharded` reads it back
    on any number of ranks, resharding, or into a replicated tree. Tensors that are not sharded (a
    step count) must be equal on every rank; one copy is stored.

    Atomic: the ranks write into ``<directory>.tmp-<token>`` and rank 0 renames it to
    ``directory`` once everything is written, so ``directory`` either does not exist or is
    complete. An existing ``directory`` is never overwritten (:class:`FileExistsError`): write
    each checkpoint to a new one (say, per step) and delete old ones afterwards. Every rank of
    ``group`` must call this, with trees of the same structure.

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
        RuntimeError: a sharded part was made for another world size or rank.

    Example:
        >>> fddp.checkpoint.save_sharded(f"ckpt/step-{step:08d}", {"params": shards, "opt": opt_state, "step": step})
    """
    from fddp.zero._checkpoint import save_sharded as save_

    return save_(directory, tree, group=group)


def load_sharded(directory: str | os.PathLike, /, like: Any, *, group: dist.ProcessGroup | None = None) -> Any:
    """Read a checkpoint written by :func:`save_sharded` into the shape of ``like``, on any world size.

    ``like`` says what to load and how it is cut here: make it as for a fresh start on the ranks
    that load, ``shards = fddp.zero.shard(params)`` and ``opt.init(shards)``, and every rank reads
    the pieces of the saved leaves that its new shards cover, whatever the world size at save. A
    replicated ``like`` (full trees, say on one process for evaluation) loads whole leaves. The
    structure, every leaf's number of elements and dtype, and every Python scalar's type must match;
    the first difference raises :class:`CheckpointError`. No code from the checkpoint runs: its
    manifest is read with :func:`load` and DCP's ``.metadata`` with an unpickler that accepts DCP's
    own metadata classes only. Every rank of ``group`` must call this.

    Args:
        directory: a directory written by :func:`save_sharded`.
        like: the tree to fill, e.g. ``{"params": shards, "opt": opt.init(shards), "step": 0}``; its
            values are not used, only its structure, layouts, dtypes and devices.
        group: the process group ``like``'s shards were made on; ``None`` for the default group.

    Returns:
        A tree like ``like`` holding the checkpoint's values (new tensors; ``like`` is not modified).

    Raises:
        CheckpointError: ``directory`` is not a complete sharded checkpoint, does not match
            ``like``, holds anything but tensors, or DCP cannot read it (the message says why).

    Example:
        >>> shards = fddp.zero.shard(params)  # on the new number of ranks
        >>> like = {"params": shards, "opt": opt.init(shards), "step": 0}
        >>> state = fddp.checkpoint.load_sharded("ckpt/step-00001000", like)
        >>> params = fddp.zero.gather(state["params"]).wait()
    """
    from fddp.zero._checkpoint import load_sharded as load_

    return load_(directory, like, group=group)
