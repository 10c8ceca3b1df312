"""The per-group distributed state: where small collectives live, waits that explain, and agreement.

Everything fddp needs to know about a process group between calls lives here, per group object
(weakly held: a destroyed group takes its state with it): how many calls each fddp function has
made on it (named in timeout errors), which thread is inside a call, and the signatures the ranks
have agreed on.

**Agreement.** Before the bytes of a synchronisation move, every rank of the group all-reduces one
fixed-size header: a digest of the call's signature (the tree's structure, shapes, dtypes and the
options that shape its collectives), the number of agreed calls this rank has made on the group,
the calling thread's name and the fddp function being called. The header has the same size on
every rank whatever they are about to do, so it cannot itself mismatch: a rank that runs another
tree, is a call behind or ahead (a caught exception, a different number of steps), or calls from
another thread, makes every rank raise :class:`MismatchError` naming what differs, instead of a
silently wrong mean or an abort inside the backend. One rank alone (or ``torch.compile``, which
cannot trace it) skips it. :func:`set_checks` turns it off.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from fddp import _caches

__all__ = [
    "MismatchError",
    "collective_device",
    "count_call",
    "call_count",
    "wait",
    "exclusive",
    "agree",
    "start_agreement",
    "Agreement",
    "Agreed",
    "abandon",
    "digest",
    "Checks",
    "set_checks",
    "checks",
]

_REMEMBERED = 256  # agreed signatures kept per group: a loop uses a handful, a sweep must not grow without bound


class MismatchError(RuntimeError):
    """Ranks disagree on what they are about to run: a tree (structure, leaf paths, shapes, dtypes
    or devices), an option that shapes the collectives (bucket caps, compression, weight), the
    order of fddp calls (a rank a call behind or ahead) or the calling thread; or, where checked,
    on values that must be identical (the parameters, the replicas).

    Raised on every rank of the group, with the same message, before any bucket is sent: the
    alternative is a hang, a crash inside the backend, or a silent mix of unrelated values.

    Example:
        >>> try:
        ...     grads = fddp.ddp_step(params, grads)
        ... except fddp.MismatchError as e:
        ...     print(e)  # names the first leaf or option where the ranks differ
    """


MismatchError.__module__ = "fddp"  # raised and caught as fddp.MismatchError


class _GroupState:
    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.agreed = 0  # headers exchanged on this group: the call number every rank must share
        self.seen: collections.OrderedDict[int, None] = collections.OrderedDict()  # agreed digests, LRU
        self.owner: int | None = None  # the thread inside an fddp call on this group
        self.owner_name = ""
        self.owner_what = ""
        self.depth = 0


_lock = threading.Lock()
_states: "weakref.WeakKeyDictionary[Any, _GroupState]" = weakref.WeakKeyDictionary()


def _forget() -> None:
    with _lock:
        _states.clear()
        _last[0] = _last[1] = None


_caches.register("fddp._dist._states", _forget)


# The group last asked about (weakly: a group the script destroys must not live on here, with
# gloo's threads, until interpreter shutdown) and its state: a call asks three times.
_last: list[Any] = [None, None]


def _state(group: dist.ProcessGroup | None) -> _GroupState:
    pg = group if group is not None else dist.group.WORLD
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


class Checks(NamedTuple):
    """Which cross-rank checks fddp makes (see :func:`set_checks`).

    Attributes:
        agreement: every synchronisation first agrees on a fixed-size header (signature, call
            number, thread, function): one small all-reduce per call.
        replicas: the first synchronisation of a new tree compares a checksum of the parameters
            across the ranks (``grad``/``grad_and_value``'s differentiated arguments, ``ddp_step``'s
            ``params``): a forgotten ``fddp.broadcast(params)`` is an error, not 50 silent steps.

    Example:
        >>> fddp.checks().agreement
        True
    """

    agreement: bool = True
    replicas: bool = True


_checks = Checks()


def set_checks(*, agreement: bool | None = None, replicas: bool | None = None) -> Checks:
    """Turn fddp's cross-rank checks on or off, for every group of this process; return the new setting.

    Every rank must make the same choice. Both are on by default. With ``agreement=False`` a
    synchronisation skips its header (one small all-reduce, a latency per call): ranks that diverge
    then give a silently wrong mean or an error from the backend instead of a
    :class:`MismatchError`, and a new tree is still checked once, at its first call (which needs
    every rank to meet it for the first time together). ``replicas=False`` skips the parameter
    checksum of a new tree: for ``ddp_step`` on values that legitimately differ between ranks.

    Example:
        >>> fddp.set_checks(agreement=False)  # on every rank, before the loop
        Checks(agreement=False, replicas=True)
    """
    global _checks
    for name, value in (("agreement", agreement), ("replicas", replicas)):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"fddp.set_checks: {name} must be True, False or None (unchanged), got {value!r}")
    _checks = Checks(
        _checks.agreement if agreement is None else agreement, _checks.replicas if replicas is None else replicas
    )
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


def wait(work: Any, group: dist.ProcessGroup | None, what: str, doing: str) -> None:
    """Wait for an async collective; on failure say which rank, which call and what it was doing."""
    try:
        work.wait()
    except Exception as e:  # gloo/NCCL raise RuntimeError (or DistBackendError) on timeout
        r, w = dist.get_rank(), dist.get_world_size()
        n = call_count(group, what)
        call = f" (call {n} to fddp.{what} in this process)" if n else ""
        verb = "timed out" if "timed out" in str(e).lower() else "failed"
        raise RuntimeError(
            f"fddp.{what}: rank {r} of {w} {verb} during {doing}{call}: {e}. A peer may have crashed, "
            "be stuck, or have skipped or reordered this call (every rank must make the same fddp "
            "calls in the same order); the process group's timeout (fddp.init(timeout=...)) bounds "
            "the wait."
        ) from e


class exclusive:
    """Hold ``group`` for this thread while ``fddp.<what>`` issues its collectives (a context manager).

    A second thread that starts an fddp call on the same group meanwhile raises at once: the
    ranks match collectives by their order on the group, and two threads' calls interleave
    differently on every rank (a wrong mean, or an abort in the backend). The thread inside may
    call fddp again (a ``loss_fn`` that synchronises). Use one group per thread.

    Example:
        >>> with exclusive(group, "ddp_step"):
        ...     ...  # this call's collectives
    """

    __slots__ = ("group", "what", "st")

    def __init__(self, group: dist.ProcessGroup | None, what: str) -> None:
        self.group, self.what, self.st = group, what, None

    def __enter__(self) -> None:
        if torch.compiler.is_compiling() or not dist.is_initialized():
            return  # no group yet: the call itself raises the error that says how to start one
        st = _state(self.group)
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

    def __exit__(self, *exc: Any) -> None:
        st = self.st
        if st is not None:
            with _lock:
                st.depth -= 1
                if st.depth == 0:
                    st.owner = None


def abandon(group: dist.ProcessGroup | None) -> None:
    """Count a call that failed before its agreement (``fn`` raised): the other ranks agreed on
    it, or will, and this rank's next call must not pass for it."""
    if not torch.compiler.is_compiling():
        _state(group).agreed += 1


def digest(described: Any) -> int:
    """A 62-bit digest of ``repr(described)``, the same in every process (``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(repr(described).encode(), digest_size=8).digest(), "little") >> 2


_name_digest = _caches.cached(maxsize=256, name="fddp._dist._name_digest")(digest)  # thread and function names: a handful per run


class Agreed(NamedTuple):
    """What every rank learned from one agreement (the same on every rank).

    Attributes:
        new: some rank meets this call's signature on this group for the first time.
        asked: some rank asked for the checks a new tree gets (``ask=True``), and the tree is new.
    """

    new: bool
    asked: bool


def agree(
    group: dist.ProcessGroup | None,
    what: str,
    signature: int,
    rows: Callable[[], list[tuple]],
    name_difference: Callable[[Sequence[list[tuple]]], str],
    ask: bool = False,
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

    Returns:
        :class:`Agreed`: whether the signature is new to some rank, and whether some rank asked
        (the same on every rank, so the caller's further collectives match).

    Raises:
        MismatchError: on every rank, when the ranks' headers differ.
    """
    return start_agreement(group, what, signature, rows, name_difference, ask).finish()


def start_agreement(
    group: dist.ProcessGroup | None,
    what: str,
    signature: int,
    rows: Callable[[], list[tuple]],
    name_difference: Callable[[Sequence[list[tuple]]], str],
    ask: bool = False,
) -> Agreement:
    """Send this call's header and return at once (the arguments are :func:`agree`'s).

    The call is numbered now; the caller must :meth:`Agreement.finish` it before this call's
    other collectives on ``group``.
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the header; a compiled step relies on its guards (a new tree
        # re-traces) and on an eager call (fddp.broadcast, a first eager step) having agreed.
        return Agreement(None, None, Agreed(False, False))
    st = _state(group)
    new = signature not in st.seen
    asked = ask and new
    call = st.agreed
    st.agreed += 1  # the call happens, if only to fail: the ranks stay numbered alike
    n = dist.get_world_size(group)
    if n > 1 and (_checks.agreement or new):
        thread = threading.current_thread().name
        h = [signature, call, _name_digest(thread), _name_digest(what)]
        t = torch.tensor(h + [int(new), int(asked)] + [-x for x in h], dtype=torch.int64, device=collective_device(group))
        return Agreement(t, _exchange(t, group, what), None, (group, what, st, signature, call, thread, rows, name_difference))
    _remember(st, signature)
    return Agreement(None, None, Agreed(new, asked))  # one rank, or a known tree with the agreement off


def _remember(st: _GroupState, signature: int) -> None:
    """Note that the ranks agreed on ``signature`` (the most recent ``_REMEMBERED`` are kept)."""
    st.seen[signature] = None
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
        """
        if self.result is not None:
            return self.result
        group, what, st, signature, call, thread, rows, name_difference = self.context
        wait(self.work, group, what, "the agreement on this call")
        t = self.header
        if t[:4].tolist() != [-x for x in t[6:].tolist()]:
            _disagree(group, what, call, thread, rows, name_difference)
        _remember(st, signature)
        self.result = Agreed(bool(t[4].item()), bool(t[5].item()))
        return self.result


def _exchange(header: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> Any:
    """Start the all-reduce of the header (the maximum of every field and of its negation: min and
    max at once); return its work."""
    return dist.all_reduce(header, op=dist.ReduceOp.MAX, group=group, async_op=True)


def _disagree(
    group: dist.ProcessGroup | None,
    what: str,
    call: int,
    thread: str,
    rows: Callable[[], list[tuple]],
    name_difference: Callable[[Sequence[list[tuple]]], str],
) -> None:
    """Every rank is here together (the all-reduced header is the same everywhere): gather what
    each rank is doing and raise the same error on all of them."""
    mine = {"what": what, "call": call, "thread": thread, "rows": rows()}
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    calls = [(e["call"], e["what"]) for e in everyone]
    if len(set(calls)) > 1:
        doing = "; ".join(f"rank {r} is at its call {c + 1} (fddp.{w})" for r, (c, w) in enumerate(calls))
        raise MismatchError(
            f"fddp.{what}: ranks are at different fddp calls on this group: {doing}. Every rank must make the "
            "same fddp calls in the same order: one skipped or repeated a call (a different number of steps, "
            "or an exception caught inside a step and the loop continued)."
        )
    threads = [e["thread"] for e in everyone]
    if len(set(threads)) > 1:
        who = ", ".join(f"rank {r} from thread {t!r}" for r, t in enumerate(threads))
        raise MismatchError(
            f"fddp.{what}: ranks call from different threads: {who}. Collectives on one group are matched by "
            "their order; call fddp from one thread per group (each thread its own group)."
        )
    raise MismatchError(f"fddp.{what}: ranks disagree on the tree or the options. {name_difference([e['rows'] for e in everyone])}")

