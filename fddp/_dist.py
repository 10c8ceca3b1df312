"""The per-group distributed state: calls, waits that watch for failures, and agreement.

Everything fddp needs to know about a process group between calls lives here, per group object
(weakly held: a destroyed group takes its state with it) and per membership *epoch* of that group
(:func:`begin_epoch`: a fault-tolerant run's quorum change starts a new one, with fresh call
numbers and checks, and the rank and world size the quorum gives).

**Calls.** Every fddp function that communicates runs inside :func:`call` on its group. It keeps
other threads out while it runs, and it decides what a failure means for the peers:

- an exception this rank raises before it sent anything for the call (a validation error, an
  exception from ``loss_fn`` in the forward pass) is *announced*: its report goes to the group's
  error channel (``fddp._channel``) and a header that says "rank r failed" takes the place of the
  call's agreement, so every peer raises :class:`PeerError` at that call, and the group stays
  usable for the next one (a retry after a caught out-of-memory error works);
- an exception after this rank sent something (in backward, between two buckets, inside a
  fully sharded forward) is *fatal*: the peers are, or will be, waiting in collectives this rank
  will never join. It is posted on the channel; every fddp wait that lasts more than a moment
  reads it, so every peer raises :class:`PeerError` within a fraction of a second; and the group
  refuses every later fddp call, on every rank, with the same words (its collectives cannot be
  matched again: the run must restart, or, under fault tolerance, start a new epoch).

**Waits.** :func:`wait` waits for a collective in short slices; between slices it reads the
channel and, once stuck for a few seconds, posts what it waits for on a board that finds ranks
waiting in *different* collectives (one on a new group, another on the default group), which is
a deadlock: each raises :class:`MismatchError` instead of waiting out the timeout.

**Agreement.** Before the bytes of a synchronisation move, every rank of the group all-reduces one
fixed-size header: a digest of the call's signature (the tree's structure, shapes, dtypes and the
options that shape its collectives), the number of agreed calls this rank has made on the group,
the fddp function being called, and a fingerprint of the replicated values. The header has the
same size on every rank whatever they are about to do, so it cannot itself mismatch: a rank that
runs another tree, is a call behind or ahead, holds other parameters, or failed, makes every rank
raise the same error naming what differs, instead of a silently wrong mean or an abort inside the
backend. :func:`set_checks` turns it off.
"""

from __future__ import annotations

import collections
import datetime
import functools
import hashlib
import struct
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from fddp import _caches, _channel
from fddp._channel import Failure

__all__ = [
    "MismatchError",
    "PeerError",
    "collective",
    "collective_device",
    "rank",
    "size",
    "begin_epoch",
    "epoch",
    "Segment",
    "describe_token",
    "owe",
    "raise_if_failed_here",
    "count_call",
    "call_count",
    "wait",
    "call",
    "entry",
    "fail",
    "agree",
    "start_agreement",
    "Agreement",
    "Agreed",
    "digest",
    "fingerprint",
    "Checks",
    "set_checks",
    "checks",
]

class _Costs:
    """What ``benchmarks/step.py``'s ``*_lean`` modes switch off to measure what they cost: the
    error channel (sliced waits, announced and posted failures) and the fingerprint in the header.
    Not an option for users: without them a failure is a hang again."""

    channel = True
    fingerprint = True


_costs = _Costs()

_REMEMBERED = 256  # agreed signatures kept per group: a loop uses a handful, a sweep must not grow without bound
_SLICE = datetime.timedelta(milliseconds=100)  # a wait looks at the channel this often
_STUCK_S = 2.0  # a rank waiting this long posts what it waits for (deadlock detection)


class MismatchError(RuntimeError):
    """Ranks disagree on what they are about to run: a tree (structure, leaf paths, shapes, dtypes
    or devices), an option that shapes the collectives (bucket caps, compression, weight), the
    order of fddp calls (a rank a call behind or ahead), the group, or the kind of call; or, where
    checked, on values that must be identical (the parameters, the replicas).

    Raised on every rank of the group, with the same message, before any bucket is sent: the
    alternative is a hang, a crash inside the backend, or a silent mix of unrelated values.

    Example:
        >>> try:
        ...     grads = fddp.ddp_step(params, grads)
        ... except fddp.MismatchError as e:
        ...     print(e)  # names the first leaf or option where the ranks differ
    """


class PeerError(RuntimeError):
    """Another rank of the group failed inside an fddp call, and this rank stopped waiting for it.

    The message names the rank, its fddp call and its exception (type and message). The failing
    rank itself raises its own exception. When the failure left collectives unmatched
    (``fatal``), the group refuses every later fddp call with this error on every rank: end the
    run and restart it from a checkpoint (``torchrun --max-restarts``), or start a new membership
    epoch under fault tolerance. Otherwise (the peer failed before it sent anything) the group
    is still in step, and the next call may go on.

    Attributes:
        rank: the failing rank.
        what: the fddp function it failed in.
        kind: its exception's type name.
        cause: its exception's message.
        fatal: whether the group can no longer carry fddp calls.

    Example:
        >>> try:
        ...     grads, loss = step(params, x, y)
        ... except fddp.PeerError as e:
        ...     print(e.rank, e.kind)  # 1 ValueError
    """

    def __init__(self, message: str, failure: Failure) -> None:
        super().__init__(message)
        self.rank, self.what, self.kind, self.cause, self.fatal = failure.rank, failure.what, failure.kind, failure.message, failure.fatal


MismatchError.__module__ = "fddp"  # raised and caught as fddp.MismatchError
PeerError.__module__ = "fddp"


def collective(e: BaseException) -> BaseException:
    """Mark ``e`` as raised on every rank alike (decided from agreed values): it leaves the group
    in step, so :func:`call` neither announces nor posts it. Returns ``e``, to ``raise collective(...)``."""
    e._fddp_collective = True  # type: ignore[attr-defined]
    return e


def _is_collective(e: BaseException) -> bool:
    return isinstance(e, (MismatchError, PeerError)) or getattr(e, "_fddp_collective", False)


class _Frame:
    """One fddp call in progress on a group (calls nest: a ``loss_fn`` may call fddp)."""

    __slots__ = ("what", "sent", "headerless")

    def __init__(self, what: str, headerless: bool) -> None:
        self.what, self.sent, self.headerless = what, False, headerless


class _GroupState:
    def __init__(self, epoch: int = 0, rank: int | None = None, size: int | None = None, store: Any = None) -> None:
        self.calls: dict[str, int] = {}
        self.agreed = 0  # headers exchanged on this group: the call number every rank must share
        # Agreed digests (LRU), each with what the fingerprints said: None (none compared yet), True
        # (they were equal once: these are replicas), False (they differed at the first
        # comparison: values that differ by design, no longer fingerprinted).
        self.seen: collections.OrderedDict[int, bool | None] = collections.OrderedDict()
        self.owner: int | None = None  # the thread inside an fddp call on this group
        self.owner_name = ""
        self.owner_what = ""
        self.depth = 0
        self.frames: list[_Frame] = []
        self.epoch = epoch
        self.rank, self.size = rank, size  # from the quorum (begin_epoch); None: torch.distributed's
        self.store = store  # the channel's store (begin_epoch); None: the group's own
        self.channel: _channel.Channel | None = None
        self.failed: Failure | None = None  # a fatal failure: this group carries no more fddp calls
        self.mine = False  # ... and it was this rank's
        self.last_mode: bool | None = None  # the agreement setting at this rank's last header (None: none yet)
        self.held: list[Any] = []  # announcements' headers in flight (kept until they complete)
        self.waits = 0  # numbers this rank's waits, for the board
        self.recordings: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()  # agreed sequences, LRU
        self.owed = 0  # collectives of an earlier call still to come on this group (a backward)


_lock = threading.Lock()
_states: "weakref.WeakKeyDictionary[Any, _GroupState]" = weakref.WeakKeyDictionary()


def _forget() -> None:
    with _lock:
        _states.clear()
        _last[0] = _last[1] = None
    _channel.next_generation()  # on every rank alike: a new generation reads no old failure


_caches.register("fddp._dist._states", _forget)


# The group last asked about (weakly: a group the script destroys must not live on here, with
# gloo's threads, until interpreter shutdown) and its state: a call asks several times.
_last: list[Any] = [None, None]


def _state(group: dist.ProcessGroup | None) -> _GroupState:
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        return _GroupState()  # no process group at all (a faked world): nothing to remember
    last_ref, last_st = _last
    if last_ref is not None and last_ref() is pg and last_st is not None:
        return last_st
    st = _states.get(pg)
    if st is None:
        with _lock:
            st = _states.get(pg)
            if st is None:
                st = _states[pg] = _GroupState()
    _last[0], _last[1] = weakref.ref(pg), st
    return st


# --- membership -----------------------------------------------------------------------------------


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group``: the quorum's under fault tolerance (:func:`begin_epoch`),
    else torch.distributed's."""
    if torch.compiler.is_compiling():
        return dist.get_rank(group)  # dynamo traces no state (a fault-tolerant step runs eagerly)
    st = _state(group)
    return st.rank if st.rank is not None else dist.get_rank(group)


def size(group: dist.ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (the quorum's under fault tolerance, else torch.distributed's)."""
    if torch.compiler.is_compiling():
        return dist.get_world_size(group)
    st = _state(group)
    return st.size if st.size is not None else dist.get_world_size(group)


def begin_epoch(group: dist.ProcessGroup | None, *, rank: int, world_size: int, store: Any = None, epoch: int | None = None) -> int:
    """Start a new membership epoch of ``group``: fresh call numbers, agreed signatures and
    failure state, with this rank and world size (a fault-tolerant run's quorum gives them).

    Every member of the new epoch must call it before its first fddp call in the epoch. Failures
    of the old epoch stay there: a group poisoned by a dead peer is usable again once the
    survivors begin a new epoch on its reconfigured process group.

    Args:
        group: the process group whose membership changed.
        rank: this process's rank in the new membership.
        world_size: the number of members.
        store: the store the members share for the error channel (under fault tolerance, the
            quorum's); ``None``: the group's own.
        epoch: the new epoch's number, the same on every member (under fault tolerance, the
            quorum's id: a member that joins late has begun fewer epochs than the others);
            default: the previous epoch's plus one.

    Returns:
        The new epoch's number (0 for the first).

    Example:
        >>> e = begin_epoch(group, rank=quorum.rank, world_size=quorum.size, store=quorum.store)
    """
    if not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
        raise ValueError(f"fddp: an epoch needs 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}")
    if epoch is not None and not (isinstance(epoch, int) and epoch >= 0):
        raise ValueError(f"fddp: an epoch's number must be an int >= 0, got {epoch!r}")
    pg = group if group is not None else dist.group.WORLD
    with _lock:
        old = _states.get(pg)
        n = epoch if epoch is not None else 0 if old is None else old.epoch + 1
        _states[pg] = _GroupState(n, rank, world_size, store)
        _last[0] = _last[1] = None
    return n


def epoch(group: dist.ProcessGroup | None = None) -> int:
    """The membership epoch of ``group`` (0 until :func:`begin_epoch`)."""
    return _state(group).epoch


def _label(group: dist.ProcessGroup | None) -> str:
    pg = group if group is not None else dist.group.WORLD
    if pg is dist.group.WORLD:
        return "the default group"
    try:
        return f"group {pg.group_name!r} (ranks {dist.get_process_group_ranks(pg)})"
    except Exception:  # noqa: BLE001 - a group torch.distributed does not know (a fault-tolerant one)
        return "a process group of its own"


def _channel_of(st: _GroupState, group: dist.ProcessGroup | None) -> _channel.Channel | None:
    """The group's error channel (made on first use), or None where the group has no store."""
    if st.channel is None:
        store = st.store
        if store is None:
            try:
                pg = group if group is not None else dist.group.WORLD
                store = dist.distributed_c10d._get_process_group_store(pg)
            except Exception:  # noqa: BLE001 - a group torch.distributed does not register
                return None
        # An epoch's own store is shared by its members only; they need not have cleared fddp's
        # caches alike (a member that joined late is a new process), so the generation stays out.
        scope = f"fddp/e{st.epoch}" if st.store is not None else f"fddp/g{_channel.generation()}/e{st.epoch}"
        st.channel = _channel.Channel(store, scope)
    return st.channel


_boards: list[Any] = [None, -1]


def _board() -> _channel.Board | None:
    """The deadlock board, on the default group's store (every rank of the job shares it)."""
    if _boards[1] != _channel.generation():
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001
            return None
        _boards[0], _boards[1] = _channel.Board(store, f"fddp/g{_channel.generation()}"), _channel.generation()
    return _boards[0]


# --- checks ---------------------------------------------------------------------------------------


class Checks(NamedTuple):
    """Which cross-rank checks fddp makes (see :func:`set_checks`).

    Attributes:
        agreement: every synchronisation first agrees on a fixed-size header (signature, call
            number, function): one small all-reduce per call.
        replicas: the first synchronisation of a new tree compares a checksum of the parameters
            across the ranks (``grad``/``grad_and_value``'s differentiated arguments, ``ddp_step``'s
            ``params``): a forgotten ``fddp.broadcast(params)`` is an error, not 50 silent steps;
            and every call's header carries a fingerprint of them, so replicas that drift apart
            (a rank that skipped an update, resumed from another checkpoint) are caught at the
            next call.

    Example:
        >>> fddp.checks().agreement
        True
    """

    agreement: bool = True
    replicas: bool = True


_checks = Checks()


def set_checks(*, agreement: bool | None = None, replicas: bool | None = None) -> Checks:
    """Turn fddp's cross-rank checks on or off, for every group of this process; return the new setting.

    Every rank must make the same choice: the header is part of every call, so a rank with it off
    meets its peers' headers with its buckets (the ranks' first call after the change is checked:
    the setting rides in the header of the call that makes it). Both are on by default. With
    ``agreement=False`` a synchronisation skips its header (one small all-reduce, a latency per
    call): ranks that diverge then give a silently wrong mean or an error from the backend instead
    of a :class:`MismatchError`, a rank that fails takes the group down (its peers still raise
    :class:`PeerError`), and a new tree is still checked once, at its first call.
    ``replicas=False`` skips the parameter checksum of a new tree and the per-call fingerprint:
    for ``ddp_step`` on values that legitimately differ between ranks.

    Example:
        >>> fddp.set_checks(agreement=False)  # on every rank, before the loop
        Checks(agreement=False, replicas=True)
    """
    global _checks
    for name, value in (("agreement", agreement), ("replicas", replicas)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"fddp.set_checks: {name} must be True, False or None (unchanged), got {value!r}")
    _checks = Checks(_checks.agreement if agreement is None else agreement, _checks.replicas if replicas is None else replicas)
    return _checks


def checks() -> Checks:
    """The cross-rank checks fddp makes now (see :func:`set_checks`).

    Example:
        >>> fddp.checks()
        Checks(agreement=True, replicas=True)
    """
    return _checks


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where small tensors for collectives on ``group`` must live (NCCL-only groups cannot reduce
    CPU tensors; gloo and mixed ``"cpu:gloo,cuda:nccl"`` groups can)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def count_call(group: dist.ProcessGroup | None, what: str) -> None:
    """Number the calls to ``fddp.<what>`` on ``group``, for the error :func:`wait` raises."""
    if torch.compiler.is_compiling():
        return  # dynamo cannot trace the state; a compiled step's errors come from the backend
    calls = _state(group).calls
    calls[what] = calls.get(what, 0) + 1


def call_count(group: dist.ProcessGroup | None, what: str) -> int:
    """The number of calls to ``fddp.<what>`` on ``group`` so far in this process."""
    return _state(group).calls.get(what, 0)


# --- failures -------------------------------------------------------------------------------------


def _peer_error(what: str, failure: Failure) -> PeerError:
    if failure.fatal:
        tail = (
            " The failure left collectives unmatched, so this process group carries no more fddp calls: end the run "
            "on every rank and restart it from the last checkpoint (torchrun --max-restarts does), or, under fault "
            "tolerance, begin a new epoch."
        )
    else:
        tail = " It failed before sending anything, so the ranks are still in step: a retry of the same call may go on."
    return PeerError(f"fddp.{what}: {failure.describe()}.{tail}", failure)


def _raise_if_failed(st: _GroupState, what: str) -> None:
    if st.failed is not None:
        if st.mine:
            raise PeerError(
                f"fddp.{what}: this process group carries no more fddp calls: this rank failed in fddp.{st.failed.what} "
                f"(its call {st.failed.call}) with {st.failed.kind}: {st.failed.message}, leaving collectives its peers "
                "wait in unmatched. End the run on every rank and restart it from the last checkpoint.",
                st.failed,
            )
        raise _peer_error(what, st.failed)


def fail(group: dist.ProcessGroup | None, what: str, e: BaseException) -> None:
    """Post ``e`` as this rank's fatal failure on ``group`` (and every other group this process
    has state for: peers may wait for it there too), and refuse every later fddp call on them.

    For a rank that finds, before issuing a collective, that it must not issue it (it left the
    agreed sequence): its peers are waiting for that collective and raise :class:`PeerError`.
    :func:`call` does the same for any exception that escapes after the call sent something.
    """
    if torch.compiler.is_compiling() or not dist.is_initialized():
        return
    st = _state(group)
    if st.failed is not None:
        return
    with _lock:
        groups = [(pg, s) for pg, s in _states.items() if s.failed is None]
    if st.rank is not None:
        # A group across fault-tolerant replica groups: this rank's other groups (its own replica
        # group's) are not waiting for it; they meet at the step's vote, and must carry the next step.
        pg = group if group is not None else dist.group.WORLD
        groups = [(pg, st)]
    for pg, s in groups:
        mine = Failure(s.rank if s.rank is not None else dist.get_rank(pg), what, s.agreed, type(e).__name__, _first_line(e), True)
        channel = _channel_of(s, pg)
        try:
            s.failed = channel.post(mine) if channel is not None else mine
        except Exception:  # noqa: BLE001 - the store is gone too: the peers' own timeouts remain
            s.failed = mine
        s.mine = s.failed == mine


def _first_line(e: BaseException) -> str:
    return (str(e).split("\n")[0] or repr(e))[:2000]


def _announce(group: dist.ProcessGroup | None, st: _GroupState, what: str, e: BaseException) -> None:
    """This rank failed before sending anything for its call: post why, then send a header that
    says so in place of the call's agreement, so the peers raise at the same call."""
    if st.owed > 0:  # a backward of an earlier call still owes its collectives: the peers will wait in them
        fail(group, what, e)
        return
    call_ = st.agreed
    st.agreed += 1
    me = rank(group)
    failure = Failure(me, what, call_ + 1, type(e).__name__, _first_line(e), False)
    channel = _channel_of(st, group)
    try:
        if channel is not None:
            channel.post(failure)
        t = torch.zeros(_HEADER, dtype=torch.int64, device=collective_device(group))
        t[_FAILED] = me + 1
        st.held = [w for w in st.held if not w.is_completed()][-8:]
        st.held.append(_exchange(t, group, what))
    except Exception:  # noqa: BLE001 - cannot announce: make it fatal, which needs nothing of the peers
        st.agreed -= 1
        fail(group, what, e)
        return
    collective(e)  # outer calls on this group see an exception every rank raises at this point


class call:
    """Run one fddp call on ``group`` (a context manager): one thread at a time, and a failure
    that every rank of the group learns.

    A second thread that starts an fddp call on the same group meanwhile raises at once: the
    ranks match collectives by their order on the group, and two threads' calls interleave
    differently on every rank. The thread inside may call fddp again (a ``loss_fn`` that
    synchronises). An exception that leaves the call is announced to the peers (before the call
    sent anything) or posted as fatal (after), as the module's docstring says; a call on a group
    that a fatal failure ended raises :class:`PeerError` at once.

    Args:
        group: the process group.
        what: the fddp function, for messages.
        headerless: the call's first collective is not an agreement header (an all-reduce of a
            sharded sum): a failure before it cannot be announced with a header, and is fatal.

    Example:
        >>> with call(group, "ddp_step"):
        ...     ...  # this call's agreement, then its collectives
    """

    __slots__ = ("group", "what", "headerless", "st", "frame")

    def __init__(self, group: dist.ProcessGroup | None, what: str, headerless: bool = False) -> None:
        self.group, self.what, self.headerless, self.st, self.frame = group, what, headerless, None, None

    def __enter__(self) -> "call":
        if torch.compiler.is_compiling() or not dist.is_initialized():
            return self  # no group yet: the call itself raises the error that says how to start one
        group = self.group if isinstance(self.group, dist.ProcessGroup) else None  # a bad group= is the call's own error
        self.group = group
        st = _state(group)
        _raise_if_failed(st, self.what)
        me = threading.get_ident()
        with _lock:
            if st.owner is not None and st.owner != me:
                raise RuntimeError(
                    f"fddp.{self.what}: thread {threading.current_thread().name!r} started a synchronisation on a "
                    f"process group while thread {st.owner_name!r} is inside fddp.{st.owner_what} on it. Collectives "
                    "on one group are matched across ranks by their order, and two threads interleave differently "
                    "on every rank; call fddp from one thread per group (give each thread its own group: "
                    "torch.distributed.new_group(), passed as group=)"
                )
            if st.owner is None:
                st.owner, st.owner_name, st.owner_what = me, threading.current_thread().name, self.what
            st.depth += 1
        self.st = st
        self.frame = _Frame(self.what, self.headerless)
        st.frames.append(self.frame)
        return self

    def without_header(self) -> None:
        """Say that this call will not start with an agreement header after all (its collectives
        are someone else's: ``grad_and_value`` on fully sharded parameters): a failure in it is
        fatal, not announced."""
        if self.frame is not None:
            self.frame.headerless = True

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> None:
        st, frame = self.st, self.frame
        if st is None:
            return
        with _lock:
            st.depth -= 1
            if st.depth == 0:
                st.owner = None
        if st.frames and st.frames[-1] is frame:
            st.frames.pop()
        if e is None or _is_collective(e) or st.failed is not None or not _costs.channel:
            return
        if size(self.group) == 1:
            return
        if frame.sent or frame.headerless or not _checks.agreement:
            fail(self.group, self.what, e)  # the peers wait in collectives this rank will not join
        else:
            _announce(self.group, st, self.what, e)


def entry(what: str, group: Callable[..., Any] | None = None, *, headerless: bool = False) -> Callable[[Callable], Callable]:
    """Make a public function one fddp call: its whole body runs inside :class:`call` on its group.

    The one way in for every function that issues a collective or must agree with its peers: a
    failure anywhere in the body (a bad argument, an OSError in housekeeping, a failure between
    two collectives) reaches every rank of the group, announced or fatal as :class:`call` decides,
    instead of leaving the peers waiting. ``tests/test_entries.py`` walks the public API and fails
    on a function that issues a collective outside such a scope.

    Args:
        what: the public name, for messages (``"checkpoint.save"``).
        group: a function of the call's arguments that returns its process group; default: the
            ``group=`` keyword argument (``None``: the default group). Where it raises (an
            argument too broken to name its group), the call runs on the default group.
        headerless: the function's first collective is not an agreement header (see :class:`call`).

    Example:
        >>> @entry("zero.gather", lambda shards, **_: shards.layout.group)
        ... def gather(shards): ...
    """

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def scoped(*args: Any, **kwargs: Any) -> Any:
            if group is None:
                g = kwargs.get("group")
            else:
                try:
                    g = group(*args, **kwargs)
                except Exception:  # noqa: BLE001 - the body raises the error that names the bad argument
                    g = None
            with call(g, what, headerless):
                return fn(*args, **kwargs)

        scoped.__fddp_entry__ = what  # type: ignore[attr-defined]
        return scoped

    return wrap


def _frame(st: _GroupState) -> _Frame | None:
    return st.frames[-1] if st.frames else None


# --- sequences ------------------------------------------------------------------------------------


class Segment:
    """The collectives of one call that its header does not fix, as tokens (a fully sharded
    forward's gathers, and its backward's gathers and reductions, whenever they run).

    The tokens of each kind of call (the header's signature and function) are *learnt* the first
    time it runs, every token agreed across the ranks before its collective is issued (a small
    all-reduce each, that first time only), and later calls of that kind *check* each token
    locally, before the collective, against the recording: a rank that would issue another
    collective, or ends the call short, fails (fatal: its peers wait in collectives it will not
    join) instead of pairing its collective with a different one on its peers. A call's segment
    travels with the call (the stage-3 pipeline holds it), so calls that interleave (several
    forwards before their backwards: micro-batches) each follow their own recording.
    """

    __slots__ = ("group", "state", "key", "what", "call", "learning", "tokens", "expected", "pos", "closed")

    def __init__(self, group: dist.ProcessGroup | None, key: tuple, what: str, call: int) -> None:
        self.group, self.key, self.what, self.call = group, key, what, call
        self.state = _state(group)  # this epoch's: a call that outlives it (fddp.clear_caches) follows nothing
        self.learning: bool | None = None  # known once the header is agreed
        self.tokens: list[tuple] = []
        self.expected: tuple = ()
        self.pos = 0
        self.closed = False

    def issue(self, op: str, t: torch.Tensor, tag: str | None = None, numel: int | None = None) -> None:
        """Say that this rank is about to issue collective ``op`` of ``t`` for this call (``tag``
        names what it carries: a bucket of a unit; ``numel``, where ``t``'s size differs between
        ranks, a size that does not). Learning, agree on it with the other ranks first; checking,
        compare it with the recording and, where it differs, fail (every rank learns it) and raise.
        """
        if self.learning is None or self.closed or torch.compiler.is_compiling():
            return  # the agreement off (nothing to follow), or a call whose sequence is over
        st = _state(self.group)
        if st is not self.state:
            return
        token = (op, tag, int(t.numel() if numel is None else numel), str(t.dtype).replace("torch.", ""))
        if self.learning:
            _agree_token(self.group, st, self, token)
            self.tokens.append(token)
            return
        expected = self.expected[self.pos] if self.pos < len(self.expected) else None
        if token != expected:
            _deviate(self, f"is about to issue {describe_token(token)}", expected)
        self.pos += 1

    def close(self, doing: str = "ends the call") -> None:
        """The call's collectives are over (its backward ran, or it has none): keep what was
        learnt, or check that nothing agreed is missing."""
        if self.closed or self.learning is None:
            return
        self.closed = True
        st = _state(self.group)
        if st is not self.state:
            return  # the group's state was cleared (fddp.clear_caches) or a new epoch began since
        if self.learning:
            st.recordings[self.key] = tuple(self.tokens)
            st.recordings.move_to_end(self.key)
            if len(st.recordings) > _REMEMBERED:
                st.recordings.popitem(last=False)
        elif self.pos < len(self.expected):
            _deviate(self, doing, self.expected[self.pos])

    def drop(self, owed: bool = False) -> None:
        """The call will never issue the rest: its graph was freed without its backward.

        ``owed``: the call had left a backward to run (:func:`owe`). Dropping it is no error when
        every rank drops it (an evaluation under grad mode whose outputs no rank differentiates:
        the same code frees them alike): this rank says so on the group's store and waits, joining
        no collective meanwhile, until every peer has said the same. A peer seen waiting in a
        collective instead (running that backward, or gone on to its next call without freeing
        the graph) fails the group on every rank. What was being learnt is not kept: the next
        call of the kind learns its sequence whole. Without ``owed``, where the recording still
        expects collectives, the peers are, or will be, waiting in them: fail.

        A failure is posted: the peers raise it, and this rank's next fddp call on the group does.
        """
        if torch.compiler.is_compiling() or not dist.is_initialized() or self.state.failed is not None:
            return
        if owed and not self.closed and self.learning is not None and _state(self.group) is self.state:
            self.closed = True
            try:
                stuck = _dropped_everywhere(self)
            except Exception as e:  # noqa: BLE001 - the store is gone (shutdown): nobody is left to wait
                stuck = None if not dist.is_initialized() else f"the store could not be read ({e})"
            if stuck is not None:
                fail(self.group, self.what, MismatchError(
                    f"fddp.{self.what}: this rank dropped a forward's graph without running its backward (its call "
                    f"{self.call + 1}), and {stuck}. Every rank must run that backward, or none: free the outputs of a "
                    "forward you do not differentiate on every rank alike (or run it under torch.no_grad())."
                ))  # fmt: skip
            return
        try:
            self.close("dropped a forward's graph without running its backward")
        except MismatchError:
            pass


def _timeout(group: dist.ProcessGroup | None) -> float:
    """The group's collective timeout, in seconds."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(collective_device(group)).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a group torch.distributed does not register
        return dist.constants.default_pg_timeout.total_seconds()


def _dropped_everywhere(seg: Segment) -> str | None:
    """Say on the group's store that this rank dropped ``seg``'s backward; wait until every rank
    has. ``None`` when they all did; else words for the peer that did not (waiting in a
    collective, on the deadlock board, or silent until the group's timeout)."""
    st, group = seg.state, seg.group
    channel = _channel_of(st, group)
    if channel is None:
        return "there is no store to ask the peers whether they dropped it too"
    n, store = size(group), channel.store
    key = f"{channel.scope}/dropped/{seg.call}"
    store.add(key, 1)
    me = dist.get_rank()
    pg = group if group is not None else dist.group.WORLD
    ranks = [r for r in (dist.get_process_group_ranks(pg) if pg is not dist.group.WORLD else range(dist.get_world_size())) if r != me]
    board = _board() if st.rank is None else None  # a fault-tolerant group posts nothing there
    deadline = time.monotonic() + _timeout(group)
    seen: dict | None = None
    while store.add(key, 0) < n:
        failure = channel.fatal()
        if failure is not None:
            st.failed = failure
            return None  # a peer failed: the next call raises its error
        if time.monotonic() > deadline:
            return f"{n - store.add(key, 0)} of its peers did not free theirs within the group's timeout"
        waiting = {r: w for r, w in (board.read(ranks) if board is not None else {}).items() if me in w.ranks}
        if waiting and waiting == seen:  # the same waits a slice apart: not a stale post
            return "; ".join(
                f"rank {r} waits in fddp.{w.what} on {w.label} instead (its call {w.call}, {w.doing})" for r, w in sorted(waiting.items())
            )
        seen = waiting
        time.sleep(_SLICE.total_seconds())
    if store.add(key + "/read", 1) == n:  # the last to read removes the keys: a long run leaves none behind
        store.delete_key(key)
        store.delete_key(key + "/read")
    return None


def describe_token(token: tuple) -> str:
    """Words for a token: ``an all-gather of bucket 3 of unit 'blocks.2' (4096 float32 values)``."""
    op, tag, numel, dtype = token
    where = f" of {tag}" if tag else ""
    article = "an" if op[0] in "aeiou" else "a"
    return f"{article} {op}{where} ({numel} {dtype} values)"


def owe(group: dist.ProcessGroup | None, n: int) -> None:
    """Count collectives of the current call still to come after it returns (``+1`` when a
    forward leaves a backward to run, ``-1`` when it has run): a failure meanwhile is fatal."""
    if not torch.compiler.is_compiling() and dist.is_initialized():
        _state(group).owed += n


def raise_if_failed_here() -> None:
    """Raise :class:`PeerError` if this rank has failed some group (its own failure, posted while
    no fddp call was there to raise it: a graph freed without its backward)."""
    with _lock:
        mine = [st for st in _states.values() if st.failed is not None and st.mine]
    if mine:
        _raise_if_failed(mine[0], mine[0].failed.what)


def _deviate(seg: Segment, doing: str, expected: tuple | None) -> None:
    n = seg.pos + 1
    agreed = f"{describe_token(expected)}" if expected is not None else "no further collective (the call's sequence is over)"
    e = MismatchError(
        f"fddp.{seg.what}: this rank {doing} as the {_ordinal(n)} collective of its call {seg.call + 1}, where the sequence "
        f"the ranks agreed on for this kind of call has {agreed}. The ranks must issue the same collectives in the same "
        "order: a forward that depends on this rank's data (a unit skipped or run in another order, an output left out "
        "of one rank's loss) pairs them with different ones on the other ranks. (fddp.set_checks(agreement=False) turns "
        "this check off, with the rest of the agreement.)"
    )
    fail(seg.group, seg.what, e)
    raise e


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _agree_token(group: dist.ProcessGroup | None, st: _GroupState, seg: Segment, token: tuple) -> None:
    """Agree on one collective of a call being learnt: the same header, its fields the token's."""
    position = len(seg.tokens)
    h = [digest((seg.key, token)), position, _TOKEN, 0, int(_checks.agreement)]
    t = _header(group, h)
    wait(_exchange(t, group, seg.what), group, seg.what, f"the agreement on its {_ordinal(position + 1)} collective")
    out = t.tolist()
    if out[_FAILED]:
        _raise_announced(group, st, seg.what, seg.call, out[_FAILED])
    if out[:_BOTH] != [-x for x in out[_BOTH : 2 * _BOTH]]:
        _disagree(group, seg.what, seg.call, lambda: [("collective", describe_token(token), None)], _no_rows, (position, token), out)


def _no_rows(per_rank: Sequence[list[tuple]]) -> str:
    return ""  # pragma: no cover - a token's mismatch is named from the tokens


# --- waits ----------------------------------------------------------------------------------------


def wait(work: Any, group: dist.ProcessGroup | None, what: str, doing: str) -> None:
    """Wait for an async collective, watching for a peer's failure; on failure say which rank,
    which call and what it was doing.

    On gloo the wait is taken in slices of a tenth of a second: between them, the group's error
    channel is read (a peer's fatal failure raises :class:`PeerError` here), and after a couple of
    seconds the deadlock board is consulted. Elsewhere (NCCL's waits do not block the host) it is
    one plain wait.
    """
    try:
        if not _costs.channel or not _sliced(group) or not hasattr(work, "is_completed") or torch.compiler.is_compiling():
            work.wait()  # NCCL's, a traced collective's, or a hook's own kind of work: one plain wait
            return
        if not _slice(work):
            _watch(work, group, what, doing)
    except (PeerError, MismatchError):
        raise
    except Exception as e:  # gloo/NCCL raise RuntimeError (or DistBackendError) on timeout
        r, w = dist.get_rank(), dist.get_world_size()
        n = call_count(group, what)
        where = f" (call {n} to fddp.{what} in this process)" if n else ""
        verb = "timed out" if "timed out" in str(e).lower() else "failed"
        raise RuntimeError(
            f"fddp.{what}: rank {r} of {w} {verb} during {doing}{where}: {e}. A peer may have crashed, "
            "be stuck, or have skipped or reordered this call (every rank must make the same fddp "
            "calls in the same order); the process group's timeout (fddp.init(timeout=...)) bounds "
            "the wait."
        ) from e


def _slice(work: Any) -> bool:
    """Wait up to one slice for ``work``; return whether it finished (a failure raises)."""
    try:
        return bool(work.wait(_SLICE))
    except RuntimeError:
        if not work.is_completed():
            return False  # the slice ran out
        work.wait()  # finished as the slice ran out, or failed: this says which
        return True


def _sliced(group: dist.ProcessGroup | None) -> bool:
    """Whether waits on ``group`` block the host (gloo: they can be taken in slices)."""
    try:
        return dist.get_backend(group) != "nccl"
    except Exception:  # noqa: BLE001 - a group torch.distributed does not register: wait plainly
        return False


def _watch(work: Any, group: dist.ProcessGroup | None, what: str, doing: str) -> None:
    """The rest of a wait that did not finish in its first slice (see :func:`wait`)."""
    st = _state(group)
    channel = _channel_of(st, group)
    started = time.monotonic()
    posted: _channel.Waiting | None = None
    suspect: list | None = None
    deadlocked = False
    try:
        while True:
            failure = channel.fatal() if channel is not None else None
            if failure is not None:
                st.failed = failure
                raise _peer_error(what, failure)
            if time.monotonic() - started > _STUCK_S:
                try:
                    posted, suspect = _check_board(st, group, what, doing, posted, suspect)
                except MismatchError:
                    deadlocked = True  # the post stays: the peers it deadlocks with must see it to raise too
                    raise
            if _slice(work):
                return
    finally:
        if posted is not None and not deadlocked:
            board = _board()
            if board is not None:
                try:
                    board.post(dist.get_rank(), None)
                except Exception:  # noqa: BLE001
                    pass


def _check_board(
    st: _GroupState, group: dist.ProcessGroup | None, what: str, doing: str, posted: Any, suspect: list | None
) -> tuple[Any, list | None]:
    """Post what this rank waits for; raise if the board shows a deadlock twice in a row."""
    board = _board()
    if board is None or st.rank is not None:
        return posted, None  # no shared store, or a fault-tolerant group (its manager watches it)
    pg = group if group is not None else dist.group.WORLD
    try:
        if posted is None:
            st.waits += 1
            ranks = tuple(dist.get_process_group_ranks(pg)) if pg is not dist.group.WORLD else tuple(range(dist.get_world_size()))
            posted = _channel.Waiting(str(pg.group_name), _label(group), ranks, st.agreed, what, doing, st.waits)
            board.post(dist.get_rank(), posted)
            return posted, None
        stuck = board.deadlock(dist.get_rank(), posted)
    except Exception:  # noqa: BLE001 - the board is a diagnosis, never a new failure
        return posted, None
    if stuck is None:
        return posted, None
    if suspect != stuck:
        return posted, stuck  # seen once: look again a slice later (a post may have been stale)
    who = "; ".join(f"rank {r} waits in fddp.{w.what} on {w.label} (its call {w.call}, {w.doing})" for r, w in stuck)
    e = MismatchError(
        f"fddp.{what}: ranks wait in different collectives, which can never complete: {who}. Every rank must make "
        "the same fddp calls on the same process groups in the same order (pass the same group= on every rank)."
    )
    fail(group, what, e)
    raise e


# --- agreement ------------------------------------------------------------------------------------


def digest(described: Any) -> int:
    """A 62-bit digest of ``repr(described)``, the same in every process (``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(repr(described).encode(), digest_size=8).digest(), "little") >> 2


_name_digest = _caches.cached(maxsize=256, name="fddp._dist._name_digest")(digest)  # function names: a handful per run


def fingerprint(leaves: Sequence[torch.Tensor]) -> int:
    """A 62-bit fingerprint of a few values of ``leaves`` (their first and last elements' bits):
    replicas hold bitwise equal values, and replicas that drifted apart differ in nearly every
    element. Reads four values, whatever the size of the tree; 0 for no leaves."""
    if not leaves:
        return 0
    picked = []
    for t in (leaves[0], leaves[-1]):
        if t.numel():
            flat = t.detach().reshape(-1)
            picked += [flat[0], flat[-1]]
    if not picked:
        return 0
    values = torch.stack([p.to(torch.float64) if not p.is_complex() else p.abs().to(torch.float64) for p in picked]).tolist()
    return digest(struct.pack(f"<{len(values)}d", *values))


# The header: these fields travel as (x, -x), so one MAX all-reduce gives each field's minimum and
# maximum; then fields that only travel as their maximum.
_SIG, _CALL, _WHAT, _PRINT, _MODE = range(5)
_BOTH = 5
_NEW, _ASKED, _FAILED, _LEARN = 2 * _BOTH, 2 * _BOTH + 1, 2 * _BOTH + 2, 2 * _BOTH + 3
_HEADER = 2 * _BOTH + 4
_TOKEN = digest("fddp: one collective of a call")  # the function field of a token's agreement


def _header(group: dist.ProcessGroup | None, both: Sequence[int], new: int = 0, asked: int = 0, learn: int = 0) -> torch.Tensor:
    """A header of every kind (a call's, a token's, a compiled call's) in the one layout: ``both``
    (the ``_BOTH`` fields) as (x, -x), then the fields that travel as their maximum."""
    return torch.tensor([*both, *[-x for x in both], new, asked, 0, learn], dtype=torch.int64, device=collective_device(group))


class Agreed(NamedTuple):
    """What every rank learned from one agreement (the same on every rank).

    Attributes:
        new: some rank meets this call's signature on this group for the first time.
        asked: some rank asked for the checks a new tree gets (``ask=True``), and the tree is new.
        drifted: the ranks run the same call, but the fingerprints of their values differ (the
            caller compares the values leaf by leaf, to name the first that differs).
        segment: with ``sequenced=True``, the :class:`Segment` the call's further collectives follow.
    """

    new: bool
    asked: bool
    drifted: bool = False
    segment: Segment | None = None


def agree(
    group: dist.ProcessGroup | None,
    what: str,
    signature: int,
    rows: Callable[[], list[tuple]],
    name_difference: Callable[[Sequence[list[tuple]]], str],
    ask: bool = False,
    values: int = 0,
    sequenced: bool = False,
) -> Agreed:
    """Make every rank agree that it is about to run the same call (:func:`start_agreement`, finished at once).

    Args:
        group: the process group.
        what: the public function's name, for messages.
        signature: this call's signature digest (:func:`digest` of its rows).
        rows: the signature as rows, to name the difference on a mismatch.
        name_difference: words for the first difference between per-rank rows.
        ask: this rank would like the tree checked further if it is new (a tree fresh from
            ``fddp.functionalize``: the replicas' values); the answer is every rank's.
        values: a :func:`fingerprint` of values that must be equal on every rank (0: none).
        sequenced: the call issues a sequence of collectives that its signature does not fix (a
            fully sharded forward and its backward): the ranks learn it, then check it before
            each collective (:class:`Segment`, in the result).

    Returns:
        :class:`Agreed`: whether the signature is new to some rank, and whether some rank asked
        (the same on every rank, so the caller's further collectives match).

    Raises:
        MismatchError: on every rank, when the ranks' headers differ.
        PeerError: on every rank but the failing one, when a rank announced a failure instead.
    """
    return start_agreement(group, what, signature, rows, name_difference, ask, values, sequenced).finish()


def start_agreement(
    group: dist.ProcessGroup | None,
    what: str,
    signature: int,
    rows: Callable[[], list[tuple]],
    name_difference: Callable[[Sequence[list[tuple]]], str],
    ask: bool = False,
    values: int = 0,
    sequenced: bool = False,
) -> Agreement:
    """Send this call's header and return at once (the arguments are :func:`agree`'s).

    The call is numbered now; the caller must :meth:`Agreement.finish` it before this call's
    other collectives on ``group``.
    """
    if torch.compiler.is_compiling():
        # A compiled call's header is in its graph: the signature's digest (taken at trace time)
        # and the function, compared at every call. The call numbers and the state live outside
        # the graph, so a compiled step checks less than an eager one: what it runs, not when.
        if _checks.agreement:
            _traced_agreement(group, what, signature)
        return Agreement(None, None, Agreed(False, False))
    st = _state(group)
    _raise_if_failed(st, what)
    new = signature not in st.seen
    replicas = st.seen.get(signature)
    asked = ask and new
    call_ = st.agreed
    st.agreed += 1  # the call happens, if only to fail: the ranks stay numbered alike
    frame = _frame(st)
    n = size(group)
    # With the agreement off, known trees send no header; the first call after turning it off
    # still sends one (saying so), so that a rank that turned it off alone is named, not met by
    # its peers' headers with its buckets.
    if n > 1 and (_checks.agreement or new or st.last_mode is not False):
        name = _name_digest(what)
        key = (signature, name)
        segment = Segment(group, key, what, call_) if sequenced and _checks.agreement else None
        if frame is not None:
            frame.sent = True
        st.last_mode = _checks.agreement
        mode = int(_checks.agreement)
        printed = values if _checks.replicas and replicas is not False else 0
        learn = int(sequenced and _checks.agreement and key not in st.recordings)
        h = [signature, call_, name, printed, mode]
        t = _header(group, h, int(new), int(asked), learn)
        context = (group, what, st, signature, call_, rows, name_difference, replicas, bool(printed), segment)
        return Agreement(t, _exchange(t, group, what), None, context)
    _remember(st, signature, replicas)
    return Agreement(None, None, Agreed(new, asked))  # one rank, or a known tree with the agreement off


traced_digest = torch.compiler.assume_constant_result(digest)  # run once, at trace time: dynamo cannot trace hashlib


def _traced_agreement(group: dist.ProcessGroup | None, what: str, signature: int) -> None:
    """The header of a compiled call: a functional all-reduce in the graph, and an assertion that
    fails, on every rank alike, where the ranks' signatures or functions differ."""
    name = traced_digest(what)
    # The eager header's size and layout (call number -1: a graph keeps no count), so that a
    # compiled call that meets an eager one on another rank pairs with its header, not its
    # buckets: the eager rank raises too, instead of an abort in the backend.
    h = [signature, -1, name, 0, 1]
    t = _header(group, h)
    out = funcol.wait_tensor(funcol.all_reduce(t, "max", group if group is not None else dist.group.WORLD))
    torch._assert_async(
        (out[:_BOTH] == -out[_BOTH : 2 * _BOTH]).all() & (out[_FAILED] == 0),
        f"fddp.{what} (compiled): the ranks disagree on what they synchronise: the tree's structure, shapes or dtypes, "
        "an option (bucket caps, compression), or the fddp function (every rank must run the same compiled step, "
        "the same number of times). Run the step once without torch.compile: the eager agreement names the difference.",
    )


def _remember(st: _GroupState, signature: int, replicas: bool | None) -> None:
    """Note that the ranks agreed on ``signature``, and what their fingerprints said (the most
    recent ``_REMEMBERED`` are kept)."""
    st.seen[signature] = replicas
    st.seen.move_to_end(signature)
    if len(st.seen) > _REMEMBERED:
        st.seen.popitem(last=False)


class Agreement:
    """A call's agreement under way: its header is on the wire (made by :func:`start_agreement`).

    ``fddp.grad_and_value`` starts it once the forward pass has run and finishes it when backward
    has its first bucket ready, so that the header's round trip overlaps the backward that fills
    that bucket.

    Example:
        >>> agreement = start_agreement(group, "grad_and_value", digest, rows, name_difference)
        >>> ...  # work that issues no collective on group
        >>> agreement.finish()  # before this call's first bucket
    """

    __slots__ = ("header", "work", "result", "context")

    def __init__(self, header: torch.Tensor | None, work: Any, result: Agreed | None, context: tuple = ()) -> None:
        self.header, self.work, self.result, self.context = header, work, result, context

    def finish(self) -> Agreed:
        """Wait for the header; return what every rank learned.

        Raises:
            MismatchError: on every rank, when the ranks' headers differ.
            PeerError: on every rank that did not fail, when a rank announced a failure.
        """
        if self.result is not None:
            return self.result
        group, what, st, signature, call_, rows, name_difference, replicas, printed, segment = self.context
        wait(self.work, group, what, "the agreement on this call")
        h = self.header.tolist()
        if h[_FAILED]:
            _raise_announced(group, st, what, call_, h[_FAILED])
        low = [-x for x in h[_BOTH : 2 * _BOTH]]
        if h[:_PRINT] != low[:_PRINT] or h[_PRINT + 1 : _BOTH] != low[_PRINT + 1 :]:
            _disagree(group, what, call_, rows, name_difference, seen=h)
        # Fingerprints compare only values that were equal once (replicas, after fddp.broadcast):
        # a tree whose values differ at its first comparison differs by design and is left alone.
        equal = h[_PRINT] == low[_PRINT]
        drifted = not equal and replicas is True
        if printed or h[_PRINT] != 0:
            replicas = True if equal and replicas is not False else (replicas is True)
        _remember(st, signature, replicas)
        if segment is not None:
            segment.learning = bool(h[_LEARN])  # every rank's answer: one without the recording makes all learn
            if not segment.learning:
                segment.expected = st.recordings[segment.key]
                st.recordings.move_to_end(segment.key)
        self.result = Agreed(bool(h[_NEW]), bool(h[_ASKED]), drifted, segment)
        return self.result


def _raise_announced(group: dist.ProcessGroup | None, st: _GroupState, what: str, call_: int, failed: int) -> None:
    """A peer announced its failure in place of this call's header: raise it here."""
    channel = _channel_of(st, group)
    unread = Failure(failed - 1, "?", call_ + 1, "unknown", "(no store to read its report from)", False)
    raise _peer_error(what, channel.announced(call_ + 1, failed - 1) if channel is not None else unread)


def _exchange(header: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> Any:
    """Start the all-reduce of the header (the maximum of every field and of its negation: min and
    max at once); return its work."""
    return dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group, async_op=True)


def _disagree(
    group: dist.ProcessGroup | None,
    what: str,
    call_: int,
    rows: Callable[[], list[tuple]],
    name_difference: Callable[[Sequence[list[tuple]]], str],
    token: tuple | None = None,
    seen: Sequence[int] = (),
) -> None:
    """The all-reduced header (``seen``, the same everywhere) says the ranks differ: tell each
    other what each is doing and raise the same error on all of them. ``token``: this rank is at
    the ``(position, token)`` collective of a call being learnt, not at a header.

    Through the group's store, not a collective: a rank that does not join in (inside a compiled
    step, whose header is in its graph, or gone) is named as silent after a few seconds instead
    of holding the others in a collective it will never enter.
    """
    thread = threading.current_thread().name
    mine = {"what": what, "call": call_, "agreement": _checks.agreement, "thread": thread, "rows": rows()}
    mine["token"] = None if token is None else (token[0], describe_token(token[1]))
    st = _state(group)
    channel = _channel_of(st, group)
    n = size(group)
    if channel is not None:
        said = channel.exchange(f"{digest(tuple(seen)):x}", rank(group), n, mine)
    else:  # a group with no store: the collective way
        said = [None] * n
        with temporarily_clear_interpreter_stack():  # its tensors must be plain, under torch.func.grad too
            dist.all_gather_object(said, mine, group=group)
    silent = [r for r, e in enumerate(said) if e is None]
    if silent:
        e = MismatchError(
            f"fddp.{what}: ranks differ in what they run, and rank(s) {silent} did not say what: they may be inside a "
            "compiled step (whose agreement is in its graph: a compiled step on some ranks and an eager call on others), "
            f"or gone. This rank is at its call {call_ + 1} (fddp.{what}). Every rank must make the same fddp calls in the "
            "same order."
        )
        fail(group, what, e)  # a rank that is not here cannot be in step
        raise e
    everyone: list[dict] = said  # type: ignore[assignment]
    if any(e["token"] is not None for e in everyone):
        def doing_of(r: int, e: dict) -> str:
            if e["token"] is None:
                return f"rank {r} starts fddp.{e['what']} (its call {e['call'] + 1})"
            n, words = e["token"]
            return f"rank {r} issues {words} as the {_ordinal(n + 1)} collective of fddp.{e['what']}'s call {e['call'] + 1}"

        doing = "; ".join(doing_of(r, e) for r, e in enumerate(everyone))
        e = MismatchError(
            f"fddp.{what}: ranks issue different collectives: {doing}. The ranks must issue the same collectives in the "
            "same order: a forward that depends on the rank's data (a unit skipped or run in another order, an output "
            "left out of one rank's loss) pairs them with different ones on the other ranks."
        )
        fail(group, what, e)  # collectives of this call may be in flight on some ranks: the group is done
        raise e
    calls = [(e["call"], e["what"]) for e in everyone]
    if len(set(calls)) > 1:
        doing = "; ".join(f"rank {r} is at its call {c + 1} (fddp.{w})" for r, (c, w) in enumerate(calls))
        raise MismatchError(
            f"fddp.{what}: ranks are at different fddp calls on this group: {doing}. Every rank must make the "
            "same fddp calls in the same order: one skipped or repeated a call (a different number of steps, "
            "or an exception caught inside a step and the loop continued)."
        )
    modes = [e["agreement"] for e in everyone]
    if len(set(modes)) > 1:
        who = ", ".join(f"rank {r} has it {'on' if m else 'off'}" for r, m in enumerate(modes))
        e = MismatchError(
            f"fddp.{what}: ranks disagree on fddp.set_checks(agreement=...): {who}. Every rank must make the same "
            "choice (a rank without the header would meet its peers' headers with its buckets)."
        )
        fail(group, what, e)  # the ranks' next calls would not match: the group is done
        raise e
    threads = [e["thread"] for e in everyone]
    hint = ""
    if len(set(threads)) > 1:  # not an error by itself (a thread pool may serve calls in turn), but a likely cause
        who = ", ".join(f"rank {r} from thread {t!r}" for r, t in enumerate(threads))
        hint = (
            f" The ranks call from different threads ({who}): if several threads call fddp on one group, their "
            "calls pair up in a different order on every rank; give each thread its own group."
        )
    raise MismatchError(f"fddp.{what}: ranks disagree on the tree or the options. {name_difference([e['rows'] for e in everyone])}{hint}")
