"""Gradient synchronisation: the signature check, options, reducer, comm hooks and front ends.

How a sync flows: a front end (``ddp_step``, ``grad``/``grad_and_value``, ``broadcast``,
``sync_buffers``, ``verify_replicas``) turns its keywords into one frozen ``SyncOptions``
(``_setup``); ``setup`` agrees on the tree's signature across ranks (``fddp._dist.agree``) and plans its
buckets (``fddp._layout``); a ``Reducer`` (``_reducer``) copies values into the buckets and hands
each full one to the comm hook (``hooks``, ``_powersgd``), which issues its collectives through a
``Comm`` (``_comm``); the reduced buffers come back as views shaped like the tree.
"""

from fddp._dist import MismatchError
from fddp.sync import hooks
from fddp.sync._accumulate import GradAccumulator, accumulate_grads
from fddp.sync._collectives import broadcast, checksum, sync_buffers, verify_replicas
from fddp.sync._grad import grad, grad_and_value
from fddp.sync._int8 import Int8, Int8State
from fddp.sync._lax import all_gather, pmax, pmean, psum, reduce_scatter
from fddp.sync._powersgd import PowerSGD, PowerSGDState
from fddp.sync._reducer import SyncInfo, Timeline
from fddp.sync._setup import plan_of
from fddp.sync._step import ddp_step
from fddp.sync.hooks import Cast

__all__ = [
    "Cast",
    "GradAccumulator",
    "Int8",
    "Int8State",
    "MismatchError",
    "PowerSGD",
    "PowerSGDState",
    "SyncInfo",
    "Timeline",
    "accumulate_grads",
    "all_gather",
    "broadcast",
    "checksum",
    "ddp_step",
    "grad",
    "grad_and_value",
    "hooks",
    "plan_of",
    "pmax",
    "pmean",
    "psum",
    "reduce_scatter",
    "sync_buffers",
    "verify_replicas",
]
