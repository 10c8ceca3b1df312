"""One writer per checkpoint directory: a lock file that names the job holding it.

Two jobs that rotate checkpoints in one directory (``save_step(keep=2)``) delete each other's:
each keeps the newest of the series, whoever wrote them. So the first :func:`fddp.checkpoint.save_step`
of a process into a directory takes ``<directory>/.fddp-writer.lock``, created exclusively
(``O_EXCL``) and holding the writer's identity (host, host id, PID and the process's start time,
the job's id from ``TORCHELASTIC_RUN_ID`` or ``SLURM_JOB_ID``, when it was taken), and keeps it
until the process exits. Every later save checks that the lock is still its own. Another job's
save into the directory is refused with an error that names the holder.

A lock whose holder is gone is taken over, with a warning: its process is no longer running on
this host (or its PID now belongs to a process started later), or it is an earlier run of this
same job (a torchrun restart; the job id must be a real one, not torchrun's default ``none``). A
lock held from another host by another job cannot be judged from here: the error says how to
remove it once no job writes the directory.

Only rank 0 of the saving group takes the lock (the caller's business); a refusal raised inside
the call scope reaches every rank as :class:`fddp.PeerError`.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import secrets
import socket
import threading
import warnings
from typing import Any

from fddp._errors import CheckpointError
from fddp.checkpoint import _temp

__all__ = ["NAME", "hold", "release"]

NAME = ".fddp-writer.lock"

_mutex = threading.Lock()
_held: dict[str, str] = {}  # real path of a directory -> the token of this process's lock in it
_registered = False


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux), to tell a reused PID apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name in parentheses may hold spaces
    except (IndexError, ValueError):
        return None


def _job() -> str | None:
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(var, "")
        if value and value != "none":  # torchrun's default --rdzv-id: every plain torchrun job has it
            return f"{var}={value}"
    return None


def _identity(token: str) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "host_id": f"{_temp.HOST_ID:012x}",
        "pid": os.getpid(),
        "start": _start_ticks(os.getpid()),
        "job": _job(),
        "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "token": token,
    }


def _read(lock: str) -> dict | None:
    """The holder a lock file names; None if there is none; ``{}`` if it cannot be read as one."""
    try:
        with open(lock, "rb") as f:
            raw = f.read(1 << 16)
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        found = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        return {}
    return found if isinstance(found, dict) else {}


def _describe(holder: dict) -> str:
    job = f", job {holder['job']}" if holder.get("job") else ""
    return f"process {holder.get('pid')!r} on host {holder.get('host')!r}{job}, since {holder.get('since')!r}"


def _gone(holder: dict) -> str | None:
    """Why ``holder`` provably no longer writes (None: it may still be writing)."""
    pid = holder.get("pid")
    if holder.get("host_id") == f"{_temp.HOST_ID:012x}" and type(pid) is int and pid > 0:
        if not _temp.running(pid):
            return "its process is no longer running"
        start = _start_ticks(pid)
        if start is not None and holder.get("start") is not None and start != holder.get("start"):
            return "its process ended (the PID now belongs to a newer process)"
        return None
    job = _job()
    if job is not None and holder.get("job") == job:
        return f"it is an earlier run of this job ({job}) on another host"
    return None


def _conflict(directory: str, lock: str, holder: dict, what: str) -> CheckpointError:
    if not holder:
        who = "another writer holds it with a lock file fddp cannot read"
    elif holder.get("host_id") == f"{_temp.HOST_ID:012x}":
        who = f"{_describe(holder)} holds it, and is still running on this host"
    else:
        who = f"{_describe(holder)} holds it; that is another host or container, so fddp cannot tell whether it still runs"
    return CheckpointError(
        f"{directory}: fddp.{what}: another job writes checkpoints into this directory: {who}. Two "
        "jobs that rotate checkpoints in one directory delete each other's. Save into another directory, or, if no "
        f"job writes this one any more, remove the lock by hand: rm '{lock}'"
    )


def hold(directory: str, what: str) -> None:
    """Take this process's lock on ``directory`` (its first save there) or check it still holds it.

    Raises:
        CheckpointError: another job holds the directory; naming it and how to resolve it.
    """
    real = os.path.realpath(directory)
    lock = os.path.join(real, NAME)
    with _mutex:
        token = _held.get(real)
        if token is not None:
            found = _read(lock)
            if found is not None and found.get("token") == token:
                return
            del _held[real]
            if found is not None:  # ours was removed by hand and another job took the directory
                raise _conflict(directory, lock, found, what)
        os.makedirs(real, exist_ok=True)
        token = secrets.token_hex(8)
        for _ in range(8):  # each round either takes the lock, takes over a stale one, or raises
            try:
                fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                found = _read(lock)
                if found is None:
                    continue  # released meanwhile
                if found.get("pid") == os.getpid() and found.get("host_id") == f"{_temp.HOST_ID:012x}" and found.get("token"):
                    if found.get("start") == _start_ticks(os.getpid()):
                        _keep(real, found["token"])  # this process's own (its record was lost: a reloaded module)
                        return
                why = _gone(found) if found else None
                if why is None:
                    raise _conflict(directory, lock, found, what) from None
                _take_over(lock, found, why, what)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(_identity(token), f)
                f.flush()
                os.fsync(f.fileno())
            _keep(real, token)
            return
        raise CheckpointError(f"{directory}: fddp.{what}: could not take {lock}: other processes keep taking it")


def _take_over(lock: str, stale: dict, why: str, what: str) -> None:
    """Move a stale lock aside, unless another process replaced it meanwhile (then leave theirs)."""
    aside = f"{lock}.stale-{secrets.token_hex(4)}"
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return  # another process moved it first: the next round finds theirs or none
    moved = _read(aside)
    if moved is not None and moved.get("token") != stale.get("token"):
        try:  # not the one judged stale: a live writer's, put back (never over a newer one)
            os.link(aside, lock)
        except OSError:
            pass
        os.remove(aside)
        return
    os.remove(aside)
    warnings.warn(
        f"fddp.{what}: took over {lock} from {_describe(stale)}: {why}. Its checkpoints are this job's to rotate now.",
        stacklevel=4,
    )


def _keep(real: str, token: str) -> None:
    global _registered
    _held[real] = token
    if not _registered:
        atexit.register(_release_all)
        _registered = True


def release(directory: str) -> None:
    """Give up this process's lock on ``directory`` (if it holds it), so another job may write there."""
    real = os.path.realpath(directory)
    with _mutex:
        token = _held.pop(real, None)
        if token is None:
            return
        lock = os.path.join(real, NAME)
        found = _read(lock)
        if found is not None and found.get("token") == token:
            try:
                os.remove(lock)
            except FileNotFoundError:
                pass


def _release_all() -> None:
    for real in list(_held):
        try:
            release(real)
        except OSError:
            pass  # the process is ending: a lock left behind is taken over as stale


def held() -> list[str]:
    """The directories whose lock this process holds (for tests and diagnostics)."""
    with _mutex:
        return sorted(_held)

