"""``ddp_step``: average a gradient pytree over the ranks with a few fused all-reduces."""

from __future__ import annotations

import itertools
import operator
from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp import _dist, _layout
from fddp._layout import BUCKET_CAP_MB, FIRST_BUCKET_MB
from fddp._tree import flatten, not_a_module, paths, specs_of, tensor_leaves
from fddp.sync import _differentiable
from fddp.sync._setup import as_weight, check_dtypes, check_state, dtype_error, make_options, setup

__all__ = ["ddp_step"]


def _grad_leaves(p_leaves: list[torch.Tensor], p_spec: optree.PyTreeSpec, p_specs: tuple, grads: Any) -> list[torch.Tensor | None]:
    """Return the grads' leaves, or raise naming the first leaf that does not match its parameter."""
    if grads is None:  # a rank with nothing to contribute (out of data): all zeros
        return [None] * len(p_leaves)
    g_leaves, g_spec = flatten(grads)
    if g_spec != p_spec:
        not_a_module(grads, "ddp_step", "grads")
        why = _layout.explain_split(p_spec, g_spec, "params", "grads")
        raise ValueError(
            "fddp.ddp_step: grads must have the same tree structure as params"
            + (f": {why}" if why else f".\n  params: {p_spec}\n  grads:  {g_spec}")
        )
    if not any(map(operator.is_, g_leaves, itertools.repeat(None))):
        try:
            if specs_of(g_leaves) == p_specs:
                return g_leaves  # the usual case, checked in C: every grad has its parameter's spec
        except AttributeError:
            pass  # a leaf that is no tensor: named below
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves)):
        if g is None:
            continue  # a parameter unused this step: counts as a zero gradient
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"fddp.ddp_step: grad {paths(p_spec)[i]!r} must be a torch.Tensor or None, got {type(g).__name__}")
        if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            raise ValueError(
                f"fddp.ddp_step: grad {paths(p_spec)[i]!r} does not match its parameter: expected shape "
                f"{tuple(p.shape)}, dtype {p.dtype}, device {p.device}; got shape {tuple(g.shape)}, "
                f"dtype {g.dtype}, device {g.device}"
            )
    return g_leaves


@_dist.entry("ddp_step")
def ddp_step(
    params: Any,
    grads: Any,
    /,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    first_bucket_mb: float = FIRST_BUCKET_MB,
    weight: float | torch.Tensor | None = None,
    compression: Any = None,
    compression_state: Any = None,
    check_finite: bool = False,
    return_info: bool = False,
) -> Any:
    """Return ``grads`` averaged over the ranks of ``group``.

    The gradients are packed into flat buckets (reverse leaf order, one bucket per dtype and device
    up to ``bucket_cap_mb``, the first one small so it starts early, as torch DDP does); each bucket
    is copied once, handed to the comm hook (by default an all-reduce with one asynchronous
    collective), and the results come back as views into the reduced buffers. Pure: neither input
    is modified. The mean is the sum divided by the group size, to the bit: for a power-of-two
    group each bucket is scaled by ``1/n`` before the sum, as torch DDP does (scaling by ``2**-k``
    commutes with rounding, short of subnormals), and otherwise summed, then divided.

    ``None`` gradients (parameters unused this step) count as zeros. Before every call the ranks
    agree on what they are about to run (one small all-reduce of a fixed-size header: the tree's
    signature and the options that shape the collectives, the call's number, the thread) and raise
    :class:`fddp.MismatchError` on every rank if they differ, instead of hanging or mixing
    unrelated values. The first call on a tree fresh from :func:`fddp.functionalize` also compares
    a checksum of ``params`` across the ranks (replicas must start equal: a forgotten
    :func:`fddp.broadcast` is an error). :func:`fddp.set_checks` turns either check off.

    ``ddp_step`` composes with torch.func as JAX's ``lax.pmean`` does (see the docs' "Transforms"):
    differentiating through it (``torch.func.grad``, ``vjp``, ``jacrev``, ``backward()``) averages
    the cotangents over the ranks (the objective is the sum of every rank's objective), forward
    mode averages the tangents, and under ``vmap`` one collective per bucket carries every member.

    Args:
        params: the parameter pytree; it fixes the structure, shapes, dtypes and devices expected
            of ``grads``, and the buckets.
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
            on every rank: 0 when no rank had data (see :class:`fddp.Join`), and the gradients are
            then zeros, in every dtype and compression: the mean over no samples is taken as zero.
            A number or a CPU tensor must be finite and >= 0, or the call raises ``ValueError``.
            A GPU tensor, and any weight under ``torch.compile``, is not read on the host (that
            would make it wait for the GPU each step, or break the graph): a negative or
            non-finite one makes the mean NaN instead, on every rank (``info.finite`` false and
            ``info.weight`` NaN, so that the ranks skip the step together, as for NaN gradients).
            A device assert would end the process (CUDA cannot go on after one), its peers left
            inside the collective.
        compression: ``"bf16"`` or ``"fp16"`` (or :class:`fddp.Cast`) to send buckets in half
            precision (halving the bytes; divided before the sum, as torch's ``fp16_compress_hook``);
            a :class:`fddp.PowerSGD` to send low-rank approximations; any
            :class:`fddp.hooks.CommHook`; ``None`` for the plain (or, with ``weight=``, weighted) mean.
        compression_state: a stateful hook's state (PowerSGD's, from ``PowerSGD.init(params)`` or
            the previous step's ``info.compression_state``). Not modified.
        check_finite: compute ``info.finite``, one bool that is the same on every rank, so all
            ranks can skip a step with NaN/Inf gradients together (requires ``return_info``).
        return_info: return ``(grads, info)`` with a :class:`fddp.SyncInfo` instead of ``grads``;
            ``info.compression_state`` holds a stateful hook's next state.

    Returns:
        The mean gradients, a tree of the same structure as ``params``; with ``return_info``, the
        pair ``(grads, info)``.

    Example:
        >>> apply_fn, params = fddp.functionalize(torch.nn.Linear(4, 1))
        >>> loss = lambda p, x: apply_fn(p, x).pow(2).mean()
        >>> grads = fddp.ddp_step(params, torch.func.grad(loss)(params, torch.randn(8, 4)))
    """
    options = make_options(
        "ddp_step", group=group, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb,
        compression=compression, check_finite=check_finite, return_info=return_info, weighted=weight is not None,
    )  # fmt: skip
    w = None if weight is None else as_weight(weight, "ddp_step")
    check_state(options, compression_state, "ddp_step", compression)
    p_leaves, p_spec = tensor_leaves(params, "ddp_step", name="params")
    p_specs = specs_of(p_leaves)
    g_leaves = _grad_leaves(p_leaves, p_spec, p_specs, grads)
    if _differentiable.needed(g_leaves):
        for d in {s[1] for s in p_specs}:  # leaf by leaf: this path is not the hot one
            if not (d.is_floating_point or d.is_complex):
                raise TypeError(dtype_error(d, p_leaves, p_spec, options.hook, "ddp_step", compression))
        if options.hook.shards:
            raise RuntimeError(
                f"fddp.ddp_step: compression={options.hook!r} returns this rank's shards, which have no "
                "derivative and no batching rule; call it eagerly, outside torch.func transforms, on "
                "gradients that do not require grad (detach them). To differentiate through stage 2's sync, "
                "differentiate through fddp.zero.unshard(shards) instead: its backward reduces the cotangents "
                "into gradient shards, ReduceScatter's numbers"
            )
        out, info = _differentiable.ddp_step(params, grads, options, compression_state, w)
        return (out, info) if return_info else out
    sync = setup(params, options, "ddp_step", compression_state, weight=w, flat=(p_leaves, p_spec), specs=p_specs, agree=False)
    # A tree whose one bucket fits sends it in the call's head, and close() reads the head before
    # anything is returned: one collective, one wait.
    sync.announce(replicas=True, drift=True)
    try:
        check_dtypes(sync, "ddp_step", compression)
    except TypeError as e:
        raise _dist.collective(e) from None  # after the agreement on the dtypes: every rank raises alike
    reducer = sync.reducer(compression_state)
    reducer.push(g_leaves)
    flats, info = sync.close(reducer)
    out = sync.tree(flats, reducer.made_views(flats))
    return (out, info) if return_info else out
