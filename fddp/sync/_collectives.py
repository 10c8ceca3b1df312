"""Trees made identical across ranks: ``broadcast``, ``sync_buffers`` and ``verify_replicas``.

The first two go through the same setup and reducer as gradients, with their own comm hooks
(:class:`~fddp.hooks.Broadcast`, and a mean whose integer buckets take the maximum); the third
compares one checksum per leaf in one small all-reduce.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch.distributed as dist

from fddp import _dist, _layout
from fddp._layout import BUCKET_CAP_MB
from fddp._tree import BUFFERS_FIX, not_a_module
from fddp.sync import _differentiable
from fddp.sync._checksum import checksum, compare_replicas
from fddp.sync._setup import SyncOptions, make_options, setup
from fddp.sync.hooks import Broadcast, BufferMean

__all__ = ["broadcast", "sync_buffers", "verify_replicas", "checksum"]

_MODES = ("broadcast", "mean")


def _run(tree: Any, options: SyncOptions, what: str) -> Any:
    sync = setup(tree, options, what, agree=False)
    sync.announce()
    reducer = sync.reducer()
    reducer.push([t.detach() for t in sync.leaves])
    flats, _ = sync.close(reducer)
    return sync.tree(flats, reducer.made_views(flats))


@_dist.entry("broadcast")
def broadcast(tree: Any, /, src: int = 0, *, group: dist.ProcessGroup | None = None, bucket_cap_mb: float = BUCKET_CAP_MB) -> Any:
    """Return ``tree`` with rank ``src``'s values on every rank, in a few fused broadcasts.

    The leaves are packed into flat buckets (the same planner as :func:`fddp.ddp_step`) and each
    bucket is broadcast with one collective. The input is not modified; the returned leaves are
    views into the received buffers. Before the first broadcast of a tree structure the ranks
    compare its signature and raise :class:`MismatchError` on any difference. This is torch DDP's
    broadcast at construction: use it on the parameters and, with
    :func:`fddp.functionalize_with_buffers`, on the buffers.

    Args:
        tree: a pytree of tensors (parameters, optimizer state, buffers).
        src: the rank, within ``group``, whose values everyone receives.
        group: the process group; ``None`` for the default one.
        bucket_cap_mb: the size of each fused broadcast, in MiB.

    Returns:
        A tree of the same structure holding ``src``'s values.

    Example:
        >>> apply_fn, params = fddp.functionalize(torch.nn.Linear(4, 2))
        >>> params = fddp.broadcast(params)  # every rank now starts from rank 0's initialisation
    """
    _differentiable.refuse_under_transforms("broadcast")
    options = make_options("broadcast", group=group, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=bucket_cap_mb)
    n = _dist.size(group) if dist.is_initialized() else 1
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < n:
        raise ValueError(f"fddp.broadcast: src must be a rank of the group, in [0, {n}), got {src!r}")
    return _run(tree, dataclasses.replace(options, hook=Broadcast(src)), "broadcast")


@_dist.entry("sync_buffers")
def sync_buffers(
    buffers: Any,
    /,
    mode: Literal["broadcast", "mean"] = "broadcast",
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = BUCKET_CAP_MB,
) -> Any:
    """Return ``buffers`` made identical on every rank, in one collective per bucket.

    ``"broadcast"`` gives every rank rank ``src``'s buffers, as torch DDP's ``broadcast_buffers``
    does at the start of each forward. ``"mean"`` averages floating-point buffers over the ranks
    (running means and variances then summarise every rank's batches); integer and bool buffers
    such as BatchNorm's ``num_batches_tracked`` are counters, not statistics, so they take their
    maximum over the ranks instead (ranks that step together hold the same count, which the
    maximum keeps; a mean of counts would need rounding). Integer and float buffers never share a
    bucket, so this costs no extra collective.

    Pure: the input is not modified. The first call for a tree checks that every rank holds the
    same one and raises :class:`fddp.MismatchError` on every rank if not.

    Args:
        buffers: a pytree of tensors (e.g. the ``buffers`` dict of
            :func:`fddp.functionalize_with_buffers`).
        mode: ``"broadcast"`` or ``"mean"``.
        src: with ``"broadcast"``, the rank (within ``group``) whose buffers everyone receives.
        group: the process group; ``None`` for the default one.
        bucket_cap_mb: the size of each fused collective, in MiB.

    Returns:
        A tree of the same structure, dtypes and shapes, equal on every rank.

    Example:
        >>> apply_fn, params, buffers = fddp.functionalize_with_buffers(torch.nn.BatchNorm1d(3))
        >>> out, buffers = apply_fn(params, buffers, torch.randn(8, 3))
        >>> buffers = fddp.sync_buffers(buffers, "mean")
    """
    if mode not in _MODES:
        raise ValueError(f"fddp.sync_buffers: mode must be 'broadcast' or 'mean', got {mode!r}")
    not_a_module(buffers, "sync_buffers", "buffers", BUFFERS_FIX)
    if mode == "broadcast":
        return broadcast(buffers, src, group=group, bucket_cap_mb=bucket_cap_mb)
    _differentiable.refuse_under_transforms("sync_buffers")
    options = make_options("sync_buffers", group=group, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=bucket_cap_mb)
    return _run(buffers, dataclasses.replace(options, hook=BufferMean()), "sync_buffers")


@_dist.entry("verify_replicas")
def verify_replicas(tree: Any, /, *, group: dist.ProcessGroup | None = None) -> None:
    """Raise :class:`fddp.MismatchError` on every rank unless all ranks hold bitwise equal leaves.

    Each rank computes a checksum of every leaf (see :func:`checksum`: any single changed word,
    such as a one-ulp difference, is always caught) and one all-reduce of ``2 * num_leaves`` int64
    values compares them. On a difference the ranks also gather the checksums (a second small
    collective) to name the first differing leaf and the ranks that disagree with rank 0, and all
    raise the same error. The tree signatures (structure, shapes, dtypes) are compared first, as in
    :func:`fddp.ddp_step`. Reading every byte costs about as much as one optimizer step: call it
    every few hundred steps, after a resume, or in tests.

    Args:
        tree: a pytree of tensors: parameters, optimizer state, buffers.
        group: the process group whose ranks must agree; ``None`` for the default group.

    Raises:
        MismatchError: on every rank, naming the first leaf (in tree order) whose bytes differ.

    Example:
        >>> params = fddp.broadcast(params)
        >>> fddp.verify_replicas(params)  # passes; raises on every rank if any rank drifted
    """
    _differentiable.refuse_under_transforms("verify_replicas")
    _refuse_shards(tree)
    _verify(tree, group)


def _refuse_shards(tree: Any) -> None:
    """Say what to verify instead of ZeRO's shards, which differ between ranks by design."""
    nodes = _layout.split_nodes(tree)
    if not nodes:
        return
    kind = (
        "fully sharded parameters (ZeRO stage 3, fddp.zero.fully_shard)" if any(n.stage == 3 for n in nodes)
        else "a sharded tree (fddp.zero.Sharded, from fddp.zero.shard or ReduceScatter)"
    )  # fmt: skip
    raise TypeError(
        f"fddp.verify_replicas: got {kind}: each rank holds its own slices of the buckets, which differ between "
        "ranks by design, so there is nothing to compare. Verify the gathered tree, which every rank holds whole: "
        "fddp.verify_replicas(fddp.zero.unshard(shards)) (or fddp.zero.gather(shards).wait())"
    )


def _verify(tree: Any, group: dist.ProcessGroup | None) -> None:
    sync = setup(tree, make_options("verify_replicas", group=group), "verify_replicas")
    compare_replicas(
        sync.leaves, sync.spec, group, "verify_replicas",
        " Replicas start apart when fddp.broadcast(params) was not called after fddp.functionalize (DDP "
        "broadcasts at construction) or the ranks loaded different checkpoints; they drift apart when ranks apply "
        "different updates (a step skipped on one rank, gradients not averaged, a learning rate or a random draw "
        "that depends on the rank, a non-deterministic op) or keep buffers of their own (BatchNorm statistics "
        "without fddp.sync_buffers).",
    )  # fmt: skip
