"""The header: the one fixed-size message through which the ranks of a group agree on a call.

Twenty int64 (160 bytes). The first six fields travel as ``(x, -x)``, so that one MAX all-reduce gives
every field's maximum and minimum at once (equal on every rank exactly when they are equal):

    SIG    the digest of the call's signature (tree, shapes, dtypes, options)
    CALL   the call's number on the group
    WHAT   the digest of the fddp function's name (or of "one collective", for a token)
    PRINT  a sampled digest of values that must be equal (0: none)
    MODE   whether the sender runs with the agreement on
    EARLY  0, or, where the sender sent its buckets without waiting for this header (its call
           repeats the last one the ranks agreed on and completed, see ``_agreement``), a digest
           of those buckets' collectives: a rank that sends zeros in their place checks it first

then fields that travel as their maximum: NEW (some rank meets the signature for the first
time), ASKED (some rank asked for a new tree's checks), FAILED (rank + 1 of a rank that
announces its failure in place of the call's agreement), LEARN (some rank must learn the
call's sequence) and, from FLAGS on, one 0/1 field per request bit (``FLAG_BITS`` of them: the
maximum of each is the or of the ranks' bits). A rank sets a request with
``_agreement.request`` (a checkpoint manager asking every rank to save at the next step
boundary, say); it rides in that rank's next header, so every rank learns it at the same call
without a collective of its own. Every kind of header (a call's, a token's, a compiled call's,
an announcement) has this size and layout, so two ranks at different kinds of call still pair
their headers instead of pairing a header with a bucket.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from fddp._dist._digest import digest
from fddp._dist._groups import control_group

__all__ = [
    "SIG", "CALL", "WHAT", "PRINT", "MODE", "BOTH", "NEW", "ASKED", "FAILED", "LEARN", "FLAGS", "FLAG_BITS", "EARLY", "SIZE", "TOKEN",
    "PREEMPT", "WRITTEN", "UNWRITTEN",
    "blank", "build", "exchange", "flags_of", "tail_size", "tail", "from_tail", "CARRIED",
]

SIG, CALL, WHAT, PRINT, MODE, EARLY = range(6)
BOTH = 6
NEW, ASKED, FAILED, LEARN = 2 * BOTH, 2 * BOTH + 1, 2 * BOTH + 2, 2 * BOTH + 3
FLAGS = 2 * BOTH + 4
FLAG_BITS = 4  # request bits a header carries, one field each
# The request bits, one owner each: a new owner takes a free bit here, and takes only its own
# bits back (``_agreement.take_requested(group, mask)``).
PREEMPT = 1 << 0  # fddp.checkpoint.Manager: a rank got a signal: save at the step boundary, then stop
WRITTEN = 1 << 1  # fddp.checkpoint.Manager: the writer's asynchronous write is in place
UNWRITTEN = 1 << 2  # fddp.checkpoint.Manager: the writer's asynchronous write failed
SIZE = FLAGS + FLAG_BITS
TOKEN = digest("fddp: one collective of a call")  # the function field of a token's agreement


def build(
    both: Sequence[int], new: int = 0, asked: int = 0, learn: int = 0, flags: int = 0, device: torch.device | None = None
) -> torch.Tensor:
    """A header in the one layout: ``both`` (the ``BOTH`` fields) as (x, -x), then the fields
    that travel as their maximum (``flags``: this rank's request bits, one field each). On the
    CPU, for :func:`exchange` (its control group reduces CPU tensors); ``device`` for a header
    inside a compiled graph, which travels on the group itself.

    Example:
        >>> t = build([sig, call, what, 0, 1, 0], new=1)
    """
    bits = [(flags >> b) & 1 for b in range(FLAG_BITS)]
    return torch.tensor([*both, *[-x for x in both], new, asked, 0, learn, *bits], dtype=torch.int64, device=device)


def blank() -> torch.Tensor:
    """A header of zeros (a failure's announcement fills in ``FAILED``)."""
    return torch.zeros(SIZE, dtype=torch.int64)


def flags_of(h: Sequence[int]) -> int:
    """The or of every rank's request bits, from an all-reduced header."""
    return sum(1 << b for b in range(FLAG_BITS) if h[FLAGS + b])


def exchange(header: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> Any:
    """Start the all-reduce of ``header`` (the maximum of every field and of its negation: min
    and max at once) on ``group``'s control group (``_groups.control_group``: never a CUDA
    tensor the host must read back); return its work."""
    return dist.all_reduce(header, op=dist.ReduceOp.MAX, group=control_group(group), async_op=True)


def agrees(h: Sequence[int], skip_print: bool = True) -> bool:
    """Whether an all-reduced header ``h`` says every rank sent the same ``BOTH`` fields (the
    values' fingerprint left out with ``skip_print``: the caller weighs it on its own)."""
    low = [-x for x in h[BOTH : 2 * BOTH]]
    if skip_print:
        return h[:PRINT] == low[:PRINT] and h[PRINT + 1 : BOTH] == low[PRINT + 1 :]
    return list(h[:BOTH]) == low


# --- the header in band: a tail on the first bucket's own all-reduce (sum) -----------------------
#
# A call that repeats the last one the ranks completed sends no header: its first bucket's
# all-reduce carries, after the bucket, a tail from which every rank reads what the header would
# have said (``_agreement``'s "In band"). The reduction is a sum in the bucket's dtype, so the tail
# holds only 0/1 slots and small counts, exact in float32 for any group below 2**24 ranks: each of
# the fields below as its 64 bits (all equal on every rank exactly when each slot's sum is 0 or
# n), then counts.
CARRIED = (SIG, CALL, WHAT, MODE)  # then PRINT's bits and whether this rank sent one
_BITS = 64
_COUNTS = 5  # printed (this rank sent a fingerprint), new, asked, learn, in band
_BYTE_BITS = [bytes((b >> i) & 1 for i in range(8)) for b in range(256)]  # a byte's bits, low first, as 0/1 bytes


def tail_size(n: int) -> int:
    """Slots of the tail for a group of ``n`` ranks (one failure slot per rank)."""
    return (len(CARRIED) + 1) * _BITS + _COUNTS + FLAG_BITS + n


def _bits(x: int) -> bytes:
    return b"".join(_BYTE_BITS[b] for b in (x & (2**64 - 1)).to_bytes(8, "little"))


def tail(
    both: Sequence[int], n: int, dtype: torch.dtype, *, new: int = 0, asked: int = 0, learn: int = 0, flags: int = 0,
    failed: int = 0, inband: bool = False,
) -> torch.Tensor:
    """This rank's tail (``both``: the header's ``BOTH`` fields; ``failed``: this rank + 1 where
    it announces a failure). A float tensor of :func:`tail_size` slots, in ``dtype``; every slot
    is 0 or 1 (built as bytes: a few microseconds, on the hot path).

    Example:
        >>> t = tail([sig, call, what, 0, 1, 0], 2, torch.float32, inband=True)
    """
    if failed:  # an announcement carries nothing but its failure (the header's zeros)
        fields = bytes((len(CARRIED) + 1) * _BITS + _COUNTS)
    else:
        printed = both[PRINT]
        fields = b"".join(_bits(both[f]) for f in CARRIED) + _bits(printed or 0)
        fields += bytes((int(bool(printed)), int(bool(new)), int(bool(asked)), int(bool(learn)), int(inband)))
    ranks = bytearray(n)
    if failed:
        ranks[failed - 1] = 1
    raw = fields + bytes((flags >> b) & 1 for b in range(FLAG_BITS)) + bytes(ranks)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dtype)


def from_tail(t: torch.Tensor, n: int, mine: torch.Tensor | None = None) -> tuple[list[int], int]:
    """The header every rank would have read, from a reduced tail: the same list on every rank,
    with :func:`agrees` true exactly when every rank sent the same fields. Returns it and the
    number of ranks that sent their bucket in band (the rest sent zeros in its place).

    ``mine`` (this rank's tail, with its ``both`` fields as the second value) gives the usual
    case in one comparison: every rank sent this rank's fields when the sum is ``n`` times them.
    """
    k = (len(CARRIED) + 1) * _BITS
    rest = t[k:].tolist()
    printed, new, asked, learn, inband = (round(x) for x in rest[:_COUNTS])
    flags = rest[_COUNTS : _COUNTS + FLAG_BITS]
    failures = [r for r, x in enumerate(rest[_COUNTS + FLAG_BITS :]) if x]
    h = [0] * SIZE
    if mine is not None and printed == n and torch.equal(t[:k], mine[0][:k] * n):
        for f in (*CARRIED, PRINT):
            h[f], h[BOTH + f] = mine[1][f], -mine[1][f]
    else:
        v = t[:k].tolist()
        for j, f in enumerate((*CARRIED, PRINT)):
            seg = v[j * _BITS : (j + 1) * _BITS]
            high = sum(1 << i for i, x in enumerate(seg) if x > 0)  # every rank's bits or-ed
            low = sum(1 << i for i, x in enumerate(seg) if x == n)  # and-ed: equal to high iff all agree
            h[f], h[BOTH + f] = high, -low
        if printed != n:  # the fingerprint's minimum, as the header's: 0 where some rank sent none
            h[BOTH + PRINT] = 0
    # Whether the bucket went in band, as a field every rank must share: all or none.
    h[EARLY], h[BOTH + EARLY] = int(inband > 0), -int(inband == n)
    h[NEW], h[ASKED], h[LEARN] = int(new > 0), int(asked > 0), int(learn > 0)
    h[FAILED] = failures[-1] + 1 if failures else 0  # the highest failing rank + 1, as the header's maximum
    for b, x in enumerate(flags):
        h[FLAGS + b] = int(x > 0)
    return h, inband
