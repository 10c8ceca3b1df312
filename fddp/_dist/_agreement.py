"""The agreement: the one way the ranks of a group check that they are about to run the same call.

:func:`agree` (or :func:`start_agreement`, finished later) is the only entry. Every capability
describes what its ranks must share as rows (``(name, value, keys)``: a tree's paths, shapes and
dtypes, options, a step count, checksums); the rows' digest is the call's *signature*. Each call
sends one head (``_header``: a fixed-size float64 all-reduce) whose identity field is a digest of
the signature, the call's number on the group, the function and the agreement setting; the
summed head says whether every rank sent the same identity (exactly: ``n * sum(c*c) ==
sum(c)**2`` per 8-bit chunk), who announced a failure, which request bits were set, and whether
the sampled replica digests agree. Only on a difference are the rows themselves exchanged, on the
group's store, to name the first that differs (``_diagnosis``). A call that issues collectives
its signature does not fix asks for a sequence (``_sequences``).

**The data rides in the head.** A plain mean whose only bucket fits in the head's DATA slots
(float32 or float64, on the CPU) puts it there (``Agreement.send_with``, through
``fddp.sync._comm``): the call's check and its data are one collective, the one it would send
anyway. Any other call sends its head first and waits for it before its first bucket (a
``grad_and_value`` waits when backward has made that bucket, so the round trip overlaps backward).
Nothing is predicted and nothing decided locally reaches a field the ranks compare: whether the
data rides is a function of the signature, which the identity compares.

**Known calls on NCCL are checked in a batch.** Where the heads travel on a gloo side group and
the waits do not block the host (``_waits.batched``), a head per call would hold the host at every
call. There a known call (nothing to learn from its head) sends none: it joins the group's batch
(``GroupState.unheaded``), whose digest the group's next head carries in its identity. The step
boundary (:func:`settle`, from ``fddp.optim.apply_gradients``, and :func:`take_requested`) sends
that head, or the batch's :data:`UNHEADED`-th call does; it is read when the group sends its next
one (``GroupState.pending``), so no call waits for it. A difference raises there, naming the first
call in which the ranks' batches differ, and ends the group: those calls' collectives went out
unchecked. Meanwhile each batched call carries its identity in its first all-reduce
(:attr:`Agreement.stamp`, ``_header.stamp``), checked on the device, so that a mixed sum never
comes out finite.

With the agreement switched off (:func:`fddp.set_checks`), known signatures send no head; a new
one still does, and so does the first call after the switch, saying so.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fddp import _caches
from fddp._dist import _header, _waits
from fddp._dist._diagnosis import disagree, name_difference
from fddp._dist._digest import digest, name_digest, traced_digest
from fddp._dist._errors import MismatchError, PeerError
from fddp._dist._failures import fail, raise_announced, raise_if_failed
from fddp._dist._groups import REMEMBERED, GroupState, checks, control_group, data_device, frame, size, state
from fddp._dist._sequences import Segment
from fddp._dist._waits import wait

__all__ = [
    "agree", "start_agreement", "can_carry", "Agreement", "Agreed", "signature_digest", "request", "take_requested", "agreements", "settle",
    "UNHEADED",
]  # fmt: skip

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
    defer: bool = False,
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
        defer: the caller needs nothing of its peers but that their collectives match (no
            barrier, no answer read): on an NCCL group a known call then sends no head, and is
            checked with the group's batch (:func:`settle`).

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
        group, what, rows, key=key, signature=signature, names=names, ask=ask, values=values, sequenced=sequenced, defer=defer
    ).finish()


def start_agreement(
    group: dist.ProcessGroup | None,
    what: str,
    rows: Rows | list[tuple],
    *,
    key: Hashable = None,
    signature: int | None = None,
    names: Callable[[Sequence[list[tuple]]], str] = name_difference,
    ask: bool | Callable[[], bool] = False,
    values: int | None = 0,
    sequenced: bool = False,
    carry: bool = False,
    defer: bool = False,
) -> Agreement:
    """Send this call's head and return at once (the arguments are :func:`agree`'s).

    The call is numbered now; the caller must :meth:`Agreement.finish` it before this call's
    other collectives on ``group``. With ``carry`` (the call's only collective is the plain sum
    of a bucket that :func:`can_carry`), the head is not sent yet: the caller sends it with its
    data (:meth:`Agreement.send_with`) where :attr:`Agreement.open` says a head is due. ``ask``
    may be a function: it is asked only where the signature is new to this rank (the only case
    its answer counts), so a known tree's call does not pay for it. ``defer``: the caller needs
    nothing of the peers but that their collectives match (no barrier): on an NCCL group a known
    call then sends no head, and is checked with the group's batch (:func:`settle`).
    """
    build = rows if callable(rows) else (lambda: rows)
    if signature is None:
        signature = signature_digest(key, build) if key is not None else digest(build())
    if torch.compiler.is_compiling():
        # A compiled call's head is in its graph: the signature's digest (taken at trace time)
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
    if callable(ask):
        ask = new and ask()
    replicas = st.seen.get(signature)
    call_ = st.agreed
    st.agreed += 1  # the call happens, if only to fail: the ranks stay numbered alike
    on = checks().agreement
    # With the agreement off, known trees send no head; the first call after turning it off
    # still sends one (saying so), so that a rank that turned it off alone is named, not met by
    # its peers' heads with its buckets.
    if size(group) <= 1 or not (on or new or st.last_mode is not False):
        _remember(st, signature, replicas)
        if size(group) == 1:  # nobody else to tell: this rank's requests are the group's
            st.requested |= st.requests
            st.requests = 0
        return Agreement(None, None, Agreed(new, ask and new), (), call_)  # one rank, or a known tree with the agreement off
    printed = (values or 0) if checks().replicas and replicas is not False else 0
    steady = defer and on and not (new or printed or ask or sequenced)
    batched = (steady or new) and _waits.batched(group)  # asked only where it decides something
    steady = steady and batched
    if steady and len(st.unheaded) < UNHEADED - 1:
        # A known call on an NCCL group (its heads on the gloo side group): checked in a batch.
        # It sends no head; its identity joins the group's next head (the step boundary's, or
        # every UNHEADED calls), which no call waits for: the next one reads it (settle).
        _owe(group, st)
        st.unheaded.append((call_, what, signature))
        _remember(st, signature, replicas)
        a = Agreement(None, None, Agreed(False, False), (), call_)
        a.stamp = _stamp(signature, what, call_)  # its identity rides in its first all-reduce instead
        return a
    if new and batched:
        st.rows[signature] = build()  # to name this signature if a batch that holds it differs
    segment = Segment(group, (signature, name_digest(what)), what, call_) if sequenced and on else None
    if steady:  # read later: its rows from the group's record, not a closure that holds the call's tree
        kept = st.rows.get(signature, [])
        build = lambda: kept  # noqa: E731
    # Deferred where steady: the UNHEADED-th call of a batch, whose head is read later: stamped too.
    a = _send(group, st, what, signature, call_, build, names, replicas, segment, on, printed, new, ask, carry, deferred=steady)
    if steady:
        a.stamp = _stamp(signature, what, call_)
    return a


def _stamp(signature: int, what: str, call_: int) -> int:
    """A batched call's identity for its first all-reduce to carry (``_header.stamp``): where the
    ranks' calls differ it differs, whatever their numbers (``_ODD``), so the sum comes out not finite."""
    return (signature ^ name_digest(what) ^ (call_ * _ODD)) % (1 << _header.STAMP_BITS)


def _send(
    group: dist.ProcessGroup | None, st: GroupState, what: str, signature: int, call_: int, build: Rows,
    names: Callable[[Sequence[list[tuple]]], str], replicas: bool | None, segment: Segment | None, on: bool,
    printed: int = 0, new: bool = False, ask: bool = False, carry: bool = False, deferred: bool = False,
) -> Agreement:  # fmt: skip
    """Build the head of call ``call_`` and send it (``carry``: not yet, the call's data rides in
    it): the earlier head is read first, and the calls batched since then join this one's
    identity. ``deferred``: :meth:`Agreement.finish` leaves it to be read later (``pending``)."""
    if st.pending is not None:
        _settle(st)
    if st.held:
        _read_announced(group, st, what)
    name = name_digest(what)
    f = frame(st)
    if f is not None:
        f.sent = True
    st.last_mode = on
    earlier, st.unheaded = st.unheaded, []
    batch = digest(tuple(earlier)) if earlier else 0
    head = _header.build(
        digest((signature, call_, name, int(on), batch)), printed=printed, new=int(new), asked=int(ask and new),
        learn=int(segment is not None and segment.key not in st.recordings), flags=st.requests,
    )  # fmt: skip
    context = (group, what, st, signature, call_, build, names, replicas, segment, st.requests, earlier)
    a = Agreement(head, None, None, context, call_)
    if not carry:
        a.work = _header.exchange(head, group)
        a.deferred = deferred
    return a


_CARRIERS = (torch.float32, torch.float64)  # exact in the head's float64 slots


def can_carry(group: dist.ProcessGroup | None, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a sum of ``numel`` values of ``dtype`` on ``device`` can ride in a head on ``group``
    (a function of the call's signature and the group: every rank that agrees decides alike)."""
    return (
        numel <= _header.HEAD - _header.DATA and dtype in _CARRIERS and device.type == "cpu"
        and not torch.compiler.is_compiling() and control_group(group) is group
    )  # fmt: skip


def _traced_agreement(group: dist.ProcessGroup | None, what: str, signature: int) -> None:
    """The head of a compiled call: a functional all-reduce in the graph, and an assertion that
    fails, on every rank alike, where the ranks' identities differ."""
    # The eager head's size and layout (call number -1: a graph keeps no count), so that a
    # compiled call that meets an eager one on another rank pairs with its head, never with a
    # bucket: the eager rank raises too, instead of an abort in the backend.
    ident = traced_digest((signature, -1, traced_digest(what), 1))
    # On the GPU where the group uses NCCL (a mixed group's CPU head would go to its gloo backend:
    # a host wait inside the graph at every call).
    t = _header.build(ident, device=data_device(group))
    out = funcol.wait_tensor(funcol.all_reduce(t, "sum", group if group is not None else dist.group.WORLD))
    torch._assert_async(
        _header.traced_verdict(out, dist.get_world_size(group)),
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
        st.rows.pop(st.seen.popitem(last=False)[0], None)


class Agreement:
    """A call's agreement under way (made by :func:`start_agreement`): its head on the wire, or,
    where :attr:`open`, waiting for the call's data to ride in it.

    ``fddp.grad_and_value`` starts it once the forward pass has run and finishes it when backward
    has its first bucket ready, so that the head's round trip overlaps the backward that fills
    that bucket.

    Example:
        >>> agreement = start_agreement(group, "grad_and_value", rows, signature=sig)
        >>> ...  # work that issues no collective on group
        >>> agreement.finish()  # before this call's first bucket
    """

    __slots__ = ("header", "work", "result", "context", "call", "deferred", "stamp")

    def __init__(self, header: torch.Tensor | None, work: Any, result: Agreed | None, context: tuple = (), call: int | None = None) -> None:
        self.header, self.work, self.result, self.context = header, work, result, context
        self.call = call  # the call's number among the group's agreements (None: a compiled call's)
        self.deferred = False  # finish() leaves the head to be read at the group's next call (settle)
        # A batched call's identity, for its first all-reduce to carry (``fddp.sync``'s ``Comm.stamp``), else None.
        self.stamp: int | None = None

    @property
    def open(self) -> bool:
        """A head is due and not sent: the call's data is to ride in it (:meth:`send_with`)."""
        return self.header is not None and self.work is None

    def send_with(self, flat: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Send the head with ``flat`` (a bucket that :func:`can_carry`) in its DATA slots; return
        the slots (the sum, in float64, once the work completes) and the work."""
        n = flat.numel()
        data = self.header[_header.DATA : _header.DATA + n]
        data.copy_(flat if flat.dim() == 1 else flat.reshape(-1))
        self.work = _header.exchange(self.header, self.context[0], data=n)
        return data, self.work

    def finish(self) -> Agreed:
        """Wait for the head; return what every rank learned.

        Raises:
            MismatchError: on every rank, when the ranks' identities differ.
            PeerError: on every rank that did not fail, when a rank announced a failure.
        """
        if self.result is not None:
            return self.result
        if self.deferred:
            # What the head would say if it agrees: a known signature (every rank knows it: the
            # ranks' `seen` evolve alike), nothing asked, compared or learnt. If it does not, the
            # group's next head or step boundary raises (settle).
            group, st, signature, replicas = self.context[0], self.context[2], self.context[3], self.context[7]
            _remember(st, signature, replicas)
            _owe(group, st)
            st.pending = self
            self.result = Agreed(False, False)
            return self.result
        return self._read()

    def _read(self) -> Agreed:
        """Wait for the head and read it (:meth:`finish`'s work)."""
        group, what, st, signature, call_, rows, names, replicas, segment, flags, earlier = self.context
        if self.work is None:
            e = RuntimeError(f"fddp.{what}: internal error: an agreement whose data never went out with its head")
            fail(group, what, e)
            raise e
        try:
            wait(self.work, group, what, "the agreement on this call", head=True)
            v = _header.read(self.header, size(group))
            # Every rank read the same head: its requests are learnt here, even by a call that raises.
            st.requested |= v.flags
            st.requests &= ~flags
            if v.fails:
                raise_announced(group, st, what, call_, v.failed)
            if not v.agrees:
                disagree(group, what, call_, rows, names, seen=v.key, earlier=earlier, rows_of=st.rows, deferred=self.deferred)
        except (MismatchError, PeerError) as e:
            if not (earlier or self.deferred or getattr(e, "unchecked", False)):
                raise  # every rank waited for this head before any collective of the call: the group is in step
            # Calls whose collectives went out before this verdict: they are unmatched, or mixed values.
            e.add_note(
                f"fddp: found by the check of {_checked(earlier, what, call_, self.deferred)}. On an NCCL group known calls "
                "do not wait for their agreement: they are checked together, at the next step boundary (or every "
                f"{UNHEADED} calls), and the check is read at the boundary after it. Their collectives went out unchecked, "
                "so their results (and the parameters of that step) may mix values, where they are not Inf or NaN (a stamped "
                "all-reduce's); this group carries no more fddp calls "
                "(restart from the last checkpoint)."
            )
            fail(group, what, e)
            raise
        # Fingerprints compare only values that were equal once (replicas, after fddp.broadcast):
        # a tree whose values differ at its first comparison differs by design and is left alone;
        # a rank that sent none (its values live on a GPU) leaves this call uncompared.
        drifted = v.compared and not v.equal and replicas is True
        if v.compared:
            replicas = True if v.equal and replicas is not False else (replicas is True)
        _remember(st, signature, replicas)
        if segment is not None:
            segment.learning = v.learn  # every rank's answer: one without the recording makes all learn
            if not segment.learning:
                segment.expected = st.recordings[segment.key]
                st.recordings.move_to_end(segment.key)
        self.result = Agreed(v.new, v.asked, drifted, segment)
        return self.result


def _checked(earlier: list, what: str, call_: int, deferred: bool) -> str:
    """Words for the calls a head checked: ``fddp.psum's call 12 and the 30 calls before it``."""
    last = f"fddp.{what}'s call {call_ + 1}" if deferred or not earlier else f"the calls before fddp.{what}'s call {call_ + 1}"
    if not earlier:
        return last
    first_call, first_what, _ = earlier[0]
    return f"{last} ({len(earlier)} earlier calls, from fddp.{first_what}'s call {first_call + 1})"


_ODD = 0x9E3779B97F4A7C15  # odd: calls whose numbers differ (mod 2**32) never share a stamp's bits

UNHEADED = 64  # at most this many known calls of an NCCL group share one head

# The groups whose checks are outstanding (calls batched since their last head, or a head not read
# yet), keyed by their state's id, each with the thread that made them and a weak reference to the
# group (None: the default one; a group the script drops is not kept alive here): settle() visits them.
_owing: dict[int, tuple[Any, GroupState, int]] = {}
_caches.register("fddp._dist._agreement._owing", _owing.clear)


def _owe(group: dist.ProcessGroup | None, st: GroupState) -> None:
    if id(st) not in _owing:
        # The thread whose fddp call holds the group, where one does: on CUDA a backward runs on
        # autograd's device thread, and the collectives it issues for the caller's call (a
        # differentiable pmean's cotangents, inside grad_and_value) are that caller's to settle.
        thread = st.owner if st.owner is not None else threading.get_ident()
        _owing[id(st)] = (None if group is None else weakref.ref(group), st, thread)


def _settle(st: GroupState) -> None:
    """Read the head sent last on ``st``'s group (deferred): where it says the ranks differed, or
    a peer announced a failure in place of a call, every rank raises here alike (:meth:`Agreement._read`)."""
    a, st.pending = st.pending, None
    if a is not None:  # else another thread read it meanwhile (apply_gradients runs outside any call's scope)
        a._read()


_BOUNDARY = digest(("fddp: the check of the calls batched since the last one",))


def _check(group: dist.ProcessGroup | None, st: GroupState, what: str) -> None:
    """Read ``st``'s deferred head (every member sent it at the same point, long ago); send one,
    deferred, for the calls batched since."""
    _owing.pop(id(st), None)  # a deferred head puts it back (finish)
    if not st.unheaded and st.pending is None:
        return  # read meanwhile, by the group's own next head
    if state(group) is not st or (group is not None and group not in dist.distributed_c10d._world.pg_map):
        return  # a new epoch began on the group (its old calls are no one's now), or the script destroyed it
    if st.pending is not None:
        _settle(st)  # first: where it shows a difference, its words name it (the watcher may have ended the group on it)
    raise_if_failed(st, what)  # an outstanding check that can no longer be made
    if st.unheaded:
        call_ = st.agreed
        st.agreed += 1
        _send(group, st, what, _BOUNDARY, call_, list, name_difference, None, None, checks().agreement, deferred=True).finish()


def settle(what: str = "optim.apply_gradients", *, final: bool = False, every_thread: bool = False) -> None:
    """The step boundary of every NCCL group with outstanding checks: read each one's last head
    (raising where it found a difference), and send one head that checks the calls made since,
    read at the next boundary (``final``: at once). Only the groups whose batches this thread
    made (``every_thread``: all, where no other thread calls any more). ``fddp.optim.apply_gradients``
    calls it, ``checkpoint.Manager.step`` (through :func:`take_requested`; final where it saves),
    ``checkpoint.save_step``, and ``fddp.shutdown`` and ``fddp.clear_caches`` (final, every
    thread). Free where nothing is outstanding (every group but an NCCL one's).

    Example:
        >>> settle()  # raises MismatchError on every rank if the last step's ranks differed
    """
    if _owing:  # apply_gradients asks every step: nothing to copy where none is outstanding
        for _ in range(2 if final else 1):
            # Final: read the heads just sent, once every group's is out (waiting for one group's
            # before sending another's could wait for a peer that waits for that other group's first).
            me = threading.get_ident()
            for ref, st, thread in list(_owing.values()):
                # Only this thread's groups: a group another thread calls on (its own, as it must
                # be) may be inside a call, and its batch ends where that thread's steps do.
                if every_thread and st.failed is not None:
                    _owing.pop(id(st), None)  # its failure was raised already; nothing is left to check
                elif thread == me or every_thread:
                    group = None if ref is None else ref()
                    if ref is None or group is not None:
                        _check(group, st, what)
                    else:
                        _owing.pop(id(st), None)  # the script dropped the group


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


def _read_announced(group: dist.ProcessGroup | None, st: GroupState, what: str) -> None:
    """Read the heads of this rank's announced failures (``_scope._announce`` sends them without
    waiting): their sums carry the peers' request bits, which the peers learnt at those calls."""
    held, st.held = st.held, []
    for work, head in held:
        wait(work, group, what, "the head of an earlier call that this rank announced it failed", head=True)
        st.requested |= _header.read(head, size(group)).flags


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
    if st.unheaded:  # a pending head alone is left to the next boundary: it was sent just now, at apply_gradients
        _check(group, st, "checkpoint.Manager.step")
    if st.held:
        _read_announced(group, st, "checkpoint.Manager.step")
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
