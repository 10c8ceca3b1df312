"""``shard`` and ``gather``: a full tree to this rank's shards, and shards back to the full tree."""

from __future__ import annotations

from typing import Any

import optree
import torch
import torch.distributed as dist

from fddp import _dist, _layout
from fddp._layout import BUCKET_CAP_MB, FIRST_BUCKET_MB
from fddp._pool import new_buffer
from fddp.sync import _differentiable
from fddp.sync._comm import Comm
from fddp.sync._setup import make_options, setup
from fddp.zero import _layout as shard_layout
from fddp.zero._hook import ReduceScatter
from fddp.zero._layout import Sharded, ShardLayout

__all__ = ["shard", "gather", "Gathered"]


@_dist.entry("zero.shard")
def shard(
    params: Any,
    /,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    first_bucket_mb: float = FIRST_BUCKET_MB,
) -> Sharded:
    """Return this rank's shards of ``params``: its slice of every bucket, as ZeRO keeps them.

    The tree is cut the way :class:`fddp.zero.ReduceScatter` cuts the gradients: the buckets of
    :func:`fddp.ddp_step` (same ``bucket_cap_mb`` and ``first_bucket_mb``), each split into
    ``world_size`` equal slices of a multiple of 64 elements, zero-padded. The shards of one dtype
    lie back to back in one buffer, the layout ``fddp.optim`` updates in place of a copy. Start an
    optimizer from them (``opt.init(shards)``: 1/N of the state), and get the full tree back with
    :func:`gather`. Every rank must call this with the same tree and options (the first call
    checks, and raises :class:`fddp.MismatchError` on every rank if they differ). The input is not
    modified.

    Args:
        params: the full tree, the same on every rank (after :func:`fddp.broadcast`).
        group: the process group to shard over; ``None`` for the default group.
        bucket_cap_mb: the cap of each bucket, in MiB; the gradients' sync must use the same.
        first_bucket_mb: the cap of the first bucket, in MiB; likewise.

    Returns:
        A :class:`fddp.zero.Sharded`: one 1-D tensor per bucket.

    Example:
        >>> params = fddp.broadcast(params)
        >>> shards = fddp.zero.shard(params)
        >>> opt_state = opt.init(shards)  # this rank's 1/N of the state
    """
    _differentiable.refuse_under_transforms("zero.shard")
    options = make_options(
        "zero.shard", group=group, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, compression=ReduceScatter()
    )
    sync = setup(params, options, "zero.shard")
    lay = shard_layout.layout(sync.plan, sync.spec, dist.get_world_size(group), dist.get_rank(group), group)
    out = shard_layout.new_shards(lay)
    for leaf, pieces in zip(sync.leaves, shard_layout.leaf_pieces(lay)):
        for k, a, x, n in pieces:
            out[k][x : x + n].copy_(leaf.detach().reshape(-1)[a : a + n])
    return Sharded(out, lay)


class Gathered:
    """All-gathers in flight: the full tree of a :class:`fddp.zero.Sharded`, once :meth:`wait` returns.

    :func:`gather` starts one all-gather per bucket and returns at once, so the collectives run
    while the caller does other work (load the next batch, log); :meth:`wait` waits for them and
    returns the tree, whose leaves are views into the gathered buckets (no copy out).

    Example:
        >>> pending = fddp.zero.gather(shards)
        >>> x, y = next(batches)  # overlaps the all-gathers
        >>> params = pending.wait()
    """

    def __init__(self, layout: ShardLayout, comm: Comm, bufs: list[torch.Tensor], works: list[Any]) -> None:
        self._layout, self._comm, self._bufs, self._works = layout, comm, bufs, works
        self._tree: Any = None

    def wait(self) -> Any:
        """Wait for every bucket's all-gather; return the full tree (the same object on a second call).

        Example:
            >>> params = fddp.zero.gather(shards).wait()
        """
        if self._tree is None:
            n = len(self._works)
            for k, work in enumerate(self._works):
                self._comm.wait(work, f"all-gather {k + 1} of {n}")
            lay = self._layout
            flats = [buf[: c.numel] for buf, c in zip(self._bufs, lay.cuts)]
            self._tree = optree.tree_unflatten(lay.spec, _layout.unflatten(lay.plan, flats))
            self._bufs, self._works = [], []
        return self._tree


@_dist.entry("zero.gather", lambda shards, /: shards.layout.group)
def gather(shards: Sharded, /) -> Gathered:
    """Start gathering every rank's shards into the full tree; return at once.

    One all-gather per bucket (bucketed like the gradients, asynchronous): call
    :meth:`Gathered.wait` when the tree is needed, typically right before the next forward pass, so
    that the collectives overlap whatever the loop does in between. Works on any tree sharded by
    ``fddp.zero``: the parameters after a step, or an optimizer state's moments (``state.exp_avg``)
    to look at or save them whole. Every rank must call it, in the same order as its other
    collectives.

    Args:
        shards: a :class:`fddp.zero.Sharded` made on this group, with this world size.

    Returns:
        A :class:`fddp.zero.Gathered`; its ``wait()`` returns the full tree, the same on every rank.

    Raises:
        RuntimeError: the shards were made for another world size or rank (say, loaded on a new
            number of ranks without :func:`fddp.checkpoint.load_sharded`, which reshards).

    Example:
        >>> shards, opt_state = fddp.optim.apply_gradients(opt, grads, opt_state, shards)
        >>> params = fddp.zero.gather(shards).wait()
    """
    if not isinstance(shards, Sharded):
        raise TypeError(
            f"fddp.zero.gather: expected a fddp.zero.Sharded (from fddp.zero.shard or a sharded optimizer step), "
            f"got {type(shards).__name__}"
        )
    _differentiable.refuse_under_transforms("zero.gather")
    lay = shards.layout
    if lay.spec is None:
        raise ValueError("fddp.zero.gather: these shards have no tree structure to rebuild")
    lay.check_group("zero.gather")
    for k, (b, c, t) in enumerate(zip(lay.plan.buckets, lay.cuts, shards.shards)):
        if not isinstance(t, torch.Tensor) or t.shape != (c.size,) or t.dtype != b.dtype or t.device != b.device:
            got = f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"fddp.zero.gather: shard {k} must be a tensor of shape ({c.size},), dtype {b.dtype}, device "
                f"{b.device}; got {got}"
            )
    _dist.count_call(lay.group, "zero.gather")
    _dist.agree(lay.group, "zero.gather", lay.describe, key=("zero.gather", lay), defer=True)  # NCCL: batched, no host wait
    comm = Comm(lay.group, "zero.gather", lay.plan)
    bufs, works = [], []
    for b, c, t in zip(lay.plan.buckets, lay.cuts, shards.shards):
        buf = new_buffer(lay.world * c.size, b.dtype, b.device)
        works.append(comm.all_gather_into(buf, t.detach().contiguous()))
        bufs.append(buf)
    return Gathered(lay, comm, bufs, works)
