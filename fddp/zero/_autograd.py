"""The all-gather of a bucket's shards as a differentiable function, and its transpose.

Gathering bucket ``k`` of a :class:`fddp.zero.Sharded` tree is linear in the shards, so its
derivatives are collectives too, as JAX's ``all_gather`` transposes to ``psum_scatter``:

- **forward**: every rank's shard of the bucket, all-gathered into the bucket's flat buffer (its
  first ``B`` elements: the padding is cut off);
- **backward**: the cotangents of that buffer, reduced over the ranks and cut to this rank's
  shard (a reduce-scatter), with ``fddp.ddp_step``'s mean. The gradient shards are the mean over
  the ranks of their local gradients (the gradient of the mean of the ranks' objectives), equal to
  stage 2's where the sums run in the same order;
- **invariant** gathers differentiate this rank's objective alone, the other ranks' shards held
  constant: the cotangent's slice, no collective (per-sample gradients, where a sum over ranks
  would add unrelated samples together);
- **forward mode**: the tangents' shards, all-gathered;
- **vmap**: the members stacked in one buffer, one collective for all of them.

The collectives run on plain tensors, below every torch.func level, in the Functions' ``forward``
(through the call's ``_gather.Pipeline``); everything above is functorch's (``_Gather`` and
``_Reduce`` are ``autograd.Function``\\ s with ``setup_context``, ``backward``, ``jvp`` and
``vmap`` rules, as ``fddp.sync._differentiable._Mean``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from fddp import _dist
from fddp.zero._gather import Pipeline, constants

__all__ = ["GatherCall", "boundary", "gather", "gather_plain", "refill_before_backward"]


@dataclasses.dataclass(frozen=True, eq=False)
class GatherCall:
    """One bucket's gather, everything but the tensor: the bucket, the pipeline, the variant.

    ``backward`` marks the gathers made again in backward (rematerialisation), which prefetch in
    the backward order; ``sync`` the reductions that must not wait behind the others.
    """

    pipe: Pipeline
    k: int
    invariant: bool = False
    backward: bool = False
    sync: bool = False

    def again(self) -> "GatherCall":
        """The same bucket's gather in backward (prefetching backward's order)."""
        return dataclasses.replace(self, backward=True)

    def plain_call(self) -> "GatherCall":
        """For tangents: synchronous, outside the prefetch order."""
        return dataclasses.replace(self, backward=True, sync=True)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(call: GatherCall, shard: torch.Tensor) -> torch.Tensor:
        if call.sync:
            return call.pipe.gather_now(call.k, shard)
        return call.pipe.gather(call.k, shard, call.backward)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.call = inputs[0]

    @staticmethod
    def backward(ctx: Any, ct: torch.Tensor) -> tuple:
        call = ctx.call
        call.pipe.enter_backward()
        if constants((ct,)):  # torch.func.grad's backward, .backward(): reduce without the Function
            out = _Reduce.forward(call, ct.detach())
        else:
            out = _Reduce.apply(call, ct)
        call.pipe.release_again(call.k)
        return None, out

    @staticmethod
    def jvp(ctx: Any, _call_tangent: Any, tangent: torch.Tensor | None) -> torch.Tensor | None:
        if tangent is None:
            return None
        return _Gather.apply(ctx.call.plain_call(), tangent)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, call: GatherCall, shard: torch.Tensor) -> tuple:
        # Apply again below this level, members first: one collective carries all of them.
        return _Gather.apply(call, shard.movedim(in_dims[1], 0)), 0


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(call: GatherCall, ct: torch.Tensor) -> torch.Tensor:
        pipe = call.pipe
        # A backward that runs after its call returned, with nothing owed (unshard's, a forward
        # under a transform's): a call of its own, so that a failure reaches the peers waiting
        # in its reductions.
        with _dist.backward_scope(pipe.lay.group, f"{pipe.what} (backward)"):
            if call.sync or call.k in pipe.repeated:
                return pipe.reduce_now(call.k, ct, call.invariant)
            return pipe.reduce(call.k, ct, call.invariant)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.call = inputs[0]

    @staticmethod
    def backward(ctx: Any, _ct: torch.Tensor) -> tuple:
        raise RuntimeError(
            "fddp.zero: the gradient of a fully sharded forward is not differentiable again (double "
            "backward, grad of grad); forward-over-reverse (torch.func.jvp of torch.func.grad) works"
        )

    @staticmethod
    def jvp(ctx: Any, _call_tangent: Any, tangent: torch.Tensor | None) -> torch.Tensor | None:
        if tangent is None:
            return None
        return _Reduce.apply(ctx.call.plain_call(), tangent)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, call: GatherCall, ct: torch.Tensor) -> tuple:
        return _Reduce.apply(call, ct.movedim(in_dims[1], 0)), 0


class _Boundary(torch.autograd.Function):
    """The identity on a call's shards; in backward it waits for the reductions still in flight."""

    generate_vmap_rule = True

    @staticmethod
    def forward(pipe: Pipeline, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(s.view_as(s) for s in shards)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.pipe = inputs[0]

    @staticmethod
    def backward(ctx: Any, *cts: torch.Tensor) -> tuple:
        ctx.pipe.end_backward()
        return (None, *cts)

    @staticmethod
    def jvp(ctx: Any, _pipe_tangent: Any, *tangents: torch.Tensor | None) -> tuple:
        return tuple(tangents)


class _Refill(torch.autograd.Function):
    """The identity on a unit's outputs; in backward, before the unit's own, it gathers the unit's
    released buckets back into their memory (and starts the previous unit's)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(pipe: Pipeline, ks: tuple[int, ...], *outs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.pipe, ctx.ks = inputs[0], inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *cts: torch.Tensor | None) -> tuple:
        ctx.pipe.enter_backward()
        ctx.pipe.refill(ctx.ks)
        return (None, None, *cts)

    @staticmethod
    def jvp(ctx: Any, _pipe_tangent: Any, _ks_tangent: Any, *tangents: torch.Tensor | None) -> tuple:
        return tuple(tangents)


def refill_before_backward(pipe: Pipeline, ks: tuple[int, ...], outs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A unit's outputs, through :class:`_Refill` for its buckets ``ks``."""
    return _Refill.apply(pipe, ks, *outs)


def boundary(pipe: Pipeline, shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The shards, through the call's backward boundary (see :class:`_Boundary`)."""
    return _Boundary.apply(pipe, *shards)


def gather(call: GatherCall, shard: torch.Tensor) -> torch.Tensor:
    """Bucket ``call.k``'s full flat buffer: the differentiable all-gather of ``shard`` (see above)."""
    return _Gather.apply(call, shard)


def gather_plain(call: GatherCall, shard: torch.Tensor) -> torch.Tensor:
    """The same for a tensor no transform wraps and nothing differentiates: the collective alone."""
    return _Gather.forward(call, shard)
