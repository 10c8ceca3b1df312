"""The agreement: the one way the ranks of a group agree that they are about to run the same call.

:func:`agree` (or :func:`start_agreement`, finished later) is the only entry. Every capability
describes what its ranks must share as rows (``(name, value, keys)``: a tree's paths, shapes and
dtypes, options, a step count, checksums); the rows' digest travels in the call's header
(``_header``) with the call's number, the function, and a sampled digest of values that must be
equal (``_digest.replica_digest``). Only on a difference are the rows themselves exchanged, to
name the first that differs (``_diagnosis``). A call that issues collectives its header does not
fix asks for a sequence (``_sequences``).

With the agreement switched off (:func:`fddp.set_checks`), known signatures send no header; a
new one still does, and so does the first call after the switch, saying so.

**Early buckets.** A call that is the one the agreed history predicts on the group (the call that
followed the last completed call the last time that one completed, or, before any has, a repeat
of it: the same signature and function, as a training loop's every step) need not wait for its
header before its buckets go out: its bucket plan is the one every rank already agreed on, so the
sizes its collectives pair with are known to match. Such a rank sends its header and its buckets back to
back (:func:`goes_early`, ``early=True``) and checks the header before it returns anything: one
round trip a call instead of two. Every rank makes the same decision from the same agreed history,
so they all go early or none does; a rank whose call is another (its plan may differ) waits for
the header first, and, where a peer went early, sends zeros in place of the peer's buckets
(:func:`drain`: the last call's collectives, which it knows) before it raises: mismatched sizes
are never issued, every rank raises, and no mixed mean is returned. A failure announced in place
of the header drains the same way, so the group stays in step.

**In band.** Where the last completed call's first collective is the plain mean's all-reduce of
a float32/float64 CPU bucket, on a two-rank group that carries its own headers (gloo; ``completed`` records
it as the call's *carrier*), the next agreement on the group sends no header at all. A call that
repeats that call (early, and itself a plain mean) appends its header's fields, as a tail
(``_header.tail``: 0/1 bits and counts, exact under a sum), to its first bucket's own
all-reduce; any other agreement (another call, another function, an announcement of a failure)
sends zeros of that bucket's size with its tail in place of a header (:func:`probe`). Either
way every rank's first message is the same all-reduce, and the reduced tail says what the
header would have (``_header.from_tail``: the same fields, equal everywhere exactly when every
rank sent the same). A rank that probed while peers carried meets their other buckets with zeros
(``drain``, all but the first); every rank then raises as with a header. Other hooks, NCCL and
half-precision buckets keep the separate header (their arithmetic or their device cannot carry
it), and so does a call after one that completed none of this kind.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fddp import _caches
from fddp._dist import _header
from fddp._dist._diagnosis import disagree, name_difference
from fddp._dist._digest import digest, name_digest, traced_digest
from fddp._dist._errors import MismatchError
from fddp._dist._failures import fail, raise_announced, raise_if_failed
from fddp._dist._groups import REMEMBERED, GroupState, checks, collective_device, control_group, frame, size, state
from fddp._dist._sequences import Segment
from fddp._dist._waits import wait

__all__ = [
    "agree", "start_agreement", "Agreement", "Agreed", "signature_digest", "goes_early", "completed", "drain", "probe", "request",
    "take_requested", "agreements", "INBAND",
]

Rows = Callable[[], list[tuple]]

_KEYS = 1024  # distinct call signatures whose digests are kept (a training loop needs a handful)
_digests: "collections.OrderedDict[Hashable, int]" = collections.OrderedDict()
_caches.register("fddp._dist._agreement._digests", _digests.clear)


def signature_digest(key: Hashable, rows: Rows) -> int:
    """The digest of the rows that ``key`` stands for (``rows()`` is built only for a new key):
    building rows walks a tree, so a hot call computes a cheap local key instead."""
    d = _digests.get(key)
    if d is None:
        d = digest(rows())
        _digests[key] = d
        if len(_digests) > _KEYS:
            _digests.popitem(last=False)
    return d


class Agreed(NamedTuple):
    """What every rank learned from one agreement (the same on every rank).

    Attributes:
        new: some rank meets this call's signature on this group for the first time.
        asked: some rank asked for the checks a new tree gets (``ask=True``), and the tree is new.
        drifted: the ranks run the same call, but the digests of their values differ (the caller
            compares the values leaf by leaf, to name the first that differs).
        segment: with ``sequenced=True``, the :class:`Segment` the call's further collectives follow.
    """

    new: bool
    asked: bool
    drifted: bool = False
    segment: Segment | None = None


def agree(
    group: dist.ProcessGroup | None,
    what: str,
    rows: Rows | list[tuple],
    *,
    key: Hashable = None,
    signature: int | None = None,
    names: Callable[[Sequence[list[tuple]]], str] = name_difference,
    ask: bool = False,
    values: int | None = 0,
    sequenced: bool = False,
) -> Agreed:
    """Make every rank agree that it is about to run the same call.

    Args:
        group: the process group.
        what: the public function's name, for messages.
        rows: what the ranks must share, as rows (or a function that builds them: it runs only
            where the digest is not known yet, or to name a difference).
        key: a cheap local stand-in for the rows, under which their digest is kept.
        signature: the rows' digest, where the caller keeps it itself (the hot path's plan cache).
        names: words for the first difference between per-rank rows.
        ask: this rank would like the tree checked further if it is new (a tree fresh from
            ``fddp.functionalize``: the replicas' values); the answer is every rank's.
        values: a sampled :func:`replica_digest` of values that must be equal on every rank (0
            or ``None``: none to compare).
        sequenced: the call issues a sequence of collectives that its signature does not fix (a
            fully sharded forward and its backward): the ranks learn it, then check it before
            each collective (:class:`Segment`, in the result).

    Returns:
        :class:`Agreed`, the same on every rank, so the caller's further collectives match.

    Raises:
        MismatchError: on every rank, when the ranks' headers differ.
        PeerError: on every rank but the failing one, when a rank announced a failure instead.

    Example:
        >>> rows = [("option every", "8", None)]
        >>> agree(group, "diloco.step", rows)
    """
    return start_agreement(
        group, what, rows, key=key, signature=signature, names=names, ask=ask, values=values, sequenced=sequenced
    ).finish()


def start_agreement(
    group: dist.ProcessGroup | None,
    what: str,
    rows: Rows | list[tuple],
    *,
    key: Hashable = None,
    signature: int | None = None,
    names: Callable[[Sequence[list[tuple]]], str] = name_difference,
    ask: bool = False,
    values: int | None = 0,
    sequenced: bool = False,
    early: bool = False,
    inband: bool = False,
) -> Agreement:
    """Send this call's header and return at once (the arguments are :func:`agree`'s).

    The call is numbered now; the caller must :meth:`Agreement.finish` it before this call's
    other collectives on ``group``, unless ``early`` (where :func:`goes_early` said so): then its
    buckets may go out first, and the caller finishes the agreement before it returns anything.

    With ``inband`` too (the caller's first collective is the plain all-reduce of its first
    bucket, the mean's), where the last completed call can carry one: no header is sent; the
    result's :attr:`Agreement.tail` is to be appended to that first all-reduce, whose work and
    reduced tail the caller hands back with :meth:`Agreement.carried` (see "In band").
    """
    build = rows if callable(rows) else (lambda: rows)
    if signature is None:
        signature = signature_digest(key, build) if key is not None else digest(build())
    if torch.compiler.is_compiling():
        # A compiled call's header is in its graph: the signature's digest (taken at trace time)
        # and the function, compared at every call. The call numbers and the state live outside
        # the graph, so a compiled step checks less than an eager one: what it runs, not when.
        if checks().agreement:
            _traced_agreement(group, what, signature)
        return Agreement(None, None, Agreed(False, False))
    st = state(group)
    raise_if_failed(st, what)
    if _asked:
        _collect()
    new = signature not in st.seen
    replicas = st.seen.get(signature)
    asked = ask and new
    call_ = st.agreed
    st.agreed += 1  # the call happens, if only to fail: the ranks stay numbered alike
    on = checks().agreement
    # With the agreement off, known trees send no header; the first call after turning it off
    # still sends one (saying so), so that a rank that turned it off alone is named, not met by
    # its peers' headers with its buckets.
    if size(group) > 1 and (on or new or st.last_mode is not False):
        name = name_digest(what)
        key_ = (signature, name)
        segment = Segment(group, key_, what, call_) if sequenced and on else None
        f = frame(st)
        if f is not None:
            f.sent = True
        st.last_mode = on
        printed = (values or 0) if checks().replicas and replicas is not False else 0
        learn = int(sequenced and on and key_ not in st.recordings)
        flags = st.requests
        carrier = st.last[3] if st.last is not None else None
        if carrier is not None:
            # The last call can carry the header in band: every rank's first message is an
            # all-reduce of its first bucket's size with a tail, the bucket itself or zeros.
            inband = bool(early and inband)
            numel, dtype = carrier
            both = [signature, call_, name, printed, int(on), 0]
            t = _header.tail(both, size(group), dtype, new=int(new), asked=int(asked), learn=learn, flags=flags, inband=inband)
            context = (group, what, st, signature, call_, build, names, replicas, early, segment, flags, inband, (t, both))
            if inband:
                return Agreement(None, None, None, context, call_, tail=t)
            return Agreement(*probe(group, numel, t), None, context, call_)
        went = _early_digest(st.last) if early else 0
        t = _header.build([signature, call_, name, printed, int(on), went], int(new), int(asked), learn, flags)
        context = (group, what, st, signature, call_, build, names, replicas, early, segment, flags, None, None)
        return Agreement(t, _header.exchange(t, group, what), None, context, call_)
    _remember(st, signature, replicas)
    if size(group) == 1:  # nobody else to tell: this rank's requests are the group's
        st.requested |= st.requests
        st.requests = 0
    return Agreement(None, None, Agreed(new, asked), (), call_)  # one rank, or a known tree with the agreement off


def probe(group: dist.ProcessGroup | None, numel: int, tail: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Send zeros in place of the last call's first bucket, followed by ``tail``: what a rank
    whose peers may carry their header in band sends in place of a header. Returns the tail's
    view (read once the work completes) and the work."""
    probe = torch.zeros(numel + tail.numel(), dtype=tail.dtype)
    probe[numel:] = tail
    return probe[numel:], dist.all_reduce(probe, group=group, async_op=True)


def _traced_agreement(group: dist.ProcessGroup | None, what: str, signature: int) -> None:
    """The header of a compiled call: a functional all-reduce in the graph, and an assertion that
    fails, on every rank alike, where the ranks' signatures or functions differ."""
    name = traced_digest(what)
    # The eager header's size and layout (call number -1: a graph keeps no count), so that a
    # compiled call that meets an eager one on another rank pairs with its header, not its
    # buckets: the eager rank raises too, instead of an abort in the backend.
    t = _header.build([signature, -1, name, 0, 1, 0], device=collective_device(group))
    out = funcol.wait_tensor(funcol.all_reduce(t, "max", group if group is not None else dist.group.WORLD))
    both = _header.BOTH
    torch._assert_async(
        (out[:both] == -out[both : 2 * both]).all() & (out[_header.FAILED] == 0),
        f"fddp.{what} (compiled): the ranks disagree on what they synchronise: the tree's structure, shapes or dtypes, "
        "an option (bucket caps, compression), or the fddp function (every rank must run the same compiled step, "
        "the same number of times). Run the step once without torch.compile: the eager agreement names the difference.",
    )


def _remember(st: GroupState, signature: int, replicas: bool | None) -> None:
    """Note that the ranks agreed on ``signature``, and what their fingerprints said (the most
    recent ``REMEMBERED`` are kept)."""
    st.seen[signature] = replicas
    st.seen.move_to_end(signature)
    if len(st.seen) > REMEMBERED:
        st.seen.popitem(last=False)
    st.last = None  # until the call completes (completed): a call that fails leaves no plan to go early on
    st.before, st.prev = st.prev, None  # the call completed before this one; this one, once it completes


# The header in band (see the module's "In band"); False sends a separate header always, the
# path before it (benchmarks compare the two).
INBAND = True


def goes_early(group: dist.ProcessGroup | None, what: str, signature: int) -> bool:
    """Whether this call may send its buckets without waiting for its header: it repeats the last
    call the ranks agreed on and completed on ``group`` (the same decision on every rank that is
    at the same call)."""
    if torch.compiler.is_compiling() or not checks().agreement:
        return False
    st = state(group)
    last = st.last
    return last is not None and last[0] == signature and last[1] == name_digest(what) and st.failed is None and size(group) > 1


_CARRIERS = (torch.float32, torch.float64)  # sums of 0/1 and counts stay exact below 2**24 ranks


def completed(
    group: dist.ProcessGroup | None,
    what: str,
    signature: int,
    collectives: Sequence[tuple] | None,
    call: int | None = None,
    carrier: bool = False,
) -> None:
    """Note that the call agreed as ``signature`` completed, having issued ``collectives`` (each an
    all-reduce, as ``(numel, dtype, device)``; ``None``: other kinds, which cannot go early).

    With ``call`` (its number among the group's agreements), only if it is still the last agreed
    call: a synchronisation finished later (``fddp.diloco``'s in flight) must not stand for the
    calls agreed since, which every rank records alike. With ``carrier`` (the first collective
    is the plain sum of a bucket), a CPU float32/float64 first bucket on a two-rank group that
    carries its own headers can carry the next repeat's header in band. Two ranks only: the tail
    lengthens the all-reduce, which moves gloo's chunk boundaries, and so the order in which three
    or more ranks' values are summed; a sum of two is the same in any order, so the mean stays
    bitwise torch DDP's.
    """
    if torch.compiler.is_compiling():
        return
    st = state(group)
    if call is not None and st.agreed != call + 1:
        return
    name = name_digest(what)
    record = None
    if collectives is not None and checks().agreement:
        first = collectives[0] if collectives else None
        can_carry = (
            carrier and INBAND and first is not None and first[1] in _CARRIERS and first[2].type == "cpu"
            and control_group(group) is group and st.size is None and size(group) == 2
        )  # fmt: skip
        record = (signature, name, tuple(collectives), (first[0], first[1]) if can_carry else None)
    # The agreed history is every rank's, so is what it predicts: the call that followed this one
    # the last time it completed (a loop that alternates grad_and_value and a broadcast, say), or,
    # before any has, this call again.
    key = (signature, name)
    if st.before is not None:
        st.successors[st.before] = record
        st.successors.move_to_end(st.before)
        if len(st.successors) > REMEMBERED:
            st.successors.popitem(last=False)
    st.prev, st.before = key, None
    st.last = st.successors.get(key, record) if checks().agreement else None


def _early_digest(last: tuple | None) -> int:
    """The digest of the collectives a rank that goes early issues (the last completed call's)."""
    return 0 if last is None else digest(tuple((n, str(dtype)) for n, dtype, _ in last[2])) or 1


def drain(group: dist.ProcessGroup | None, st: GroupState, what: str, went: int = 0, skip: int = 0) -> None:
    """A peer went early with the last completed call's buckets (``went``: their digest) while this
    rank did not: send zeros in their place (the same all-reduces: their sizes are the ones every
    rank agreed on), so that the group stays in step while every rank raises. Where this rank does
    not know those collectives (its history is not its peers'), nothing can pair with them: fail
    the group instead of issuing collectives of other sizes. ``skip``: the first collectives,
    already paired (in band: the first bucket met this rank's zeros and tail)."""
    last = st.last
    if last is None or (went and _early_digest(last) != went):
        e = MismatchError(
            f"fddp.{what}: a peer sent its buckets before this call's header (its call repeats the last one the ranks "
            "completed), but this rank holds no such call: the ranks' histories on this group differ."
        )
        fail(group, what, e)
        raise e
    works = [dist.all_reduce(torch.zeros(n, dtype=dtype, device=device), group=group, async_op=True) for n, dtype, device in last[2][skip:]]
    for w in works:
        wait(w, group, what, "the zeros sent in place of a peer's early buckets")


class Agreement:
    """A call's agreement under way: its header is on the wire (made by :func:`start_agreement`).

    ``fddp.grad_and_value`` starts it once the forward pass has run and finishes it when backward
    has its first bucket ready, so that the header's round trip overlaps the backward that fills
    that bucket.

    Example:
        >>> agreement = start_agreement(group, "grad_and_value", rows, signature=sig)
        >>> ...  # work that issues no collective on group
        >>> agreement.finish()  # before this call's first bucket
    """

    __slots__ = ("header", "work", "result", "context", "call", "tail")

    def __init__(
        self,
        header: torch.Tensor | None,
        work: Any,
        result: Agreed | None,
        context: tuple = (),
        call: int | None = None,
        tail: torch.Tensor | None = None,
    ) -> None:
        self.header, self.work, self.result, self.context = header, work, result, context
        self.call = call  # the call's number among the group's agreements (None: a compiled call's)
        self.tail = tail  # in band: the tail the caller appends to its first all-reduce

    def carried(self, reduced: torch.Tensor, work: Any) -> None:
        """In band: the first all-reduce carrying :attr:`tail` is issued; ``reduced`` is the tail's
        place in its buffer, valid once ``work`` completes."""
        self.header, self.work, self.tail = reduced, work, None

    def finish(self) -> Agreed:
        """Wait for the header; return what every rank learned.

        Raises:
            MismatchError: on every rank, when the ranks' headers differ.
            PeerError: on every rank that did not fail, when a rank announced a failure.
        """
        if self.result is not None:
            return self.result
        group, what, st, signature, call_, rows, names, replicas, early, segment, flags, inband, mine = self.context
        if self.work is None:
            e = RuntimeError(f"fddp.{what}: internal error: an agreement in band whose first bucket never went out")
            fail(group, what, e)
            raise e
        wait(self.work, group, what, "the agreement on this call")
        if inband is None:
            h = self.header.tolist()
            went = h[_header.EARLY] and not early
        else:
            h, carried = _header.from_tail(self.header, size(group), mine)
            went = carried and not inband
        # Every rank read the same header: its requests are learnt here, even by a call that raises.
        st.requested |= _header.flags_of(h)
        st.requests &= ~flags
        if went:  # a peer's buckets are on their way: meet them with zeros (in band: all but the first)
            drain(group, st, what, h[_header.EARLY] if inband is None else 0, skip=0 if inband is None else 1)
        if h[_header.FAILED]:
            raise_announced(group, st, what, call_, h[_header.FAILED])
        if not _header.agrees(h):
            disagree(group, what, call_, rows, names, seen=h)
        # Fingerprints compare only values that were equal once (replicas, after fddp.broadcast):
        # a tree whose values differ at its first comparison differs by design and is left alone;
        # a rank that sent none (0: its values live on a GPU) leaves this call uncompared.
        high, low = h[_header.PRINT], -h[_header.BOTH + _header.PRINT]
        compared = low != 0
        equal = high == low
        drifted = compared and not equal and replicas is True
        if compared:
            replicas = True if equal and replicas is not False else (replicas is True)
        _remember(st, signature, replicas)
        if segment is not None:
            segment.learning = bool(h[_header.LEARN])  # every rank's answer: one without the recording makes all learn
            if not segment.learning:
                segment.expected = st.recordings[segment.key]
                st.recordings.move_to_end(segment.key)
        self.result = Agreed(bool(h[_header.NEW]), bool(h[_header.ASKED]), drifted, segment)
        return self.result


# Requests not yet moved into their group's state, as (group, bits). A deque's append and popleft
# are atomic: a signal handler (which runs between two bytecodes of the main thread, possibly
# inside an agreement) or another thread appends, and only agreements and take_requested move
# them, so no read-modify-write of a group's state can lose a bit.
_asked: "collections.deque[tuple[Any, int]]" = collections.deque()


def _collect() -> None:
    """Move the requests made since the last agreement into their groups' state."""
    while _asked:
        try:
            group, bits = _asked.popleft()
        except IndexError:  # another thread took the last one
            return
        state(group).requests |= bits


def request(group: dist.ProcessGroup | None, bits: int) -> None:
    """Ask every rank of ``group`` for something (``bits``, below ``2**FLAG_BITS``): the bits ride
    in this rank's next agreement header on the group, and every rank learns them from that
    call's agreement, without a collective of their own (see :func:`take_requested`).

    Safe in a signal handler and from another thread: it only appends to a queue, which the next
    agreement on any group reads (no lock, no collective, no read-modify-write of the group's
    state that the interrupted code may be in the middle of).

    Example:
        >>> request(None, _header.PREEMPT)  # from a SIGTERM handler: save at the next step boundary
    """
    if not (isinstance(bits, int) and 0 < bits < 1 << _header.FLAG_BITS):
        raise ValueError(f"fddp: request bits must be an int in [1, {1 << _header.FLAG_BITS}), got {bits!r}")
    _asked.append((group, bits))


def take_requested(group: dist.ProcessGroup | None, mask: int = (1 << _header.FLAG_BITS) - 1) -> int:
    """Return the or of every rank's request bits (those in ``mask``: a caller takes only its own)
    in the agreements on ``group`` since the last call, and forget them. Every rank that calls it
    at the same point of the same sequence of fddp calls gets the same bits (a one-rank group: its
    own requests at once).

    Example:
        >>> if take_requested(None, _header.PREEMPT):  # at a step boundary, on every rank alike
        ...     save()
    """
    if _asked:
        _collect()
    st = state(group)
    if size(group) == 1:
        st.requested |= st.requests
        st.requests = 0
    bits = st.requested & mask
    st.requested &= ~mask
    return bits


def agreements(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(epoch, number of agreements on group in it)``: the same on every rank at the same point
    of the same sequence of fddp calls. Where it has not moved since a point, no header (and no
    request) has travelled on the group since then.

    Example:
        >>> before = agreements(None)
        >>> ...  # a step
        >>> if agreements(None) == before: ...  # nothing carried a request: agree now
    """
    st = state(group)
    return st.epoch, st.agreed
