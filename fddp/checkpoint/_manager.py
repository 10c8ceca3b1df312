"""Checkpoints that survive preemption: a manager around :func:`fddp.checkpoint.save_step` that saves
every few steps, saves on ``SIGTERM`` / ``SIGINT`` at a step boundary on every rank together, and
optionally writes in the background while training goes on.

**One step boundary, every rank alike.** :meth:`Manager.step` is called by every rank at the end of
each training step. A signal handler only records the signal and sets a request bit
(``fddp._dist.request``: an append to a queue, safe in a handler; no collective, no lock). The bit
rides in the next agreement header on the group, so every rank learns it at the same fddp call
and takes it at the same boundary (``fddp._dist.take_requested``), even though only one rank got
the signal; they all save that boundary's step and :attr:`Manager.should_stop` turns True. A loop
whose steps call fddp (``grad_and_value``, ``ddp_step``) carries the bits in those calls' headers:
the manager adds no collective to such a step. Where no agreement happened on the group since
the previous boundary (a step without an fddp call on it), the boundary agrees itself, a
header's round trip, so that a request is never stuck. A signal that arrives after the step's
last header is learnt at the following boundary: the save is at most one step later.

**One request per delivery.** Schedulers signal every process of a job step and torchrun's agent
forwards what it gets, so a worker receives one preemption two or more times within milliseconds.
The handler takes arrivals of a signal within ``grace`` seconds of the one that asked as that
same request; only a later one before the save falls through to the previous handler (a person's
second Ctrl-C), and not in a torchrun worker, whose agent may forward seconds late and ends a
worker that does not stop itself. ``close`` waits out the grace period of a signal that arrived, so that a late copy
meets this handler rather than the default action after the save.

**One writer per series.** The manager claims its directory and prefix in this process
(``_series``) from construction to ``close``: a Manager or ``save_step`` of another group on them
is refused, naming both.

**Asynchronous saves.** With ``async_=True`` a due save snapshots the tree on the training thread
(host copies of its tensors, see ``_codec.encode(copy=True)``) and rank 0 writes the snapshot on a
thread of its own, through the usual temporary-then-rename (``_single.write_payload``), then
prunes beyond ``keep``. The thread issues no collective: only the writer writes a single-file
checkpoint, and fddp refuses two threads in one group's calls. Its outcome travels like a
signal: the writer, finding the thread finished at a boundary, requests ``WRITTEN`` or
``UNWRITTEN``, and every rank learns it at the same boundary; ``UNWRITTEN`` raises
:class:`CheckpointError` on every rank there. Earlier checkpoints are untouched by a failed
write (the rename never happened; pruning comes only after it). One write is in flight at a
time: a save due while the previous is still being written waits for it, and so does a save on
a signal, which is written synchronously (the process is about to end).

A sharded tree (``fddp.zero.Sharded``, ``PerRank`` parts) is saved by every rank with DCP's
collectives, which cannot run beside the training's calls on the group: the manager saves those
synchronously and refuses ``async_=True`` for them.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import warnings
import weakref
from types import FrameType
from typing import Any, Sequence

import torch.distributed as dist

from fddp import _dist
from fddp._dist import PREEMPT, UNWRITTEN, WRITTEN
from fddp._errors import CheckpointError
from fddp.checkpoint import _codec, _lock, _ranks, _series, _single, _steps

__all__ = ["Manager"]

_WHAT = "checkpoint.Manager.step"
_ROWS = [("call", f"fddp.{_WHAT}: a step boundary", None)]
_SIGNATURE = _dist.digest(_ROWS)
_MINE = PREEMPT | WRITTEN | UNWRITTEN  # the request bits this module owns (fddp._dist._header)

_open: "weakref.WeakSet[Manager]" = weakref.WeakSet()  # managers not closed yet, one per group


class _Write:
    """One asynchronous write: the writer's thread and, once it ends, its error (None: in place)."""

    def __init__(self, step: int, path: str, payload: dict, directory: str, prefix: str, keep: int | None) -> None:
        self.step, self.path, self.error = step, path, None
        belongs = _steps._step_name(prefix).fullmatch
        args = (payload, directory, belongs, prefix, keep)
        # Not a daemon: a process that ends while its last checkpoint is being written waits for it.
        self.thread = threading.Thread(target=self._run, args=args, name=f"fddp-checkpoint-{step}")

    def _run(self, payload: dict, directory: str, belongs: Any, prefix: str, keep: int | None) -> None:
        try:
            _single.write_payload(self.path, _codec.add_checksums(payload), belongs)
            _steps._prune(directory, self.path, self.step, prefix, keep)
        except BaseException as e:  # noqa: BLE001 - reported at a step boundary, on every rank
            self.error = e


class Manager:
    """Save a run's checkpoints every few steps and when the job is preempted, on every rank together.

    Call :meth:`step` on every rank at the end of every training step. It saves the tree as the
    checkpoint of that step (:func:`fddp.checkpoint.save_step`, with ``keep=`` rotation) when the
    step is a multiple of ``every``, and, after any rank received one of ``signals`` (a scheduler's
    ``SIGTERM`` before it kills the job, a ``SIGINT``), at the next step boundary on every rank:
    then :attr:`should_stop` is True and the loop should end. The ranks learn of the signal from
    the agreement of their fddp calls, so a signal to one rank is enough; a loop whose steps make
    fddp calls pays nothing per step for it.

    **A signal that arrives several times is one request.** A scheduler signals every process of
    a job step (SLURM at ``scancel``, the time limit, ``--signal``), and torchrun's agent forwards
    the signal it gets to its workers, so each worker gets it twice within milliseconds. Arrivals
    of a signal within ``grace`` seconds of the one that asked are that same request: nothing more
    happens, also after the save and after :meth:`close` (which waits out the rest of the grace
    period before it puts the previous handler back, so that a late copy cannot kill the process
    after its save). An arrival later than that, before the save, is a deliberate second request
    and falls through to the signal's previous handler: a second Ctrl-C more than ``grace``
    seconds after the first interrupts as usual (``KeyboardInterrupt``), a second ``SIGTERM``
    terminates. In a torchrun worker (``TORCHELASTIC_RUN_ID`` set) every arrival before the save
    is the same request: the agent forwards each signal it gets, seconds late on a loaded node,
    and itself ends a worker that does not stop within its ``--shutdown-timeout``. An arrival
    later than ``grace``, after the save, asks for another save.

    With ``async_=True``, a periodic save copies the tree's tensors to host memory and returns;
    rank 0 writes the file on a background thread while training goes on. A failed write leaves
    every earlier checkpoint in place and raises :class:`CheckpointError` at a later step boundary
    on every rank, the same one (the first after the writer found it failed). A save on a signal
    is written before :meth:`step` returns, on every rank's behalf.

    Use it as a context manager (or call :meth:`close`): leaving waits for a write still in
    flight and puts the previous signal handlers back.

    Args:
        directory: where checkpoints live (see :func:`fddp.checkpoint.save_step`).
        every: save every ``every`` steps (when ``step % every == 0``); None: only on a signal.
        keep: how many checkpoints to keep (>= 1), or None to keep all.
        async_: write periodic saves of single-file trees on a background thread.
        prefix: the checkpoints' name prefix.
        group: the process group whose ranks save together (rank 0 writes a single file).
        signals: the signals that request a save and a stop (one this process ignores stays
            ignored); ``()`` installs no handler (needed where the manager is made off the main
            thread).
        grace: seconds after a signal during which its further arrivals are the same request
            (>= 0; 0: every repeat before the save falls through to the previous handler).

    Raises:
        ValueError: a bad ``every``, ``keep`` or ``grace``; signals asked for off the main thread.
        RuntimeError: another manager is open on ``group``.
        CheckpointError: another process group's Manager or saves in this process write the
            series ``prefix`` in ``directory`` (naming it): each would overwrite and prune the
            other's checkpoints. Give each its own prefix or directory.

    Example:
        >>> with fddp.checkpoint.Manager("runs/a", every=100, keep=2, async_=True) as manager:
        ...     for step in range(start, steps):
        ...         grads, loss = grad_fn(params, *batch(step))
        ...         params, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, params)
        ...         manager.step(step, {"params": params, "opt_state": opt_state, "step": step})
        ...         if manager.should_stop:
        ...             break
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        /,
        *,
        every: int | None = None,
        keep: int | None = 3,
        async_: bool = False,
        prefix: str = "ckpt",
        group: dist.ProcessGroup | None = None,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
        grace: float = 2.0,
    ) -> None:
        if every is not None and not (isinstance(every, int) and every >= 1):
            raise ValueError(f"fddp.checkpoint.Manager: every must be an int >= 1 or None (save only on a signal), got {every!r}")
        if keep is not None and not (isinstance(keep, int) and keep >= 1):
            raise ValueError(f"fddp.checkpoint.Manager: keep must be an int >= 1 or None (keep all), got {keep!r}")
        if not (isinstance(grace, (int, float)) and grace >= 0):
            raise ValueError(f"fddp.checkpoint.Manager: grace must be a number of seconds >= 0, got {grace!r}")
        signals = tuple(signals)
        if signals and threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "fddp.checkpoint.Manager: Python runs signal handlers on the main thread only, and this manager is made "
                f"on thread {threading.current_thread().name!r}; make it on the main thread, or pass signals=()"
            )
        for other in list(_open):
            if other.group is group:
                raise RuntimeError(
                    f"fddp.checkpoint.Manager: a manager of {other.directory!r} is open on this process group; its step "
                    "boundaries and this one's would take each other's requests. Close it first (manager.close(), or a "
                    "with block), or give this one a group of its own (group=torch.distributed.new_group()) and a prefix or "
                    "directory of its own"
                )
        self.directory, self.every, self.keep, self.async_ = os.fspath(directory), every, keep, bool(async_)
        self.prefix, self.group, self.grace = prefix, group, float(grace)
        _series.claim(self.directory, prefix, group, f"fddp.checkpoint.Manager({self.directory!r}, prefix={prefix!r})", self)
        self._distributed = _ranks.world_size(group) > 1  # fixed: every rank decides each boundary the same way
        self._write: _Write | None = None  # the writer's write in flight
        self._pending = False  # an asynchronous save whose outcome the ranks have not learnt (every rank alike)
        self._superseded: tuple[int, str] | None = None  # a failed write a signal's save made up for
        self._started: int | None = None  # the step of the last asynchronous save started (every rank alike)
        self._failure: _Write | None = None  # the writer's last write collected
        self._mark: tuple[int, int] | None = None  # the group's agreements at the end of the last boundary
        self._raised = 0  # signals handled (written by the handler only)
        self._taken = 0  # ... of which the boundaries have seen (one process, or without the agreement)
        self._waiting: set[int] = set()  # signals received whose save is still to come
        self._asked: dict[int, float] = {}  # each signal's arrival that made its latest request (time.monotonic())
        # A torchrun worker: its agent forwards every signal it gets, late on a loaded node, and
        # ends a worker that does not stop itself (--shutdown-timeout); see _on_signal.
        self._forwarded = "TORCHELASTIC_RUN_ID" in os.environ
        self._saved: int | None = None  # the last step saved
        self._stop = False
        self._closed = False
        self._previous: dict[int, Any] = {}
        for s in signals:
            if signal.getsignal(s) != signal.SIG_IGN:  # an ignored signal stays ignored (nohup, a job started with &)
                self._previous[s] = signal.signal(s, self._on_signal)
        _open.add(self)

    # --- signals ----------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Record a save request; no collective, no lock (it runs between two bytecodes of any code)."""
        now = time.monotonic()
        if now - self._asked.get(signum, -math.inf) < self.grace:
            return  # the same request again: another path of one delivery (the agent's forward, SLURM's)
        if signum in self._waiting:  # asked again later, before the save
            # Under torchrun a repeat is the agent's forward, however late (a loaded node's agent
            # forwarded seconds after SLURM's own copy, which killed a worker short of its save);
            # elsewhere a deliberate second request: do what the signal did before.
            if not self._forwarded:
                self._fall_through(signum, frame)
            return
        self._asked[signum] = now
        self._waiting.add(signum)
        self._raised += 1
        if self._distributed:
            _dist.request(self.group, PREEMPT)

    def _fall_through(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action (SIG_DFL, or None: a handler set in C)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # --- the step boundary -------------------------------------------------------------------------

    @property
    def should_stop(self) -> bool:
        """Whether a signal's checkpoint is saved and the loop should end (every rank alike)."""
        return self._stop

    @property
    def preempted(self) -> bool:
        """Whether the run was asked to stop by a signal (to any rank): the same as :attr:`should_stop`,
        named for the question after the loop (preempted, or finished?)."""
        return self._stop

    @_dist.entry(_WHAT, lambda self, *args, **kwargs: self.group)
    def step(self, step: int, tree: Any, /) -> bool:
        """End a training step: save ``tree`` as the checkpoint of ``step`` if one is due.

        Every rank of the group calls it at every step boundary, with the same ``step``. A save is
        due when ``step`` is a multiple of ``every`` or when any rank got one of the signals since
        the last boundary that learnt one; after a signal's save, :attr:`should_stop` is True.
        ``tree`` is what :func:`fddp.checkpoint.save_step` accepts (the parameters, optimizer
        state, the step itself, RNG states); with ``async_``, its tensors are copied before this
        returns, so the loop may update them in place at once.

        Args:
            step: the step just finished (the checkpoint's number).
            tree: the state to save.

        Returns:
            Whether a save of this step started (asynchronous) or completed (otherwise).

        Raises:
            CheckpointError: on every rank, an asynchronous write failed (the writer's error is the
                cause on rank 0; every earlier checkpoint is intact).
            ValueError: a negative ``step``; ``async_=True`` with a tree that has sharded parts;
                the manager was made before the process group (make it after ``fddp.init()``).
            RuntimeError: the manager is closed.
            OSError, fddp.PeerError: as :func:`fddp.checkpoint.save_step`, for a synchronous save.

        Example:
            >>> manager.step(step, {"params": params, "opt_state": opt_state, "step": step})
            False
        """
        if self._closed:
            raise RuntimeError("fddp.checkpoint.Manager.step: the manager is closed; make a new one to save again")
        if not (isinstance(step, int) and step >= 0):
            raise ValueError(f"fddp.checkpoint.Manager.step: step must be an int >= 0, got {step!r}")
        if (_ranks.world_size(self.group) > 1) != self._distributed:
            raise ValueError(
                "fddp.checkpoint.Manager.step: the process group was made after the manager; make the manager after "
                "fddp.init(), so that its signal handler knows whom to tell"
            )
        sharded = _steps._is_sharded(tree)
        if sharded and self.async_:
            raise ValueError(
                "fddp.checkpoint.Manager: async_=True writes single-file checkpoints on a background thread; this tree "
                "has fddp.zero.Sharded or PerRank parts, which every rank saves with collectives that cannot run beside "
                "the training's. Use async_=False for it"
            )
        bits = self._boundary(wait=False)
        preempt = bool(bits & PREEMPT)
        due = preempt or (self.every is not None and step % self.every == 0 and step != self._saved)
        if due and self._pending:  # one write in flight at a time: wait for it, and let every rank learn how it went
            bits = self._boundary(wait=True)
            preempt = preempt or bool(bits & PREEMPT)
        if not due:
            return False
        # An NCCL group's known calls are checked a step late: make and read that check before
        # the snapshot, so that no checkpoint holds a step whose ranks differed (free elsewhere).
        _dist.settle(_WHAT, final=True)
        if preempt or not self.async_:
            _steps.save_step(self.directory, step, tree, keep=self.keep, prefix=self.prefix, group=self.group)
        else:
            self._start(step, tree)
        self._saved = step
        if preempt:
            self._waiting = set()  # answered: a signal from now on (after its grace period) asks again
            self._stop = True
            if self._superseded is not None:
                failed, why = self._superseded
                self._superseded = None
                warnings.warn(
                    f"fddp.checkpoint.Manager: the asynchronous save of step {failed} failed ({why}); the checkpoint of "
                    f"step {step}, saved on the signal, supersedes it",
                    stacklevel=3,
                )
        return True

    def _boundary(self, wait: bool) -> int:
        """The request bits every rank learns at this boundary (this rank's own sent first): a
        signal, and the outcome of the writer's write (``wait``: once it has ended). A failed write
        raises here, on every rank, unless a signal's save makes up for it."""
        mine = 0
        w = self._write
        if w is not None and (wait or not w.thread.is_alive()):
            w.thread.join()
            self._write = None
            mine = WRITTEN if w.error is None else UNWRITTEN
            self._failure = w
        if not self._distributed:
            raised = self._raised
            bits = mine | (PREEMPT if raised != self._taken else 0)
            self._taken = raised
        elif not _dist.checks().agreement:
            # With the agreement off, a known call sends no header to carry requests: the
            # boundary sends what this rank knows itself, every step.
            raised = self._raised
            got = _ranks.agree(
                [int(raised != self._taken), int(mine == WRITTEN), int(mine == UNWRITTEN)], self.group, _WHAT,
                "what a step boundary learns (a signal, an asynchronous write's outcome)", op="max",
            )  # fmt: skip
            self._taken = raised
            _dist.take_requested(self.group, _MINE)  # told above: a header that carried them meanwhile says it again
            bits = (PREEMPT if got[0] else 0) | (WRITTEN if got[1] else 0) | (UNWRITTEN if got[2] else 0)
        else:
            if mine:
                _dist.request(self.group, mine)
            if wait or _dist.agreements(self.group) == self._mark:
                # Nothing carried a request since the last boundary (or the outcome is needed now): agree here.
                _dist.agree(self.group, _WHAT, _ROWS, signature=_SIGNATURE)
            bits = _dist.take_requested(self.group, _MINE)
            self._mark = _dist.agreements(self.group)
        if bits & (WRITTEN | UNWRITTEN):
            self._pending = False
        if bits & UNWRITTEN:
            self._failed(bool(bits & PREEMPT))
        return bits

    def _failed(self, preempt: bool) -> None:
        """Every rank learnt that the writer's asynchronous write failed: raise (or, where a signal's
        save is about to make up for it, warn after that save)."""
        w = self._failure if _ranks.is_writer(self.group) else None
        step = w.step if w is not None else self._started
        why = f"{type(w.error).__name__}: {w.error}" if w is not None else "rank 0's error says why"
        if preempt:
            self._superseded = (step, why)
            return
        where = "on this rank" if w is not None else "on rank 0, which writes single-file checkpoints"
        e = CheckpointError(
            f"{self.directory}: fddp.{_WHAT}: the asynchronous save of step {step} failed {where} ({why}). Every earlier "
            "checkpoint is intact (the write's temporary was never renamed into place, and nothing was pruned); "
            "fix the cause (disk space, permissions) and save again, or resume from fddp.checkpoint.latest()"
        )
        raise _dist.collective(e) from (w.error if w is not None else None)

    def _start(self, step: int, tree: Any) -> None:
        """Snapshot ``tree`` and start writing it (on the writer); every rank notes a write in flight."""
        if _ranks.is_writer(self.group):
            _lock.hold(self.directory, _WHAT)
            payload = _codec.encode(tree, copy=True, checksums=False)
            path = _steps.step_path(self.directory, step, prefix=self.prefix)
            self._write = _Write(step, path, payload, self.directory, self.prefix, self.keep)
            self._write.thread.start()
        self._pending = True
        self._started = step

    # --- the end -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for this rank's asynchronous write still in flight and put the previous signal handlers
        back (after the rest of the grace period of a signal that arrived, see :class:`Manager`), and
        free the series for another writer. Not an fddp call (it runs on an error path too): a failed last write raises on the
        writer only. Closing twice does nothing.

        Raises:
            CheckpointError: this rank's last asynchronous write failed (every earlier checkpoint
                is intact).

        Example:
            >>> manager.close()
        """
        if self._closed:
            return
        self._closed = True
        _open.discard(self)
        _series.release(self)
        if self._asked:  # copies of a signal still on their way must find this handler, not the default action
            time.sleep(max(0.0, max(self._asked.values()) + self.grace - time.monotonic()))
        for s, previous in self._previous.items():
            try:
                if signal.getsignal(s) == self._on_signal:  # not one installed after ours
                    signal.signal(s, previous if previous is not None else signal.SIG_DFL)
            except ValueError:  # off the main thread: the handler stays, and only records
                pass
        w, self._write = self._write, None
        if w is not None:
            w.thread.join()
            if w.error is not None:
                raise CheckpointError(
                    f"{self.directory}: fddp.checkpoint.Manager.close: the asynchronous save of step {w.step} failed "
                    f"({type(w.error).__name__}: {w.error}); every earlier checkpoint is intact"
                ) from w.error

    def __enter__(self) -> "Manager":
        return self

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> None:
        if e is None:
            self.close()
            return
        try:  # leaving on an error: the write still ends, and its failure must not hide that error
            self.close()
        except CheckpointError as failed:
            warnings.warn(str(failed), stacklevel=2)
