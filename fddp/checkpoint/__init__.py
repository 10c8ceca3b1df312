"""Save and load pytrees of tensors: atomic, rank-0-only writes, code-free and verified loads.

A checkpoint is one ``torch.save`` file holding only plain data: a dict with the leaves
(tensors and Python scalars) in depth-first order, each leaf's path (``params/w``), CRC-32s of
every tensor's bytes (one per 4 MiB), and the tree's structure described with tuples, strings and ints. Nothing in
it names a Python class, so it loads with ``torch.load(..., weights_only=True)``, and a file that
would need to run code is refused. A file that was cut short or changed on disk after the write
is an error naming the file and the damaged leaf, never a silently different value.

Supported trees are nested ``dict`` (and ``OrderedDict``), ``list``, ``tuple`` and ``NamedTuple``
(optimizer states) nodes, with leaves that are tensors or ``int``, ``float``, ``complex``, ``bool``,
``str``, ``bytes`` or ``None`` (a step count, ``torch.get_rng_state()``, ``random.getstate()``).
Other dict subclasses are saved as dicts, other tuple/list subclasses as tuples/lists; subclasses
of the scalar types (numpy scalars, enums) are refused at save time, since loading them would need
their class. Tensors are stored on the CPU.

Writes are atomic: the file is written next to its destination under a temporary name, flushed,
fsynced and renamed over the destination, then the directory is fsynced. A writer killed at any
moment leaves either the old file or the new one, never a torn one; its temporary
(``<name>.tmp-<host id>-<pid>-<random>``) is deleted by the next save of the same destination once
it is provably abandoned (see :func:`save_step` for the rule).

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

from fddp.checkpoint._codec import CheckpointError
from fddp.checkpoint._sharded import load_sharded, save_sharded
from fddp.checkpoint._single import latest, load, save, save_step, step_path, steps

__all__ = ["CheckpointError", "save", "load", "save_step", "latest", "steps", "step_path", "save_sharded", "load_sharded"]
