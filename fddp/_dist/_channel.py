"""The error channel: what one rank says on a process group's store, and every rank can read.

A rank that fails inside an fddp call while its peers may be waiting in a collective for it
posts a :class:`Failure` here; every fddp wait that lasts longer than a moment reads the channel,
so the peers raise the same error within a poll interval instead of waiting for the group's
timeout (NCCL's async error handling and torchft's abort-on-failure give users the same
guarantee). A rank stuck for a while also posts what it is waiting for, so that ranks waiting in
*different* collectives (one on a new group, the other on the default one) see each other and
raise instead of hanging: the :class:`Board`.

The channel lives on the store the group was made with (torchrun's, or the ``FileStore`` of a
test), under keys scoped by a *generation* (how many times this process cleared fddp's caches:
every rank does it alike, and a new generation must not read an old one's failures) and by the
group's membership *epoch* (a fault-tolerant run's quorum changes start new ones). Values are
JSON, never pickle: a store is shared with other programs.

This module knows stores and records, not process groups or tensors: ``fddp._dist`` decides when
to post and when to read.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from typing import Any, NamedTuple, Sequence

import torch.distributed as dist

__all__ = ["Failure", "Channel", "Waiting", "Board", "generation", "next_generation"]

_GET_TIMEOUT = datetime.timedelta(seconds=10)  # a key another rank has promised (it posts, then tells)

_generation = [0]
_lock = threading.Lock()


def generation() -> int:
    """This process's cache generation: the number of ``fddp.clear_caches()`` calls so far."""
    return _generation[0]


def next_generation() -> None:
    """Start a new generation (``fddp.clear_caches()`` does, on every rank alike)."""
    with _lock:
        _generation[0] += 1


class Failure(NamedTuple):
    """What went wrong on one rank, as its peers read it.

    Attributes:
        rank: the failing rank, in the group.
        what: the fddp function it was in (``"ddp_step"``, ``"zero.fully_shard"``).
        call: its call number on the group (the agreement's count, from 1).
        kind: the exception's type name (``"ValueError"``).
        message: the exception's message.
        fatal: the failure left collectives unmatched: the group cannot carry fddp calls any more.
    """

    rank: int
    what: str
    call: int
    kind: str
    message: str
    fatal: bool

    def encode(self) -> str:
        return json.dumps(self._asdict())

    @classmethod
    def decode(cls, raw: bytes | str) -> "Failure":
        d = json.loads(raw)
        return cls(int(d["rank"]), str(d["what"]), int(d["call"]), str(d["kind"]), str(d["message"]), bool(d["fatal"]))

    def describe(self) -> str:
        """``rank 1 failed in fddp.ddp_step (its call 12 on this group): ValueError: a bad batch``"""
        return f"rank {self.rank} failed in fddp.{self.what} (its call {self.call} on this group): {self.kind}: {self.message}"


class Channel:
    """One group's channel in one generation and epoch.

    Args:
        store: the group's store (already prefixed for the group, as torch.distributed keeps it).
        scope: the key prefix, unique per generation and epoch.

    Example:
        >>> channel = Channel(store, "fddp/g3/e0")
        >>> channel.post(Failure(1, "ddp_step", 12, "ValueError", "a bad batch", fatal=True))
        >>> channel.fatal()  # on any rank
        Failure(rank=1, what='ddp_step', call=12, kind='ValueError', message='a bad batch', fatal=True)
    """

    __slots__ = ("store", "scope", "_fatal")

    def __init__(self, store: dist.Store, scope: str) -> None:
        self.store, self.scope = store, scope
        self._fatal: Failure | None = None

    def _key(self, *parts: Any) -> str:
        return "/".join((self.scope, *map(str, parts)))

    def post(self, failure: Failure) -> Failure:
        """Post ``failure``; a fatal one goes to the key every wait reads (the first poster wins).

        Returns the group's fatal failure as posted (another rank's, if it was first), or
        ``failure`` itself for a non-fatal one.
        """
        raw = failure.encode()
        self.store.set(self._key("call", failure.call, "rank", failure.rank), raw)
        if not failure.fatal:
            return failure
        first = self.store.compare_set(self._key("fatal"), "", raw)
        self._fatal = Failure.decode(first) if first else failure
        return self._fatal

    def announced(self, call: int, rank: int) -> Failure:
        """The failure ``rank`` posted for its call ``call`` (it posts before its header says so)."""
        key = self._key("call", call, "rank", rank)
        try:
            self.store.wait([key], _GET_TIMEOUT)
            return Failure.decode(self.store.get(key))
        except Exception as e:  # noqa: BLE001 - the peer died between its post and its header, or the store is gone
            return Failure(rank, "?", call, "unknown", f"(its report could not be read from the store: {e})", False)

    def posted(self, call: int, rank: int) -> bool:
        """Whether ``rank`` posted a failure for its call ``call``."""
        try:
            return bool(self.store.check([self._key("call", call, "rank", rank)]))
        except Exception:  # noqa: BLE001 - a store that is gone cannot tell
            return False

    def exchange(self, topic: str, rank: int, world: int, mine: dict, timeout: float = 5.0) -> list[dict | None]:
        """Post ``mine`` (JSON) under ``topic`` and read every rank's; ``None`` for a rank that
        does not post within ``timeout`` seconds in all (a rank inside a compiled step, or gone).

        For ranks whose header showed that they differ, to say how: ``topic`` is made from what
        they all saw, the same on every rank whatever their own calls were.
        """
        key = lambda r: self._key("differ", topic, r)  # noqa: E731
        self.store.set(key(rank), json.dumps(mine))
        out: list[dict | None] = []
        deadline = time.monotonic() + timeout
        for r in range(world):
            if r == rank:
                out.append(json.loads(json.dumps(mine)))  # through JSON like the others: tuples become lists
                continue
            try:
                left = max(deadline - time.monotonic(), 0.01)
                self.store.wait([key(r)], datetime.timedelta(seconds=left))
                out.append(json.loads(self.store.get(key(r))))
            except Exception:  # noqa: BLE001 - it did not say: the error names what the others said
                out.append(None)
        # Each rank says it has read, and waits (within what is left of the timeout) for the others
        # that posted to say so: the rank that hosts the store must not raise, exit and take the
        # store down while a peer is still reading its record.
        done = lambda r: self._key("differ", topic, r, "read")  # noqa: E731
        try:
            self.store.set(done(rank), "1")
            for r, got in enumerate(out):
                if r != rank and got is not None:
                    left = max(deadline - time.monotonic(), 0.01)
                    self.store.wait([done(r)], datetime.timedelta(seconds=left))
        except Exception:  # noqa: BLE001 - a peer gone or slow: what was read stands
            pass
        return out

    def fatal(self) -> Failure | None:
        """The group's fatal failure, if some rank posted one (one store round trip until then)."""
        if self._fatal is None:
            key = self._key("fatal")
            try:
                if self.store.check([key]):
                    self._fatal = Failure.decode(self.store.get(key))
            except Exception:  # noqa: BLE001 - a store that is gone cannot tell; the wait's own timeout still holds
                return None
        return self._fatal


class Waiting(NamedTuple):
    """What a rank stuck in a wait is waiting for (posted on the :class:`Board`).

    Attributes:
        group: the group's name, the same on every rank (``torch.distributed``'s ``group_name``).
        label: the group in words ("the default group", "group 3 (ranks [0, 1])").
        ranks: the group's members, as global ranks.
        call: the call's number on the group.
        what: the fddp function.
        doing: what it waits for ("the agreement on this call").
        wait: a number that changes with every wait this rank makes (to tell a stale post).
    """

    group: str
    label: str
    ranks: tuple[int, ...]
    call: int
    what: str
    doing: str
    wait: int

    def where(self) -> tuple:
        """What two ranks waiting in the same collective share."""
        return self.group, self.call, self.what, self.doing


class Board:
    """Where ranks stuck in a wait post what they wait for, on the default group's store.

    A collective completes only when every rank of its group is in it; if every rank that some
    stuck rank waits for is itself stuck, each in a collective whose group is not wholly in it,
    nothing can move: a deadlock (one rank on a new group, its peer on the default group). The
    board finds that from the posts and :func:`fddp._dist.wait` raises on each stuck rank.
    """

    __slots__ = ("store", "scope")

    def __init__(self, store: dist.Store, scope: str) -> None:
        self.store, self.scope = store, scope

    def _key(self, rank: int) -> str:
        return f"{self.scope}/waiting/{rank}"

    def post(self, rank: int, waiting: Waiting | None) -> None:
        """Say what global rank ``rank`` waits for (``None``: nothing any more)."""
        self.store.set(self._key(rank), "" if waiting is None else json.dumps(waiting._asdict()))

    def read(self, ranks: Sequence[int]) -> dict[int, Waiting]:
        """The posts of ``ranks`` that say they are waiting."""
        keys = [self._key(r) for r in ranks]
        present = [self.store.check([k]) for k in keys]
        out = {}
        for r, k, there in zip(ranks, keys, present):
            if there:
                raw = self.store.get(k)
                if raw:
                    d = json.loads(raw)
                    out[r] = Waiting(d["group"], d["label"], tuple(d["ranks"]), d["call"], d["what"], d["doing"], d["wait"])
        return out

    def introduce(self, rank: int, host: str, pid: int) -> None:
        """Say which process global rank ``rank`` is."""
        self.store.set(f"{self.scope}/who/{rank}", json.dumps({"host": host, "pid": pid}))

    def who(self, ranks: Sequence[int]) -> dict[int, tuple[str, int]]:
        """The host and pid of those of ``ranks`` that introduced themselves."""
        out = {}
        for r in ranks:
            key = f"{self.scope}/who/{r}"
            if self.store.check([key]):
                d = json.loads(self.store.get(key))
                out[r] = (str(d["host"]), int(d["pid"]))
        return out

    def deadlock(self, me: int, mine: Waiting) -> list[tuple[int, Waiting]] | None:
        """The stuck ranks (with what each waits for) if no collective that ``mine`` depends on can
        complete; ``None`` otherwise (someone is still working, or the collective is just slow)."""
        posts = self.read(mine.ranks)
        posts[me] = mine
        if set(posts) != set(mine.ranks):
            return None  # a peer is not in a wait: it may yet arrive
        if _complete(mine, posts):
            return None  # every member is in this very collective: it is moving, only slowly
        for w in set(posts.values()):
            if w.group == mine.group:
                continue
            theirs = self.read(w.ranks)
            if set(theirs) == set(w.ranks) and _complete(w, theirs):
                return None  # that peer waits in a collective that can complete, then comes here
            if set(theirs) != set(w.ranks):
                return None  # somebody that peer waits for is working
        return sorted(posts.items())


def _complete(w: Waiting, posts: dict[int, Waiting]) -> bool:
    """Whether every member of ``w``'s group waits in ``w``'s collective."""
    return all(r in posts and posts[r].where() == w.where() for r in w.ranks)

