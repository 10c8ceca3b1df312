"""Save and load pytrees of tensors: atomic writes, code-free and verified loads, one API for every kind of state.

Three kinds of state, one rotation API (:func:`save_step`, :func:`latest`, :func:`steps`,
:func:`load_step`, ``keep=``):

- **Replicated** trees (parameters, optimizer state, step counts, RNG states, the same on every
  rank) are one file, written by rank 0: :func:`save` / :func:`load`.
- **Sharded** trees (:mod:`fddp.zero`'s ``Sharded`` parts, stages 1 to 3) are a directory in
  torch.distributed.checkpoint's format, every rank writing its pieces, readable on any number of
  ranks: :func:`save_sharded` / :func:`load_sharded`. Leaves are keyed as DCP keys a module's
  state dict (``params.0.weight``; a tree of a module's parameters by their own names), so
  ``torch.distributed.checkpoint.load`` reads them into a module and :func:`load_sharded` reads
  checkpoints DCP wrote.
- **Per-rank** state (DiLoCo's local parameters and inner optimizer state, a compressor's
  residuals) is wrapped in :class:`PerRank` inside a sharded checkpoint: each rank stores and
  loads its own copy, with no process groups to build.

A single-file checkpoint is one ``torch.save`` file holding only plain data: a dict with the
leaves (tensors and Python scalars) in depth-first order, each leaf's path (``params/w``), CRC-32s
of every tensor's bytes (one per 4 MiB), and the tree's structure described with tuples, strings
and ints. Nothing in it names a Python class, so it loads with ``torch.load(..., weights_only=True)``,
after fddp's own checks that run nothing: the file must be a zip whose pickle passes its CRC-32 and
names only the globals a tensor needs (an exact list, :mod:`fddp.checkpoint._pickles`), so a file
that would need to run code is refused unread. A file that was cut short or changed on disk
after the write is an error naming the file and the damaged leaf, never a silently different value.

Supported trees are nested ``dict`` (and ``OrderedDict``), ``list``, ``tuple`` and ``NamedTuple``
(optimizer states) nodes, with leaves that are tensors or ``int``, ``float``, ``complex``, ``bool``,
``str``, ``bytes`` or ``None`` (a step count, ``torch.get_rng_state()``, ``random.getstate()``).
Other dict subclasses are saved as dicts, other tuple/list subclasses as tuples/lists; subclasses
of the scalar types (numpy scalars, enums) are refused at save time, since loading them would need
their class. Tensors are stored on the CPU.

Writes are atomic: a checkpoint is written next to its destination under a temporary name,
flushed, fsynced and renamed over the destination, then the directory is fsynced. A writer killed
at any moment leaves either the old checkpoint or the new one, never a torn one; its temporary
(``<name>.tmp-<host id>-<pid>-<random>``) is deleted by the next save of the same destination once
it is provably abandoned (see :func:`save_step` for the rule).

Checkpoints of a run live in one directory as ``<prefix>-<step:08d>.pt`` (a file) or
``<prefix>-<step:08d>`` (a sharded checkpoint); :func:`save_step` writes one of the right kind and
keeps only the newest few, :func:`latest` finds the newest, :func:`steps` lists them all,
:func:`load_step` reads either kind. The first :func:`save_step` of a job into a directory takes
its lock (``.fddp-writer.lock``): a second job that would rotate the same checkpoints is refused,
naming the first. Inside a process, a series (directory and prefix) belongs to one process group
(a :class:`Manager` until it closes): another group's ``save_step`` or Manager on it is refused,
naming both.

A run that may be preempted saves through a :class:`Manager`: every few steps (optionally on a
background thread), and at the next step boundary on every rank together once any rank gets
``SIGTERM`` or ``SIGINT`` (repeats of a signal within its grace period are one request: SLURM and
torchrun's agent each deliver one preemption).

Every function that more than one rank calls together (``save`` and ``save_step`` with their
barrier, ``save_sharded``, ``load_sharded``, ``load_step`` of a directory) is one fddp call: a
failure on one rank raises there and :class:`fddp.PeerError` on its peers, within a moment.

Example:
    >>> import tempfile, torch, fddp.checkpoint as ckpt
    >>> d = tempfile.mkdtemp()
    >>> state = {"params": {"w": torch.ones(2)}, "step": 10}
    >>> _ = ckpt.save_step(d, 10, state, keep=3)
    >>> ckpt.load_step(ckpt.latest(d), like=state)["step"]
    10
"""

from fddp.checkpoint._codec import CheckpointError
from fddp.checkpoint._manager import Manager
from fddp.checkpoint._sharded import PerRank, load_sharded, save_sharded
from fddp.checkpoint._single import load, save
from fddp.checkpoint._steps import latest, load_step, save_step, step_path, steps

__all__ = [
    "CheckpointError",
    "Manager",
    "PerRank",
    "save",
    "load",
    "save_step",
    "load_step",
    "latest",
    "steps",
    "step_path",
    "save_sharded",
    "load_sharded",
]
