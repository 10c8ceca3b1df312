"""A synchronisation's signature: what the ranks must agree on before its bytes move.

The signature is the tree's structure (a dict's keys in insertion order, which is the order
buckets fill in), every leaf's shape, dtype and device type, and every option that shapes the
collectives (bucket caps, the comm hook and its state, whether a weight rides along), as
``fddp._tree`` rows. Its digest goes into the per-call header that :func:`fddp._dist.agree`
all-reduces; only on a mismatch are the rows themselves gathered, to name the first difference.

Building the rows walks the tree, so a call computes a cheap local *key* instead (the treedef,
the leaf specs, the definition order, the option rows) and the digest is cached per key.
"""

from __future__ import annotations

import collections
from typing import Callable, Hashable, Sequence

import torch.distributed as dist

from fddp import _caches, _dist
from fddp._dist import MismatchError
from fddp._tree import first_difference

__all__ = ["MismatchError", "signature_digest", "check", "start", "name_difference"]

_KEYS = 1024  # distinct call signatures whose digests are kept (a training loop needs a handful)
_digests: "collections.OrderedDict[Hashable, int]" = collections.OrderedDict()
_caches.register("fddp.sync._signature._digests", _digests.clear)


def signature_digest(key: Hashable, rows: Callable[[], list[tuple]]) -> int:
    """The digest of the signature that ``key`` stands for (``rows()`` is built only for a new key)."""
    d = _digests.get(key)
    if d is None:
        d = _dist.digest(rows())
        _digests[key] = d
        if len(_digests) > _KEYS:
            _digests.popitem(last=False)
    return d


def name_difference(per_rank: Sequence[list[tuple]]) -> str:
    """Words for the first row where a rank's signature differs from rank 0's."""
    for r, rows in enumerate(per_rank[1:], start=1):
        diff = first_difference(per_rank[0], rows, "rank 0", f"rank {r}")
        if diff is not None:
            return diff[0].upper() + diff[1:] + "."
    return "The signatures hash differently but compare equal."  # pragma: no cover


def check(
    digest: int,
    rows: Callable[[], list[tuple]],
    group: dist.ProcessGroup | None,
    what: str,
    ask: bool = False,
    values: int = 0,
    sequenced: bool = False,
) -> _dist.Agreed:
    """Agree across ``group`` on the call whose signature has this ``digest`` (see
    :func:`fddp._dist.agree`: ``ask`` asks for a new tree's further checks, ``values`` is a
    fingerprint of values that must be equal on every rank, ``sequenced`` that the call's further
    collectives are learnt and checked as a sequence).

    Raises :class:`MismatchError` on every rank if the ranks' signatures (or call numbers, or
    threads) differ.
    """
    return start(digest, rows, group, what, ask, values, sequenced).finish()


def start(
    digest: int,
    rows: Callable[[], list[tuple]],
    group: dist.ProcessGroup | None,
    what: str,
    ask: bool = False,
    values: int = 0,
    sequenced: bool = False,
) -> _dist.Agreement:
    """:func:`check`, started: the header is sent, and the caller finishes the agreement
    (:meth:`fddp._dist.Agreement.finish`) before the call's other collectives."""
    return _dist.start_agreement(group, what, digest, rows, name_difference, ask, values, sequenced)
