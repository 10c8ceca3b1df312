"""Checkpoints of sharded and per-rank trees with torch.distributed.checkpoint (DCP): per-rank files
that reshard, keyed as DCP keys a module's state dict.

Every leaf is stored whole under its own key, the leaf's path joined with dots the way DCP
flattens a nested state dict: ``params.0.weight`` for the leaf at ``{"params": {"0.weight": w}}``,
and for a tree that *is* a module's parameters (``fddp.zero.shard(params)``, ``fully_shard``'s
shards), exactly the module's parameter names, what
``torch.distributed.checkpoint.state_dict.get_model_state_dict`` writes. Each leaf keeps its own
shape; each rank writes the pieces its shards hold (:mod:`fddp.checkpoint._pieces`). Neither the
world size nor the bucket plan appears in the keys, so a checkpoint saved on 4 ranks loads on 2,
on 1, into a replicated tree, or with ``dcp.load`` into a module; and a checkpoint that DCP wrote
from a module's state dict loads into fddp's shards.

Three kinds of leaf:

- parts of a :class:`fddp.zero.Sharded` tree: each rank writes its pieces;
- other tensors and Python values, *replicated*: they must be equal on every rank (checked at
  save: a value that differs is a :class:`fddp.MismatchError` on every rank) and one copy is stored;
- leaves inside :class:`PerRank`: every rank's own copy is stored (under ``__rank<r>__.<key>``) and
  each rank loads its own back, on as many ranks as saved.

The ranks first agree on the tree's structure (every leaf's path, kind, shape and dtype, in the
call's header), so a leaf that only one rank has is a :class:`fddp.MismatchError`, never a leaf
silently left out. Python values go into a small manifest (:mod:`fddp.checkpoint._codec`'s format)
with every leaf's shape and dtype and a CRC-32 of every piece as stored (:mod:`fddp.checkpoint._dcp`),
verified as it is read back.

Atomic: every rank writes into ``<directory>.tmp-<host id>-<pid>-<random>`` (rank 0's name, see
:mod:`fddp.checkpoint._temp`); once DCP's last collective has returned (its ``.metadata`` is
written), rank 0 adds the manifest and renames the directory into place.
"""

from __future__ import annotations

import os
import shutil
import zlib
from typing import Any, Callable, NamedTuple

import optree
import torch
import torch.distributed as dist

from fddp import _dist
from fddp._dist import MismatchError
from fddp._tree import article, path_str
from fddp.checkpoint import _codec, _dcp, _ranks, _temp
from fddp.checkpoint._codec import PRIMITIVES, CheckpointError
from fddp.checkpoint._dcp import dcp
from fddp.checkpoint._pieces import Pieces
from fddp.zero import _layout as _shard

__all__ = ["PerRank", "load_sharded", "save_sharded", "write_sharded"]

_FORMAT = "fddp-sharded-checkpoint"
_VERSION = 2  # 1: keys are fddp paths (params/w), every leaf stored flat; read still
_RANK_PREFIX = "__rank{rank}__."

try:
    from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
except ImportError:  # pragma: no cover - builds without torch.distributed
    _CheckpointException = Exception


class PerRank:
    """Mark a subtree whose values differ from rank to rank, so that every rank's copy is saved.

    A sharded checkpoint stores one copy of every tensor and Python value that is not sharded, and
    refuses values that differ across ranks (:class:`fddp.MismatchError`). Wrap what each rank
    holds for itself in ``PerRank``: DiLoCo's parameters and inner optimizer state between
    synchronisations, a compressor's residuals (``fddp.PowerSGD``, ``fddp.Int8``), a rank's own RNG
    state. :func:`save_sharded` and :func:`fddp.checkpoint.save_step` then store each rank's copy,
    and :func:`load_sharded` / :func:`fddp.checkpoint.load_step` give each rank its own back, on as
    many ranks as saved it, in place of the ``PerRank`` (the result holds the tree, unwrapped). The
    tree's structure, shapes and dtypes must be the same on every rank; no one-rank process groups
    are needed.

    Args:
        tree: nested dicts, lists, tuples, NamedTuples and registered pytree containers (a
            ``TensorDict``) of tensors and Python scalars (no
            :class:`fddp.zero.Sharded` parts: they are per-rank already).

    Example:
        >>> state = {"outer": outer_state, "local": fddp.checkpoint.PerRank({"params": params, "inner": inner_state})}
        >>> fddp.checkpoint.save_step("runs/diloco", step, state, keep=2)  # every rank calls it
        >>> state = fddp.checkpoint.load_step(fddp.checkpoint.latest("runs/diloco"), like=state)
        >>> params, inner_state = state["local"]["params"], state["local"]["inner"]  # this rank's
    """

    __slots__ = ("tree",)

    def __init__(self, tree: Any, /) -> None:
        self.tree = tree

    def __repr__(self) -> str:
        return f"PerRank({self.tree!r})"


class _Keys(NamedTuple):
    """How leaves are keyed and laid out in DCP: ``sep`` joins a path, ``flat`` stores leaves 1-D."""

    sep: str
    flat: bool

    def join(self, parts: tuple) -> str:
        return self.sep.join(map(str, parts)) if parts else "<root>"


_V2 = _Keys(".", False)
_V1 = _Keys("/", True)


class _Entry(NamedTuple):
    """One leaf as stored: its fddp path (for messages), its DCP key (without a rank prefix), its
    kind (``tensor``, ``sharded`` or ``scalar``), whether it is per-rank, shape and dtype (tensors),
    and the object DCP writes or reads (a tensor, :class:`Pieces`), or the Python value."""

    path: str
    key: str
    kind: str
    per_rank: bool
    shape: tuple | None
    dtype: torch.dtype | None
    value: Any

    def where(self) -> str:
        return f"{self.path!r}" if self.key == self.path else f"{self.path!r} (key {self.key!r})"


class _Group(NamedTuple):
    """A :class:`PerRank` part, rebuilt: its tree's structure and leaves."""

    spec: optree.PyTreeSpec
    leaves: list


def _parts(accessor: Any) -> tuple:
    """A leaf's path as plain keys: dict keys, NamedTuple field names, sequence indices."""
    return tuple(getattr(e, "field", None) or getattr(e, "entry", e) for e in accessor)


def _flatten(tree: Any) -> tuple[list, optree.PyTreeSpec, list[tuple]]:
    leaves, spec = optree.tree_flatten(tree, is_leaf=lambda x: isinstance(x, (_shard.Sharded, PerRank)), none_is_leaf=True)
    return leaves, spec, [_parts(a) for a in spec.accessors()]


def _leaf_specs(lay: _shard.ShardLayout) -> list[tuple[tuple[int, ...], torch.dtype, torch.device]]:
    specs: list[Any] = [None] * lay.plan.num_leaves
    for b in lay.plan.buckets:
        for i, shape in zip(b.indices, b.shapes):
            specs[i] = (tuple(shape), b.dtype, b.device)
    return specs


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _entries(tree: Any, keys: _Keys, what: str, fresh: bool) -> tuple[list[_Entry], Callable[[Callable[[_Entry], Any]], Any]]:
    """Describe ``tree``'s leaves for DCP; also return ``rebuild(value_of)``, the tree again.

    With ``fresh`` (loading), tensors and shards are new zeroed buffers that DCP reads into;
    ``rebuild`` puts them back into ``tree``'s structure, each Python value as ``value_of(entry)``
    gives it, and every :class:`PerRank` unwrapped.
    """
    entries: list[_Entry] = []

    def leaf(parts: tuple, x: Any, per_rank: bool) -> Any:
        path = path_str(parts)
        if isinstance(x, _shard.Sharded):
            if per_rank:
                raise TypeError(
                    f"fddp.checkpoint.{what}: a fddp.zero.Sharded tree at {path!r} is inside PerRank; shards are per-rank already"
                )
            lay = x.layout
            lay.check_group(what)
            shards = _shard.new_shards(lay) if fresh else list(x.shards)
            inner = [_parts(a) for a in lay.spec.accessors()]
            for q, (shape, dtype, device), pieces in zip(inner, _leaf_specs(lay), _shard.leaf_pieces(lay)):
                held = [(a, shards[k][s : s + n]) for k, a, s, n in pieces]
                stored = (_numel(shape),) if keys.flat else shape
                full = parts + q
                entries.append(_Entry(path_str(full), keys.join(full), "sharded", False, shape, dtype, Pieces(stored, held, dtype, device)))
            return _shard.Sharded(shards, lay)
        if isinstance(x, torch.Tensor):
            t = torch.zeros_like(x, memory_format=torch.contiguous_format) if fresh else x.detach().contiguous()
            entries.append(_Entry(path, keys.join(parts), "tensor", per_rank, tuple(x.shape), x.dtype, t.reshape(-1) if keys.flat else t))
            return t
        if type(x) in PRIMITIVES:
            entry = _Entry(path, keys.join(parts), "scalar", per_rank, None, None, x)
            entries.append(entry)
            return entry  # a placeholder: rebuild asks value_of for it
        raise TypeError(
            f"fddp.checkpoint.{what}: leaf at {path!r} has unsupported type {type(x).__qualname__}; expected tensors, "
            "fddp.zero.Sharded trees, fddp.checkpoint.PerRank parts and Python scalars inside dicts, lists, tuples, NamedTuples "
            "and containers registered as pytree nodes"
        )

    leaves, spec, paths = _flatten(tree)
    out: list[Any] = []
    for parts, x in zip(paths, leaves):
        if isinstance(x, PerRank):
            inner, inner_spec, inner_paths = _flatten(x.tree)
            if any(isinstance(y, PerRank) for y in inner):
                raise TypeError(f"fddp.checkpoint.{what}: PerRank inside PerRank at {path_str(parts)!r}")
            out.append(_Group(inner_spec, [leaf(parts + q, y, True) for q, y in zip(inner_paths, inner)]))
        else:
            out.append(leaf(parts, x, False))

    def rebuild(value_of: Callable[[_Entry], Any]) -> Any:
        def fill(x: Any) -> Any:
            return value_of(x) if isinstance(x, _Entry) else x

        done = [optree.tree_unflatten(x.spec, [fill(y) for y in x.leaves]) if isinstance(x, _Group) else fill(x) for x in out]
        return optree.tree_unflatten(spec, done)

    return entries, rebuild


def _dcp_key(e: _Entry, rank: int) -> str:
    return _RANK_PREFIX.format(rank=rank) + e.key if e.per_rank else e.key


def _rows(entries: list[_Entry]) -> list[tuple]:
    """The structure the ranks must agree on before saving: every leaf's path, kind, shape and dtype."""
    rows = []
    for e in entries:
        kind = ("per-rank " if e.per_rank else "") + (e.kind if e.kind != "scalar" else type(e.value).__name__)
        shape = "" if e.shape is None else f" shape={e.shape} dtype={e.dtype}"
        rows.append((e.path, kind + shape, None))
    return rows


def _checked(entries: list[_Entry]) -> list[_Entry]:
    """The entries stored once, whose values must be equal on every rank."""
    return [e for e in entries if not e.per_rank and e.kind != "sharded"]


def _crc(e: _Entry) -> int:
    if e.kind == "scalar":
        return zlib.crc32(repr((type(e.value).__name__, e.value)).encode())
    return zlib.crc32(repr(_codec.crc32s([_codec.tensor_bytes(e.value)])[0]).encode())


def _check_keys(entries: list[_Entry], what: str) -> None:
    seen: dict[str, str] = {}
    for e in entries:
        key = _dcp_key(e, 0)
        if key in seen:
            raise ValueError(f"fddp.checkpoint.{what}: leaves {seen[key]!r} and {e.path!r} would both be stored as {key!r}; rename a key")
        if not e.per_rank and e.key.startswith("__rank"):
            raise ValueError(f"fddp.checkpoint.{what}: the key {e.key!r} (leaf {e.path!r}) starts with '__rank', which per-rank state uses")
        seen[key] = e.path


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------


@_ranks.entry("checkpoint.save_sharded")
def save_sharded(directory: str | os.PathLike, tree: Any, /, *, group: dist.ProcessGroup | None = None) -> str:
    """Write a tree holding :class:`fddp.zero.Sharded` parts into ``directory``, every rank its own pieces.

    The format is torch.distributed.checkpoint's (DCP): one file per rank plus a ``.metadata``
    index, and a small ``fddp-manifest.pt`` (the format of :func:`save`) holding the Python scalars,
    every leaf's shape and dtype, and a CRC-32 of every piece as stored, which
    :func:`load_sharded` verifies. Each leaf is stored whole, in its own shape, under its path
    joined with dots, as DCP keys a nested state dict (``opt.exp_avg.0.weight``); a tree that is a
    module's parameters (``fddp.zero.shard(params)``, ``fully_shard``'s shards) is keyed by the
    module's parameter names, so ``torch.distributed.checkpoint.load`` reads it into
    ``get_model_state_dict(model)`` as it reads torchtitan's. Nothing in the checkpoint depends on
    the world size or the bucket plan: :func:`load_sharded` reads it back on any number of ranks,
    resharding, or into a replicated tree.

    Tensors and Python values that are not sharded are stored once and must be equal on every rank
    (compared bitwise, at the cost of a CRC-32 of them on every rank): a value that differs is a
    :class:`fddp.MismatchError` on every rank, before anything is written. Wrap state that differs
    per rank in :class:`PerRank` to store every rank's copy. The ranks agree on the tree's
    structure first: a leaf that one rank has and another lacks is a :class:`fddp.MismatchError`
    too.

    Atomic: the ranks write into ``<directory>.tmp-<host id>-<pid>-<random>`` and rank 0 renames it
    to ``directory`` once everything is written, so ``directory`` either does not exist or is
    complete. An existing ``directory`` is never overwritten (:class:`FileExistsError`): write
    each checkpoint to a new one, or let :func:`fddp.checkpoint.save_step` name, rotate and replace
    them. Every rank of ``group`` must call this.

    A save killed before the rename (``SIGKILL``, a lost node) leaves its temporary directory, as
    large as the checkpoint. The next ``save_sharded`` to the same ``directory`` (say, the same
    step, reached again after resuming from an older checkpoint) deletes it on rank 0 if it is
    provably abandoned: created on rank 0's host by a process that is no longer running. One made
    from another host or container is never deleted automatically (its writer may be alive there);
    delete such leftovers by hand once no job writes to them: ``rm -r <directory>.tmp-*``. A save
    that fails with an exception removes its temporary itself.

    The call is one fddp call on ``group``: a rank that fails before the ranks' agreement (rank 0
    cleaning up, a tree one rank cannot save) raises its error and every other rank
    :class:`fddp.PeerError` naming it, within a moment; a failure while writing reaches every rank
    through the barrier that ends the save.

    Args:
        directory: the checkpoint directory to create (on a file system every rank sees).
        tree: nested dicts, lists, tuples, NamedTuples and registered pytree containers of :class:`fddp.zero.Sharded` trees,
            :class:`PerRank` parts, tensors and Python scalars: say ``{"params": shards, "opt":
            opt_state, "step": step}``.
        group: the process group the tree is sharded over; ``None`` for the default group.
            Without an initialised process group, one process writes everything.

    Returns:
        ``directory`` (absolute), on every rank.

    Raises:
        FileExistsError: ``directory`` exists (on every rank, before any rank writes).
        fddp.MismatchError: on every rank, the ranks' trees differ in structure, or a value that is
            stored once differs across ranks (naming the first such leaf).
        RuntimeError: a sharded part was made for another world size or rank; or a peer did not
            arrive within the process group's timeout.
        CheckpointError: on the other ranks, rank 0 failed to finish the checkpoint (its own
            error says why); on every rank, a rank's write failed inside
            torch.distributed.checkpoint (a full disk there: the message names the ranks and the
            first one's error).
        fddp.PeerError: a peer failed before the ranks agreed (its error named).

    Example:
        >>> fddp.checkpoint.save_sharded(f"ckpt/step-{step:08d}", {"params": shards, "opt": opt_state, "step": step})
    """
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory):  # every rank sees the same file system: all raise, no one waits
        raise FileExistsError(
            f"fddp.checkpoint.save_sharded: {directory} exists; sharded checkpoints are never overwritten "
            "(write each to a new directory, e.g. one per step, or use fddp.checkpoint.save_step, which rotates them)"
        )
    name = os.path.basename(directory)
    return write_sharded(directory, tree, group, "checkpoint.save_sharded", lambda base: base == name)


def write_sharded(
    directory: str,
    tree: Any,
    group: dist.ProcessGroup | None,
    what: str,
    belongs: Callable[[str], Any],
    before: Callable[[], None] | None = None,
    after: Callable[[], None] | None = None,
) -> str:
    """:func:`save_sharded`'s write, which replaces an existing ``directory``.

    ``before()`` runs on rank 0 first (:func:`fddp.checkpoint.save_step` takes the directory's
    lock); ``belongs(name)`` says which destinations' abandoned temporaries rank 0 deletes next.
    ``after()`` runs on rank 0 once the checkpoint is in place, before the ranks learn the outcome
    (:func:`fddp.checkpoint.save_step` prunes old steps there): housekeeping that must not raise.

    An existing ``directory`` is first renamed to a temporary name, then the new one into place:
    a kill between the two renames leaves no ``directory`` but both complete ones (the old under
    its temporary name, deleted by the next save).
    """
    if dcp is None:  # pragma: no cover
        raise RuntimeError("fddp.checkpoint.save_sharded needs torch.distributed.checkpoint")
    rank, world = _ranks.rank(group), _ranks.world_size(group)
    entries, _ = _entries(tree, _V2, what.rpartition(".")[2], fresh=False)
    checked = _checked(entries)
    crcs = [_crc(e) for e in checked]
    parent = os.path.dirname(directory)
    if rank == 0:
        # Before the ranks agree: an exception here (a held lock, an OSError cleaning up) is
        # announced by the call scope, and the peers raise PeerError at the agreement below.
        if before is not None:
            before()
        _temp.clean(parent, belongs)
    # One reduction (MAX) after the header that agrees on the structure: rank 0's name for the
    # temporary (host id, pid, random token; the others send 0), and each stored-once value's
    # CRC-32 and its negation: max == -max(-crc) exactly when every rank holds the same value.
    mine = [_temp.HOST_ID, os.getpid(), int.from_bytes(os.urandom(7), "big")] if rank == 0 else [0, 0, 0]
    doing = "agreeing on the temporary directory and on the values stored once"
    agreed = _ranks.agree(mine + crcs + [-c for c in crcs], group, what, doing, rows=_rows(entries), op="max")
    n = len(crcs)
    differ = [e for e, hi, neg in zip(checked, agreed[3 : 3 + n], agreed[3 + n :]) if hi != -neg]
    if differ:
        e = differ[0]
        more = f" ({len(differ) - 1} more leaves differ too)" if len(differ) > 1 else ""
        raise MismatchError(
            f"fddp.{what}: the ranks hold different values at {e.where()}{more}, which a sharded checkpoint stores once "
            "(it is neither sharded nor per-rank). Make it equal on every rank (fddp.broadcast it, or save it from the "
            "replicated state), or wrap state that differs per rank in fddp.checkpoint.PerRank(...) to store each "
            "rank's copy; nothing was written."
        )
    try:
        _check_keys(entries, what.rpartition(".")[2])
    except ValueError as e:  # decided from the agreed structure: every rank raises it alike
        raise _dist.collective(e) from None
    tmp = _temp.new_name(directory, *agreed[:3])
    state = {_dcp_key(e, rank): e.value for e in entries if e.kind != "scalar" and _numel(e.shape)}
    mine_scalars = {e.key: e.value for e in entries if e.kind == "scalar" and e.per_rank}
    error: BaseException | None = None
    complete = False
    with _temp.writing(tmp):
        try:
            dcp.save(state, storage_writer=_dcp.Writer(tmp, rank, mine_scalars), process_group=group, no_dist=not _ranks.is_distributed())
            if rank == 0:
                _finish(tmp, directory, entries, world)
                complete = True
        # DCP's CheckpointException is a BaseException (it holds every failed rank's error); an
        # interrupt is not caught: the process is going away, and the next save removes its temporary.
        except (Exception, _CheckpointException) as e:  # noqa: BLE001 - every rank learns below whether the checkpoint is complete
            error = e
        if complete and after is not None:
            after()  # the checkpoint is in place whatever this does
        (failed,) = _ranks.agree([error is not None], group, what, f"the barrier after writing {directory}")
    if failed:
        if rank == 0 and not complete:
            shutil.rmtree(tmp, ignore_errors=True)  # every rank is past its writes; never renamed, so still ours
        # Every rank raises, as the agreed count says: the group stays in step.
        if isinstance(error, _CheckpointException) and not isinstance(error, Exception):
            # DCP's aggregate is a BaseException (an `except Exception` would not see it); every
            # rank gets it alike, with each failed rank's error inside: say which, as load does.
            ranks = sorted(error.failures)
            first = error.failures[ranks[0]]
            first = first[0] if isinstance(first, tuple) else first
            raise _dist.collective(
                CheckpointError(
                    f"{directory}: not written: rank(s) {ranks} of the group failed to write it, rank {ranks[0]} with "
                    f"{type(first).__name__}: {first}; a checkpoint already there is kept"
                )
            ) from error
        if error is not None:
            raise _dist.collective(error)
        raise _dist.collective(
            CheckpointError(f"{directory}: not written: {failed} rank(s) of the group failed to write it (their own errors say why)")
        )
    return directory


def _finish(tmp: str, directory: str, entries: list[_Entry], world: int) -> None:
    """On rank 0, after DCP's save: write the manifest with every rank's checksums, rename into place."""
    sums: dict[str, dict[str, torch.Tensor]] = {}
    per_rank_scalars = []
    for r in range(world):
        part = os.path.join(tmp, _dcp.CHECKSUMS.format(rank=r))
        got = _dcp.read_file(part)
        sums.update(got["checksums"])
        per_rank_scalars.append(got["scalars"])
        os.remove(part)
    shared = [e for e in entries if not e.per_rank]
    mine = [e for e in entries if e.per_rank]
    manifest = {
        "format": _FORMAT,
        "version": _VERSION,
        "world_size": world,
        "tensors": {e.key: (list(e.shape), str(e.dtype)) for e in shared if e.kind != "scalar"},
        "scalars": {e.key: e.value for e in shared if e.kind == "scalar"},
        "per_rank": {"tensors": {e.key: (list(e.shape), str(e.dtype)) for e in mine if e.kind != "scalar"}, "scalars": per_rank_scalars},
        "checksums": sums,
        "metadata_crc32": _dcp.crc_of_file(os.path.join(tmp, ".metadata")),
    }
    _dcp.write_file(os.path.join(tmp, _dcp.MANIFEST), manifest)
    _codec.fsync_dir(tmp)
    old = None
    if os.path.isdir(directory):  # save_step replacing a step: move the old one aside first
        old = _temp.new_name(directory)
        os.replace(directory, old)
    try:
        os.replace(tmp, directory)
    except BaseException:
        if old is not None:  # the step is not lost to an exception: the old one goes back
            os.replace(old, directory)
        raise
    # Complete from here on: nothing below may fail the save.
    _codec.fsync_dir(os.path.dirname(directory))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@_ranks.entry("checkpoint.load_sharded")
def load_sharded(directory: str | os.PathLike, /, like: Any, *, group: dist.ProcessGroup | None = None) -> Any:
    """Read a sharded checkpoint into the shape of ``like``, on any world size.

    ``like`` says what to load and how it is cut here: make it as for a fresh start on the ranks
    that load, ``shards = fddp.zero.shard(params)`` and ``opt.init(shards)``, and every rank reads
    the pieces of the saved leaves that its new shards cover, whatever the world size at save. A
    replicated ``like`` (full trees, say on one process for evaluation) loads whole leaves. The
    structure, every leaf's shape and dtype, and every Python scalar's type must match; the first
    difference raises :class:`CheckpointError`. A :class:`PerRank` part of ``like`` reads this
    rank's own copy (the checkpoint must come from as many ranks) and comes back unwrapped.

    No code from the checkpoint runs: its manifest is read as :func:`load` reads a file, DCP's
    ``.metadata`` is checked against the CRC-32 the manifest holds before any of it is parsed, then
    unpickled with an exact list of DCP's metadata classes (by module and name; nothing else is
    imported), and every piece is checked as a file is (a zip whose pickle names only what a
    tensor needs) before DCP reads it, and against the CRC-32 saved for it, so a damaged file is
    an error naming the file and the leaf; DCP is never asked to unpickle an object. Checkpoints written
    before checksums existed load unverified, as do those written by torch.distributed.checkpoint
    itself (``dcp.save(get_model_state_dict(model))``, torchtitan): those have no manifest, the
    shapes and dtypes come from DCP's index, entries that ``like`` does not name are not read, and
    ``like`` may hold tensors only. Every rank of ``group`` must call this, as one fddp call: the
    ranks agree on ``like``'s structure and on the checkpoint they read (its ``.metadata``'s CRC-32)
    before DCP reads, so a rank that failed its own checks raises and its peers raise
    :class:`fddp.PeerError` naming it, and ranks that read different checkpoints or trees raise
    :class:`fddp.MismatchError`.

    Args:
        directory: a directory written by :func:`save_sharded` (or :func:`fddp.checkpoint.save_step`),
            or by torch.distributed.checkpoint.
        like: the tree to fill, e.g. ``{"params": shards, "opt": opt.init(shards), "step": 0}``; its
            values are not used, only its structure, layouts, dtypes and devices.
        group: the process group ``like``'s shards were made on; ``None`` for the default group.

    Returns:
        A tree like ``like`` holding the checkpoint's values (new tensors; ``like`` is not modified),
        each :class:`PerRank` replaced by the tree it wraps.

    Raises:
        CheckpointError: ``directory`` is not a complete sharded checkpoint, is damaged, does not
            match ``like``, holds anything but tensors, or DCP cannot read it (the message says why).

    Example:
        >>> shards = fddp.zero.shard(params)  # on the new number of ranks
        >>> like = {"params": shards, "opt": opt.init(shards), "step": 0}
        >>> state = fddp.checkpoint.load_sharded("ckpt/step-00001000", like)
        >>> params = fddp.zero.gather(state["params"]).wait()
    """
    if dcp is None:  # pragma: no cover
        raise RuntimeError("fddp.checkpoint.load_sharded needs torch.distributed.checkpoint")
    directory = os.fspath(directory)
    manifest = _read_manifest(directory)
    metadata = None
    if manifest is None:  # written by DCP itself: no manifest, no checksums, no Python values
        metadata = _dcp.read_metadata(directory, None, tensors_only=False)
    saved = _foreign(metadata) if manifest is None else manifest
    rank, world = _ranks.rank(group), _ranks.world_size(group)
    entries, rebuild = _entries(like, _V1 if saved["version"] == 1 else _V2, "load_sharded", fresh=True)
    _check_against(directory, saved, entries, rank, world, foreign=manifest is None)
    if metadata is None:
        metadata = _dcp.read_metadata(directory, manifest.get("metadata_crc32"), tensors_only=True)
    # Every rank has checked what it reads before DCP's collectives start: one that failed above
    # announced it in place of this header (its peers raise PeerError here, not in DCP's gathers).
    read = ("checkpoint", f".metadata CRC-32 {_dcp.crc_of_file(os.path.join(directory, '.metadata')):#010x}", None)
    _ranks.agree([], group, "checkpoint.load_sharded", f"reading {directory}", rows=[*_rows(entries), read])
    state = {_dcp_key(e, rank): e.value for e in entries if e.kind != "scalar" and _numel(e.shape)}
    reader = _dcp.Reader(directory, None if manifest is None else manifest.get("checksums"), metadata)
    try:
        dcp.load(state, storage_reader=reader, process_group=group, no_dist=not _ranks.is_distributed())
    except _CheckpointException as e:  # a BaseException, with every failed rank's error inside: every rank raises alike
        first = next(iter(e.failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, CheckpointError):
            raise _dist.collective(CheckpointError(str(first))) from None
        raise _dist.collective(
            CheckpointError(f"{directory}: torch.distributed.checkpoint could not load it: {type(first).__name__}: {first}")
        ) from None
    except CheckpointError:
        raise
    except Exception as e:  # DCP's own checks, before its collectives (sizes, missing keys)
        raise CheckpointError(f"{directory}: torch.distributed.checkpoint could not load it: {type(e).__name__}: {e}") from None
    shared, mine = saved["scalars"], (saved.get("per_rank") or {}).get("scalars")
    return rebuild(lambda e: mine[rank][e.key] if e.per_rank else shared[e.key])


def _read_manifest(directory: str) -> dict | None:
    """fddp's manifest of ``directory``; None for a checkpoint of DCP's own (no manifest, a ``.metadata``)."""
    path = os.path.join(directory, _dcp.MANIFEST)
    if not os.path.isfile(path):
        if os.path.isfile(os.path.join(directory, ".metadata")):
            return None
        raise CheckpointError(f"{directory}: not a sharded checkpoint (no {_dcp.MANIFEST}, no DCP .metadata; is the save complete?)")
    manifest = _dcp.read_file(path)
    if not (isinstance(manifest, dict) and manifest.get("format") == _FORMAT):
        raise CheckpointError(f"{path}: not an fddp sharded-checkpoint manifest")
    if manifest.get("version") not in (1, _VERSION):
        raise CheckpointError(f"{path}: version {manifest.get('version')!r}; this fddp reads versions 1 and {_VERSION}")
    tables = [manifest.get("tensors"), manifest.get("scalars")]
    per_rank = manifest.get("per_rank")
    if per_rank is not None:
        tables += [per_rank.get("tensors"), per_rank.get("scalars")] if isinstance(per_rank, dict) else [None]
    if not all(isinstance(t, (dict, list)) for t in tables):
        raise CheckpointError(f"{path}: corrupt manifest (its tables of tensors and Python values are missing)")
    return manifest


def _foreign(metadata: Any) -> dict:
    """A manifest's view of a checkpoint that DCP wrote: its tensors' shapes and dtypes, no Python values."""
    tensors, others = {}, set()
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensors[key] = (list(md.size), str(md.properties.dtype))
        else:
            others.add(key)
    return {"version": _VERSION, "tensors": tensors, "scalars": {}, "others": others}


def _check_against(directory: str, saved: dict, entries: list[_Entry], rank: int, world: int, foreign: bool) -> None:
    """Raise at the first leaf where ``like`` (its entries) and the checkpoint differ."""

    def mismatch(e: _Entry, expected: str, found: str) -> CheckpointError:
        return CheckpointError(f"{directory}: checkpoint does not match `like` at {e.where()}: expected {expected}, found {found}")

    per_rank = saved.get("per_rank") or {"tensors": {}, "scalars": []}
    for e in entries:
        if e.per_rank:
            saved_by = saved.get("world_size")
            if len(per_rank["scalars"]) != world or saved_by != world:
                held = f"{saved_by} ranks' own state" if per_rank["tensors"] or any(per_rank["scalars"]) else "no per-rank state"
                raise CheckpointError(
                    f"{directory}: `like` has per-rank state at {e.where()}, and the checkpoint holds {held}; per-rank "
                    f"state loads on as many ranks as saved it (each rank reads its own), and this group has {world}"
                )
            tensors, scalars = per_rank["tensors"], per_rank["scalars"][rank]
        else:
            tensors, scalars = saved["tensors"], saved["scalars"]
        if e.kind == "scalar":
            if e.key not in scalars:
                pickled = e.key in saved.get("others", ())
                found = "a pickled object, which fddp does not load (it could run code)" if pickled else "no such key"
                raise mismatch(e, article(type(e.value).__name__), found)
            if type(scalars[e.key]) is not type(e.value):
                raise mismatch(e, article(type(e.value).__name__), f"{type(scalars[e.key]).__name__} {scalars[e.key]!r}")
            continue
        expected = f"shape {e.shape} and dtype {e.dtype}"
        if e.key not in tensors:
            among = f" (the checkpoint has {len(tensors)} tensors)" if foreign else ""
            raise mismatch(e, f"a tensor of {expected}", "no such key" + among)
        shape, dtype = tensors[e.key]
        if tuple(shape) != tuple(e.shape) or dtype != str(e.dtype):
            raise mismatch(e, expected, f"shape {tuple(shape)} and dtype {dtype}")
    if foreign:
        return  # other tools' checkpoints hold more (an optimizer's, a data loader's state): not read
    for name, table, mine in (
        ("", saved["tensors"], {e.key for e in entries if not e.per_rank and e.kind != "scalar"}),
        ("", saved["scalars"], {e.key for e in entries if not e.per_rank and e.kind == "scalar"}),
        ("per-rank ", per_rank["tensors"], {e.key for e in entries if e.per_rank and e.kind != "scalar"}),
        ("per-rank ", per_rank["scalars"][0] if per_rank["scalars"] else {}, {e.key for e in entries if e.per_rank and e.kind == "scalar"}),
    ):
        extra = [k for k in table if k not in mine]
        if extra:
            raise CheckpointError(f"{directory}: checkpoint does not match `like`: it holds {name}{extra[0]!r}, which `like` lacks")
