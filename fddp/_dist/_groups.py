"""What fddp remembers about each process group between calls, per membership epoch.

State is kept per group object (weakly held: a destroyed group takes its state with it) and per
membership *epoch* of that group (:func:`begin_epoch`: a fault-tolerant run's quorum change starts
a new one, with fresh call numbers and checks, and the rank and world size the quorum gives).
This module also holds the process-wide switches (:func:`set_checks`) and the places a group's
ranks talk outside its collectives: the error channel on the group's store and the deadlock board
on the default store (``_channel``).
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import weakref
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fddp import _caches
from fddp._dist import _channel
from fddp._dist._channel import Failure

__all__ = [
    "GroupState",
    "Frame",
    "state",
    "states",
    "rank",
    "size",
    "begin_epoch",
    "epoch",
    "label",
    "channel_of",
    "board",
    "Checks",
    "set_checks",
    "checks",
    "collective_device",
    "data_device",
    "control_group",
    "uses_nccl",
    "backends",
    "count_call",
    "call_count",
    "REMEMBERED",
    "lock",
    "frame",
]

REMEMBERED = 256  # agreed signatures kept per group: a loop uses a handful, a sweep must not grow without bound


class Frame:
    """One fddp call in progress on a group (calls nest: a ``loss_fn`` may call fddp)."""

    __slots__ = ("what", "sent", "headerless")

    def __init__(self, what: str, headerless: bool) -> None:
        self.what, self.sent, self.headerless = what, False, headerless


class GroupState:
    """One group's state in one membership epoch."""

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
        self.frames: list[Frame] = []
        self.epoch = epoch
        self.rank, self.size = rank, size  # from the quorum (begin_epoch); None: torch.distributed's
        # torch.distributed's rank and size of the group, asked once (a group's never change; a
        # call asks several times, and each question is a few Python calls in torch)
        self.dist_rank: int | None = None
        self.dist_size: int | None = None
        self.sliced: bool | None = None  # whether its waits block the host (_waits.sliced), once asked
        self.store = store  # the channel's store (begin_epoch); None: the group's own
        self.channel: _channel.Channel | None = None
        self.failed: Failure | None = None  # a fatal failure: this group carries no more fddp calls
        self.mine = False  # ... and it was this rank's
        self.last_mode: bool | None = None  # the agreement setting at this rank's last head (None: none yet)
        self.held: list[Any] = []  # this rank's announcements, (work, head), until the next agreement reads them
        self.waits = 0  # numbers this rank's waits, for the board
        self.recordings: collections.OrderedDict[tuple, tuple] = collections.OrderedDict()  # agreed sequences, LRU
        self.owed = 0  # collectives of an earlier call still to come on this group (a backward)
        self.watched: bool | None = None  # whether the watcher reads this group's channel (None: not decided yet)
        self.requests = 0  # this rank's request bits, sent with its next head (_agreement.request)
        self.requested = 0  # the or of every rank's requests in the heads agreed since the last take_requested
        self.control: Any = None  # the group the heads travel on (control_group), once decided
        # An NCCL group's checks in batches (_agreement): its known calls since its last head, as
        # (call number, function, signature), checked by the next head; the head sent last and not
        # read yet (an Agreement); and the rows of its agreed signatures, to name a difference.
        self.unheaded: list[tuple[int, str, int]] = []
        self.pending: Any = None
        self.rows: dict[int, list[tuple]] = {}

    def busy(self) -> bool:
        """Whether this rank's peers may be waiting for it on this group: a call is in progress
        here, or a backward still owes its collectives."""
        return self.depth > 0 or self.owed > 0


lock = threading.Lock()
_states: "weakref.WeakKeyDictionary[Any, GroupState]" = weakref.WeakKeyDictionary()
# The group last asked about (weakly: a group the script destroys must not live on here, with
# gloo's threads, until interpreter shutdown) and its state: a call asks several times.
_last: list[Any] = [None, None]


def _forget() -> None:
    with lock:
        _states.clear()
        _last[0] = _last[1] = None
        _boards[0], _boards[1] = None, -1
    _channel.next_generation()  # on every rank alike: a new generation reads no old failure


_caches.register("fddp._dist._states", _forget)


# torch.distributed's record of the default group: ``dist.group.WORLD`` is two Python properties
# over its one attribute, and a call asks for its group's state a dozen times.
# (torch 2.4 to 2.13: ``_world._default_pg``; another torch reads the property).
_world = getattr(dist.distributed_c10d, "_world", None)
_DIRECT = _world is not None and "_default_pg" in vars(_world) and dist.group.WORLD is _world._default_pg


def state(group: dist.ProcessGroup | None) -> GroupState:
    """``group``'s state in its current epoch (made on first use)."""
    pg = group if group is not None else _world._default_pg if _DIRECT else dist.group.WORLD
    if pg is None:
        return GroupState()  # no process group at all (a faked world): nothing to remember
    last_ref, last_st = _last
    if last_ref is not None and last_ref() is pg and last_st is not None:
        return last_st
    st = _states.get(pg)
    if st is None:
        with lock:
            st = _states.get(pg)
            if st is None:
                st = _states[pg] = GroupState()
        _introduce()
    _last[0], _last[1] = weakref.ref(pg), st
    return st


def states() -> list[tuple[Any, GroupState]]:
    """Every group this process has state for, with its state (a snapshot)."""
    with lock:
        return list(_states.items())


# --- membership -----------------------------------------------------------------------------------


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group``: the quorum's under fault tolerance (:func:`begin_epoch`),
    else torch.distributed's."""
    if torch.compiler.is_compiling():
        return dist.get_rank(group)  # dynamo traces no state (a fault-tolerant step runs eagerly)
    st = state(group)
    if st.rank is not None:
        return st.rank
    if st.dist_rank is None:
        st.dist_rank = dist.get_rank(group)
    return st.dist_rank


def size(group: dist.ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (the quorum's under fault tolerance, else torch.distributed's)."""
    if torch.compiler.is_compiling():
        return dist.get_world_size(group)
    st = state(group)
    if st.size is not None:
        return st.size
    if st.dist_size is None:
        st.dist_size = dist.get_world_size(group)
    return st.dist_size


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
    with lock:
        old = _states.get(pg)
        n = epoch if epoch is not None else 0 if old is None else old.epoch + 1
        _states[pg] = GroupState(n, rank, world_size, store)
        _last[0] = _last[1] = None
    return n


def epoch(group: dist.ProcessGroup | None = None) -> int:
    """The membership epoch of ``group`` (0 until :func:`begin_epoch`)."""
    return state(group).epoch


def label(group: dist.ProcessGroup | None) -> str:
    """The group in words: "the default group", "group '3' (ranks [0, 1])"."""
    pg = group if group is not None else dist.group.WORLD
    if pg is dist.group.WORLD:
        return "the default group"
    try:
        return f"group {pg.group_name!r} (ranks {dist.get_process_group_ranks(pg)})"
    except Exception:  # noqa: BLE001 - a group torch.distributed does not know (a fault-tolerant one)
        return "a process group of its own"


def global_ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    """The global ranks of ``group``'s members, in group order (``None``: a group torch.distributed does not know)."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return list(range(dist.get_world_size())) if pg is dist.group.WORLD else dist.get_process_group_ranks(pg)
    except Exception:  # noqa: BLE001 - a fault-tolerant group across replica groups
        return None


def channel_of(st: GroupState, group: dist.ProcessGroup | None) -> _channel.Channel | None:
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
_introduced = [-1]  # the generation in which this process last said who it is


def board() -> _channel.Board | None:
    """The job's board, on the default group's store (every rank of the job shares it): the
    deadlock posts, and who each rank is (to name a peer that died without a word)."""
    if _boards[1] != _channel.generation():
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001
            return None
        _boards[0], _boards[1] = _channel.Board(store, f"fddp/g{_channel.generation()}"), _channel.generation()
    return _boards[0]


def _introduce() -> None:
    """Say on the board who this process is (its host and pid), once per generation: a survivor
    that loses a connection can then tell which peer on its host died (see ``_waits``)."""
    if _introduced[0] == _channel.generation() or not dist.is_initialized():
        return
    _introduced[0] = _channel.generation()
    b = board()
    if b is not None:
        try:
            b.introduce(dist.get_rank(), socket.gethostname(), os.getpid())
        except Exception:  # noqa: BLE001 - a diagnosis aid, never a failure of its own
            pass


# --- checks ---------------------------------------------------------------------------------------


class Checks(NamedTuple):
    """Which cross-rank checks fddp makes (see :func:`set_checks`).

    Attributes:
        agreement: every synchronisation first agrees on a fixed-size head (signature, call
            number, function): one small all-reduce per call.
        replicas: the first synchronisation of a new tree compares a checksum of the parameters
            across the ranks (``grad``/``grad_and_value``'s differentiated arguments, ``ddp_step``'s
            ``params``): a forgotten ``fddp.broadcast(params)`` is an error, not 50 silent steps;
            and every call's head carries a fingerprint of them, so replicas that drift apart
            (a rank that skipped an update, resumed from another checkpoint) are caught at the
            next call.

    Example:
        >>> fddp.checks().agreement
        True
    """

    agreement: bool = True
    replicas: bool = True


_checks = [Checks()]


def set_checks(*, agreement: bool | None = None, replicas: bool | None = None) -> Checks:
    """Turn fddp's cross-rank checks on or off, for every group of this process; return the new setting.

    Every rank must make the same choice, at the same point: the head is part of every call. A
    rank that turns it *off* alone is named at its next call (that call still sends a head, which
    says so). A rank that turns it back *on* alone is not: it sends a head where its peers, off,
    send a known call's buckets, and the backend aborts or, where the bucket has the head's size,
    returns a wrong sum. Both are on by default. With ``agreement=False`` a synchronisation skips
    its head (one small all-reduce, a latency per call): ranks that diverge then give a silently
    wrong mean or an error from the backend instead of a :class:`MismatchError`, a rank that fails
    takes the group down (its peers still raise :class:`PeerError`), and a new tree is still
    checked once, at its first call.
    ``replicas=False`` skips the parameter checksum of a new tree and the per-call fingerprint:
    for ``ddp_step`` on values that legitimately differ between ranks.

    Example:
        >>> fddp.set_checks(agreement=False)  # on every rank, before the loop
        Checks(agreement=False, replicas=True)
    """
    for name, value in (("agreement", agreement), ("replicas", replicas)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"fddp.set_checks: {name} must be True, False or None (unchanged), got {value!r}")
    now = _checks[0]
    _checks[0] = Checks(now.agreement if agreement is None else agreement, now.replicas if replicas is None else replicas)
    return _checks[0]


def checks() -> Checks:
    """The cross-rank checks fddp makes now (see :func:`set_checks`).

    Example:
        >>> fddp.checks()
        Checks(agreement=True, replicas=True)
    """
    return _checks[0]


def backends(group: dist.ProcessGroup | None) -> str:
    """``group``'s backends by device, as torch configured them: ``"cpu:gloo,cuda:gloo"`` for
    gloo, ``"cuda:nccl"`` for NCCL, ``"cpu:gloo,cuda:nccl"`` for a mixed group (``fddp.init``'s
    default on a GPU machine), the detected device's alone where ``init_process_group`` named no
    backend (``"cuda:nccl"`` on a GPU machine: no CPU backend). A group torch.distributed does not
    configure answers its backend's name; one it does not know at all raises, as
    ``dist.get_backend`` does (``_waits.sliced`` and the watcher wait for it plainly)."""
    try:
        return str(dist.get_backend_config(group))
    except Exception:  # noqa: BLE001 - not in torch's tables: its backend's name
        return str(dist.get_backend(group))


def uses_nccl(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` reduces CUDA tensors with NCCL (:func:`backends`: an NCCL group, a mixed
    one, or one made with no backend named on a GPU machine). Its collectives on CUDA tensors do
    not block the host, so fddp's control plane must not either: such a group's heads travel on a
    gloo side group, its waits are NCCL's, and its known calls are checked in batches."""
    return "nccl" in backends(group)


def data_device(group: dist.ProcessGroup | None = None, like: torch.device | None = None) -> torch.device:
    """Where a small tensor made from the data (a sharded norm, a finite flag, Muon's pieces) goes
    for a collective on ``group``: the GPU where the group uses NCCL (:func:`uses_nccl`; on a mixed
    group the CPU would cost a copy to the host, a sync, and a trip over gloo), else the CPU.
    Decided by the group, not by the tensor, so that a rank that holds no data (an empty shard)
    joins the same backend as its peers; which GPU: ``like`` where it is one (the data's: a script
    may place its data on ``cuda:{local_rank}`` without ``torch.cuda.set_device``), else the
    group's bound device, else the current one. Values the host made (counts, checksums) go to
    :func:`collective_device` instead."""
    if not uses_nccl(group):
        return torch.device("cpu")
    return like if like is not None and like.type == "cuda" else _gpu(group)


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where small tensors the host made go for collectives on ``group``: the CPU where the group
    has a CPU backend (gloo, mixed), else (NCCL alone) its GPU."""
    b = backends(group)
    return torch.device("cpu") if "cpu:" in b or "nccl" not in b else _gpu(group)


def _gpu(group: dist.ProcessGroup | None) -> torch.device:
    bound = getattr(group if group is not None else dist.group.WORLD, "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


# Tests set this to carry the headers of gloo groups on a side group too, the path NCCL groups
# take, so that a machine without a GPU runs it.
SIDE_CONTROL = False
_SAME = object()  # control_group: the group carries its own headers


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group on which ``group``'s headers travel: ``group`` itself on gloo (and a
    fault-tolerant group), else, where the group uses NCCL (:func:`uses_nccl`: an NCCL group or a
    mixed ``"cpu:gloo,cuda:nccl"`` one), a gloo group of the same ranks, made once, at the group's
    first header (the default group's by ``fddp.init``).

    Why: the host reads every head before it decides what the call's collectives are. On an
    NCCL group a CUDA head would make the host wait for the GPU stream at every call, which torch
    DDP never does; a CPU head on gloo costs a wait for the peers' hosts only. A mixed group could
    carry CPU heads itself, but its known calls send none (``_agreement``'s batches): a head on
    the group's own gloo backend could then pair with a peer's CPU data there. On a side group
    heads pair with heads only, whatever the calls' data (a call whose data rides in its head
    does so only where the control group is the group itself).
    """
    st = state(group)
    control = st.control
    if control is None:
        control = _SAME
        if st.size is None and (SIDE_CONTROL or uses_nccl(group)):
            pg = group if group is not None else dist.group.WORLD
            ranks = dist.get_process_group_ranks(pg)
            # Only the group's ranks take part (they all reach their first header on it at the
            # same call); the default group's is made by fddp.init, with the rest of the setup.
            control = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        st.control = control
    return group if control is _SAME else control


def count_call(group: dist.ProcessGroup | None, what: str) -> None:
    """Number the calls to ``fddp.<what>`` on ``group``, for the error a failed wait raises."""
    if torch.compiler.is_compiling():
        return  # dynamo cannot trace the state; a compiled step's errors come from the backend
    calls = state(group).calls
    calls[what] = calls.get(what, 0) + 1


def call_count(group: dist.ProcessGroup | None, what: str) -> int:
    """The number of calls to ``fddp.<what>`` on ``group`` so far in this process."""
    return state(group).calls.get(what, 0)


def frame(st: GroupState) -> Frame | None:
    """The innermost call in progress on the group, if any."""
    return st.frames[-1] if st.frames else None
