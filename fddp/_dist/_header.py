"""The head: the one fixed-size collective through which the ranks of a group check a call.

Every checked call on a group starts with one all-reduce (a sum) of ``HEAD`` float64 slots. Its
size does not depend on the call, so ranks at different calls (another tree, another function, a
compiled step, a failure announced in place of a call) always pair head with head, never a head
with a bucket of another size. Its slots:

    ID      the call's identity (a digest of its signature, its number on the group, the function
            and the agreement setting) as ``CHUNKS`` chunks ``c`` of 8 bits, sent as ``c`` and
            ``c * c``: summed over ``n`` ranks, every rank sent the same chunk exactly when
            ``n * sum(c * c) == sum(c) ** 2`` (Cauchy-Schwarz; every sum exact in float64, on the
            host or the device, below 2**18 ranks)
    PRINT   a sampled digest of values that must be equal, the same way; PRINTED: how many ranks sent one
    NEW, ASKED, LEARN   how many ranks meet the signature first, ask for a new tree's checks, lack
            the call's recorded sequence
    FAILS, FAILED       how many ranks announce a failure in place of the call, and the sum of their ranks + 1
    FLAGS   one count per request bit (``_agreement.request``: a rank's SIGTERM handler asks every rank
            to save at the next step boundary; every rank learns it from the same head)
    DATA    the rest: a plain mean's only bucket (float32 or float64, on the CPU), where it fits; the
            call then sends no collective but its head

A compiled call's head has the same size and layout (its graph asserts the identity), and so does
a token's (a collective of a stage-3 call being learnt).
"""

from __future__ import annotations

import array
import operator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fddp._dist._digest import digest
from fddp._dist._groups import control_group

__all__ = [
    "HEAD", "DATA", "FAILS", "FAILED", "TOKEN", "PREEMPT", "WRITTEN", "UNWRITTEN", "FLAG_BITS", "Verdict", "build", "exchange", "read",
    "traced_verdict", "stamp",
]

CHUNKS = 8  # 8-bit chunks of a 64-bit identity
ID, ID_SQ = 0, CHUNKS
PRINT, PRINT_SQ = 2 * CHUNKS, 3 * CHUNKS
PRINTED, NEW, ASKED, LEARN, FAILS, FAILED = range(4 * CHUNKS, 4 * CHUNKS + 6)
FLAGS = 4 * CHUNKS + 6
FLAG_BITS = 4  # request bits a head carries, one count each
DATA = FLAGS + FLAG_BITS  # 42: the fields end here
HEAD = 512  # slots in all (4 KiB): a 100-leaf tree of 4 values rides in the head
# The request bits, one owner each: a new owner takes a free bit here, and takes only its own
# bits back (``_agreement.take_requested(group, mask)``).
PREEMPT = 1 << 0  # fddp.checkpoint.Manager: a rank got a signal: save at the step boundary, then stop
WRITTEN = 1 << 1  # fddp.checkpoint.Manager: the writer's asynchronous write is in place
UNWRITTEN = 1 << 2  # fddp.checkpoint.Manager: the writer's asynchronous write failed
TOKEN = digest("fddp: one collective of a call")  # the function of a token's identity


_MASK = (1 << 8 * CHUNKS) - 1
_SQUARES = [c * c for c in range(256)]


def _chunks(x: int) -> bytes:
    """The low ``8 * CHUNKS`` bits of ``x`` (two's complement, any int) as ``CHUNKS`` 8-bit chunks,
    least significant first: one C call, where a shift and mask per chunk cost a tenth of a call's build."""
    return (x & _MASK).to_bytes(CHUNKS, "little")


def build(
    ident: int,
    *,
    printed: int = 0,
    new: int = 0,
    asked: int = 0,
    learn: int = 0,
    flags: int = 0,
    failed: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """This rank's head: ``ident`` (the call's identity, any int), ``printed`` (a replica digest,
    0: none), the counts, ``flags`` (this rank's request bits) and ``failed`` (this rank, where it
    announces a failure; its identity is then 0). DATA slots are zeros.

    Example:
        >>> h = build(digest((signature, call, what, 1)), new=1)
    """
    if torch.compiler.is_compiling():  # a constant of the graph (dynamo traces neither to_bytes nor frombuffer)
        c = [(ident >> (8 * i)) & 0xFF for i in range(CHUNKS)]
        p = [(printed >> (8 * i)) & 0xFF for i in range(CHUNKS)]
        fields = [*c, *(x * x for x in c), *p, *(x * x for x in p), int(bool(printed)), new, asked, learn]
        fields += (0, 0) if failed is None else (1, failed + 1)
        fields += ((flags >> b) & 1 for b in range(FLAG_BITS))
        return torch.tensor([*fields, *([0] * (HEAD - DATA))], dtype=torch.float64, device=device)
    c = _chunks(ident)
    square = _SQUARES.__getitem__
    if printed:
        p = _chunks(printed)
        fields = [*c, *map(square, c), *p, *map(square, p), 1, new, asked, learn]
    else:
        fields = [*c, *map(square, c), *_NO_PRINT, new, asked, learn]
    fields += (0, 0) if failed is None else (1, failed + 1)
    fields += _FLAG_FIELDS[flags] if 0 <= flags < 1 << FLAG_BITS else ((flags >> b) & 1 for b in range(FLAG_BITS))
    # From bytes: a tenth of the cost of torch.tensor(list) on the hot path (every call builds one).
    # Cloned, so that the head's storage is torch's: a frombuffer tensor's is a Python object, and
    # the backend's thread may drop a collective's last reference to it, freeing that object from
    # a thread with no Python frame (rank 1 of test_preempt's boundaries test died of SIGSEGV there,
    # in such a thread, about once in 30 runs).
    head = torch.frombuffer(bytearray(array.array("d", fields).tobytes() + _PAD), dtype=torch.float64).clone()
    return head if device is None else head.to(device)


_NO_PRINT = (0,) * (2 * CHUNKS + 1)  # PRINT, PRINT_SQ and PRINTED of a head without a replica digest
_FLAG_FIELDS = [tuple((f >> b) & 1 for b in range(FLAG_BITS)) for f in range(1 << FLAG_BITS)]
_PAD = bytes(8 * (HEAD - DATA))


def exchange(head: torch.Tensor, group: dist.ProcessGroup | None, data: int = 0) -> Any:
    """Start the all-reduce (sum) of ``head`` on ``group``'s control group (``_groups.control_group``:
    the group itself where it reduces CPU tensors); return its work. ``data``: how many DATA
    slots carry the call's values (0: none; the test harness counts such a head as the data's
    collective, any other as a head)."""
    return dist.all_reduce(head, group=control_group(group), async_op=True)


class Verdict(NamedTuple):
    """What a summed head says, the same on every rank."""

    agrees: bool  # every rank sent the same identity
    fails: int  # ranks that announced a failure
    failed: int | None  # the announcing rank, where only one did
    compared: bool  # every rank sent a replica digest
    equal: bool  # ... and they are equal
    new: bool
    asked: bool
    learn: bool
    flags: int
    key: tuple  # the fields (as ints), as a topic every rank shares; () where they agree (only a difference needs one)


def _same(v: list[float], sq: list[float], n: int) -> bool:
    return list(map(float(n).__mul__, sq)) == list(map(operator.mul, v, v))


def read(head: torch.Tensor, n: int) -> Verdict:
    """Read the summed ``head`` of a group of ``n`` ranks (one copy to the host)."""
    # The fields as Python floats in one call (a cast to int64 first costs as much again): sums
    # of small integers, exact in float64, and so is every product _same takes (below 2**53 for
    # fewer than 2**18 ranks), so the comparisons are the integers' own.
    h = head[:DATA].tolist()
    fails = int(h[FAILS])
    agrees = fails == 0 and _same(h[ID:ID_SQ], h[ID_SQ:PRINT], n)
    printed = h[PRINTED]
    flags = h[FLAGS:DATA]
    return Verdict(
        agrees,
        fails,
        int(h[FAILED]) - 1 if fails == 1 else None,  # failed
        printed == n,  # compared
        printed == 0 or _same(h[PRINT:PRINT_SQ], h[PRINT_SQ:PRINTED], n),  # equal (no rank sent a digest: all zeros, equal)
        h[NEW] > 0,
        h[ASKED] > 0,
        h[LEARN] > 0,
        sum(1 << b for b in range(FLAG_BITS) if flags[b]) if any(flags) else 0,  # flags
        () if agrees else tuple(map(int, h)),  # key
    )


def traced_verdict(head: torch.Tensor, n: int) -> torch.Tensor:
    """On the device, a bool scalar: every rank sent the same identity and none announced a
    failure (a compiled call's assertion)."""
    v, sq = head[ID:ID_SQ], head[ID_SQ:PRINT]
    return (sq * n == v * v).all() & (head[FAILS] == 0)


# ----------------------------------------------------------------------------------- the stamp
# A known call on an NCCL group sends no head (``_agreement``: it is checked in the step's batch).
# Its identity rides instead in trailing slots of its first all-reduce (a sum), as chunks ``c``
# and ``c * c``. Where every rank sent the same, the sums are ``n * c`` and ``n * c * c``, which
# each rank knows; where any differ, no rank's are (``sum (c_r - c_0)**2 = S2 - 2 c_0 S1 + n c_0**2``
# is 0 only if every ``c_r == c_0``). So each rank compares the sums with its own expectation on
# the device, reaching the same verdict as every other rank without a host read, and the call's
# results are divided by it (1, or 0: a mixed sum never comes out finite). The batch's head still
# names the call, a step later.

STAMP_BITS = 32  # of the identity: calls numbered alike but differing elsewhere collide with odds 2**-32
_SIGNIFICAND = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}


def stamp(ident: int, n: int, dtype: torch.dtype) -> list[int] | None:
    """``ident``'s low :data:`STAMP_BITS` bits as the ``2 k`` slots a rank sends in a sum over
    ``n`` ranks of ``dtype`` (``k`` chunks, then their squares), followed by the ``2 k`` sums that
    every rank receives where all sent the same (``n`` times each slot); ``None`` where ``dtype``
    cannot carry them exactly (an integer type, bfloat16 beyond 255 ranks). Chunks are as wide as
    keeps every sum exact in ``dtype``: ``n * (2**b - 1)**2 < 2**significand``.

    Example:
        >>> stamp(0xDEADBEEF, 2, torch.float32)[:8]  # four 8-bit chunks and their squares
        [239, 190, 173, 222, 57121, 36100, 29929, 49284]
    """
    p = _SIGNIFICAND.get(dtype, 0)
    b = next((b for b in range(8, 0, -1) if n * ((1 << b) - 1) ** 2 < 1 << p), 0)
    if b == 0:
        return None
    m = (1 << b) - 1
    c = [(ident >> (b * i)) & m for i in range(-(-STAMP_BITS // b))]
    sent = c + [x * x for x in c]
    return sent + [n * x for x in sent]
