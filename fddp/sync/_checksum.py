"""The comparison of a tree's values across the ranks, through their full replica digest.

``fddp.verify_replicas`` compares any tree on request; the first synchronisation of a tree fresh
from ``fddp.functionalize`` compares the parameters on its own (:func:`check_replicas`), so that
a forgotten ``fddp.broadcast`` is an error on every rank, not a run of diverging replicas.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fddp._dist import MismatchError, checksum, collective_device, replica_digest, wait
from fddp._tree import paths

__all__ = ["checksum", "check_replicas", "compare_replicas"]

def check_replicas(leaves: list[torch.Tensor], spec: Any, group: dist.ProcessGroup | None, what: str, drifted: bool = False) -> None:
    """Raise :class:`MismatchError` on every rank unless the ranks hold the same parameters: at
    the first synchronisation of a new tree (what ``fddp.broadcast`` makes sure of, as torch DDP's
    constructor does), or when the header's fingerprints say the replicas ``drifted`` apart. One
    checksum pass over the leaves and one small all-reduce."""
    if drifted:
        advice = (
            f" fddp.{what} averages gradients of replicas, which must stay bitwise equal, and they drifted apart "
            "since they last agreed: a rank skipped an update or applied its own (gradients not averaged), loaded "
            "another checkpoint, or drew a rank-dependent learning rate or random number."
        )
    else:
        advice = (
            f" fddp.{what} averages gradients of replicas, which must start equal: did you call "
            "params = fddp.broadcast(params) on every rank after fddp.functionalize?"
        )
    compare_replicas(
        leaves, spec, group, what,
        advice + " (To average values that differ between ranks by design, turn this check off on every rank: "
        "fddp.set_checks(replicas=False).)",
    )  # fmt: skip


def compare_replicas(leaves: list[torch.Tensor], spec: Any, group: dist.ProcessGroup | None, what: str, advice: str) -> None:
    """Raise :class:`MismatchError` on every rank, naming the first differing leaf, unless every rank
    holds bitwise equal ``leaves`` (one all-reduce of their checksums; a gather only on a difference)."""
    if dist.get_world_size(group) == 1 or not leaves:
        return
    sums = torch.tensor(replica_digest(leaves, "full"), dtype=torch.int64, device=collective_device(group))
    both = torch.cat([sums, -sums])
    wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True), group, what, "the checksum all-reduce", host=both.is_cpu)
    high, low = both[: len(leaves)], -both[len(leaves) :]
    differ = (high != low).nonzero().flatten().tolist()
    if not differ:
        return
    n = dist.get_world_size(group)
    gathered = [torch.empty_like(sums) for _ in range(n)]
    wait(dist.all_gather(gathered, sums, group=group, async_op=True), group, what, "the checksum gather", host=sums.is_cpu)
    first = differ[0]
    others = [r for r in range(1, n) if gathered[r][first] != gathered[0][first]]
    which = f"rank {others[0]} differs" if len(others) == 1 else f"ranks {others} differ"
    more = f" (and {len(differ) - 1} more of the {len(leaves)} leaves)" if len(differ) > 1 else ""
    raise MismatchError(
        f"fddp.{what}: ranks hold different values at leaf {paths(spec)[first]!r}{more}: {which} "
        f"from rank 0 (checksums {[int(g[first]) for g in gathered]}).{advice}"
    )
