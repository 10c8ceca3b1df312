"""Multi-process test harness: run a function on N gloo ranks and collect each rank's result.

``run(fn, world_size, *args)`` calls ``fn(*args)`` on every rank of a gloo process group made of
separate processes and returns the list of results, indexed by rank. A rank that raises fails the
call with that rank's traceback; a call that does not finish within ``timeout`` seconds kills the
group and raises, so a broken collective fails a test instead of hanging the suite.

Workers are kept between calls (one pool per world size) because starting a process and importing
torch costs seconds; a pool that saw an error or a timeout is killed and rebuilt on next use.
``fn`` must be picklable: a module-level function of a test module.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

# A collective that waits longer than this raises inside the worker, well before the test's timeout.
COLLECTIVE_TIMEOUT_S = 30.0


class RankError(RuntimeError):
    """A rank raised; the message holds its traceback."""


def _worker(rank: int, world_size: int, store_path: str, conn: Any, timeout_s: float) -> None:
    import faulthandler

    faulthandler.enable()  # a rank that dies of a signal (SIGSEGV seen once) prints every thread's Python stack
    import torch
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401 - before the group: see fddp.init

    torch.set_num_threads(1)  # several ranks share 2 cores
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    import fddp
    import scopes

    scopes.install()  # every collective fddp issues in the suite's multi-process tests must be in a call scope

    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        fddp.clear_caches()  # each call starts with no remembered signatures, on every rank
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()


class Pool:
    """``world_size`` worker processes joined in one gloo process group."""

    def __init__(self, world_size: int, collective_timeout: float = COLLECTIVE_TIMEOUT_S):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tmp = tempfile.mkdtemp(prefix="fddp-test-")
        store = os.path.join(self.tmp, "store")
        self.conns, self.procs = [], []
        for r in range(world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world_size, store, child, collective_timeout), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for c in self.conns:
            c.send((fn, args, kwargs))
        results: list[Any] = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            if errors:  # a failed rank's peers may be stuck in a collective: give them a moment
                deadline = min(deadline, time.monotonic() + 3.0)
            left = deadline - time.monotonic()
            ready = mpc.wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], max(left, 0))
            if not ready:
                if errors:
                    break
                raise TimeoutError(f"ranks {sorted(pending)} of {self.world_size} did not finish within {timeout} s")
            for r in sorted(pending):
                if self.conns[r] in ready or self.conns[r].poll():
                    pending.discard(r)
                    try:
                        status, payload = self.conns[r].recv()
                    except EOFError:  # the worker died before it could answer
                        status, payload = "err", f"rank {r} died (exit code {self._exitcode(r)})"
                    if status == "ok":
                        results[r] = payload
                    else:
                        errors[r] = payload
                elif self.procs[r].sentinel in ready:
                    pending.discard(r)
                    errors[r] = f"rank {r} died (exit code {self._exitcode(r)})"
        if errors:
            # Every failed rank's story, the first first: a peer's error often says only that
            # the first one left; the first's alone can hide why it did.
            r = min(errors)
            others = "".join(f"\n--- rank {o} failed too:\n{errors[o][-3000:]}" for o in sorted(errors) if o != r)
            raise RankError(f"rank {r} of {self.world_size} failed:\n{errors[r]}{others}")
        return results

    def _exitcode(self, r: int) -> int | None:
        self.procs[r].join(timeout=1)
        return self.procs[r].exitcode

    def close(self, graceful: bool = False) -> None:
        for c, p in zip(self.conns, self.procs):
            if graceful and p.is_alive():
                try:
                    c.send(None)
                except OSError:
                    pass
        for p in self.procs:
            p.join(timeout=2 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(self.tmp, ignore_errors=True)


_pools: dict[int, Pool] = {}


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0, **kwargs: Any) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the results by rank.

    Raises:
        RankError: a rank raised (the message holds its traceback) or died.
        TimeoutError: the ranks did not all finish within ``timeout`` seconds.
    """
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = Pool(world_size)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except BaseException:
        # Peers of a failed rank may be stuck in a collective: never reuse the group.
        _pools.pop(world_size).close()
        raise


@contextlib.contextmanager
def count_calls(names: tuple[str, ...], entry: Callable[[str, tuple], Any]):
    """Record the ``torch.distributed`` functions ``names`` called while the block runs.

    Yields a list that gets ``entry(name, args)`` per call. fddp's per-call head
    (``fddp._dist._header``) is not one of a call's data collectives: it is counted apart, in
    ``calls.headers``, and the collective it issues is not recorded; a head that carries the
    call's data (a plain mean or sum that fits in it) is recorded as an ``all_reduce`` of that
    data (its DATA slots), and not counted as a head.
    """
    import torch.distributed as tdist

    import fddp._dist._header as header

    calls = _Calls()
    originals = {name: getattr(tdist, name) for name in names}
    exchange = header.exchange
    in_header = [False]

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            if not in_header[0]:
                calls.append(entry(name, args))
            return fn(*args, **kwargs)

        return wrapper

    def as_header(head, group, data=0):
        if data:
            if "all_reduce" in names:
                calls.append(entry("all_reduce", (head[header.DATA : header.DATA + data], group)))
        else:
            calls.headers += 1
        in_header[0] = True
        try:
            return exchange(head, group, data)
        finally:
            in_header[0] = False

    for name, fn in originals.items():
        setattr(tdist, name, counting(name, fn))
    header.exchange = as_header
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(tdist, name, fn)
        header.exchange = exchange


def count_all_reduces():
    """Count the all-reduces issued through ``torch.distributed.all_reduce`` while the block runs.

    Yields a list that gets one ``(numel, in_backward)`` pair per call; ``in_backward`` says whether
    the call was made from inside an autograd backward pass. Agreement headers are counted apart,
    in ``calls.headers`` (:func:`count_calls`).
    """
    import torch

    return count_calls(("all_reduce",), lambda _, args: (args[0].numel(), torch._C._current_graph_task_id() != -1))


class _Calls(list):
    headers = 0


def kill_marked(variable: str, value: Any) -> None:
    """SIGKILL every process whose environment holds ``variable=value``: the processes a test
    launched with that marker (torchrun's workers run in sessions of their own, so killing the
    launcher's process group would miss them)."""
    tag = f"{variable}={value}\0".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except OSError:  # gone, or not ours to read
            pass


@atexit.register
def _close_all() -> None:
    for pool in _pools.values():
        pool.close(graceful=True)
    _pools.clear()
