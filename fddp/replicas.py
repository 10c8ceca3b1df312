"""Check that every rank holds bitwise the same tree: one small all-reduce of per-leaf checksums.

Data-parallel replicas drift apart only through a bug (a rank that skipped an update, a
non-deterministic op applied to the parameters, a resume that loaded a different checkpoint on one
rank), and then they drift silently. :func:`verify_replicas` makes that loud and cheap: each rank
hashes every leaf's bytes into a 62-bit checksum, and one all-reduce of ``[c, -c]`` with MAX gives
every rank the maximum and the minimum of each leaf's checksum over the ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fddp.buckets import LeafSpec
from fddp.comm import MismatchError, _collective_device, check_signature, tree_leaves_with_paths, wait
from fddp.runtime import require_initialized

__all__ = ["verify_replicas", "checksum"]

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


def verify_replicas(tree: Any, /, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`fddp.MismatchError` on every rank unless all ranks hold bitwise equal leaves.

    Each rank computes a checksum of every leaf (see :func:`checksum`: any single changed word,
    such as a one-ulp difference, is always caught) and one all-reduce of ``2 * num_leaves`` int64
    values compares them. On a difference the ranks also gather the checksums (a second small
    collective) to name the first differing leaf and the ranks that disagree with rank 0, and all
    raise the same error. The tree signatures (structure, shapes, dtypes) are compared first, as in
    :func:`fddp.ddp_step`. Reading every byte costs about as much as one optimizer step: call it
    every few hundred steps, after a resume, or in tests.

    Args:
        tree: a pytree of tensors: parameters, optimizer state, buffers.
        group: the process group whose ranks must agree; ``None`` for the default group.

    Raises:
        MismatchError: on every rank, naming the first leaf (in tree order) whose bytes differ.

    Example:
        >>> params = fddp.broadcast(params)
        >>> fddp.verify_replicas(params)  # passes; raises on every rank if any rank drifted
    """
    require_initialized("verify_replicas")
    paths, leaves, spec = tree_leaves_with_paths(tree, "verify_replicas")
    check_signature(spec, paths, tuple(LeafSpec.of(t) for t in leaves), group, "verify_replicas")
    if dist.get_world_size(group) == 1 or not leaves:
        return
    device = _collective_device(group)
    sums = torch.stack([checksum(t).to(device) for t in leaves])
    both = torch.cat([sums, -sums])
    wait(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True), "verify_replicas", "the checksum all-reduce")
    high, low = both[: len(leaves)], -both[len(leaves) :]
    differ = (high != low).nonzero().flatten().tolist()
    if not differ:
        return
    n = dist.get_world_size(group)
    gathered = [torch.empty_like(sums) for _ in range(n)]
    wait(dist.all_gather(gathered, sums, group=group, async_op=True), "verify_replicas", "the checksum gather")
    first = differ[0]
    others = [r for r in range(1, n) if gathered[r][first] != gathered[0][first]]
    which = f"rank {others[0]} differs" if len(others) == 1 else f"ranks {others} differ"
    more = f" (and {len(differ) - 1} more of the {len(leaves)} leaves)" if len(differ) > 1 else ""
    raise MismatchError(
        f"fddp.verify_replicas: ranks hold different values at leaf {paths[first]!r}{more}: {which} "
        f"from rank 0 (checksums {[int(g[first]) for g in gathered]})."
    )
