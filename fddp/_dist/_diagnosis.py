"""Diagnosis: when the header says the ranks differ, find out how and say it in the same words everywhere.

The header carries digests, which say *that* ranks differ, not *how*. On a difference every rank
posts what it is doing (its function, call number, agreement setting, thread and signature rows)
on the group's error channel, reads everyone's, and raises the same :class:`MismatchError`
naming the first difference. Through the store, not a collective: a rank that does not join in
(inside a compiled step, whose header is in its graph, or gone) is named as silent after a few
seconds instead of holding the others in a collective it will never enter.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch.distributed as dist
from torch._functorch.pyfunctorch import temporarily_clear_interpreter_stack

from fddp._dist import _waits
from fddp._dist._digest import digest
from fddp._dist._errors import MismatchError
from fddp._dist._failures import fail
from fddp._dist._groups import channel_of, checks, rank, size, state
from fddp._tree import first_difference

__all__ = ["disagree", "name_difference", "describe_token", "ordinal"]


def name_difference(per_rank: Sequence[list[tuple]]) -> str:
    """Words for the first row where a rank's rows differ from rank 0's (the default namer)."""
    for r, rows in enumerate(per_rank[1:], start=1):
        diff = first_difference(per_rank[0], rows, "rank 0", f"rank {r}")
        if diff is not None:
            return diff[0].upper() + diff[1:] + "."
    return "The signatures hash differently but compare equal."  # pragma: no cover


def describe_token(token: tuple) -> str:
    """Words for a token: ``an all-gather of bucket 3 of unit 'blocks.2' (4096 float32 values)``."""
    op, tag, numel, dtype = token
    where = f" of {tag}" if tag else ""
    article = "an" if op[0] in "aeiou" else "a"
    return f"{article} {op}{where} ({numel} {dtype} values)"


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``11th``..."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def disagree(
    group: dist.ProcessGroup | None,
    what: str,
    call_: int,
    rows: Callable[[], list[tuple]],
    name_difference: Callable[[Sequence[list[tuple]]], str],
    token: tuple | None = None,
    seen: Sequence[int] = (),
    earlier: Sequence[tuple[int, str, int]] = (),
    rows_of: dict[int, list[tuple]] | None = None,
    deferred: bool = False,
) -> None:
    """The all-reduced header (``seen``, the same everywhere) says the ranks differ: tell each
    other what each is doing and raise the same error on all of them. ``token``: this rank is at
    the ``(position, token)`` collective of a call being learnt, not at a header. ``earlier``: the
    calls this head checks besides its own (an NCCL group's batch: call number, function,
    signature), with the rows of their signatures in ``rows_of``; ``deferred``: no call waited for
    this head. Where some rank had either, collectives went out before this verdict: the error
    raised is marked ``unchecked`` (its caller ends the group)."""
    thread = threading.current_thread().name
    mine = {"what": what, "call": call_, "agreement": checks().agreement, "thread": thread, "rows": rows()}
    mine["token"] = None if token is None else (token[0], describe_token(token[1]))
    mine["earlier"] = [[c, w, f"{s:x}"] for c, w, s in earlier]
    mine["earlier_rows"] = {f"{s:x}": rows_of[s] for s in {s for _, _, s in earlier} if rows_of and s in rows_of}
    mine["unchecked"] = bool(earlier) or deferred
    channel = channel_of(state(group), group)
    n = size(group)
    if channel is not None:
        # A batched group's peers may read the head that differs only at their next step boundary.
        wait_s = _BATCHED_S if _waits.batched(group) else 5.0
        said = channel.exchange(f"{digest(tuple(seen)):x}", rank(group), n, mine, timeout=wait_s)
    else:  # a group with no store: the collective way
        said = [None] * n
        with temporarily_clear_interpreter_stack():  # its tensors must be plain, under torch.func.grad too
            dist.all_gather_object(said, mine, group=group)
    try:
        _explain(group, what, call_, said, name_difference)
    except MismatchError as e:
        e.unchecked = any(x is not None and x.get("unchecked") for x in said)  # type: ignore[attr-defined]
        raise


_BATCHED_S = 30.0  # how long the ranks of a batched check wait for each other's words


def _explain(group: dist.ProcessGroup | None, what: str, call_: int, said: list, name_difference: Callable) -> None:
    """Raise the :class:`MismatchError` that what every rank ``said`` (``None``: a rank silent) shows."""
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
    if any(e["earlier"] != everyone[0]["earlier"] for e in everyone):
        raise MismatchError(f"fddp.{what}: ranks differ in calls they made since the group's last check: {_first_call_apart(everyone)}")
    if any(e["token"] is not None for e in everyone):

        def doing_of(r: int, e: dict) -> str:
            if e["token"] is None:
                return f"rank {r} starts fddp.{e['what']} (its call {e['call'] + 1})"
            n, words = e["token"]
            return f"rank {r} issues {words} as the {ordinal(n + 1)} collective of fddp.{e['what']}'s call {e['call'] + 1}"

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


def _first_call_apart(everyone: list[dict]) -> str:
    """Words for the first call in which the ranks' batches differ: each rank's batched calls
    (``earlier``), then the call of its head, which a rank that met it as new sent."""
    seqs = [[*e["earlier"], [e["call"], e["what"], None]] for e in everyone]
    i = next(i for i in range(max(map(len, seqs))) if len({repr(s[i]) if i < len(s) else "" for s in seqs}) > 1)
    if any(i >= len(s) for s in seqs):
        made = ", ".join(f"rank {r} {len(s)}" for r, s in enumerate(seqs))
        return f"the ranks made different numbers of calls since the last check ({made}); every rank must make the same calls."
    if len({(s[i][0], s[i][1]) for s in seqs}) > 1:
        doing = "; ".join(f"rank {r}'s call {s[i][0] + 1} was fddp.{s[i][1]}" for r, s in enumerate(seqs))
        return f"{doing}. Every rank must make the same fddp calls in the same order."
    c, w, _ = seqs[0][i]
    per_rank = [e["rows"] if s[i][2] is None else e["earlier_rows"].get(s[i][2]) for e, s in zip(everyone, seqs)]
    if any(rows is None for rows in per_rank):
        how = "Their trees or options differ."
    elif all(rows == per_rank[0] for rows in per_rank):
        new = [r for r, s in enumerate(seqs) if s[i][2] is None]
        how = (
            f"Rank(s) {new} met it as a new call where the others knew it: were fddp's caches cleared "
            "(fddp.clear_caches) on some ranks only?"
        )
    else:
        how = name_difference(per_rank)
    return f"their call {c + 1} (fddp.{w}) differs. {how}"
