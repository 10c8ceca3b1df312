"""Keep module buffers (BatchNorm running statistics and the like) consistent across ranks.

Each rank's forward pass updates its buffers from its own batch, so replicas drift apart.
:func:`sync_buffers` brings them back together, in the same few fused collectives as gradients.
With :func:`fddp.functionalize_with_buffers` the forward returns new buffers instead of mutating
the module's, so the whole step stays pure; torch DDP's ``broadcast_buffers=True`` is::

    apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
    for x, y in loader:
        buffers = fddp.sync_buffers(buffers, "broadcast")    # DDP does this before each forward
        (g, buffers) = torch.func.grad(loss_fn, has_aux=True)(params, buffers, x, y)
        grads = fddp.ddp_step(params, g)
        ...
"""

from __future__ import annotations

from typing import Any, Literal

import optree
import torch
import torch.distributed as dist

from fddp.buckets import LeafSpec, flatten, unflatten
from fddp.comm import Reducer, broadcast, checked_plan, tree_leaves_with_paths, wait
from fddp.runtime import require_initialized

__all__ = ["sync_buffers"]

_MODES = ("broadcast", "mean")


def sync_buffers(
    buffers: Any,
    /,
    mode: Literal["broadcast", "mean"] = "broadcast",
    *,
    src: int = 0,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
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
    require_initialized("sync_buffers")
    if mode == "broadcast":
        return broadcast(buffers, src, group, bucket_cap_mb=bucket_cap_mb)
    paths, leaves, spec = tree_leaves_with_paths(buffers, "sync_buffers")
    specs = tuple(LeafSpec.of(t) for t in leaves)
    plan = checked_plan(buffers, spec, paths, specs, group, "sync_buffers", bucket_cap_mb, bucket_cap_mb, options="mean")
    flats = flatten(plan, [t.detach() for t in leaves])
    is_mean = [f.is_floating_point() or f.is_complex() for f in flats]
    reducer = Reducer(sum(is_mean), group, "sync_buffers")
    counters, launched = [], 0
    for flat, mean in zip(flats, is_mean):
        if mean:
            reducer.launch(launched, flat)
            launched += 1
        else:
            # gloo has no MAX for bool; as uint8 the maximum is the logical or.
            t = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
            counters.append(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True))
    means, _ = reducer.finish()
    for k, work in enumerate(counters):
        wait(work, "sync_buffers", f"the max all-reduce of integer bucket {k + 1} of {len(counters)}")
    it = iter(means)
    out = [next(it) if mean else flat for flat, mean in zip(flats, is_mean)]
    return optree.tree_unflatten(spec, unflatten(plan, out))
