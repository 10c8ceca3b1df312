"""Sequences: the collectives of a call that its header does not fix, learnt once and then checked.

A fully sharded forward issues gathers unit by unit, and its backward more gathers and
reductions, whenever autograd runs them: the header agrees on the call, not on each of these.
The first time a kind of call runs (its signature and function), each of its collectives is
agreed across the ranks as a *token* before it is issued (a header-sized all-reduce each, that
first time only); later calls of that kind check each token locally against the recording. A
rank that would issue another collective, or ends the call short, fails (fatal) instead of
pairing its collective with a different one on its peers.

What the header cannot know, the call's later context (a backward that runs under a transform
its forward did not: ``jacrev`` maps the vjp over the outputs, so every reduction carries every
member), branches the sequence (:meth:`Segment.branch`): the ranks agree on that context on the
group's store, which pairs with no collective, and follow, or learn, the recording of the call's
kind in that context.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from fddp._dist import _header
from fddp._dist._diagnosis import describe_token, disagree, ordinal
from fddp._dist._digest import digest
from fddp._dist._errors import MismatchError
from fddp._dist._failures import fail, peer_error, raise_announced
from fddp._dist._groups import REMEMBERED, GroupState, board, channel_of, checks, collective_device, global_ranks, rank, size, state
from fddp._dist._waits import SLICE, wait

__all__ = ["Segment", "BRANCH", "OWN"]

BRANCH = ("branch point", None, 0, "")  # in a recording: the kind was learnt in another context from here on
OWN = "the levels its forward ran under"  # the context of a call that does not branch (its own)


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

    __slots__ = ("group", "state", "key", "what", "call", "learning", "tokens", "expected", "pos", "closed", "base", "at")

    def __init__(self, group: dist.ProcessGroup | None, key: tuple, what: str, call: int) -> None:
        self.group, self.key, self.what, self.call = group, key, what, call
        self.state = state(group)  # this epoch's: a call that outlives it (fddp.clear_caches) follows nothing
        self.learning: bool | None = None  # known once the header is agreed
        self.tokens: list[tuple] = []
        self.expected: tuple = ()
        self.pos = 0
        self.closed = False
        self.base: tuple | None = None  # learning, and branched: the kind's own key, kept with a branch point
        self.at = 0  # ... at this position

    def issue(self, op: str, t: torch.Tensor, tag: str | None = None, numel: int | None = None) -> None:
        """Say that this rank is about to issue collective ``op`` of ``t`` for this call (``tag``
        names what it carries: a bucket of a unit; ``numel``, where ``t``'s size differs between
        ranks, a size that does not). Learning, agree on it with the other ranks first; checking,
        compare it with the recording and, where it differs, fail (every rank learns it) and raise.
        """
        if self.learning is None or self.closed or torch.compiler.is_compiling():
            return  # the agreement off (nothing to follow), or a call whose sequence is over
        st = state(self.group)
        if st is not self.state:
            return
        token = (op, tag, int(t.numel() if numel is None else numel), str(t.dtype).replace("torch.", ""))
        if self.learning:
            _agree_token(self.group, st, self, token)
            self.tokens.append(token)
            return
        expected = self.expected[self.pos] if self.pos < len(self.expected) else None
        if expected == BRANCH:  # the kind was learnt in another context from here on: agree on this one
            self.branch(OWN)
            if self.learning:
                self.issue(op, t, tag, numel)
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
        st = state(self.group)
        if st is not self.state:
            return  # the group's state was cleared (fddp.clear_caches) or a new epoch began since
        if self.learning:
            if self.base is not None:  # the kind itself, up to where this call branched
                _record(st, self.base, (*self.tokens[: self.at], BRANCH))
            _record(st, self.key, tuple(self.tokens))
        elif self.pos < len(self.expected):
            if self.expected[self.pos] == BRANCH:
                self.closed = False
                self.branch(OWN)  # every rank must end there in the same context
                self.close(doing)
                return
            _deviate(self, doing, self.expected[self.pos])

    def branch(self, context: str) -> None:
        """The rest of the call runs in ``context``, which its header could not fix (a backward under
        a transform its forward did not run under: ``jacrev``'s ``vmap`` of the vjp); its
        collectives follow the recording of the call's kind in that context from here on.

        Checking, the ranks agree on the context first, on the group's store (a collective would
        pair with a peer's reduction where that peer's backward runs otherwise): every rank says
        its context and whether it holds that recording; a rank that says another context, or is
        seen waiting in a collective instead, fails the group on every rank (fatal: the peers
        wait in collectives). Where some rank lacks the recording, all learn the rest, token by
        token. Learning already, the tokens that follow are agreed anyway: the call is recorded
        under the new key, and the kind's own recording ends with a branch point (``BRANCH``),
        where a later call of the kind in its own context (``OWN``: no branch of its own) agrees
        on that context in the same way. One store exchange per call that branches; the calls
        that do not pay nothing.
        """
        if self.learning is None or self.closed or torch.compiler.is_compiling() or size(self.group) == 1:
            return
        st = state(self.group)
        if st is not self.state:
            return
        key = (self.key, context)
        if self.learning:
            if self.base is None:
                self.base, self.at = self.key, len(self.tokens)
            self.key = key
            return
        known = key in st.recordings
        try:
            posts, stuck = _posted_everywhere(self, "branch", f"{int(known)}{context}", "did not reach it within the group's timeout")
        except Exception as e:  # noqa: BLE001 - the store is gone: nothing can be agreed
            posts, stuck = None, f"the store could not be read ({e})"
        if posts is None and stuck is None:
            raise peer_error(self.what, st.failed)  # a peer failed meanwhile
        if posts is not None:
            other = next(((r, p[1:]) for r, p in enumerate(posts) if p[1:] != context), None)
            if other is not None:
                stuck = f"rank {other[0]} runs it under {other[1]}"
        if stuck is not None:
            e = MismatchError(
                f"fddp.{self.what}: this rank runs the backward of its call {self.call + 1} under {context}, and {stuck}. "
                "Every rank must differentiate a call alike, with the same transforms around its backward (jacrev or "
                "hessian on every rank, or on none)"
            )
            fail(self.group, self.what, e)
            raise e
        self.key = key
        if all(p[0] == "1" for p in posts):
            self.expected = st.recordings[key]
            st.recordings.move_to_end(key)
        else:
            self.learning, self.tokens = True, list(self.expected[: self.pos])

    def drop(self, owed: bool = False) -> None:
        """The call will never issue the rest: its graph was freed without its backward.

        ``owed``: the call had left a backward to run (``owe``). Dropping it is no error when
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
        if owed and not self.closed and self.learning is not None and state(self.group) is self.state:
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


def _record(st: GroupState, key: tuple, tokens: tuple) -> None:
    st.recordings[key] = tokens
    st.recordings.move_to_end(key)
    if len(st.recordings) > REMEMBERED:
        st.recordings.popitem(last=False)


def _timeout(group: dist.ProcessGroup | None) -> float:
    """The group's collective timeout, in seconds."""
    pg = group if group is not None else dist.group.WORLD
    try:
        return pg._get_backend(collective_device(group)).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - a group torch.distributed does not register
        return dist.constants.default_pg_timeout.total_seconds()


def _dropped_everywhere(seg: Segment) -> str | None:
    """Say on the group's store that this rank dropped ``seg``'s backward; wait until every rank
    has. ``None`` when they all did (or a peer failed: the next call raises it); else words for
    the peer that did not (waiting in a collective, on the deadlock board, or silent until the
    group's timeout)."""
    return _posted_everywhere(seg, "dropped", "", "did not free theirs within the group's timeout")[1]


def _posted_everywhere(seg: Segment, topic: str, mine: str, late: str) -> tuple[list[str] | None, str | None]:
    """Post ``mine`` on the group's store under ``topic`` for ``seg``'s call; wait until every rank
    of the group has posted there. Returns every rank's post, by rank in the group, and ``None``;
    or ``None`` and words for the peers that did not post (waiting in a collective instead, on the
    deadlock board, or ``late``: silent until the group's timeout); or ``(None, None)`` where a
    peer posted a fatal failure meanwhile (``seg.state.failed``)."""
    st, group = seg.state, seg.group
    channel = channel_of(st, group)
    if channel is None:
        return None, "there is no store to ask the peers"
    n, store = size(group), channel.store
    key = f"{channel.scope}/{topic}/{seg.call}"
    store.set(f"{key}/{rank(group)}", mine)
    store.add(key, 1)
    me = dist.get_rank()
    ranks = [r for r in (global_ranks(group) or []) if r != me]
    posts = board() if st.rank is None else None  # a fault-tolerant group posts nothing there
    deadline = time.monotonic() + _timeout(group)
    seen: dict | None = None
    pause = 0.001  # an agreement the peers reach at once (a branch) costs a few store round trips
    while store.add(key, 0) < n:
        failure = channel.fatal()
        if failure is not None:
            st.failed = failure
            return None, None
        if time.monotonic() > deadline:
            return None, f"{n - store.add(key, 0)} of its peers {late}"
        waiting = {r: w for r, w in (posts.read(ranks) if posts is not None else {}).items() if me in w.ranks}
        if waiting and waiting == seen:  # the same waits a slice apart: not a stale post
            return None, "; ".join(
                f"rank {r} waits in fddp.{w.what} on {w.label} instead (its call {w.call}, {w.doing})" for r, w in sorted(waiting.items())
            )
        seen = waiting if pause >= SLICE.total_seconds() else None
        time.sleep(pause)
        pause = min(2 * pause, SLICE.total_seconds())
    out = [store.get(f"{key}/{r}").decode() for r in range(n)]
    if store.add(key + "/read", 1) == n:  # the last to read removes the keys: a long run leaves none behind
        for k in (key, key + "/read", *(f"{key}/{r}" for r in range(n))):
            store.delete_key(k)
    return out, None


def _deviate(seg: Segment, doing: str, expected: tuple | None) -> None:
    n = seg.pos + 1
    agreed = f"{describe_token(expected)}" if expected is not None else "no further collective (the call's sequence is over)"
    e = MismatchError(
        f"fddp.{seg.what}: this rank {doing} as the {ordinal(n)} collective of its call {seg.call + 1}, where the sequence "
        f"the ranks agreed on for this kind of call has {agreed}. The ranks must issue the same collectives in the same "
        "order: a forward that depends on this rank's data (a unit skipped or run in another order, an output left out "
        "of one rank's loss) pairs them with different ones on the other ranks. (fddp.set_checks(agreement=False) turns "
        "this check off, with the rest of the agreement.)"
    )
    fail(seg.group, seg.what, e)
    raise e



def _agree_token(group: dist.ProcessGroup | None, st: GroupState, seg: Segment, token: tuple) -> None:
    """Agree on one collective of a call being learnt: a head whose identity is the token's."""
    position = len(seg.tokens)
    head = _header.build(digest((seg.key, token, position, _header.TOKEN, int(checks().agreement))))
    wait(_header.exchange(head, group), group, seg.what, f"the agreement on its {ordinal(position + 1)} collective", head=True)
    v = _header.read(head, size(group))
    if v.fails:
        raise_announced(group, st, seg.what, seg.call, v.failed)
    if not v.agrees:
        disagree(group, seg.what, seg.call, lambda: [("collective", describe_token(token), None)], _no_rows, (position, token), v.key)


def _no_rows(per_rank: Sequence[list[tuple]]) -> str:
    return ""  # pragma: no cover - a token's mismatch is named from the tokens
