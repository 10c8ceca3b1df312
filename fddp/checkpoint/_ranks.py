"""Which rank writes a checkpoint, the call scope of the checkpoint functions, and the one collective
through which the ranks agree on it.

Every public checkpoint function that communicates runs inside the call scope (:func:`entry`,
``fddp._dist.entry``): an exception on one rank anywhere in it (an OSError while rank 0 cleans up
or writes, a bad tree on one rank) reaches its peers as :class:`fddp.PeerError` within a moment,
instead of leaving them waiting in the next agreement.

Every collective that ``fddp.checkpoint`` issues itself goes through :func:`agree`: a sum of a few
ints over the group (an outcome flag, rank 0's name for a temporary directory; on a pure NCCL group
over its gloo side group, as its headers, so that the host never reads a GPU tensor), after the per-call
agreement of every fddp collective (``fddp._dist.agree``), so that a rank still a step behind in
its loop gets a ``MismatchError`` on every rank rather than an abort in the backend. Its wait is
bounded by the process group's timeout (``fddp.init(timeout=...)``) and a failure or timeout names
the rank, the call and what it was doing. The collectives inside ``torch.distributed.checkpoint``
(``dcp.save`` / ``dcp.load``) are DCP's own, bounded by the same timeout.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from fddp import _dist
from fddp._dist import collective_device, control_group, count_call, wait

__all__ = ["agree", "barrier", "entry", "is_distributed", "is_writer", "rank", "world_size"]


def is_distributed() -> bool:
    """Whether a default process group exists (without one, this is rank 0 of 1)."""
    return dist.is_available() and dist.is_initialized()


def rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 without a process group."""
    return dist.get_rank(group) if is_distributed() else 0


def world_size(group: dist.ProcessGroup | None) -> int:
    """The number of ranks in ``group``; 1 without a process group."""
    return dist.get_world_size(group) if is_distributed() else 1


def is_writer(group: dist.ProcessGroup | None) -> bool:
    """Whether this process is rank 0 of ``group``, the one that writes single-file checkpoints."""
    return rank(group) == 0


def entry(what: str, together: Callable[..., bool] | None = None) -> Callable[[Callable], Callable]:
    """``fddp._dist.entry(what)`` for a checkpoint function (its group: the ``group=`` argument),
    entered only where ``together(*args, **kwargs)`` says the call is collective.

    ``save`` without a barrier is rank 0's alone, and ``load`` of a file any rank's alone: a failure
    there is that rank's own, not one to announce to peers that never called.

    Example:
        >>> @entry("checkpoint.save", together=lambda *a, barrier=False, **k: barrier)
        ... def save(path, tree, /, *, group=None, barrier=False): ...
    """

    def wrap(fn: Callable) -> Callable:
        scoped = _dist.entry(what)(fn)
        if together is None:
            return scoped

        @functools.wraps(fn)
        def maybe(*args: Any, **kwargs: Any) -> Any:
            return (scoped if together(*args, **kwargs) else fn)(*args, **kwargs)

        maybe.__fddp_entry__ = what  # type: ignore[attr-defined]
        return maybe

    return wrap


def barrier(path: str, group: dist.ProcessGroup | None, what: str) -> None:
    """Return once every rank of ``group`` has arrived: rank 0 only once ``path`` is written (a rank 0
    that failed raised inside the call scope instead, and its peers raise ``PeerError`` here)."""
    if world_size(group) > 1:
        agree([], group, what, f"the barrier after rank 0 wrote {path}")


def agree(
    values: Sequence[int],
    group: dist.ProcessGroup | None,
    what: str,
    doing: str,
    *,
    rows: Sequence[tuple] = (),
    op: str = "sum",
) -> list[int]:
    """Reduce ``values`` (ints) over the ranks of ``group``; every rank must call it with as many.

    Args:
        values: this rank's contribution, e.g. ``[1]`` for "I failed" or rank 0's token; none: the
            call's header alone (every rank arrived, in the same call, with the same ``rows``).
        group: the process group; without one (or with one rank) the values come back as they are.
        what: the public function, for the error (``"checkpoint.save_step"``).
        doing: what the ranks agree on, for the error.
        rows: what else the ranks must agree on first, as ``fddp._tree`` rows (a tree's paths,
            shapes and dtypes): part of the call's header, so a difference is a
            :class:`fddp.MismatchError` on every rank naming the first row that differs.
        op: ``"sum"`` or ``"max"``.

    Raises:
        fddp.MismatchError: the ranks are at different calls, or their ``rows`` differ.
        RuntimeError: a peer failed or did not arrive within the process group's timeout.
    """
    if world_size(group) == 1:
        return [int(v) for v in values]
    count_call(group, what)
    # The rows first: where trees differ, their first difference is named, not the count it implies.
    described = [*rows, ("checkpoint", f"fddp.{what}: {doing} ({len(values)} values, {op})", None)]
    _dist.agree(group, what, described)
    if not values:
        return []  # the header was the agreement
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    device = collective_device(group)
    # A pure NCCL group's would be a GPU tensor that the host reads back: a wait for the GPU's
    # stream, at every step of a Manager with the agreement off. These ints are the host's: they go
    # on the group's gloo side group, where its headers go (a wait for the peers' hosts only).
    side = control_group(group) if device.type != "cpu" else group
    if side is not group:
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        wait(dist.all_reduce(t, op=reduce_op, group=side, async_op=True), group, what, doing, head=True)
    else:
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)
        wait(dist.all_reduce(t, op=reduce_op, group=group, async_op=True), group, what, doing, host=t.is_cpu)
    return [int(v) for v in t.tolist()]
