"""What a member of a fault-tolerant job is, as its peers compare it at every quorum change.

A checksum of its replicated state, a description of its run (the state's tree, shapes and dtypes,
and the user's ``config`` by value), a digest of its history (the members of every quorum it
committed a step in), and its replica id as int64 words: :class:`fddp.ft.Replicas` sends these in
one all-gather and judges the quorum from them.
"""

from __future__ import annotations

from typing import Any

import optree

from fddp import _dist, _tree
from fddp.diloco._plan import describe  # the run's configuration, described as DiLoCo's agreement does

__all__ = ["NAME_WORDS", "state_checksum", "describe_run", "advance", "name_words", "name_of"]

NAME_WORDS = 8  # a member's replica id travels in the quorum check as this many int64 words (64 bytes)
_MASK = (1 << 62) - 1


def state_checksum(tree: Any) -> int:
    """A 62-bit checksum of every leaf of ``tree`` (bits of tensors, ``repr`` of the rest), by position."""
    total = 0
    for i, c in enumerate(_dist.replica_digest(optree.tree_leaves(tree, none_is_leaf=True), "full")):
        total = (total + c * (2 * i + 1)) & _MASK
    return total


def describe_run(state: Any, config: Any = None) -> list[tuple]:
    """What a joining group must share with the job: every node and leaf of ``state`` (structure,
    shapes, dtypes; not the values, nor the value of a number) and ``config`` by value (optimizers
    by their settings: :func:`fddp.diloco._plan.describe`).

    Example:
        >>> describe_run({"w": torch.zeros(2)}, {"lr": 0.1})
        [('<root>', 'dict', ('w',)), ('w', 'tensor shape=(2,) dtype=torch.float32 device=cpu', None), ('option config', '{...}', None)]
    """
    rows = [tuple(r) for r in _tree.structure_rows(state)]
    if config is not None:
        rows.append(("option config", describe(config), None))
    return rows


def advance(history: int, step: int, members: tuple[str, ...]) -> int:
    """The history digest after committing step ``step`` in a quorum of ``members``: two groups have
    the same digest at a step exactly when they committed every step up to it in the same quorums."""
    return _dist.digest((history, step, tuple(sorted(members))))


def name_words(name: str) -> list[int]:
    raw = name.encode()[: 8 * NAME_WORDS].ljust(8 * NAME_WORDS, b"\0")
    return [int.from_bytes(raw[8 * i : 8 * i + 8], "little", signed=True) for i in range(NAME_WORDS)]


def name_of(words: list[int]) -> str:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words).rstrip(b"\0").decode(errors="replace")
