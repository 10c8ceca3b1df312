"""Temporaries of atomic checkpoint writes: names that record their writer, and cleaning abandoned ones.

A checkpoint is written under a temporary name next to its destination and renamed into place
when complete. A writer killed before the rename (``SIGKILL``, a lost node) leaves the temporary
behind: a torn file, or for :func:`fddp.checkpoint.save_sharded` a directory as large as the
checkpoint. Its name records who wrote it::

    <destination>.tmp-<host id>-<pid>-<random>

where the host id (12 hex digits) hashes the host name, the kernel's boot id and the PID
namespace, so that two processes share a host id only when a PID means the same process to both.
The next save to the same destination (or, for :func:`fddp.checkpoint.save_step`, to the same
series) deletes a temporary only when it is provably abandoned:

- its writer ran on this host (same host id) and its PID is no longer running, or
- its writer is this very process and no write of this process is using it.

Anything else is left alone: a temporary from another host or container may belong to a live
writer there, and a PID that is running again on this host may be that writer (or a reused PID;
keeping it is the safe side). Such a temporary older than an hour draws one warning that names it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import shutil
import socket
import threading
import time
import warnings
from typing import Callable, Iterator

from fddp import _caches

__all__ = ["HOST_ID", "clean", "new_name", "running", "split", "writing"]

_PATTERN = re.compile(r"(?P<base>.+)\.tmp-(?P<host>[0-9a-f]{12})-(?P<pid>\d+)-(?P<token>[0-9a-f]{1,16})")
_ANY_TMP = re.compile(r"(?P<base>.+)\.tmp-[^/]+")  # also older fddp's and other tools' temporaries
_WARN_AFTER_S = 3600.0

_lock = threading.Lock()
_live: set[str] = set()  # absolute paths of the temporaries this process is writing now
_warned: set[str] = set()


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@_caches.cached(maxsize=1)
def _host_id() -> int:
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    boot = _read("/proc/sys/kernel/random/boot_id")
    digest = hashlib.sha1(f"{socket.gethostname()}|{boot}|{pid_ns}".encode()).digest()
    return int.from_bytes(digest[:6], "big")  # 48 bits: fits the int64 that ranks agree on


HOST_ID = _host_id()


def new_name(destination: str, host: int = HOST_ID, pid: int | None = None, token: int | None = None) -> str:
    """The temporary name for a write of ``destination`` by process ``pid`` of host ``host``.

    Every rank of a sharded save builds the same name from rank 0's ``host``, ``pid`` and ``token``.
    """
    pid = os.getpid() if pid is None else pid
    token = secrets.randbits(63) if token is None else token
    return f"{destination}.tmp-{host:012x}-{pid}-{token:016x}"


def split(name: str) -> str | None:
    """The destination name a temporary's name belongs to, or None if ``name`` is no temporary."""
    m = _ANY_TMP.fullmatch(name)
    return m.group("base") if m else None


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Mark ``path`` as a temporary this process is writing, so that no cleanup deletes it."""
    path = os.path.abspath(path)
    with _lock:
        _live.add(path)
    try:
        yield
    finally:
        with _lock:
            _live.discard(path)


def running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one we may not signal counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or a PID we cannot ask about): assume it is alive
    return True


def _abandoned(path: str) -> bool:
    m = _PATTERN.fullmatch(os.path.basename(path))
    if m is None or int(m.group("host"), 16) != HOST_ID:
        return False
    pid = int(m.group("pid"))
    if pid == os.getpid():
        with _lock:
            return os.path.abspath(path) not in _live
    return not running(pid)


def clean(directory: str, belongs: Callable[[str], bool]) -> list[str]:
    """Delete the abandoned temporaries in ``directory`` whose destination name satisfies ``belongs``.

    Returns the paths deleted. Temporaries that are not provably abandoned are kept; one older
    than an hour draws a warning (once per process) that says how to delete it by hand.
    """
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for name in names:
        base = split(name)
        if base is None or not belongs(base):
            continue
        path = os.path.join(directory, name)
        if _abandoned(path):
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
            except FileNotFoundError:
                pass  # another cleaner got there first
            removed.append(path)
        else:
            _warn_if_old(path, os.path.join(directory, base))
    return removed


def _warn_if_old(path: str, destination: str) -> None:
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return
    if age < _WARN_AFTER_S or path in _warned:
        return
    _warned.add(path)
    warnings.warn(
        f"fddp.checkpoint: {path} is the temporary of an unfinished write of {destination}, "
        f"{age / 3600:.1f} h old, by a writer that may still run on another host or in another "
        "container, so it is not deleted automatically. Once no job writes this checkpoint, delete it "
        f"by hand: rm -r '{path}'",
        stacklevel=3,
    )
