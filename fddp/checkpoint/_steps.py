"""A directory of numbered checkpoints, of any kind: save one per step, keep the newest few, find the latest.

One series of a run lives in one directory as ``<prefix>-<step:08d>.pt`` (a single file, written by
rank 0) or ``<prefix>-<step:08d>`` (a sharded checkpoint's directory, every rank writing its part:
the tree holds :class:`fddp.zero.Sharded` or :class:`fddp.checkpoint.PerRank` parts). Both kinds
are written under a temporary name and renamed into place when complete, so :func:`steps` and
:func:`latest` only ever see whole checkpoints; old ones are deleted only after the new one is in
place, a directory by first renaming it to a temporary name (a kill mid-delete leaves a temporary
that the next save removes, never a half checkpoint under a step's name).
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
import zipfile
from typing import Any

import optree
import torch.distributed as dist

from fddp import _dist
from fddp.checkpoint import _dcp, _lock, _ranks, _series, _single, _temp
from fddp.checkpoint._sharded import PerRank, load_sharded, write_sharded
from fddp.zero import _layout as _shard

__all__ = ["latest", "load_step", "save_step", "step_path", "steps"]


def _is_sharded(tree: Any) -> bool:
    """Whether ``tree`` holds parts that each rank saves itself (shards, per-rank state)."""
    leaves = optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, (_shard.Sharded, PerRank)), none_is_leaf=True)
    return any(isinstance(x, (_shard.Sharded, PerRank)) for x in leaves)


def step_path(directory: str | os.PathLike, step: int, /, *, prefix: str = "ckpt", sharded: bool = False) -> str:
    """Return the path :func:`save_step` uses for ``step``: ``<directory>/<prefix>-<step:08d>.pt``,
    or without ``.pt`` for a sharded checkpoint (a directory).

    Example:
        >>> step_path("runs/a", 42)
        'runs/a/ckpt-00000042.pt'
        >>> step_path("runs/a", 42, sharded=True)
        'runs/a/ckpt-00000042'
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return os.path.join(os.fspath(directory), f"{prefix}-{int(step):08d}{'' if sharded else '.pt'}")


def _step_name(prefix: str) -> re.Pattern:
    return re.compile(rf"{re.escape(prefix)}-(\d+)(\.pt)?")


def _complete(full: str, is_file: bool) -> bool:
    # torch.save writes a zip whose central directory comes last, so a file cut short (by a copy;
    # save's rename is atomic) fails this cheap check; a sharded directory is renamed into place
    # only once its manifest, written last, is whole.
    if is_file:
        return os.path.isfile(full) and zipfile.is_zipfile(full)
    manifest = os.path.join(full, _dcp.MANIFEST)
    return os.path.isdir(full) and os.path.isfile(manifest) and zipfile.is_zipfile(manifest)


def steps(directory: str | os.PathLike, /, *, prefix: str = "ckpt") -> list[tuple[int, str]]:
    """List the complete checkpoints in ``directory`` as ``(step, path)``, oldest step first.

    Counted are files named ``<prefix>-<digits>.pt`` that are whole zip archives and directories
    named ``<prefix>-<digits>`` that hold a whole sharded checkpoint's manifest. Temporaries of an
    interrupted write (``*.tmp-*``, files or directories) and truncated copies are skipped. A
    missing directory has no checkpoints.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> _ = save_step(d, 5, {"w": torch.ones(1)})
        >>> [s for s, _ in steps(d)]
        [5]
    """
    directory = os.fspath(directory)
    pattern = _step_name(prefix)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = pattern.fullmatch(name)
        if m and _complete(os.path.join(directory, name), is_file=m.group(2) is not None):
            found.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(found)


def latest(directory: str | os.PathLike, /, *, prefix: str = "ckpt") -> str | None:
    """Return the path of the newest complete checkpoint in ``directory``, or None if there is none.

    "Newest" means the highest step number in the name, not the modification time; temporaries of
    interrupted writes never count (see :func:`steps`). The path is a file or a sharded
    checkpoint's directory: :func:`load_step` reads either.

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


def _remove(path: str) -> None:
    """Delete an old checkpoint; a directory is renamed to a temporary name first, so that a kill
    mid-delete never leaves part of one under a step's name. One already gone is left alone."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            doomed = _temp.new_name(path)
            os.replace(path, doomed)
            with _temp.writing(doomed):  # not another save's to clean meanwhile
                shutil.rmtree(doomed)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass


def _prune(directory: str, path: str, step: int, prefix: str, keep: int | None) -> None:
    """Delete the series' checkpoints beyond the newest ``keep`` (and the other kind's of ``step``),
    after ``path`` is complete. Housekeeping: a failure is a warning, never the save's failure (the
    checkpoint is in place), and the next save tries again."""
    try:
        others = [(s, p) for s, p in steps(directory, prefix=prefix) if p != path]
        same = [p for s, p in others if s == step]  # the other kind's checkpoint of this step
        others = [(s, p) for s, p in others if s != step]
        doomed = same + ([p for _, p in others[: max(0, len(others) - (keep - 1))]] if keep is not None else [])
        for old in doomed:
            _remove(old)
    except Exception as e:  # noqa: BLE001 - housekeeping after a complete checkpoint (see the docstring)
        warnings.warn(
            f"fddp.checkpoint.save_step: {path} is saved, but removing older checkpoints of {directory} failed "
            f"({type(e).__name__}: {e}); the next save_step tries again",
            stacklevel=4,
        )


@_ranks.entry("checkpoint.save_step", together=lambda *args, barrier=True, **kwargs: barrier)
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

    Every kind of state goes through this one call:

    - a plain tree (replicated parameters, optimizer state, step counts, RNG states) is one file,
      ``<prefix>-<step:08d>.pt``, written by rank 0 of ``group`` (:func:`fddp.checkpoint.save`);
    - a tree holding :class:`fddp.zero.Sharded` parts (ZeRO stages 1 to 3) or
      :class:`fddp.checkpoint.PerRank` parts (DiLoCo's local state, a compressor's residuals:
      what differs per rank) is a sharded checkpoint, the directory ``<prefix>-<step:08d>``, every
      rank writing its own part (:func:`fddp.checkpoint.save_sharded`, which says what must be
      equal on every rank).

    Either is written under a temporary name and renamed into place once complete, so
    :func:`latest` never finds a half checkpoint. Older checkpoints of the series (either kind)
    are deleted only after the new one is in place, so a crash never leaves fewer than before.
    Pruning keeps the checkpoint just written plus the ``keep - 1`` highest other steps. If higher
    steps exist (say, from an abandoned earlier run in the same directory) they count among those
    and :func:`latest` keeps returning them; clear the directory when restarting from an older
    step. A step saved again replaces the earlier one of that step: a file atomically; a sharded
    directory by moving the old one aside, then the new one into place (a kill between those two
    renames leaves the step missing and the previous steps intact).

    Before writing, rank 0 deletes the temporaries of this series (``<prefix>-<step>[.pt].tmp-*``)
    that a killed earlier write left behind, but only those provably abandoned: written on this
    host by a process that is no longer running (or by this process, by no write still under way).
    A temporary written from another host or container is never deleted automatically, since its
    writer may still be running there; one older than an hour draws a warning with the command to
    delete it by hand once no job writes to ``directory`` (``rm -r <directory>/<prefix>-*.tmp-*``).

    A directory has one writer at a time: the first ``save_step`` of a process into ``directory``
    takes a lock there (``.fddp-writer.lock``, naming the host, the process and the job), kept until
    the process exits, so that a second job's ``save_step`` into the same directory (which would
    delete this job's checkpoints as its own old ones) fails with an error naming the first job.
    A lock whose process is no longer running on this host, or that an earlier run of this same
    job left (``TORCHELASTIC_RUN_ID`` / ``SLURM_JOB_ID``), is taken over with a warning; one
    held from another host by another job is the error, which says how to remove it by hand once no
    job writes the directory.

    Inside a process, a series (``directory`` and ``prefix``) has one writer too: the first
    ``save_step`` of a series claims it for its ``group`` for as long as the group exists (a
    :class:`fddp.checkpoint.Manager` claims its series from when it is made until it closes). A
    ``save_step`` or a Manager with another group on that series is a :class:`CheckpointError`
    naming both, since the two would overwrite each other's checkpoint of a step and prune each
    other's; another ``prefix`` or directory keeps them apart.

    Pruning is housekeeping after the checkpoint is complete: if it fails (a permission, a file
    system error), ``save_step`` warns and returns the new checkpoint, which loads; the next save
    prunes again.

    Every rank of ``group`` calls ``save_step`` and, by default, returns only once the new
    checkpoint is in place and the old ones are pruned, so :func:`latest` then finds it on every
    rank, and :func:`load_step` reads it back. With the default ``barrier`` the call is one fddp
    call on ``group``: a failure on any rank (rank 0's write, a tree that one rank cannot save)
    raises there and :class:`fddp.PeerError` on every other rank, naming it, within a moment.

    Args:
        directory: where checkpoints live; created if missing.
        step: training step, used in the name (see :func:`step_path`).
        tree: the pytree to save.
        keep: how many checkpoints to keep (>= 1), or None to keep all.
        prefix: name prefix.
        group: process group whose rank 0 writes and prunes (for sharded parts: the group they are
            sharded over; per-rank parts: the ranks that each save their own).
        barrier: wait until rank 0 has written (see :func:`fddp.checkpoint.save`); True by default
            here. With False, the other ranks return at once, and may still find the previous
            checkpoint. A sharded checkpoint always waits (every rank writes), so False is refused.

    Returns:
        The path of the checkpoint, a file or a directory (on every rank).

    Raises:
        OSError: on rank 0, the file cannot be written (a full disk says so).
        CheckpointError: on rank 0, another job writes ``directory`` (naming it); on every rank,
            another process group's saves or Manager in this process write this series (naming it).
        fddp.PeerError: on the other ranks (with ``barrier``), rank 0 failed (its error named).
        fddp.MismatchError: a sharded checkpoint whose trees differ across ranks, or whose values
            stored once differ (see :func:`fddp.checkpoint.save_sharded`).
        RuntimeError: with ``barrier``, a peer did not arrive within the process group's timeout
            (say, a rank that skipped this call); the message names the rank and the call.

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
    sharded = _is_sharded(tree)
    if sharded and not barrier:
        raise ValueError(
            "fddp.checkpoint.save_step: barrier=False does not apply to a tree with fddp.zero.Sharded or PerRank "
            "parts: every rank writes its own part and returns once the checkpoint is complete"
        )
    if barrier:
        # An NCCL group's known calls are checked a step late: make and read that check first, so
        # that no checkpoint holds a step whose ranks differed (free elsewhere).
        _dist.settle("checkpoint.save_step", final=True)
    path = step_path(directory, step, prefix=prefix, sharded=sharded)
    belongs = _step_name(prefix).fullmatch
    directory = os.fspath(directory)
    _series.claim(directory, prefix, group, f"fddp.checkpoint.save_step({directory!r}, prefix={prefix!r})")

    def prune() -> None:
        _prune(directory, path, step, prefix, keep)

    def take() -> None:
        _lock.hold(directory, "checkpoint.save_step")

    if sharded:
        write_sharded(os.path.abspath(path), tree, group, "checkpoint.save_step", belongs, before=take, after=prune)
        return path
    if _ranks.is_writer(group):
        take()
        _single.write(path, tree, belongs)
        prune()
    if barrier:
        _ranks.barrier(path, group, "checkpoint.save_step")
    return path


@_ranks.entry("checkpoint.load_step", together=lambda path, *args, **kwargs: os.path.isdir(path))
def load_step(
    path: str | os.PathLike,
    /,
    like: Any = None,
    *,
    group: dist.ProcessGroup | None = None,
    map_location: Any = "cpu",
) -> Any:
    """Read a checkpoint that :func:`save_step` wrote, of either kind (what :func:`latest` returns).

    A file is read with :func:`fddp.checkpoint.load` (any rank may call it, alone); a sharded
    checkpoint's directory with :func:`fddp.checkpoint.load_sharded` (every rank of ``group``
    calls it, as one fddp call: a rank that fails raises, its peers :class:`fddp.PeerError`;
    ``like`` is required, and each :class:`fddp.checkpoint.PerRank` part of it comes back as this
    rank's own tree).

    Args:
        path: a checkpoint's file or directory.
        like: the expected tree (see :func:`fddp.checkpoint.load`, :func:`fddp.checkpoint.load_sharded`).
        group: for a sharded checkpoint, the process group ``like``'s parts were made on.
        map_location: for a file, where tensors land before any move to ``like``.

    Returns:
        The tree.

    Raises:
        CheckpointError: the checkpoint is damaged, incomplete or does not match ``like``.
        FileNotFoundError: nothing at ``path``.

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> state = {"w": torch.ones(2), "step": 3}
        >>> _ = save_step(d, 3, state)
        >>> load_step(latest(d), like=state)["step"]
        3
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        if like is None:
            raise TypeError("fddp.checkpoint.load_step: a sharded checkpoint needs `like` (the tree to fill, with this run's shards)")
        return load_sharded(path, like, group=group)
    return _single.load(path, like, map_location=map_location)
