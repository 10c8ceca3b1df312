"""Errors that more than one layer raises: :class:`CheckpointError`, for anything fddp refuses to load.

``fddp.checkpoint`` reads checkpoints, ``fddp.zero.load_full`` reads weights (safetensors files and
their index), ``fddp.ft`` reads a peer's live state off the wire: each refuses a file or message
that is damaged or would run code with this one error, which ``fddp.checkpoint`` exports. It lives
at the bottom of the import graph so that ``fddp.zero`` (below ``fddp.checkpoint``) can raise it.
"""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: it is truncated, damaged, not an fddp checkpoint, would need to
    run code, or does not match the expected ``like`` tree; or, on the ranks that did not write it,
    rank 0 failed to write it. The message names the file and, for a leaf, its path (``a/b/0``).

    Also raised by :func:`fddp.zero.load_full` for weights it refuses (not safetensors, damaged, an
    index that points outside its directory), by :func:`fddp.checkpoint.save_step` when another job
    writes the same directory, and by ``fddp.ft`` for a peer's live state that fails its checks.

    Example:
        >>> try:
        ...     state = fddp.checkpoint.load(path, like=state)
        ... except fddp.checkpoint.CheckpointError as e:
        ...     print(e)  # "<path>: damaged: the data of leaf 'params/w' does not match the CRC-32 ..."
    """

    __module__ = "fddp.checkpoint"  # where users import it from, and how tracebacks name it
