"""One writer per series: in a process, a directory and a prefix belong to one process group's saves.

The directory's lock (:mod:`fddp.checkpoint._lock`) keeps a second job out of a directory. Inside
one job, two series saved under one prefix into one directory by different process groups (two
:class:`fddp.checkpoint.Manager` objects, each on a group of its own as the one-manager-per-group
rule advises) would overwrite each other's checkpoint of a step, and each one's ``keep=`` would
delete the other's: the names cannot tell the series apart. So the first save of a series in a
process claims it for its process group (:func:`claim`): a :class:`Manager` from when it is made
until it closes, a plain ``save_step`` for as long as its group exists (until
``torch.distributed.destroy_process_group``). A save or a Manager on a
claimed series with another group is refused, naming both writers. Another prefix or another
directory is another series; the same group continues a series (a Manager's own saves, a last
``save_step`` after its loop).

Every rank that makes the Manager or calls ``save_step`` claims, so a script that makes the same
Managers on every rank is refused on every rank alike, at the second one's construction.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import torch.distributed as dist

from fddp._errors import CheckpointError
from fddp.checkpoint import _ranks

__all__ = ["claim", "release"]

_ALONE = object()  # the "group" of a process without torch.distributed: every save there is one writer's


def _registered(group: Any) -> bool:
    """Whether torch.distributed knows ``group`` now (a destroyed group it no longer does)."""
    try:
        dist.get_rank(group)
    except Exception:  # noqa: BLE001 - ValueError (not registered), RuntimeError (no default group any more)
        return False
    return True


class _Owner:
    """Who writes a series: a process group (weakly held: a destroyed group's claim ends with it),
    the call that claimed it (for the error), and the Manager that holds it, if one does."""

    __slots__ = ("group", "known", "what", "manager")

    def __init__(self, group: Any, what: str, manager: Any) -> None:
        try:
            self.group = weakref.ref(group) if group is not _ALONE else (lambda: group)
        except TypeError:  # an object that takes no weak reference (a test's stand-in): held while the process lives
            self.group = lambda: group
        # A group torch.distributed does not register (a fault-tolerant one) ends with its object only.
        self.known = group is not _ALONE and _registered(group)
        self.what = what
        self.manager = weakref.ref(manager) if manager is not None else None

    def alive(self) -> bool:
        group = self.group()
        if group is None or (self.known and not _registered(group)):
            return False
        return self.manager is None or self.manager() is not None


_mutex = threading.Lock()
_owners: dict[tuple[str, str], _Owner] = {}  # (real path of the directory, prefix) -> its writer


def _resolve(group: dist.ProcessGroup | None) -> Any:
    if not _ranks.is_distributed():
        return _ALONE
    group = group if group is not None else dist.group.WORLD
    return group if group is not None else _ALONE


def _label(group: Any) -> str:
    if group is _ALONE:
        return "this process (no process group)"
    if group is dist.group.WORLD:
        return "the default group"
    try:
        return f"group {group.group_name!r} (ranks {dist.get_process_group_ranks(group)})"
    except Exception:  # noqa: BLE001 - a group torch.distributed does not know (a fault-tolerant one)
        return "a process group of its own"


def claim(directory: str | os.PathLike, prefix: str, group: dist.ProcessGroup | None, what: str, manager: Any = None) -> None:
    """Claim the series ``prefix`` in ``directory`` for ``group`` (and ``manager``), or check that it is its.

    Args:
        directory: the series' directory (any spelling of it: its real path is the key).
        prefix: the series' name prefix.
        group: the process group whose rank 0 writes the series.
        what: who asks, in words, for an error: ``"fddp.checkpoint.Manager('runs/a')"``.
        manager: the Manager claiming the series until it closes (None: a plain save).

    Raises:
        CheckpointError: another group's writer (a Manager, or saves) holds the series; the message
            names both and how to keep them apart.
    """
    key = (os.path.realpath(os.fspath(directory)), prefix)
    mine = _resolve(group)
    with _mutex:
        for dead in [k for k, o in _owners.items() if not o.alive()]:  # destroyed groups, Managers never closed
            del _owners[dead]
        owner = _owners.get(key)
        if owner is not None and owner.alive():
            holder = owner.group()
            held_by = owner.manager() if owner.manager is not None else None
            if holder is mine and (manager is None or held_by is None or held_by is manager):
                if manager is not None and held_by is None:
                    _owners[key] = _Owner(mine, what, manager)  # the Manager continues the group's series
                return
            raise CheckpointError(
                f"{os.fspath(directory)}: {what} on {_label(mine)} would write the checkpoints '{prefix}-<step>' that "
                f"{owner.what} on {_label(holder)} writes in this process: each would overwrite the other's checkpoint "
                f"of a step, and each one's keep= would delete the other's. Give each series a prefix of its own "
                f"(prefix='...') or a directory of its own"
                + (", or close the other Manager first" if held_by is not None else "")
            )
        _owners[key] = _Owner(mine, what, manager)


def release(manager: Any) -> None:
    """End ``manager``'s claims (it closed): its series is free for another writer."""
    with _mutex:
        for key in [k for k, o in _owners.items() if o.manager is not None and o.manager() is manager]:
            del _owners[key]
