"""Batch normalisation over every rank's batch: ``torch.nn.SyncBatchNorm`` for functional models.

In training, BatchNorm normalises with the statistics of the batch; under data parallelism each
rank holds a slice of it, and per-rank statistics are noisier (small per-rank batches: detection,
segmentation) and leave every rank with running statistics of its own. :func:`sync_batchnorm`
converts a model's BatchNorm layers into :class:`SyncBatchNorm`, which, in training on several
ranks, computes each channel's mean and variance over all ranks' inputs (one all-gather of every
rank's count, mean and variance, combined in float64 in rank order: the same numbers on every
rank). The running statistics are then updated the same on every rank, and the backward pass
all-reduces the two per-channel sums the input gradient needs (``sum(dy)``, ``sum(dy * (x -
mean))``), as torch's ``SyncBatchNorm`` does. The weight's and bias's gradients stay local, for
the gradient synchronisation to average like every other gradient.

Every forward agrees first on what it runs (fddp's per-call header: the layer, its channels and
dtype, the call number), so a rank out of step raises :class:`fddp.MismatchError` instead of
hanging in a mismatched collective (on an NCCL group a known layer's check joins the step's
batch, read at the next step boundary: see ``fddp._dist._agreement``). It works under ``torch.func.grad`` and ``fddp.grad_and_value``
(the collectives run on plain tensors inside an ``autograd.Function``), with
:func:`fddp.functionalize` and :func:`fddp.functionalize_with_buffers`, and on the CPU (gloo), where
torch's own ``SyncBatchNorm`` refuses to run.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from fddp import _dist
from fddp.sync import _differentiable

__all__ = ["SyncBatchNorm", "sync_batchnorm"]

_WHAT = "sync_batchnorm"


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics are those of every rank's batch together.

    The same arguments, parameters and buffers as ``torch.nn.SyncBatchNorm`` (any input of 2 or
    more dimensions, channels in dimension 1). In eval mode, on one rank, or before
    ``torch.distributed`` is initialised, it is plain BatchNorm. Make one with
    :func:`sync_batchnorm`, which converts a model's BatchNorm layers.

    Args:
        num_features: the number of channels ``C`` of an input ``(N, C, ...)``.
        eps: added to the variance for numerical stability.
        momentum: the running statistics' update factor; ``None`` for a cumulative average.
        affine: learn a per-channel weight and bias.
        track_running_stats: keep running statistics (else eval mode uses batch statistics too).
        group: the process group whose ranks share statistics; ``None`` for the default one.

    Example:
        >>> bn = fddp.SyncBatchNorm(16)
        >>> y = bn(torch.randn(8, 16, 4, 4))  # on several ranks: normalised over all their batches
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        group: dist.ProcessGroup | None = None,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.group = group
        self.layer_name = ""  # its name in the converted model, for messages

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"fddp.SyncBatchNorm: expected an input of at least 2 dimensions (N, C, ...), got {input.dim()}")

    def forward(self, input: Tensor) -> Tensor:
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if self.training and batch_stats and _several_ranks(self.group):
            # The check inside the call's scope: a rank whose input is wrong tells its peers,
            # which wait in this layer's agreement, instead of leaving them there.
            with _dist.call(self.group, _WHAT):
                return self._forward(input, batch_stats)
        return self._forward(input, batch_stats)

    def _forward(self, input: Tensor, batch_stats: bool) -> Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative moving average, as torch
                factor = 1.0 / float(self.num_batches_tracked)
        tracked = not self.training or self.track_running_stats
        running_mean = self.running_mean if tracked else None
        running_var = self.running_var if tracked else None
        if not (self.training and batch_stats and _several_ranks(self.group)):
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, batch_stats, factor, self.eps)
        return sync_batch_norm(input, self.weight, self.bias, running_mean, running_var, self.eps, factor, self.group, self.layer_name)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", group={self.group!r}" if self.group is not None else "")


def sync_batchnorm(module: nn.Module, /, *, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Convert every BatchNorm layer of ``module`` into a :class:`SyncBatchNorm` (torch's
    ``nn.SyncBatchNorm.convert_sync_batchnorm``); return the module.

    BatchNorm1d, 2d, 3d and torch's own SyncBatchNorm are replaced in place, keeping their
    parameters (the same ``nn.Parameter`` objects), buffers, options and train/eval mode. Convert
    before :func:`fddp.functionalize` (or ``functionalize_with_buffers``)::

        model = fddp.sync_batchnorm(torchvision.models.resnet18())
        apply_fn, params, buffers = fddp.functionalize_with_buffers(model)
        params, buffers = fddp.broadcast(params), fddp.broadcast(buffers)  # DDP's start

    Batch statistics then span every rank, and the running statistics stay equal across ranks
    without ``fddp.sync_buffers``; with :func:`fddp.functionalize` the layers update the module's
    own buffers, the same on every rank (the several-rank check on buffer writes lets them pass).

    Args:
        module: a model, or one BatchNorm layer (then the new layer is returned).
        group: the process group whose ranks share statistics; ``None`` for the default one.

    Returns:
        ``module`` with its BatchNorm layers converted (a new layer if ``module`` was one).

    Example:
        >>> model = fddp.sync_batchnorm(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)))
        >>> type(model[1]).__name__
        'SyncBatchNorm'
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fddp.sync_batchnorm: expected a torch.nn.Module, got {type(module).__name__}")
    return _convert(module, group, "")


def _convert(module: nn.Module, group: dist.ProcessGroup | None, name: str) -> nn.Module:
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, group)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
        if hasattr(module, "qconfig"):
            out.qconfig = module.qconfig
    elif isinstance(module, SyncBatchNorm):
        out.group = group
    if isinstance(out, SyncBatchNorm):
        out.layer_name = name or "<root>"
    for child_name, child in module.named_children():
        out.add_module(child_name, _convert(child, group, f"{name}.{child_name}" if name else child_name))
    return out


def _several_ranks(group: dist.ProcessGroup | None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


# ---------------------------------------------------------------------------------------------- the math


def sync_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    eps: float,
    momentum: float,
    group: dist.ProcessGroup | None,
    name: str = "",
) -> Tensor:
    """Batch norm in training mode over every rank's ``x`` (``x``: ``(N, C, ...)``), updating the
    running statistics in place; differentiable (eagerly and under ``torch.func.grad``)."""
    for key in _differentiable.active_transforms():
        if key == _differentiable._TT.Vmap:
            raise RuntimeError(
                "fddp.SyncBatchNorm cannot run inside torch.func.vmap (its statistics would mix the members' batches "
                "with the ranks'); use one model per vmap member with plain BatchNorm, or no vmap"
            )
    with _dist.call(group, _WHAT):
        _agree(x, group, name)
        y, *_ = _SyncBatchNorm.apply(x, weight, bias, running_mean, running_var, eps, momentum, group, name)
    return y


def _agree(x: Tensor, group: dist.ProcessGroup | None, name: str, what: str = _WHAT) -> None:
    """Agree with the other ranks on this call before its all-gather (a rank out of step raises here)."""
    _dist.count_call(group, what)
    key = (what, name, x.shape[1], x.dtype, x.device.type)

    def rows() -> list[tuple]:
        return [
            ("option layer", repr(name or "a SyncBatchNorm"), None),
            ("option channels", str(x.shape[1]), None),
            ("option input", f"dtype={x.dtype} device={x.device.type}", None),
        ]

    # Deferred: the layer needs nothing of its peers but that their collectives match, so on an
    # NCCL group a known layer sends no head (its check joins the step's batch) instead of making
    # the host wait for its peers at every layer, forward and backward.
    _dist.agree(group, what, rows, key=key, defer=True)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32  # half and bfloat16 accumulate in float32


def _channel_view(t: Tensor, dim: int) -> Tensor:
    return t.view(1, -1, *([1] * (dim - 2)))


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(x, weight, bias, running_mean, running_var, eps, momentum, group, name):
        # functorch has unwrapped every level: plain tensors, so the collectives see real storage.
        acc = _acc_dtype(x.dtype)
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        n = x.numel() // c if c else 0
        if n:
            var, mean = torch.var_mean(x.to(acc), dim=dims, correction=0)
        else:  # an empty batch on this rank: it still joins the collective, with count 0
            var = mean = torch.zeros(c, dtype=acc, device=x.device)
        local = torch.cat([mean.to(torch.float64), var.to(torch.float64), torch.full((1,), float(n), dtype=torch.float64, device=x.device)])
        rows = _all_gather(local, group, name)
        counts = rows[:, 2 * c]
        total = counts.sum()
        few = f"fddp.SyncBatchNorm ({_label(name)}): expected more than 1 value per channel over all ranks when training"
        if total.device.type == "cpu":
            if total.item() < 2:  # every rank sees the same total: all raise
                raise ValueError(f"{few}, got {int(total.item())}")
        else:  # no host sync per layer on a GPU: the check runs on the device, after the gather
            torch._assert_async(total >= 2, few)
        # Chan et al.'s combination, in rank order on every rank: the same float64 numbers everywhere.
        means, vars_ = rows[:, :c], rows[:, c : 2 * c]
        g_mean = (counts[:, None] * means).sum(0) / total
        g_var = (counts[:, None] * (vars_ + (means - g_mean) ** 2)).sum(0) / total
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_((g_mean * momentum).to(running_mean.dtype))
        if running_var is not None:
            with torch.no_grad():
                unbiased = g_var * (total / (total - 1))
                running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))
        mean = g_mean.to(acc)
        invstd = torch.rsqrt(g_var + eps).to(acc)
        scale = invstd if weight is None else invstd * weight.to(acc)
        shift = -mean * scale if bias is None else bias.to(acc) - mean * scale
        y = torch.addcmul(_channel_view(shift, x.dim()), x.to(acc), _channel_view(scale, x.dim())).to(x.dtype)
        return y, mean, invstd, total.to(acc)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, *_, group, name = inputs
        _, mean, invstd, total = output
        ctx.mark_non_differentiable(mean, invstd, total)
        ctx.save_for_backward(x, weight, mean, invstd, total)
        ctx.group, ctx.name = group, name
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, dy, _dmean, _dinvstd, _dtotal):
        x, weight, mean, invstd, total = ctx.saved_tensors
        acc = mean.dtype
        d = x.dim()
        dims = [0, *range(2, d)]
        xmu = x.to(acc) - _channel_view(mean, d)
        dy_acc = dy.to(acc)
        sum_dy = dy_acc.sum(dims)
        sum_dy_xmu = (dy_acc * xmu).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = (sum_dy_xmu * invstd).to(weight.dtype)  # local: the gradient sync averages it
        if ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(weight.dtype if weight is not None else dy.dtype)
        if ctx.needs_input_grad[0]:
            c = sum_dy.shape[0]
            # torch's one collective of backward: the two per-channel sums, over every rank's batch.
            both = _SumOverRanks.apply(torch.cat([sum_dy, sum_dy_xmu]), ctx.group, ctx.name)
            mean_dy, mean_dy_xmu = (both / total).split(c)
            scale = invstd if weight is None else invstd * weight.to(acc)
            inner = dy_acc - _channel_view(mean_dy, d) - xmu * _channel_view(invstd * invstd * mean_dy_xmu, d)
            grad_x = (inner * _channel_view(scale, d)).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class _SumOverRanks(torch.autograd.Function):
    """The sum over the ranks (an all-reduce), inside a Function so that it runs on plain tensors
    under torch.func transforms; its derivative is the same sum."""

    @staticmethod
    def forward(t, group, name):
        # A call of its own, agreed like the forward's: a rank whose loss leaves this layer out
        # (no backward here) meets its peers' header with another call's, and every rank raises
        # (on an NCCL group, at the step boundary that checks the batch).
        what = f"{_WHAT} (backward)"
        with _dist.call(group, what):
            _agree(t.view(1, -1), group, name, what)
            out = t.clone()
            work = dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group, async_op=True)
            _dist.wait(work, group, what, f"the backward all-reduce of {_label(name)}", host=out.is_cpu)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.name = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, ct):
        return _SumOverRanks.apply(ct, ctx.group, ctx.name), None, None


def _all_gather(local: Tensor, group: dist.ProcessGroup | None, name: str) -> Tensor:
    """Every rank's ``local`` (the same size everywhere), stacked in rank order."""
    n = dist.get_world_size(group)
    device = _dist.collective_device(group) if local.device.type == "cpu" else local.device
    moved = local.to(device)
    doing = f"the all-gather of the batch statistics of {_label(name)}"
    if moved.device.type == "cuda" and _dist.uses_nccl(group):
        out = torch.empty(n, moved.numel(), dtype=moved.dtype, device=device)
        _dist.wait(dist.all_gather_into_tensor(out, moved, group=group, async_op=True), group, _WHAT, doing)
    else:  # gloo: a list of tensors (as torch's SyncBatchNorm does there)
        rows = [torch.empty_like(moved) for _ in range(n)]
        _dist.wait(dist.all_gather(rows, moved, group=group, async_op=True), group, _WHAT, doing, host=moved.is_cpu)
        out = torch.stack(rows)
    return out.to(local.device)


def _label(name: str) -> str:
    return f"layer {name!r}" if name else "a SyncBatchNorm"
