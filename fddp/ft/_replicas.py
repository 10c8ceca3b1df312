"""``Replicas``: one replica group's place in a fault-tolerant job, on torchft's Lighthouse and Manager.

torchft does the membership: a Lighthouse forms a *quorum* of the live replica groups, a Manager
per group asks it for one, reconfigures a gloo process group across the quorum's members when it
changes, moves the live state to the groups that are behind (through
:class:`fddp.ft._transport.GroupTransport`), and takes a vote on every step (``should_commit``).
fddp adds what a pure step makes possible and what torchft leaves to its user:

- every quorum change starts a membership *epoch* of the group in ``fddp._dist`` (fresh call
  numbers and checks, rank and world size from the quorum, an error channel on the quorum's store),
  so fddp's agreement and failure reporting work across the members of each quorum;
- right after a change, the members compare their committed step and a checksum of the replicated
  state (one all-gather): replicas that differ at the same step (a Lighthouse restart that let each
  group commit alone) are healed from one of them, or stop with :class:`DivergedError`, never left
  apart;
- a step is a function from state to state: when the vote fails (a member died during it) the
  inputs are returned as they were, and the next quorum goes on without the dead group.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any, Callable, NamedTuple

import optree
import torch
import torch.distributed as dist
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from fddp import _dist
from fddp.ft._store import BoundedStore
from fddp.ft._transport import GroupTransport, TransferError

__all__ = ["Replicas", "StepInfo", "DivergedError", "Quorum"]

log = logging.getLogger("fddp.ft")

_KEY = "fddp"  # the Manager's name for our state
_NAME_WORDS = 8  # a member's replica id travels in the quorum check as this many int64 words (64 bytes)
_MASK = (1 << 62) - 1
_STORE_DEADLINE_S = 1.0  # a channel read that takes longer: the store's host hangs (see fddp.ft._store)
_instances = itertools.count()


class DivergedError(RuntimeError):
    """Replica groups of one quorum hold different states at the same committed step.

    Raised on every member, by :class:`Replicas` made with ``on_divergence="raise"``, when the
    check that follows every quorum change finds it (the default heals them from the member with
    the lowest rank in the quorum instead). The usual cause is a Lighthouse that restarted while
    ``min_replicas`` let a group commit steps alone.
    """


DivergedError.__module__ = "fddp.ft"


class Quorum(NamedTuple):
    """The quorum the Manager last configured the group for.

    Attributes:
        id: torchft's quorum id (it changes when the members change or a vote failed).
        rank: this replica group's rank among the members.
        size: the number of member groups.
        store: the address of the quorum's store (``host:port/prefix``).

    Example:
        >>> replicas.group.quorum  # what the Manager configured last
        Quorum(id=3, rank=0, size=2, store='10.0.0.1:29500/torchft/3/0')
    """

    id: int
    rank: int
    size: int
    store: str


class StepInfo(NamedTuple):
    """What one fault-tolerant step did (``return_info=True``).

    Attributes:
        committed: every member group finished the step and the vote passed; the returned state is
            the new one. Otherwise it is the input state (or the one this group healed to).
        step: the number of committed steps after this one (torchft's step).
        rank: this group's rank in the step's quorum.
        size: the number of replica groups in the step's quorum.
        members: their replica ids, by rank.
        healed: this group received a peer's state before the step (it joined or was behind).
        quorum_s: seconds spent waiting for the quorum and its checks.
        error: the exception that failed the step on this group (``None`` when committed).

    Example:
        >>> state, loss, info = replicas.step(train_step, state, x, y, return_info=True)
        >>> if not info.committed:
        ...     print(f"step {info.step} not committed: {info.error}")  # the next call retries without the lost group
    """

    committed: bool
    step: int
    rank: int
    size: int
    members: tuple[str, ...]
    healed: bool
    quorum_s: float
    error: BaseException | None


class _Background:
    """``fn()`` on a daemon thread: a quorum still pending when the process ends must not hold its exit."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="fddp-ft-quorum", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread by result()
            self._error = e

    def result(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the quorum did not finish")
        if self._error is not None:
            raise self._error


class _Group(ProcessGroupGloo):
    """torchft's reconfigurable gloo group, noting each configuration the Manager makes."""

    def __init__(self, timeout: datetime.timedelta) -> None:
        super().__init__(timeout=timeout)
        self.quorum: Quorum | None = None

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                  group_rank: int | None = None, group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:  # fmt: skip
        self.quorum = None  # until the new group exists: a failed configuration leaves none
        # torchft drops the old gloo group here, and destroying a gloo group waits for its pending
        # collectives to time out (gloo has no abort): after a peer's failure reached this rank
        # through fddp's error channel, one is still pending, and the survivors would stall for the
        # whole collective timeout. The old group goes to a thread of its own to die there.
        retired = [self._pg]
        self._pg = None
        threading.Thread(target=retired.clear, name="fddp-ft-retired-group", daemon=True).start()
        super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks)
        self.quorum = Quorum(int(quorum_id if quorum_id is not None else -1), rank, world_size, store_addr)


def _seconds(x: float | datetime.timedelta) -> datetime.timedelta:
    return x if isinstance(x, datetime.timedelta) else datetime.timedelta(seconds=float(x))


def _transient(e: BaseException) -> bool:
    """Whether ``e`` says a peer or the link failed (the quorum will change), not this group's own bug."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (_dist.PeerError, dist.DistError, TransferError, TimeoutError, ConnectionError)):
            return True
        if isinstance(e, RuntimeError) and any(
            w in str(e) for w in ("Connection closed by peer", "Connection reset", "Timed out", "timed out", "failed during")
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


def state_checksum(tree: Any) -> int:
    """A 62-bit checksum of every leaf of ``tree`` (bits of tensors, ``repr`` of the rest), by position."""
    total = 0
    for i, c in enumerate(_dist.replica_digest(optree.tree_leaves(tree, none_is_leaf=True), "full")):
        total = (total + c * (2 * i + 1)) & _MASK
    return total


def _name_words(name: str) -> list[int]:
    raw = name.encode()[: 8 * _NAME_WORDS].ljust(8 * _NAME_WORDS, b"\0")
    return [int.from_bytes(raw[8 * i : 8 * i + 8], "little", signed=True) for i in range(_NAME_WORDS)]


def _name_of(words: list[int]) -> str:
    return b"".join(int(w).to_bytes(8, "little", signed=True) for w in words).rstrip(b"\0").decode(errors="replace")


class Replicas:
    """This replica group's membership in a fault-tolerant job: torchft's Manager, its
    reconfigurable gloo group across the replica groups, and fddp's epochs and checks on it.

    Make one per process, after ``torch.distributed`` is initialised for the replica group (one
    ``torchrun`` per group: the group's own store is torchrun's). The Lighthouse must be running
    (``torchft_lighthouse``, or :func:`fddp.ft.lighthouse` in-process).

    Args:
        min_replicas: the fewest replica groups a step may commit with.
        lighthouse: the Lighthouse's address (``http://host:29510``); default ``$TORCHFT_LIGHTHOUSE``.
        replica_id: this group's name, unique in the job (``$REPLICA_GROUP_ID`` by default, as
            torchft's examples); a restarted group may reuse it.
        timeout: seconds any collective, vote or state transfer may take; a member that hangs (not
            one that dies: its sockets close at once) is found only by this.
        quorum_timeout: seconds a quorum may take to form: longer than a step (the members meet once
            per step) or, for DiLoCo, than the time between synchronisations; a group that joins
            waits up to this for the others' next quorum.
        connect_timeout: seconds to reach the Lighthouse and the Managers.
        heartbeat: seconds between this group's heartbeats to the Lighthouse (its
            ``--heartbeat_timeout_ms`` decides when a silent group is dead).
        hostname: the address the other groups reach this group's Manager at (default: this host's name).
        store: ``(host, port)`` of this group's store (default ``$MASTER_ADDR``, ``$MASTER_PORT``: torchrun's).
        max_retries: consecutive failed steps (or unusable quorums) after which a step raises instead of trying
            again: a failure that repeats (a transfer that cannot work) is an error, never a silent loop.
        on_divergence: ``"heal"`` (default): members whose state differs at the same step take the
            lowest-ranked member's, with a warning in the ``fddp.ft`` log; ``"raise"``:
            :class:`DivergedError` on every member.
        quorum_retries: how often the Manager retries a quorum request the Lighthouse did not answer
            (it may be restarting) before the step fails.

    Attributes:
        group: the process group across the replica groups (the same object for the whole run:
            pass it as ``group=`` to fddp inside the step function).

    Example:
        >>> replicas = fddp.ft.Replicas(min_replicas=1)
        >>> state = replicas.start({"params": params, "opt": opt.init(params)})
        >>> for x, y in batches:
        ...     state, loss = replicas.step(train_step, state, x, y)
    """

    def __init__(
        self,
        *,
        min_replicas: int = 1,
        lighthouse: str | None = None,
        replica_id: str | None = None,
        timeout: float | datetime.timedelta = 30.0,
        quorum_timeout: float | datetime.timedelta = 60.0,
        connect_timeout: float | datetime.timedelta = 10.0,
        heartbeat: float | datetime.timedelta = 0.1,
        hostname: str | None = None,
        store: tuple[str, int] | None = None,
        max_retries: int = 3,
        on_divergence: str = "heal",
        quorum_retries: int = 20,
    ) -> None:
        if on_divergence not in ("heal", "raise"):
            raise ValueError(f"fddp.ft.Replicas: on_divergence must be 'heal' or 'raise', got {on_divergence!r}")
        if not dist.is_initialized():
            raise RuntimeError(
                "fddp.ft.Replicas: torch.distributed is not initialised; start each replica group with torchrun and call "
                "fddp.init() first (the group's store is the one torchrun starts)"
            )
        lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError("fddp.ft.Replicas: no Lighthouse address: pass lighthouse= or set TORCHFT_LIGHTHOUSE")
        replica_id = replica_id if replica_id is not None else os.environ.get("REPLICA_GROUP_ID")
        if not replica_id:
            raise ValueError("fddp.ft.Replicas: no replica id: pass replica_id= or set REPLICA_GROUP_ID (unique per replica group)")
        host, port = store if store is not None else (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"))
        if not host or not port:
            raise ValueError("fddp.ft.Replicas: no store for this replica group: pass store=(host, port) or run under torchrun")
        self.replica_id = str(replica_id)
        self.on_divergence = on_divergence
        self.max_retries = max_retries
        self._timeout = _seconds(timeout)
        self.group = _Group(self._timeout)
        self._transport = GroupTransport(self.group, self._like)
        self._committed: Any = None
        self._received: Any = None
        self._like_state: Any = None
        self._epoch_id: int | None = None
        self._epoch_store: BoundedStore | None = None
        self._members: tuple[str, ...] = ()
        self._failures = 0
        self._last_error: BaseException | None = None
        self._pending: _Background | None = None
        self._joined: tuple[bool, float] | None = None  # start() took the quorum the first step runs on
        self._lock = threading.Lock()
        self.manager = Manager(
            pg=self.group,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=min_replicas,
            use_async_quorum=False,  # fddp takes the quorum on its own thread, before the step that needs it
            timeout=self._timeout,
            quorum_timeout=_seconds(quorum_timeout),
            connect_timeout=_seconds(connect_timeout),
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            store_addr=str(host),
            store_port=int(port),
            lighthouse_addr=lighthouse,
            replica_id=self.replica_id,
            hostname=hostname or socket.gethostname(),
            heartbeat_interval=_seconds(heartbeat),
            checkpoint_transport=self._transport,
            init_sync=True,
            quorum_retries=quorum_retries,
        )
        self.manager.register_state_dict_fn(_KEY, self._load, self._state)
        # Registered with torch.distributed (as torchft does for DeviceMesh) so that fddp's waits
        # can tell its backend: gloo, waited for in slices that watch the error channel.
        self.group.register(f"fddp_ft_{os.getpid()}_{next(_instances)}")

    # --- what torchft calls ---------------------------------------------------------------------

    def _state(self) -> Any:
        with self._lock:
            if self._committed is None:
                raise RuntimeError("fddp.ft: asked for this group's state before it had one")
            return self._committed

    def _load(self, state: Any) -> None:
        with self._lock:
            self._received = state

    def _like(self) -> dict:
        return {"user": {_KEY: self._like_state}, "torchft": {"step": 0, "batches_committed": 0}}

    # --- membership -----------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This replica group's rank in the current quorum."""
        return _dist.rank(self.group)

    @property
    def size(self) -> int:
        """The number of replica groups in the current quorum."""
        return _dist.size(self.group)

    @property
    def members(self) -> tuple[str, ...]:
        """The replica ids of the current quorum's members, by rank (known after a quorum change)."""
        return self._members

    @property
    def committed_steps(self) -> int:
        """The job's committed steps so far (torchft's step; a group that healed has the source's)."""
        return self.manager.current_step()

    def _start_quorum(self) -> None:
        self._pending = _Background(self.manager.start_quorum)

    def _epoch(self) -> None:
        """Begin an fddp epoch on the group for the quorum the Manager just configured."""
        q = self.group.quorum
        store = BoundedStore(f"{q.store}/fddp", deadline=_STORE_DEADLINE_S, connect_timeout=self._timeout.total_seconds())
        _dist.begin_epoch(self.group, rank=q.rank, world_size=q.size, store=store, epoch=q.id)
        self._epoch_id = q.id
        # The old epoch's store: its helper thread holds it alive (it would never be collected),
        # and nothing reads it any more (the old epoch's waits are over).
        old, self._epoch_store = self._epoch_store, store
        if old is not None:
            old.close()

    def _stale(self, q: Quorum) -> bool:
        """Whether the Manager kept a group configured for other members: a restarted Lighthouse
        numbers its quorums from 1 again, and torchft reconfigures only when the number changes."""
        try:
            return (self.manager.participating_rank(), self.manager.num_participants()) != (q.rank, q.size)
        except Exception:  # noqa: BLE001 - no quorum yet
            return True

    def _quorum(self, state: Any, replicated: Callable[[Any], Any], intent: int) -> tuple[Any, bool, list[int], float]:
        """Wait for this step's quorum (taken in the background since the last commit, or now).

        On a new quorum: begin an epoch and run the check. Returns the state to step from (a peer's
        when this group healed), whether it healed, every member's ``intent`` (by rank), and the
        seconds it took. An unusable quorum (a member's transfer failed) is voted down and another
        taken, up to ``max_retries`` times.
        """
        t0 = time.perf_counter()
        healed = False
        while True:
            if self._pending is None:
                self._committed = state
                self._start_quorum()
            try:
                self._pending.result()
            except Exception as e:
                self._pending = None
                raise RuntimeError(
                    f"fddp.ft: replica group {self.replica_id!r} could not take part in a quorum: {e}. The Lighthouse may be "
                    "down or unreachable for longer than the Manager's retries (quorum_retries x quorum_timeout), or "
                    "the other groups took longer than quorum_timeout to ask for one."
                ) from e
            self._pending = None
            with self._lock:
                received, self._received = self._received, None
            if received is not None:
                state, healed = received, True
                self._committed = state
            errored = self.manager.errored()
            q = self.group.quorum
            intents = [intent]
            bad = errored is not None
            if q is None:  # the Manager could not configure the group (its error is the step's)
                bad = True
            elif q.id != self._epoch_id:
                self._epoch()
                try:
                    state, intents, peers_bad, took = self._check(state, replicated, intent, bad)
                except Exception as e:
                    if not _transient(e):
                        raise
                    errored, peers_bad, took = e, True, False  # a member died during the check: another quorum
                bad, healed = bad or peers_bad, healed or took
            elif self._stale(q):
                log.warning("fddp.ft: the quorum's members changed but its id did not (a restarted Lighthouse); voting "
                            "this step down so that the next quorum reconfigures the group")  # fmt: skip
                bad = True
            if not bad:
                return state, healed, intents, time.perf_counter() - t0
            error = getattr(errored, "original_exception", errored) or RuntimeError("a member could not use the quorum")
            self._fail(error)
            self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(str(error)))
            self.manager.should_commit()  # votes no: the next quorum is a new one (torchft bumps its id)

    def _fail(self, error: BaseException) -> None:
        self._failures += 1
        self._last_error = error
        if self._failures > self.max_retries:
            raise RuntimeError(
                f"fddp.ft: replica group {self.replica_id!r} failed {self._failures} steps in a row (max_retries="
                f"{self.max_retries}); the last failure: {type(error).__name__}: {error}"
            ) from error

    def _check(self, state: Any, replicated: Callable[[Any], Any], intent: int, bad: bool) -> tuple[Any, list[int], bool, bool]:
        """After a quorum change: compare every member's step and checksum of the replicated state
        (one all-gather); heal or raise on a divergence. Returns the state, the intents, whether
        some member cannot go on with this quorum, and whether this group took a peer's state."""
        n, me = self.size, self.rank
        words = 5 + _NAME_WORDS
        mine = torch.tensor(
            [self.committed_steps, 0 if bad else state_checksum(replicated(state)), intent, int(bad), 0] + _name_words(self.replica_id),
            dtype=torch.int64,
        )
        got = [torch.empty(words, dtype=torch.int64) for _ in range(n)]
        _dist.wait(dist.all_gather(got, mine, group=self.group, async_op=True), self.group, "ft", "the quorum check")
        rows = [g.tolist() for g in got]
        self._members = tuple(_name_of(r[5:]) for r in rows)
        intents = [r[2] for r in rows]
        if any(r[3] for r in rows):
            return state, intents, True, False
        top = max(r[0] for r in rows)
        src = min(r for r in range(n) if rows[r][0] == top)
        behind = [r for r in range(n) if (rows[r][0], rows[r][1]) != (rows[src][0], rows[src][1])]
        if not behind:
            return state, intents, False, False
        what = "; ".join(f"{self._members[r]} (rank {r}) at step {rows[r][0]}, checksum {rows[r][1]:#x}" for r in range(n))
        if self.on_divergence == "raise":
            raise DivergedError(
                f"fddp.ft: the replica groups of quorum {self.group.quorum.id} hold different states: {what}. Each committed "
                "steps the others did not see (a Lighthouse restart with a small min_replicas lets a group commit alone); "
                "restart them from one checkpoint, or make Replicas with on_divergence='heal' to take one group's state."
            )
        log.warning("fddp.ft: replica groups diverged (%s); healing them from %s (rank %d)", what, self._members[src], src)
        timeout = self._timeout
        if me == src:
            self._transport.send_checkpoint(behind, top, self.manager._manager_state_dict(), timeout)
        elif me in behind:
            self._like_state = state
            tree = self._transport.recv_checkpoint(src, self._transport.metadata(), top, timeout)
            self.manager.load_state_dict(tree["torchft"])
            state = tree["user"][_KEY]
            self._committed = state
        return state, intents, False, me in behind

    # --- the steps -------------------------------------------------------------------------------

    def start(self, state: Any, /) -> Any:
        """Join the job: take the first quorum and return the state to train from.

        Every replica group calls it once, before its first step, with its initial state (the
        same structure, shapes and dtypes everywhere). When the job starts, every group takes the
        state of one of them (so the replicas start bitwise equal); a group that joins later, or
        restarts after a failure, takes a live peer's state at the others' next step.

        Example:
            >>> state = replicas.start({"params": params, "opt": opt.init(params)})
        """
        self._like_state = state
        state, healed, _, quorum_s = self._quorum(state, lambda s: s, 0)
        self._committed = state
        self._joined = (healed, quorum_s)  # the first step runs on this quorum: the others' step meets it
        return state

    def step(self, fn: Callable[..., tuple[Any, Any]], state: Any, /, *args: Any, return_info: bool = False, **kwargs: Any) -> Any:
        """Run one fault-tolerant step: ``fn(state, *args, **kwargs) -> (new_state, out)`` on this
        step's quorum, committed only if every member finished it.

        ``fn`` synchronises across the replica groups through ``replicas.group`` (for instance
        ``fddp.grad_and_value(loss_fn, group=replicas.group)`` with ``weight=`` this group's sample
        count: the mean is then over the groups in this step's quorum, weighted by what each
        contributed). If a member dies or fails during the step, no member commits it: ``step``
        returns the input ``state`` unchanged and ``out`` as ``None``, and the next call goes on with
        the groups that are left. The next step's quorum is taken in the background as soon as this
        one commits; pass the state ``step`` returned (change it only inside ``fn``).

        Args:
            fn: the step, pure: it must not modify its inputs (fddp's functions never do).
            state: the state ``start`` or the previous ``step`` returned.
            *args: the step's other arguments (this group's batch).
            return_info: also return a :class:`StepInfo`.
            **kwargs: passed to ``fn``.

        Returns:
            ``(state, out)``, or ``(state, out, info)``: the new state and ``fn``'s output when the
            step committed, else the state to retry from and ``None``.

        Raises:
            RuntimeError: the step failed ``max_retries`` times in a row, or no quorum formed.
            Exception: what ``fn`` raised, when it is this group's own error (not a peer's failure).

        Example:
            >>> def train_step(state, x, y):
            ...     grads, loss = fddp.grad_and_value(loss_fn, group=replicas.group)(state["params"], x, y, weight=len(x))
            ...     params, opt_state = fddp.optim.apply_gradients(opt, grads, state["opt"], state["params"])
            ...     return {"params": params, "opt": opt_state}, loss
            >>> state, loss = replicas.step(train_step, state, x, y)
        """
        if state is not self._committed:
            raise ValueError(
                "fddp.ft.Replicas.step: state is not the one the last start() or step() returned. The next step's quorum "
                "was taken when that one committed, and a group joining in it received that state; change the state only "
                "inside the step function (or call start() first)"
            )
        if self._joined is not None:
            (healed, quorum_s), self._joined = self._joined, None
        else:
            state, healed, _, quorum_s = self._quorum(state, lambda s: s, 0)
        committed, new, out, error = self._run(fn, state, args, kwargs)
        state = new if committed else state
        self._committed = state
        if committed:
            self._start_quorum()  # the next step's, while the caller gets its next batch
        info = StepInfo(committed, self.committed_steps, self.rank, self.size, self._members, healed, quorum_s, error)
        out = out if committed else None
        return (state, out, info) if return_info else (state, out)

    def _run(self, fn: Callable, state: Any, args: tuple, kwargs: dict) -> tuple[bool, Any, Any, BaseException | None]:
        """``fn`` on this quorum, then the vote (:meth:`_voted`): whether it committed, the new state
        (the input one if not), ``fn``'s output and the failure."""
        committed, result, error = self._voted(lambda: fn(state, *args, **kwargs),
                                               "a replica group of this step's quorum failed (the vote did not pass)")  # fmt: skip
        if committed:
            new, out = result
            return True, new, out, None
        return False, state, None, error

    def _voted(self, fn: Callable[[], Any], failed: str) -> tuple[bool, Any, BaseException | None]:
        """``fn()`` on this quorum, then the vote: whether every member committed, ``fn``'s result,
        and the failure (``failed`` in words, when a peer's failure voted it down). This group's own
        error is raised after voting no (so the other ranks of this group do not wait for the vote)."""
        error: BaseException | None = None
        result = None
        try:
            result = fn()
        except Exception as e:
            error = e
            self.manager.report_error(e)
            if not _transient(e):
                self.manager.should_commit()
                raise
        if self.manager.should_commit():
            self._failures = 0
            return True, result, None
        error = error or RuntimeError(failed)
        self._fail(error)
        return False, None, error

    def close(self) -> None:
        """Leave the job: stop the Manager (the others see this group gone at its next heartbeat)."""
        self.manager.shutdown(wait=False)
        if self._epoch_store is not None:
            self._epoch_store.close()

    def __enter__(self) -> "Replicas":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
