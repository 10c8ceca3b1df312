"""fddp: data-parallel training for functional PyTorch.

Parameters are pytrees, gradients come from ``torch.func``, and synchronisation is a pure
function, :func:`ddp_step`, that averages a gradient tree over the ranks with a few fused
all-reduces over ``torch.distributed``.

Example:
    >>> import fddp, torch
    >>> fddp.init()
    >>> apply_fn, params = fddp.functionalize(torch.nn.Linear(4, 1))
    >>> params = fddp.broadcast(params)
    >>> loss = lambda p, x: apply_fn(p, x).pow(2).mean()
    >>> grads = fddp.ddp_step(params, torch.func.grad(loss)(params, torch.randn(8, 4)))
"""

from fddp import checkpoint, diloco, optim, scaling, zero
from fddp._dist import Checks, PeerError, checks, set_checks
from fddp.batchnorm import SyncBatchNorm, sync_batchnorm
from fddp.join import Join
from fddp.module import functionalize, functionalize_with_buffers, load_into
from fddp.nonfinite import DynamicLossScale, LossScaleState, apply_if_finite
from fddp.runtime import clear_caches, device, init, is_initialized, is_main, local_rank, rank, shutdown, world_size
from fddp.sync import (
    Cast,
    GradAccumulator,
    Int8,
    Int8State,
    MismatchError,
    PowerSGD,
    PowerSGDState,
    SyncInfo,
    accumulate_grads,
    all_gather,
    broadcast,
    ddp_step,
    grad,
    grad_and_value,
    hooks,
    pmax,
    pmean,
    psum,
    reduce_scatter,
    sync_buffers,
    verify_replicas,
)

__all__ = [
    "Cast",
    "Checks",
    "DynamicLossScale",
    "GradAccumulator",
    "Int8",
    "Int8State",
    "Join",
    "LossScaleState",
    "MismatchError",
    "PeerError",
    "PowerSGD",
    "PowerSGDState",
    "SyncBatchNorm",
    "SyncInfo",
    "accumulate_grads",
    "all_gather",
    "apply_if_finite",
    "broadcast",
    "checkpoint",
    "checks",
    "clear_caches",
    "ddp_step",
    "device",
    "diloco",
    "functionalize",
    "functionalize_with_buffers",
    "grad",
    "grad_and_value",
    "hooks",
    "init",
    "is_initialized",
    "is_main",
    "load_into",
    "local_rank",
    "optim",
    "pmax",
    "pmean",
    "psum",
    "rank",
    "reduce_scatter",
    "scaling",
    "set_checks",
    "shutdown",
    "sync_batchnorm",
    "sync_buffers",
    "verify_replicas",
    "world_size",
    "zero",
]
__version__ = "0.1.0"
