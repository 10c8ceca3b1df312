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
    "blank", "build", "exchange", "flags_of", "tail_size", "tail", "from_tail", "CARRIED",
]

SIG, CALL, WHAT, PRINT, MODE, EARLY = range(6)
BOTH = 6
NEW, ASKED, FAILED, LEARN = 2 * BOTH, 2 * BOTH + 1, 2 * BOTH + 2, 2 * BOTH + 3
FLAGS = 2 * BOTH + 4
FLAG_BITS = 4  # request bits a header carries, one field each
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


def tail_size(n: int) -> int:
    """Slots of the tail for a group of ``n`` ranks (one failure slot per rank)."""
    return (len(CARRIED) + 1) * _BITS + _COUNTS + FLAG_BITS + n


def _bits(values: Sequence[int]) -> torch.Tensor:
    x = torch.tensor(list(values), dtype=torch.int64).unsqueeze(1)
    return (x >> torch.arange(_BITS)).bitwise_and_(1).reshape(-1)


def tail(
    both: Sequence[int], n: int, dtype: torch.dtype, *, new: int = 0, asked: int = 0, learn: int = 0, flags: int = 0,
    failed: int = 0, inband: bool = False,
) -> torch.Tensor:
    """This rank's tail (``both``: the header's ``BOTH`` fields; ``failed``: this rank + 1 where
    it announces a failure). A float tensor of :func:`tail_size` slots, in ``dtype``.

    Example:
        >>> t = tail([sig, call, what, 0, 1, 0], 2, torch.float32, inband=True)
    """
    out = torch.zeros(tail_size(n), dtype=torch.int64)
    k = len(CARRIED) * _BITS
    if not failed:  # an announcement carries nothing but its failure (the header's zeros)
        out[:k] = _bits([both[f] for f in CARRIED])
        printed = both[PRINT]
        if printed:
            out[k : k + _BITS] = _bits([printed])
        out[k + _BITS : k + _BITS + _COUNTS] = torch.tensor([int(bool(printed)), new, asked, learn, int(inband)])
    bits = [(flags >> b) & 1 for b in range(FLAG_BITS)]
    at = k + _BITS + _COUNTS
    out[at : at + FLAG_BITS] = torch.tensor(bits, dtype=torch.int64)
    if failed:
        out[at + FLAG_BITS + failed - 1] = 1
    return out.to(dtype)


def from_tail(t: torch.Tensor, n: int) -> tuple[list[int], int]:
    """The header every rank would have read, from a reduced tail: the same list on every rank,
    with :func:`agrees` true exactly when every rank sent the same fields. Returns it and the
    number of ranks that sent their bucket in band (the rest sent zeros in its place)."""
    v = t.to(torch.int64)
    k = len(CARRIED) * _BITS
    fields = v[: k + _BITS].view(len(CARRIED) + 1, _BITS)
    weights = torch.ones(_BITS, dtype=torch.int64) << torch.arange(_BITS)
    high = ((fields > 0).to(torch.int64) * weights).sum(1).tolist()  # every rank's bits or-ed
    low = ((fields == n).to(torch.int64) * weights).sum(1).tolist()  # and-ed: equal to high iff all agree
    printed, new, asked, learn, inband = v[k + _BITS : k + _BITS + _COUNTS].tolist()
    at = k + _BITS + _COUNTS
    flags = v[at : at + FLAG_BITS].tolist()
    failures = v[at + FLAG_BITS : at + FLAG_BITS + n].nonzero().flatten().tolist()
    h = [0] * SIZE
    for f, hi, lo in zip(CARRIED, high, low):
        h[f], h[BOTH + f] = hi, -lo
    # The fingerprint, as the header's (max, min): min 0 where some rank sent none.
    h[PRINT], h[BOTH + PRINT] = high[-1], -(low[-1] if printed == n else 0)
    # Whether the bucket went in band, as a field every rank must share: all or none.
    h[EARLY], h[BOTH + EARLY] = int(inband > 0), -int(inband == n)
    h[NEW], h[ASKED], h[LEARN] = int(new > 0), int(asked > 0), int(learn > 0)
    h[FAILED] = failures[-1] + 1 if failures else 0  # the highest failing rank + 1, as the header's maximum
    for b, x in enumerate(flags):
        h[FLAGS + b] = int(x > 0)
    return h, inband
