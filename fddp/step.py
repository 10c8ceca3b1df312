"""``ddp_step``: average a gradient pytree over the ranks with a few fused all-reduces."""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp.buckets import LeafSpec, flatten, unflatten
from fddp.comm import Reducer, checked_plan, sync_options, tree_leaves_with_paths
from fddp.compress import Cast, PowerSGD, check_return_info
from fddp.runtime import require_initialized

__all__ = ["ddp_step"]


def _check_grads(paths: list[str], p_specs: tuple[LeafSpec, ...], p_spec: Any, grads: Any) -> list[torch.Tensor | None]:
    """Return the grads' leaves, or raise naming the first leaf that does not match its parameter."""
    if grads is None:  # a rank with nothing to contribute (out of data): all zeros
        return [None] * len(paths)
    g_leaves, g_spec = optree.tree_flatten(grads, none_is_leaf=True)
    if g_spec != p_spec:
        raise ValueError(
            "fddp.ddp_step: grads must have the same tree structure as params.\n"
            f"  params: {p_spec}\n  grads:  {g_spec}"
        )
    for path, ps, g in zip(paths, p_specs, g_leaves):
        if g is None:
            continue  # a parameter unused this step: counts as a zero gradient
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"fddp.ddp_step: grad {path!r} must be a torch.Tensor or None, got {type(g).__name__}")
        if tuple(g.shape) != ps.shape or g.dtype != ps.dtype or g.device != ps.device:
            raise ValueError(
                f"fddp.ddp_step: grad {path!r} does not match its parameter: expected shape "
                f"{ps.shape}, dtype {ps.dtype}, device {ps.device}; got shape {tuple(g.shape)}, "
                f"dtype {g.dtype}, device {g.device}"
            )
    return g_leaves


def ddp_step(
    params: Any,
    grads: Any,
    /,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    weight: float | torch.Tensor | None = None,
    compression: str | Cast | PowerSGD | None = None,
    compression_state: Any = None,
    check_finite: bool = False,
    return_info: bool = False,
) -> Any:
    """Return ``grads`` averaged over the ranks of ``group``.

    The gradients are packed into flat buckets (reverse leaf order, one bucket per dtype and device
    up to ``bucket_cap_mb``, the first one small so it starts early, as torch DDP does); each bucket
    is copied once, all-reduced with one asynchronous collective, and the results come back as views
    into the reduced buffers. Pure: neither input is modified. The mean is the sum divided by the
    group size, to the bit: for a power-of-two group each bucket is scaled by ``1/n`` before the
    sum, as torch DDP does (scaling by ``2**-k`` commutes with rounding, short of subnormals), and
    otherwise summed, then divided.

    ``None`` gradients (parameters unused this step) count as zeros. Before the first step of a new
    tree signature the ranks compare it and raise :class:`fddp.MismatchError` on every rank if they
    differ, instead of hanging or mixing unrelated values.

    Args:
        params: the parameter pytree; it fixes the structure, shapes, dtypes and devices expected
            of ``grads``.
        grads: the local gradients, a tree of the same structure (leaves may be ``None``), or
            ``None`` for a rank with no gradients at all (one out of data, see :class:`fddp.Join`).
        group: the process group to average over; ``None`` for the default group.
        bucket_cap_mb: the cap of each bucket, in MiB.
        first_bucket_mb: the cap of the first bucket, in MiB.
        weight: this rank's weight, usually its local number of samples. The result is then the
            weighted mean ``sum_r w_r g_r / sum_r w_r``: the gradient of the mean loss over the
            global batch even when ranks hold different batch sizes (a rank with weight 0
            contributes nothing, even NaN). The sum of weights rides in bucket 0's all-reduce (with
            half-precision buckets it travels first, alone, so that each rank can send
            ``w_r / W * g_r``, which cannot overflow fp16). ``info.weight`` is that sum, the same
            on every rank: 0 when no rank had data (see :class:`fddp.Join`).
        compression: ``"bf16"`` or ``"fp16"`` (or :class:`fddp.Cast`) to send buckets in half
            precision (halving the bytes; divided before the sum, as torch's ``fp16_compress_hook``);
            a :class:`fddp.PowerSGD` to send low-rank approximations (requires ``compression_state``
            and ``return_info``); ``None`` sends them as they are.
        compression_state: PowerSGD's state, from ``PowerSGD.init(params)`` or the previous step's
            ``info.compression_state``. Not modified.
        check_finite: compute ``info.finite``, one bool that is the same on every rank, so all
            ranks can skip a step with NaN/Inf gradients together.
        return_info: return ``(grads, info)`` with a :class:`fddp.SyncInfo` instead of ``grads``;
            ``info.compression_state`` holds PowerSGD's next state.

    Returns:
        The mean gradients, a tree of the same structure as ``params``; with ``return_info``, the
        pair ``(grads, info)``.

    Example:
        >>> apply_fn, params = fddp.functionalize(torch.nn.Linear(4, 1))
        >>> loss = lambda p, x: apply_fn(p, x).pow(2).mean()
        >>> grads = fddp.ddp_step(params, torch.func.grad(loss)(params, torch.randn(8, 4)))
    """
    require_initialized("ddp_step")
    check_return_info(compression, return_info, "ddp_step")
    paths, p_leaves, p_spec = tree_leaves_with_paths(params, "ddp_step")
    p_specs = tuple(LeafSpec.of(p) for p in p_leaves)
    g_leaves = _check_grads(paths, p_specs, p_spec, grads)
    options = sync_options(weight, compression, compression_state, "ddp_step")
    plan = checked_plan(params, p_spec, paths, p_specs, group, "ddp_step", bucket_cap_mb, first_bucket_mb, options=options)
    reducer = Reducer(
        len(plan.buckets),
        group,
        "ddp_step",
        weight=weight,
        compression=compression,
        check_finite=check_finite,
        compression_state=compression_state,
        plan=plan,
    )
    for i, flat in enumerate(flatten(plan, [None if g is None else g.detach() for g in g_leaves])):
        reducer.launch(i, flat)
    flats, info = reducer.finish()
    out = optree.tree_unflatten(p_spec, unflatten(plan, flats))
    return (out, info) if return_info else out
