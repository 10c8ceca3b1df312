"""``Replicas``: one replica group's place in a fault-tolerant job, on torchft's Lighthouse and Manager.

torchft does the membership: a Lighthouse forms a *quorum* of the live replica groups, a Manager
per group asks it for one, reconfigures a gloo process group across the quorum's members when it
changes, moves the live state to the groups that are behind (through
:class:`fddp.ft._transport.GroupTransport`), and takes each group's vote on a step
(``should_commit``). fddp adds what a pure step makes possible and what torchft leaves to its user:

- every quorum change starts a membership *epoch* of the group in ``fddp._dist`` (fresh call
  numbers and checks, rank and world size from the quorum, an error channel on the quorum's store),
  so fddp's agreement and failure reporting work across the members of each quorum;
- right after a change, the members compare (one all-gather) what each holds: its committed step,
  a checksum of the replicated state, a digest of its *history* (the members of every quorum it
  committed in), whether it holds the job's state at all, and a digest of its configuration (the
  state's tree, shapes and dtypes, and what the user passed as ``config``). A member whose
  configuration differs from the job's is refused, naming the difference; replicas that committed
  apart are healed from one of them or stop with :class:`DivergedError`; members that hold none of
  a job that has run before (a restart given a quorum of its own while the Lighthouse did not hear
  the live groups) wait for a group that does, and stop with :class:`StateLostError` when none
  comes within ``quorum_timeout``. Nothing is left apart silently;
- a step is a function from state to state: when the vote fails (a member died during it) the
  inputs are returned as they were, and the next quorum goes on without the dead group;
- quorums are taken every ``quorum_every`` committed steps (and after any failure), on a thread
  while the caller fetches its next batch, never inside a step: a membership change cannot land in
  the middle of a step's collectives.
"""

from __future__ import annotations

import ast
import datetime
import importlib.metadata
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo

from fddp import _dist, _tree
from fddp.ft._identity import NAME_WORDS, advance, describe_run, name_of, name_words, state_checksum
from fddp.ft._results import DivergedError, Quorum, StateLostError, StepFailed, StepInfo
from fddp.ft._store import BoundedStore
from fddp.ft._transport import GroupTransport, TransferError

__all__ = ["Replicas"]

log = logging.getLogger("fddp.ft")

_KEY = "fddp"  # the Manager's name for our state
_STORE_DEADLINE_S = 1.0  # a channel read that takes longer: the store's host hangs (see fddp.ft._store)
_RING = 8192  # committed steps whose history digest a group remembers (to judge a member that is behind)
_UNHELD_RETRY_S = 0.1  # between quorums while no member holds the job's state (a live holder waits this long for us)
# The quorum check's row: one int64 each, then the replica id's words.
_STEP, _SUM, _INTENT, _BAD, _PRE, _HIST, _HOLDS, _SPEC = range(8)
_FIELDS = 8
_instances = itertools.count()
_TORCHFT = importlib.metadata.version("torchft")


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
        self.in_first = False  # the Lighthouse made this group a member of the job's first quorum

    def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                  group_rank: int | None = None, group_world_size: int | None = None,
                  global_ranks: list[int] | None = None) -> None:  # fmt: skip
        self.quorum = None  # until the new group exists: a failed configuration leaves none
        # A member of the job's first quorum holds the job's start even when this configuration
        # fails (a gloo rendezvous that timed out on a loaded machine): nothing was committed yet,
        # and the next quorum's members start from one of them.
        self.in_first = self.in_first or quorum_id == 1
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
    """Whether ``e`` says a peer or the link failed (the quorum will change), not this group's own bug.

    Decided by class: fddp's own :class:`fddp.PeerError` and :class:`TransferError`, torch's
    ``DistError`` family, timeouts and connection errors. gloo reports a peer lost mid-collective as
    a plain ``RuntimeError``; those are recognised by gloo's wording, the only place it is read.
    """
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


class Replicas:
    """This replica group's membership in a fault-tolerant job: torchft's Manager, its
    reconfigurable gloo group across the replica groups, and fddp's epochs and checks on it.

    Make one per process, after ``torch.distributed`` is initialised for the replica group (one
    ``torchrun`` per group: the group's own store is torchrun's). The Lighthouse must be running
    (``torchft_lighthouse``, or :func:`fddp.ft.lighthouse` in-process): one per job, since it is the
    job's only memory of having run (see :class:`StateLostError`).

    Args:
        min_replicas: the fewest replica groups a step may commit with.
        lighthouse: the Lighthouse's address (``http://host:29510``); default ``$TORCHFT_LIGHTHOUSE``.
        replica_id: this group's name, unique in the job (``$REPLICA_GROUP_ID`` by default, as
            torchft's examples); a restarted group may reuse it.
        timeout: seconds any collective, vote or state transfer may take; a member that hangs (not
            one that dies: its sockets close at once) is found only by this.
        quorum_timeout: seconds a quorum may take to form: longer than ``quorum_every`` steps (a
            group that joins waits for the others' next quorum) or, for DiLoCo, than the time
            between synchronisations. Also how long a group whose quorums hold no group with the
            job's state waits for one before :class:`StateLostError`.
        connect_timeout: seconds to reach the Lighthouse and the Managers.
        heartbeat: seconds between this group's heartbeats to the Lighthouse (its
            ``--heartbeat_timeout_ms`` decides when a silent group is dead).
        hostname: the address the other groups reach this group's Manager at (default: this host's name).
        store: ``(host, port)`` of this group's store (default ``$MASTER_ADDR``, ``$MASTER_PORT``: torchrun's).
        max_retries: consecutive failed steps (or unusable quorums) after which a step raises instead of trying
            again: a failure that repeats (a transfer that cannot work) is an error, never a silent loop.
        on_divergence: ``"heal"`` (default): groups that committed apart take the state of the one
            with the most committed steps (the lowest rank among equals), with a warning in the
            ``fddp.ft`` log naming the steps dropped; ``"raise"``: :class:`DivergedError` on every member.
        quorum_retries: how often the Manager retries a quorum request the Lighthouse did not answer
            (it may be restarting) before the step fails.
        quorum_every: take a quorum every this many committed steps (and after every failed step).
            A group that starts or restarts joins at the others' next quorum, so this bounds how
            long it waits, in the others' steps; 1 asks at every step, as torchft's own wrappers do
            (a Lighthouse round trip a step). Failures do not wait for it: a dead member fails the
            step it dies in, and the next step takes a quorum.
        warn_alone_after: seconds of committing alone (in a quorum of this group only) after which
            every further step committed alone logs a warning; ``None``: never. Alone, a group has
            no replica: with a small ``min_replicas`` it may be training apart from groups it cannot
            reach.

    Attributes:
        group: the process group across the replica groups (the same object for the whole run:
            pass it as ``group=`` to fddp inside the step function).

    Example:
        >>> replicas = fddp.ft.Replicas(min_replicas=1)
        >>> state = replicas.start({"params": params, "opt": opt.init(params)}, config={"opt": opt})
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
        quorum_every: int = 10,
        warn_alone_after: float | None = 60.0,
    ) -> None:
        if on_divergence not in ("heal", "raise"):
            raise ValueError(f"fddp.ft.Replicas: on_divergence must be 'heal' or 'raise', got {on_divergence!r}")
        if not isinstance(quorum_every, int) or isinstance(quorum_every, bool) or quorum_every < 1:
            raise ValueError(f"fddp.ft.Replicas: quorum_every must be an int >= 1 (committed steps), got {quorum_every!r}")
        if warn_alone_after is not None and not warn_alone_after >= 0:
            raise ValueError(f"fddp.ft.Replicas: warn_alone_after must be seconds >= 0 or None, got {warn_alone_after!r}")
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
        self.quorum_every = quorum_every
        self.warn_alone_after = warn_alone_after
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
        # What this group holds, for the quorum check: its committed steps' history digest (and the
        # last _RING of them, to judge a member that is behind), whether it holds the job's state,
        # and its configuration.
        self._step = 0
        self._history = 0
        self._ring: dict[int, int] = {0: 0}
        self._holds = False
        self._spec: list[tuple] = []
        self._spec_digest = 0
        self._alone_since: float | None = None
        self._stale_quorum = True  # a quorum is due before the next step (none taken yet, or a step failed)
        self._quorum_timeout = _seconds(quorum_timeout)
        self._unheld_since: float | None = None  # since when this group's quorums held no group with the job's state
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
        self._vote_locally = dist.get_world_size() == 1 and _TORCHFT == "0.2.0"
        # Registered with torch.distributed (as torchft does for DeviceMesh) so that fddp's waits
        # can tell its backend: gloo, waited for in slices that watch the error channel.
        self.group.register(f"fddp_ft_{os.getpid()}_{next(_instances)}")

    # --- what torchft calls ---------------------------------------------------------------------

    # The state travels as its leaves (each checked against this group's own: shapes, dtypes, the
    # type of a number), put back into this group's own structure: the structure itself is compared
    # by the quorum check, and so may hold nodes the wire format does not know (fddp.zero.Sharded).

    def _state(self) -> Any:
        with self._lock:
            if self._committed is None:
                raise RuntimeError("fddp.ft: asked for this group's state before it had one")
            return {"leaves": optree.tree_leaves(self._committed), "history": self._history}

    def _load(self, state: Any) -> None:
        with self._lock:
            self._received = state

    def _like(self) -> dict:
        like = {"leaves": optree.tree_leaves(self._like_state), "history": 0}
        return {"user": {_KEY: like}, "torchft": {"step": 0, "batches_committed": 0}}

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

    def _set_run(self, state: Any, config: Any, step: int) -> None:
        """Note what this group brings to the job (before its first quorum)."""
        self._like_state = state
        self._spec = describe_run(state, config)
        self._spec_digest = _dist.digest(self._spec)
        if step:
            if not isinstance(step, int) or step < 0:
                raise ValueError(f"fddp.ft: step must be the committed step count of the state (an int >= 0), got {step!r}")
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
            self._step, self._history, self._ring, self._holds = step, 0, {step: 0}, True

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

    def _adopt(self, received: dict, step: int) -> Any:
        """Take a peer's state (and its history) at ``step``."""
        state = optree.tree_unflatten(optree.tree_structure(self._like_state), received["leaves"])
        self._committed = state
        self._step, self._history, self._ring = step, int(received["history"]), {step: int(received["history"])}
        # Not yet a holder: torchft also gives a member the state of another that holds none (at
        # step 0 every quorum heals from its primary); the check decides (see _quorum).
        return state

    def _quorum(self, state: Any, replicated: Callable[[Any], Any], intent: int, *,
                force: bool = True) -> tuple[Any, bool, list[int], float]:  # fmt: skip
        """Wait for this step's quorum (taken in the background since the last commit, or now).

        On a new quorum: begin an epoch and run the check. Returns the state to step from (a peer's
        when this group healed), whether it healed, every member's ``intent`` (by rank), and the
        seconds it took. An unusable quorum (a member's transfer failed) is voted down and another
        taken, up to ``max_retries`` times. Without ``force``, and no quorum due or pending, the
        step runs on the previous quorum (no wait).
        """
        if not force and self._pending is None and not self._stale_quorum:
            return state, False, [intent], 0.0
        t0 = time.perf_counter()
        healed = False
        while True:
            pre = (self._step, self._history, self._holds)  # before a heal replaces them
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
            if self.group.in_first:
                self._holds = True
            with self._lock:
                received, self._received = self._received, None
            if received is not None:
                state, healed = self._adopt(received, self.committed_steps), True
            errored = self.manager.errored()
            q = self.group.quorum
            intents = [intent]
            bad = errored is not None
            if q is None:  # the Manager could not configure the group (its error is the step's)
                bad = True
            elif q.id != self._epoch_id:
                self._epoch()
                try:
                    state, intents, peers_bad, took = self._check(state, replicated, intent, bad, pre, errored)
                except _Unheld as e:
                    self._await_holder(e)
                    continue
                except Exception as e:
                    if not _transient(e):
                        raise
                    errored, peers_bad, took = e, True, False  # a member died during the check: another quorum
                bad, healed = bad or peers_bad, healed or took
            elif self._unheld_since is not None and not bad:  # the same members again: still none holds the state
                self._await_holder(_Unheld(q.id, self._members))
                continue
            elif self._stale(q):
                log.warning("fddp.ft: the quorum's members changed but its id did not (a restarted Lighthouse); voting "
                            "this step down so that the next quorum reconfigures the group")  # fmt: skip
                bad = True
            if not bad:
                self._holds = True  # a usable quorum: it had a holder (or was the job's first), and every member is as it
                self._stale_quorum = False
                return state, healed, intents, time.perf_counter() - t0
            error = getattr(errored, "original_exception", errored) or RuntimeError("a member could not use the quorum")
            self._fail(error)
            self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(str(error)))
            self._vote()  # no (an error is reported): the next quorum is a new one (torchft bumps its id)

    def _await_holder(self, unheld: _Unheld) -> None:
        """This group's quorum holds no group with the job's state, in a job that has run: wait
        for one (the next quorum is taken after a pause), up to ``quorum_timeout``; then
        :class:`StateLostError`.

        A live group that holds the state can be missing from a quorum for a moment: the
        Lighthouse leaves a group it has not heard from for its heartbeat timeout out of the next
        quorum (a loaded machine), so a restarted group can get a quorum of its own between the
        others' quorums. The holder's next request meets this group's (the Lighthouse forms no
        quorum without a group that heartbeats and asks, and this group asks again every
        ``_UNHELD_RETRY_S``); a holder asks at least every ``quorum_every`` steps, which
        ``quorum_timeout`` must exceed. No step is taken and no retry is counted while waiting.
        """
        now = time.monotonic()
        if self._unheld_since is None:
            self._unheld_since = now
            log.warning("fddp.ft: replica group %r: no member of quorum %d (%s) holds the job's state; waiting up to %g s "
                        "(quorum_timeout) for a group that does", self.replica_id, unheld.quorum_id, ", ".join(unheld.names),
                        self._quorum_timeout.total_seconds())  # fmt: skip
        elif now - self._unheld_since > self._quorum_timeout.total_seconds():
            waited, self._unheld_since = now - self._unheld_since, None
            raise self._leave(StateLostError(
                f"fddp.ft: no replica group that holds the job's state joined replica group {self.replica_id!r} in "
                f"{waited:.0f} s (quorum_timeout={self._quorum_timeout.total_seconds():g}): its last quorum, {unheld.quorum_id} "
                f"({', '.join(unheld.names)}), held none (none has committed a step or was in the job's first quorum), and the "
                f"Lighthouse has formed {unheld.quorum_id - 1} quorum(s) before. The groups that held the state are gone; "
                "starting over from these groups' own initial states would make a second model under the same job. Resume from "
                "a checkpoint (replicas.start(state, step=n)), or start a new Lighthouse for a new job."
            ))  # fmt: skip
        time.sleep(_UNHELD_RETRY_S)

    def _fail(self, error: BaseException) -> None:
        self._failures += 1
        self._last_error = error
        self._stale_quorum = True
        if self._failures > self.max_retries:
            raise RuntimeError(
                f"fddp.ft: replica group {self.replica_id!r} failed {self._failures} steps in a row (max_retries="
                f"{self.max_retries}); the last failure: {type(error).__name__}: {error}"
            ) from error

    def _leave(self, error: BaseException) -> BaseException:
        """Stop taking part (the Manager stops, so the others' next quorum goes on without this
        group after its heartbeat timeout) and return ``error`` to raise."""
        self.close()
        return error

    def _check(self, state: Any, replicated: Callable[[Any], Any], intent: int, bad: bool, pre: tuple,
               errored: Any) -> tuple[Any, list[int], bool, bool]:  # fmt: skip
        """After a quorum change: one all-gather of what every member holds (see the module's
        docstring); refuse, raise, or heal. Returns the state, the intents, whether some member
        cannot go on with this quorum, and whether this group took a peer's state."""
        n, me = self.size, self.rank
        q = self.group.quorum
        pre_step, pre_history, holds = pre
        row = [self.committed_steps, 0 if bad else state_checksum(replicated(state)), intent, int(bad), pre_step, pre_history,
               int(holds), self._spec_digest]  # fmt: skip
        mine = torch.tensor(row + name_words(self.replica_id), dtype=torch.int64)
        got = [torch.empty(_FIELDS + NAME_WORDS, dtype=torch.int64) for _ in range(n)]
        _dist.wait(dist.all_gather(got, mine, group=self.group, async_op=True), self.group, "ft", "the quorum check")
        rows = [g.tolist() for g in got]
        self._members = names = tuple(name_of(r[_FIELDS:]) for r in rows)
        intents = [r[_INTENT] for r in rows]
        holders = [r for r in range(n) if rows[r][_HOLDS]]
        if q.id == 1:
            # The job's first quorum: its members hold the job's start (the primary's state, which
            # torchft gives every member), even if this quorum fails and another must be taken.
            self._holds = True
        if not holders and q.id > 1:
            # Before the configurations are compared: a group that holds nothing is judged against the job's.
            raise _Unheld(q.id, names)
        self._unheld_since = None
        self._refuse_misfits(rows, holders, names)
        if any(r[_BAD] for r in rows):
            return state, intents, True, False
        split = self._split(rows, names)
        top = max(r[_STEP] for r in rows)
        src = min(r for r in range(n) if rows[r][_STEP] == top)
        behind = [r for r in range(n) if (rows[r][_STEP], rows[r][_SUM]) != (rows[src][_STEP], rows[src][_SUM])]
        if split is None and not behind:
            self._holds = True
            return state, intents, False, False
        what = split or "; ".join(f"{names[r]} (rank {r}) at step {rows[r][_STEP]}, checksum {rows[r][_SUM]:#x}" for r in range(n))
        if self.on_divergence == "raise":
            raise self._leave(DivergedError(
                f"fddp.ft: the replica groups of quorum {q.id} committed steps apart: {what}. A small min_replicas lets groups "
                "that cannot reach each other (a Lighthouse restart, a group stopped past the heartbeat timeout) commit alone; "
                "restart them from one checkpoint, or make Replicas with on_divergence='heal' to keep one group's state."
            ))  # fmt: skip
        log.warning("fddp.ft: replica groups committed steps apart (%s); every member now holds %s's state (rank %d, step %d)",
                    what, names[src], src, top)  # fmt: skip
        self._holds = True
        if not behind:  # torchft's recovery already gave the ones behind the source's state
            return state, intents, False, False
        timeout = self._timeout
        if me == src:
            self._transport.send_checkpoint(behind, top, self.manager._manager_state_dict(), timeout)
        elif me in behind:
            self._like_state = state
            tree = self._transport.recv_checkpoint(src, self._transport.metadata(), top, timeout)
            self.manager.load_state_dict(tree["torchft"])
            state = self._adopt(tree["user"][_KEY], top)
        return state, intents, False, me in behind

    def _refuse_misfits(self, rows: list[list[int]], holders: list[int], names: tuple[str, ...]) -> None:
        """Refuse the members whose configuration differs from the job's (the lowest-ranked
        holder's): they raise :class:`fddp.MismatchError` naming the difference and leave; the
        others vote this quorum down and go on. Among groups of which none holds the job (its
        start), a difference is an error on every member: none of them is the job's."""
        ref = holders[0] if holders else 0
        misfits = [r for r in range(len(rows)) if rows[r][_SPEC] != rows[ref][_SPEC]]
        if not misfits:
            return
        me = self.rank
        store = self._epoch_store
        key = f"fddp-ft-spec/{self.group.quorum.id}/"
        if me == ref or (not holders and me == misfits[0]):
            store.set(key + str(me), repr(self._spec))
        if me in misfits or not holders:
            other = ref if me in misfits else misfits[0]
            store.wait([key + str(other)], self._timeout)
            # The description is plain data (tuples of strings), read without running code.
            theirs = [tuple(r) for r in ast.literal_eval(store.get(key + str(other)).decode())]
            job = f"{names[other]} (the job's)" if holders else names[other]
            diff = _tree.first_difference(theirs, self._spec, job, f"{names[me]} (this group)")
            if holders:
                message = (f"replica group {names[me]!r} does not fit the job: {diff}. Start it with the same model, dtypes, "
                           "optimizer and configuration as the others")  # fmt: skip
            else:
                message = (f"the replica groups starting this job differ: {diff}. Every group refuses (none holds the job's state "
                           "yet); start them with the same model, dtypes, optimizer and configuration")  # fmt: skip
            raise self._leave(_dist.MismatchError(f"fddp.ft: {message}"))
        raise _RefusedPeers(f"fddp.ft: refused {', '.join(names[r] for r in misfits)} (another configuration)")

    def _split(self, rows: list[list[int]], names: tuple[str, ...]) -> str | None:
        """Whether the members' histories split: at equal steps their digests differ, or a member
        behind committed a step the one ahead did not (its digest at the step it is at differs
        from the ahead one's). Judged by every member from its own ring, agreed with one more
        all-gather (only when the members were at different steps: rows decide it alike)."""
        n = len(rows)
        pre = [(r[_PRE], r[_HIST]) for r in rows]
        if len({s for s, _ in pre}) == 1:
            if len({h for _, h in pre}) == 1:
                return None
            return "; ".join(f"{names[r]} (rank {r}) committed its steps up to {pre[r][0]} in other quorums" for r in range(n))
        mine = torch.zeros(n, dtype=torch.int64)
        for r, (s, h) in enumerate(pre):
            if s <= pre[self.rank][0]:
                known = self._ring.get(s)
                mine[r] = 0 if known is None else (1 if known == h else 2)
        got = [torch.empty(n, dtype=torch.int64) for _ in range(n)]
        _dist.wait(dist.all_gather(got, mine, group=self.group, async_op=True), self.group, "ft", "the history check")
        verdict = torch.stack(got).max(dim=0).values.tolist()  # 2: split, seen by someone ahead; 1: same history
        apart = [r for r in range(n) if verdict[r] == 2]
        if not apart:
            return None
        ahead = max(s for s, _ in pre)
        return "; ".join(f"{names[r]} (rank {r}), at step {pre[r][0]}, had committed steps the group(s) at step {ahead} did "
                         f"not see; its steps since they parted are dropped" for r in apart)  # fmt: skip

    # --- the steps -------------------------------------------------------------------------------

    def start(self, state: Any, /, *, config: Any = None, step: int = 0) -> Any:
        """Join the job: take the first quorum and return the state to train from.

        Every replica group calls it once, before its first step, with its initial state (the
        same structure, shapes and dtypes everywhere). When the job starts, every group takes the
        state of one of them (so the replicas start bitwise equal); a group that joins later, or
        restarts after a failure, takes a live peer's state at the others' next quorum: if the
        Lighthouse gives it a quorum without them first (it had not heard from them for its
        heartbeat timeout), it waits for them, up to ``quorum_timeout``. A group whose state's
        tree, shapes or dtypes, or whose ``config``, differ from the job's is refused:
        :class:`fddp.MismatchError` here, naming the difference; the others go on.

        Args:
            state: this group's initial state (a pytree).
            config: what else the groups must share, compared by value at every change of
                membership (the optimizer, its schedule, hyperparameters: ``{"opt": opt, "lr": lr}``).
            step: the committed steps ``state`` holds: 0 for a new job; a checkpoint's count to
                resume a job whose every group was lost.

        Raises:
            fddp.MismatchError: this group does not fit the job (or the groups starting it differ).
            StateLostError: no group holding the state of a job that has run before joined this
                group's quorums within ``quorum_timeout``.

        Example:
            >>> state = replicas.start({"params": params, "opt": opt.init(params)}, config={"opt": opt})
        """
        self._set_run(state, config, step)
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
        the groups that are left. Every ``quorum_every`` committed steps the next quorum is taken in
        the background as soon as a step commits; pass the state ``step`` returned (change it only
        inside ``fn``).

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
            DivergedError, StateLostError, fddp.MismatchError: at a change of membership (see
                :meth:`start` and the classes).
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
            state, healed, _, quorum_s = self._quorum(state, lambda s: s, 0, force=False)
        committed, new, out, error = self._run(fn, state, args, kwargs)
        state = new if committed else state
        self._committed = state
        if committed and self.committed_steps % self.quorum_every == 0:
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
        error is raised after voting no (so the other ranks of this group do not wait for the vote).
        A committed step advances this group's history; a failed one is posted on the epoch's error
        channel, so that a member whose own vote passed fails its next step at once (it would
        otherwise wait in that step's collectives, for a group gone to take a quorum)."""
        error: BaseException | None = None
        result = None
        try:
            result = fn()
        except Exception as e:
            error = e
            self.manager.report_error(e)
            if not _transient(e):
                self._vote()
                self._stale_quorum = True
                raise
        if self._vote():
            self._failures = 0
            self._committed_one()
            return True, result, None
        cause = error
        error = StepFailed(f"fddp.ft: {failed}" + (f": {type(cause).__name__}: {cause}" if cause is not None else ""))
        error.__cause__ = cause
        _dist.fail(self.group, "ft.step", error)
        self._fail(error)
        return False, None, error

    def _vote(self) -> bool:
        """The Manager's vote on this step: whether every rank of this replica group finished it.

        Across the replica groups there is no vote (torchft's Manager aggregates only the group's
        own ranks: the members of a quorum agree through their collectives, which fail on every
        member when one dies). A group of one rank therefore votes alone, and its Manager's round
        trip to its own server (0.8 ms a step here) decides nothing: the same bookkeeping is done
        here, as ``Manager.should_commit`` does it, for torchft 0.2.0 (the version fddp pins).
        """
        m = self.manager
        if not self._vote_locally:
            return m.should_commit()
        if m._recovery_event is not None:
            m._recovery_event.synchronize()
            m._recovery_event = None
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
        if err := m._pg.errored():
            m.report_error(err)
        if m._healing:
            m._apply_pending_state_dict()
        ok = m.num_participants() >= m._min_replica_size and m._errored is None
        if ok:
            m._step += 1
            m._batches_committed += m.num_participants()
            m._commit_failures = 0
        else:
            m._commit_failures += 1
        return ok

    def _committed_one(self) -> None:
        """Advance the history by the step just committed; warn if this group has been alone too long."""
        step = self.manager.current_step()
        self._history = advance(self._history, step, self._members)
        self._step = step
        self._ring[step] = self._history
        self._ring.pop(step - _RING, None)
        if self.size > 1 or self.warn_alone_after is None:
            self._alone_since = None
            return
        now = time.monotonic()
        if self._alone_since is None:
            self._alone_since = now
        elif now - self._alone_since > self.warn_alone_after:
            log.warning("fddp.ft: replica group %r committed step %d alone: no other group has been in its quorum for %.0f s "
                        "(warn_alone_after=%g). With min_replicas=%d it may be training apart from groups it cannot reach; "
                        "they are healed or refused when they meet", self.replica_id, step, now - self._alone_since,
                        self.warn_alone_after, self.manager._min_replica_size)  # fmt: skip

    def close(self) -> None:
        """Leave the job: stop the Manager (the others see this group gone at its next heartbeat)."""
        self.manager.shutdown(wait=False)
        if self._epoch_store is not None:
            self._epoch_store.close()
            self._epoch_store = None

    def __enter__(self) -> "Replicas":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _Unheld(Exception):
    """No member of this quorum holds the job's state (see :meth:`Replicas._await_holder`)."""

    def __init__(self, quorum_id: int, names: tuple[str, ...]) -> None:
        super().__init__(f"no member of quorum {quorum_id} holds the job's state")
        self.quorum_id, self.names = quorum_id, names


class _RefusedPeers(TransferError):
    """Members of this quorum were refused (they leave): the quorum is voted down and another taken."""
