"""ZeRO as pure functions: each rank keeps 1/N of the gradients and optimizer state (stages 1 and 2)
or of the parameters too (stage 3, :func:`fully_shard`).

Data parallelism keeps a full copy of the parameters, gradients and optimizer state on every rank.
``fddp.zero`` keeps, on each rank, only its shard of every gradient bucket (reduce-scattered, not
all-reduced), the parameters laid out the same way, and the optimizer state made from them; after
each step the new parameter shards are all-gathered into the full tree the forward pass needs. A
replicated loop switches with four changed lines::

    shards = fddp.zero.shard(params)                     # this rank's 1/N of the parameters
    opt_state = opt.init(shards)                         # 1/N of the optimizer state
    step = fddp.grad_and_value(loss_fn, compression=fddp.zero.ReduceScatter())
    for x, y in loader:
        grads, loss = step(params, x, y)                 # this rank's shard of the mean gradients
        shards, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, shards)
        params = fddp.zero.gather(shards).wait()         # the full new parameters

The numbers are those of the replicated loop, to the bit: the shards are slices of the same
buckets, reduced with the same sums, and ``fddp.optim`` steps every element the same way.
Checkpoints of sharded trees are written per rank and reshard on load
(:func:`fddp.checkpoint.save_sharded`, :func:`fddp.checkpoint.load_sharded`).

Stage 3 shards the module's parameters unit by unit; ``apply_fn`` gathers each unit inside the
forward and backward passes, through a differentiable gather, so no full tree is ever built::

    apply_fn, shards = fddp.zero.fully_shard(model)      # units chosen by size
    opt_state = opt.init(shards)
    step = fddp.grad_and_value(lambda s, x, y: F.cross_entropy(apply_fn(s, x), y))
    for x, y in loader:
        grads, loss = step(shards, x, y)                  # already averaged: no sync
        shards, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, shards)

Example:
    >>> shards = fddp.zero.shard(params)
    >>> params = fddp.zero.gather(shards).wait()
"""

from fddp.zero._api import Gathered, gather, shard
from fddp.zero._full import load_full, release, write_back
from fddp.zero._gather import Counters
from fddp.zero._hook import ReduceScatter
from fddp.zero._layout import Sharded, ShardLayout
from fddp.zero._stage3 import FullyShardedForward, fully_shard, unshard
from fddp.zero._units import UnitLayout

__all__ = [
    "Counters",
    "FullyShardedForward",
    "Gathered",
    "ReduceScatter",
    "ShardLayout",
    "Sharded",
    "UnitLayout",
    "fully_shard",
    "gather",
    "load_full",
    "release",
    "shard",
    "unshard",
    "write_back",
]
