"""Single-file checkpoints: atomic, rank-0-only writes, code-free loads.

The file format is :mod:`fddp.checkpoint._codec`'s. A write goes to a temporary next to the
destination (named by :mod:`fddp.checkpoint._temp`), is flushed, fsynced and renamed over the
destination, then the directory is fsynced: a writer killed at any moment leaves either the old
file or the new one, and at worst a temporary that the next save of the same destination removes.
"""

from __future__ import annotations

import errno
import os
from typing import Any, Callable

import torch.distributed as dist

from fddp.checkpoint import _codec, _ranks, _temp

__all__ = ["load", "save", "write", "write_payload"]


@_ranks.entry("checkpoint.save", together=lambda *args, barrier=False, **kwargs: barrier)
def save(
    path: str | os.PathLike,
    tree: Any,
    /,
    *,
    group: dist.ProcessGroup | None = None,
    barrier: bool = False,
) -> str:
    """Write ``tree`` to ``path`` atomically, from rank 0 of ``group`` only.

    The file is written as ``<path>.tmp-<host id>-<pid>-<random>`` in the same directory, flushed
    and fsynced, then renamed over ``path`` and the directory is fsynced, so ``path`` always holds
    either the old checkpoint or the complete new one. A write that fails (a full disk, say)
    removes the temporary file and leaves the old checkpoint as it was; a writer killed before the
    rename leaves its temporary, which the next ``save`` to ``path`` deletes once it is provably
    abandoned (see :func:`fddp.checkpoint.save_step`). Missing parent directories are created. Tensors are stored
    detached, compact (a view saves only its own elements, not its base's storage) and on the CPU,
    as plain ``torch.Tensor``, each with CRC-32s of its bytes (one per 4 MiB) that :func:`load` verifies;
    :func:`load` puts them back on a device.

    Args:
        path: destination file.
        tree: nested dicts/lists/tuples/NamedTuples (or containers registered as pytree nodes,
            such as a ``TensorDict``) of tensors and Python scalars, str, bytes, None.
        group: process group whose rank 0 writes; the default group when None. Other ranks return
            at once without touching the file system. Without ``torch.distributed`` initialised,
            the caller writes.
        barrier: if True, every rank of ``group`` must call ``save`` and returns only once the
            file is in place, so all ranks may read it afterwards (the call is then one fddp call
            on ``group``, with one small agreement: if rank 0 fails to write, it raises its error
            and every other rank raises :class:`fddp.PeerError` naming it, instead of waiting).
            Leave it False when only rank 0 calls ``save``. :func:`fddp.checkpoint.save_step` does
            this by default.

    Returns:
        ``path`` as a string (on every rank).

    Raises:
        TypeError: a leaf or dict key of an unsupported type, naming its path (``a/b/0``).
        OSError: the file cannot be written, naming ``path``; a full disk says so (``ENOSPC``).
        fddp.PeerError: with ``barrier=True``, on the other ranks, when rank 0 failed to write (its
            error named).
        RuntimeError: with ``barrier=True``, a peer did not arrive within the process group's timeout.

    Example:
        >>> import os, tempfile, torch
        >>> p = os.path.join(tempfile.mkdtemp(), "model.pt")
        >>> save(p, {"w": torch.zeros(3), "step": 1})  # doctest: +ELLIPSIS
        '...model.pt'
    """
    path = os.fspath(path)
    if _ranks.is_writer(group):
        name = os.path.basename(path)
        write(path, tree, lambda base: base == name)  # a failure here reaches the peers through the call scope
    if barrier:
        _ranks.barrier(path, group, "checkpoint.save")
    return path


def write(path: str, tree: Any, belongs: Callable[[str], Any]) -> None:
    """Write the file (on the writing rank), atomically.

    ``belongs(name)`` says which destinations' abandoned temporaries to delete first.
    """
    write_payload(path, _codec.encode(tree), belongs)


def write_payload(path: str, payload: dict, belongs: Callable[[str], Any]) -> None:
    """:func:`write` of a tree already encoded (``_codec.encode``; an asynchronous save encodes
    a snapshot on the training thread and writes it on another)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    _temp.clean(directory, belongs)
    tmp = _temp.new_name(path)
    with _temp.writing(tmp):
        try:
            with open(tmp, "wb") as f:
                _codec.write(f, payload)
            os.replace(tmp, path)
        except BaseException as e:
            # An exception (not a kill) must not leave a stray temporary file behind.
            try:
                os.remove(tmp)
            except OSError:
                pass
            raise _write_error(e, path) from e
    _codec.fsync_dir(directory)


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
    refused with :class:`CheckpointError` before any of it executes. Before that, the file must be
    a whole zip (a copy cut short is "truncated or damaged") whose pickle of the structure and
    Python values passes the zip's CRC-32; every tensor must match the CRC-32s of its bytes saved
    with it, so a byte that changed on disk is an error naming the leaf, never a silently different
    value. (Files written before checksums existed load unverified.) Verifying costs one pass over
    the tensors' bytes, on the CPU (a tensor loaded onto another device is copied back for it;
    ``map_location="meta"`` has no data to verify).

    Without ``like``, dicts, OrderedDicts, lists and tuples come back as such, and each NamedTuple
    as a namedtuple class generated from the saved class name and fields (one class per name and
    fields, shared across loads; it is not the original class, so ``isinstance`` checks against
    the original fail). A container registered as a pytree node (a ``tensordict.TensorDict``, a
    dataclass passed to ``torch.utils._pytree.register_dataclass``) was saved as its keys and
    children only, no class or constructor: without ``like`` it comes back as a dict of its
    entries; with a ``like`` of its type it is rebuilt by ``like``'s own registration (a
    TensorDict with ``like``'s batch size and device). Pass ``like`` to get the original types back.

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
        FileNotFoundError: no file at ``path`` (and other OS errors of opening it).
        CheckpointError: the file is truncated, damaged (a failed checksum names the leaf), is not
            an fddp checkpoint, would need to unpickle arbitrary objects, or does not match
            ``like``; the message names the path and, for a mismatch, the first differing leaf
            (``params/w``) with what was expected and what was found.

    Example:
        >>> import os, tempfile, torch
        >>> p = save(os.path.join(tempfile.mkdtemp(), "c.pt"), {"w": torch.ones(2), "step": 3})
        >>> load(p, like={"w": torch.zeros(2), "step": 0})
        {'w': tensor([1., 1.]), 'step': 3}
    """
    path = os.fspath(path)
    return _codec.decode(_codec.read(path, map_location), like, path)
