"""Checksums of tensors, and the comparison of a tree's checksums across the ranks.

``fddp.verify_replicas`` compares any tree on request; the first synchronisation of a tree fresh
from ``fddp.functionalize`` compares the parameters on its own (:func:`check_replicas`), so that
a forgotten ``fddp.broadcast`` is an error on every rank, not a run of diverging replicas.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fddp._dist import MismatchError, collective_device, wait
from fddp._tree import paths

__all__ = ["checksum", "check_replicas", "compare_replicas"]

_MASK = (1 << 62) - 1  # checksums in [0, 2**62): their negations never overflow int64
_CHUNK = 1 << 22  # words hashed at a time: bounds the temporaries at ~64 MiB


def checksum(t: torch.Tensor, /) -> torch.Tensor:
    """Return a 62-bit checksum of ``t``'s bytes, as an int64 scalar tensor on ``t``'s device.

    The bytes (in row-major order) are read as little 32-bit words ``w_i`` (the last one
    zero-padded) and summed as ``sum_i w_i * (2 i + 1) mod 2**62``. Changing any one word (a one-ulp
    change of a float32, two bf16 values, ...) always changes the checksum, since ``(2 i + 1)`` is
    odd and the change is smaller than ``2**32``; so does swapping two different words. It compares
    bits, not values: ``0.0`` and ``-0.0``, or two NaNs with different payloads, differ.

    Example:
        >>> a = torch.ones(3)
        >>> b = a.clone(); b[1] = torch.nextafter(b[1], torch.tensor(2.0))
        >>> bool(checksum(a) != checksum(b))
        True
    """
    if t.layout is not torch.strided or t.is_quantized or t.device.type == "meta":
        raise TypeError(f"checksum: needs a dense tensor with data, got layout {t.layout}, dtype {t.dtype}, device {t.device}")
    data = t.detach().resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    elif data.storage_offset() % 4:
        data = data.clone()  # a view into a bucket may start mid-word; reading it as words needs a copy
    words = data.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        w = words[start : start + _CHUNK].to(torch.int64) & 0xFFFFFFFF
        odd = torch.arange(start, start + w.numel(), dtype=torch.int64, device=t.device).mul_(2).add_(1)
        total += (w * odd).sum()  # int64 arithmetic wraps: the sum is taken mod 2**64
    return total & _MASK


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
    device = collective_device(group)
    sums = torch.stack([checksum(t).to(device) for t in leaves])
    both = torch.cat([sums, -sums])
    wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True), group, what, "the checksum all-reduce")
    high, low = both[: len(leaves)], -both[len(leaves) :]
    differ = (high != low).nonzero().flatten().tolist()
    if not differ:
        return
    n = dist.get_world_size(group)
    gathered = [torch.empty_like(sums) for _ in range(n)]
    wait(dist.all_gather(gathered, sums, group=group, async_op=True), group, what, "the checksum gather")
    first = differ[0]
    others = [r for r in range(1, n) if gathered[r][first] != gathered[0][first]]
    which = f"rank {others[0]} differs" if len(others) == 1 else f"ranks {others} differ"
    more = f" (and {len(differ) - 1} more of the {len(leaves)} leaves)" if len(differ) > 1 else ""
    raise MismatchError(
        f"fddp.{what}: ranks hold different values at leaf {paths(spec)[first]!r}{more}: {which} "
        f"from rank 0 (checksums {[int(g[first]) for g in gathered]}).{advice}"
    )
