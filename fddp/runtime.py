"""The process-group runtime: initialise from torchrun's environment, query rank and world size."""

from __future__ import annotations

import atexit
import datetime
import gc
import importlib
import os
import secrets
import sys
import time

import torch
import torch.distributed as dist

from fddp import _caches, _dist

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "world_size",
    "is_main",
    "local_rank",
    "device",
    "clear_caches",
    "require_initialized",
]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and timeout > 0:
        return datetime.timedelta(seconds=float(timeout))
    raise ValueError(f"fddp.init: timeout must be a positive number of seconds or a timedelta, got {timeout!r}")


def init(*, backend: str | None = None, timeout: float | datetime.timedelta | None = None) -> None:
    """Initialise the default process group from torchrun's environment.

    Idempotent: a second call (or a process group the user created) is left as it is. A new
    group (after ``torch.distributed.destroy_process_group()``) starts with empty caches
    (:func:`clear_caches`), so its trees are checked across ranks afresh. Without
    torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) this gives a
    one-process world, so the same script runs under plain ``python``.

    Args:
        backend: ``"gloo"``, ``"nccl"`` or any torch.distributed backend string. ``None`` picks
            ``"cpu:gloo,cuda:nccl"`` when CUDA is available (and selects the GPU ``LOCAL_RANK``),
            else ``"gloo"``.
        timeout: seconds (or a ``timedelta``) after which a collective that cannot complete
            raises instead of hanging. ``None`` keeps torch's default.

    Example:
        >>> import fddp
        >>> fddp.init()
        >>> fddp.rank(), fddp.world_size()
        (0, 1)
    """
    global _shut_down
    td = _as_timedelta(timeout)
    if dist.is_initialized():
        return
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available() and "nccl" in backend:
        torch.cuda.set_device(local_rank())
    kwargs = {} if td is None else {"timeout": td}
    _shut_down = False
    clear_caches()
    # torch.distributed.nn.functional evaluates `group=group.WORLD` in its functions' signatures
    # when it is imported: imported after this group exists (torch._dynamo imports it, and
    # torch.func.grad imports torch._dynamo), ten default arguments keep the group alive after
    # destroy_process_group, and gloo's threads with it, until interpreter shutdown. Imported
    # now, those defaults are None (the default group at call time).
    importlib.import_module("torch.distributed.nn.functional")

    store = _restart_scoped_store(td)
    if store is not None:
        rank_, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend=backend, store=store, rank=rank_, world_size=size, **kwargs)
    elif all(v in os.environ for v in _TORCHRUN_VARS):
        dist.init_process_group(backend=backend, init_method="env://", **kwargs)
    else:
        # An in-memory store: a one-process world needs no rendezvous and no free port.
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    if _dist.uses_nccl(None) and dist.get_world_size() > 1:

        _dist.control_group(None)  # the headers' gloo side group, made while every rank is here (see control_group)
    _release_at_exit()


_at_exit_registered = False
_shut_down = False  # fddp.shutdown() destroyed the group, and no init() has made one since: said in errors


def _release_at_exit() -> None:
    """Destroy fddp's process group at interpreter exit if the script did not call :func:`shutdown`.

    atexit handlers run while the interpreter is fully alive; a gloo group left for interpreter
    finalization to free can abort the process ("terminate called without an active exception")
    after the script's last line. No barrier here: a script that ends without ``shutdown`` may be
    ending on an error, and a peer that never arrives would hold the barrier for the whole timeout.
    """
    global _at_exit_registered
    if not _at_exit_registered:
        atexit.register(_destroy_if_alive)
        _at_exit_registered = True


def _destroy_if_alive() -> None:
    if is_initialized():
        dist.destroy_process_group()
    # Also after a script's own destroy_process_group: fddp's caches (options, layouts, per-group
    # state, keyed by or holding the group object) would keep the group, and gloo's threads, for
    # interpreter finalization to free, which aborts the process about one run in three.
    _release_captured_groups()
    clear_caches()
    gc.collect()


def shutdown() -> None:
    """End the process group on every rank, together: the counterpart of :func:`init`.

    Call it at the end of a successful run, on every rank (not on an error path: a rank that
    failed never reaches it, and the others would wait in the barrier until the group's timeout).
    In order, it:

    1. agrees with every rank that all are here (the per-call agreement of every fddp collective:
       a rank still inside a step, because the others stopped a step early, makes every rank raise
       :class:`fddp.MismatchError` naming each one's call, at once) and waits for them (a barrier),
       so that no rank tears its connections down while a peer is still in a collective or still
       writing a checkpoint the others may read;
    2. destroys the process group (``torch.distributed.destroy_process_group``) while the
       interpreter is fully alive;
    3. lets go of what fddp keeps for the group (its pooled host buffers, the remembered tree
       signatures) and collects garbage, so that no tensor or communication object tied to the
       group is left for interpreter shutdown to free (DDP's reducer, for one, sits in reference
       cycles); freeing those while the interpreter is being torn down can abort the process
       ("terminate called without an active exception").

    Without a process group it does nothing, so the same script ends cleanly under plain python.

    Example:
        >>> fddp.init()
        >>> fddp.shutdown()
        >>> fddp.is_initialized()
        False
    """
    global _shut_down
    if not is_initialized():
        return
    try:
        if dist.get_world_size() > 1:
            # A rank still inside a step (the others stopped early) meets this agreement instead of
            # its peers' step: every rank raises fddp.MismatchError, naming each one's call, within
            # a round trip, instead of waiting for the group's timeout.
            with _dist.call(None, "shutdown"):
                _dist.settle("shutdown", final=True, every_thread=True)  # an NCCL group's last checks are made and read, not dropped
                _dist.agree(None, "shutdown", _shutdown_rows, signature=_SHUTDOWN, names=_shutdown_difference)
                dist.barrier()
    finally:
        dist.destroy_process_group()
        _shut_down = True
        _release_captured_groups()
        clear_caches()
        gc.collect()


_SHUTDOWN_ROWS = [("call", "fddp.shutdown", None)]
_SHUTDOWN = _dist.digest(_SHUTDOWN_ROWS)


def _shutdown_rows() -> list[tuple]:
    return list(_SHUTDOWN_ROWS)


def _shutdown_difference(per_rank: list) -> str:
    return "Some rank is not at its fddp.shutdown()."


def _release_captured_groups() -> None:
    """Let go of destroyed process groups held as default arguments of torch.distributed.nn.functional.

    Its functions are defined with ``group=group.WORLD``, evaluated on import; imported after the
    group was made (by torch._dynamo, which torch.func.grad imports), they hold that group, and
    gloo's worker threads, until interpreter shutdown, where tearing them down can abort the
    process. :func:`init` imports the module first; a group made by ``init_process_group``
    directly may still be caught, and is released here. ``None`` means the default group at call
    time, which is what those defaults would be had the module been imported earlier.
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(module).values() if module is not None else ():
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def _restart_scoped_store(timeout: datetime.timedelta | None) -> dist.Store | None:
    """Return torchrun's shared store with keys scoped to this attempt of the group; else None.

    torchrun (c10d rendezvous) hosts one TCP store for all of a job's restarts, and the process
    group's rendezvous keys (each rank's address) are not scoped by restart: after a worker is
    killed and the group restarted, a rank may read its dead predecessor's address and fail with
    "Connection refused" (pytorch issue #135712). ``TORCHELASTIC_RESTART_COUNT`` cannot tell the
    attempts apart when several agents (hosts) take part: an agent restarted by a peer's failure
    does not count it, so the counts differ between hosts. The ranks therefore agree on a fresh
    session id (see ``_agree_on_session``) and prefix every key with it.
    """
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not all(v in env for v in _TORCHRUN_VARS):
        return None
    timeout = timeout or dist.constants.default_pg_timeout
    rank_, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), size, is_master=False, timeout=timeout)
    session = _agree_on_session(store, rank_, size, timeout)
    return dist.PrefixStore(f"fddp/session_{session}", store)


_HANDSHAKE = "fddp/handshake"


def _agree_on_session(store: dist.Store, rank_: int, size: int, timeout: datetime.timedelta) -> str:
    """Return a session id, the same on every rank and new for every start of the group.

    Rank 0 draws the id. Every other rank draws a nonce, posts it under its rank and waits for the
    id under a key named by that nonce: a key no earlier attempt can have written. A posted nonce
    may still be a dead predecessor's, so rank 0 answers every nonce it sees until each rank has
    acknowledged the id (under a key named by the id, again fresh).
    """
    if rank_ != 0:
        nonce = secrets.token_hex(8)
        store.set(f"{_HANDSHAKE}/hello/{rank_}", nonce)
        session = store.get(f"{_HANDSHAKE}/welcome/{rank_}/{nonce}").decode()
        store.set(f"{_HANDSHAKE}/ack/{session}/{rank_}", "1")
        return session
    session = secrets.token_hex(8)
    answered: dict[int, bytes] = {}
    pending = set(range(1, size))
    deadline, pause = time.monotonic() + timeout.total_seconds(), 0.001
    while pending:
        for r in sorted(pending):
            if store.check([f"{_HANDSHAKE}/ack/{session}/{r}"]):
                pending.discard(r)
                continue
            nonce = store.get(f"{_HANDSHAKE}/hello/{r}")  # blocks until rank r (or a predecessor) posted
            if answered.get(r) != nonce:
                store.set(f"{_HANDSHAKE}/welcome/{r}/{nonce.decode()}", session)
                answered[r] = nonce
        if pending:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"fddp.init: ranks {sorted(pending)} of {size} did not join within {timeout} "
                    "(they may have failed to start; see their logs)"
                )
            time.sleep(pause)
            pause = min(2 * pause, 0.05)  # a few polls while everyone arrives, then fewer
    return session


def is_initialized() -> bool:
    """Return whether the default process group exists.

    Example:
        >>> fddp.is_initialized()
        True
    """
    return dist.is_available() and dist.is_initialized()


def require_initialized(what: str) -> None:
    """Raise a RuntimeError that tells the user how to start the runtime, for where this process runs."""
    if is_initialized():
        return
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if _shut_down:
        fix = "fddp.shutdown() ended this process's group earlier; call fddp.init() again (on every rank) for a new one."
    elif not missing:
        fix = (
            f"torchrun's variables are set here (RANK={os.environ['RANK']}, WORLD_SIZE={os.environ['WORLD_SIZE']}): "
            "call fddp.init() at the start of the script, on every rank, before any other fddp call."
        )
    elif len(missing) < len(_TORCHRUN_VARS):
        present = [v for v in _TORCHRUN_VARS if v in os.environ]
        fix = (
            f"torchrun's variables are only partly set ({', '.join(present)} set; {', '.join(missing)} missing), so "
            "fddp.init() would make a one-process world: launch with `torchrun --nproc-per-node=N script.py`, or "
            "set all four, then call fddp.init()."
        )
    else:
        fix = (
            "Call fddp.init() first: under plain python it makes a one-process world; for N processes, launch the "
            "script with `torchrun --nproc-per-node=N script.py`, where fddp.init() reads torchrun's environment."
        )
    raise RuntimeError(f"fddp.{what}: the torch.distributed process group is not initialised. {fix}")


def rank(group: dist.ProcessGroup | None = None) -> int:
    """Return this process's rank in ``group`` (the default group when None); 0 before ``init``.

    Example:
        >>> fddp.rank()
        0
    """
    return dist.get_rank(group) if is_initialized() else 0


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Return the number of ranks in ``group`` (the default group when None); 1 before ``init``.

    Example:
        >>> fddp.world_size()
        1
    """
    return dist.get_world_size(group) if is_initialized() else 1


def is_main(group: dist.ProcessGroup | None = None) -> bool:
    """Return whether this process is rank 0 of ``group``: the one that logs and writes files.

    Example:
        >>> if fddp.is_main():
        ...     print("only once")
        only once
    """
    return rank(group) == 0


def local_rank() -> int:
    """Return the rank within this machine (torchrun's ``LOCAL_RANK``; 0 without torchrun).

    Example:
        >>> fddp.local_rank()
        0
    """
    return int(os.environ.get("LOCAL_RANK", 0))


def device() -> torch.device:
    """Return the device this process should compute on: its local GPU when CUDA is used, else CPU.

    Example:
        >>> fddp.device()
        device(type='cpu')
    """
    if torch.cuda.is_available() and is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def clear_caches() -> None:
    """Forget everything fddp remembers between calls: the signatures the ranks agreed on, the
    call counts named in timeout errors, bucket plans, tree structures, layouts, and the host
    buffer pool (every cache in fddp's registry, ``fddp._caches``).

    fddp keeps the host buffers it makes (gradient buckets, ``fddp.optim``'s flat parameters and
    state) and reuses the ones nothing refers to any more: like torch's CUDA caching allocator, it
    holds on to a step's peak working set. Buffers still in use stay valid; they are simply not
    reused. Call this after training, or between phases that use different models; every rank
    must then call it too (the next call on every tree is checked as a new one).
    :func:`init` calls it when it creates a process group.

    Example:
        >>> fddp.clear_caches()
    """
    try:
        if dist.is_available() and dist.is_initialized():
            _dist.settle("clear_caches", final=True, every_thread=True)  # an NCCL group's last checks, not dropped
    finally:
        _caches.clear_all()
