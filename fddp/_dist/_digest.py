"""The two digests every cross-rank check uses: of a description, and of replicated values.

:func:`digest` hashes what the ranks *run* (a signature's rows, an option, a function's name) to 62
bits that are the same in every process. :func:`replica_digest` hashes what the ranks *hold*, at
one of two depths: ``"full"`` reads every byte (``fddp.verify_replicas``, the first call on a new
tree, DiLoCo's snapshot, a fault-tolerant group's state), ``"sampled"`` reads the first and last
elements of the first and last leaves (every call's head: replicas that drift apart differ in
nearly every element). Every equality check of fddp compares these digests, nothing else.

All digests are below ``2**62``; the head (``_header``) carries one as eight 8-bit chunks and
their squares, whose sums say exactly whether every rank sent the same digest.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Literal, Sequence

import torch

from fddp import _caches

__all__ = ["digest", "name_digest", "traced_digest", "checksum", "replica_digest", "MASK"]

MASK = (1 << 62) - 1  # digests in [0, 2**62): their negations never overflow int64
_CHUNK = 1 << 22  # words hashed at a time: bounds the temporaries at ~64 MiB


def digest(described: Any) -> int:
    """A 62-bit digest of ``repr(described)``, the same in every process (``hash`` of a str is not).

    Example:
        >>> digest([("option", "25.0", None)]) == digest([("option", "25.0", None)])
        True
    """
    return int.from_bytes(hashlib.blake2b(repr(described).encode(), digest_size=8).digest(), "little") >> 2


name_digest = _caches.cached(maxsize=256, name="fddp._dist._name_digest")(digest)  # function names: a handful per run
traced_digest = torch.compiler.assume_constant_result(digest)  # run once, at trace time: dynamo cannot trace hashlib


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
    return total & MASK


def replica_digest(leaves: Sequence[Any], /, depth: Literal["full", "sampled"] = "full") -> list[int] | int:
    """Digest values that must be bitwise equal on every rank, at a depth.

    Args:
        leaves: tensors (a tree's leaves); with ``depth="full"``, other leaves (a step count, a
            string) are digested by their type and ``repr``.
        depth: ``"full"``: one :func:`checksum` of every byte per leaf, a list of ints (any
            one-word difference shows); ``"sampled"``: one int from the bits of the first and
            last elements of the first and last leaves (four values whatever the tree's size;
            0 for a tree without values; ``None`` where reading them would make the host wait
            for a CUDA stream: the caller compares nothing then).

    Returns:
        ``"full"``: a list of 62-bit ints, one per leaf; ``"sampled"``: one 62-bit int (or ``None``).

    Example:
        >>> replica_digest([torch.ones(3), torch.zeros(2)])  # per leaf
        [..., ...]
        >>> replica_digest([torch.ones(3)], "sampled") == replica_digest([torch.ones(3)], "sampled")
        True
    """
    if depth == "full":
        tensors = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        out = [0] * len(leaves)
        by_device: dict[torch.device, list[int]] = {}
        for i in tensors:
            by_device.setdefault(leaves[i].device, []).append(i)
        for idx in by_device.values():  # one read per device: a GPU leaf's own .cpu() would wait for the stream once per leaf
            for i, s in zip(idx, torch.stack([checksum(leaves[i]) for i in idx]).tolist()):
                out[i] = s
        for i, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):
                out[i] = digest((type(t).__name__, t))
        return out
    if depth != "sampled":
        raise ValueError(f"replica_digest: depth must be 'full' or 'sampled', got {depth!r}")
    if not leaves:
        return 0
    values: list = []
    for t in (leaves[0], leaves[-1]):
        n = t.numel()
        if n:
            if not t.is_cpu:
                return None  # reading device values here is a host sync per call (see docs/design.md)
            if t.is_floating_point():
                # The first and last elements in one view and one tolist (the hot path: per call);
                # a Python float holds every float dtype's value exactly, as float() of an element does.
                if t.is_contiguous():  # one view op, where detach, reshape and a slice take three
                    values += t.as_strided((2,), (n - 1,)).tolist()  # n == 1: stride 0, the one element twice
                    continue
                pair = t.detach().reshape(-1)[:: n - 1 or 1].tolist()
                values += pair if n > 1 else pair * 2
                continue
            flat = t.detach().reshape(-1)
            for x in (flat[0], flat[n - 1]):
                values.append(float(x.abs() if x.is_complex() else x))
    if not values:
        return 0
    return digest(struct.pack(f"<{len(values)}d", *values))
