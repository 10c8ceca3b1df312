"""``Comm``: one synchronisation's handle on the process group, given to comm hooks with each bucket.

Hooks issue their collectives through it, so that every collective is counted (``SyncInfo``'s
bytes and collectives), traced as a functional collective under ``torch.compile``, and waited for
with an error that names the call, the rank and what it was doing.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fddp._dist import Segment, collective_device, rank, size, sliced, stamp, wait
from fddp._layout import BucketPlan
from fddp._pool import new_buffer

__all__ = ["Comm", "on_host"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def on_host(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s value on the host is free: a CPU tensor, outside torch.compile.

    A GPU tensor's value reaches the host only by making it wait for the GPU, and dynamo cannot
    trace a branch on a tensor's value: code paths for either keep the value on the device.
    """
    return t.is_cpu and not torch.compiler.is_compiling()


class Comm:
    """One synchronisation as a comm hook sees it: the process group, the bucket plan, the weight.

    Attributes:
        group: the process group (``None``: the default one).
        plan: the synchronisation's bucket plan (every bucket's leaves, shapes and offsets).
        world_size: the number of ranks in ``group``.
        rank: this process's rank in ``group``.
        weight: this rank's weight for a weighted mean (a float64 scalar tensor, see
            ``fddp.sync._setup.as_weight``: on the CPU, or on the buckets' device), or ``None``.
        weight_sum: the sum of the weights over the ranks, once a weighted hook has learned it
            (``SyncInfo.weight``): a float64 scalar tensor on the device of the collective that
            carried it.
        bytes_sent: payload bytes handed to collectives so far.
        collectives: collectives issued so far.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, what: str, plan: BucketPlan, weight: torch.Tensor | None = None
    ) -> None:
        if weight is not None and not on_host(weight):
            # A weight read on the device, where the buckets are not (a CUDA weight, CPU gradients):
            # one copy here, which the hooks' arithmetic with the buckets would otherwise refuse.
            there = plan.buckets[0].device if plan is not None and plan.buckets else collective_device(group)
            weight = weight.to(there)
        self.group, self.what, self.plan, self.weight = group, what, plan, weight
        self.world_size = size(group)  # the membership epoch's (fault tolerance), else torch.distributed's
        self._rank: int | None = None  # asked of the group when a hook first reads it (most never do)
        self.weight_sum: torch.Tensor | None = None
        self.bytes_sent = 0
        self.collectives = 0
        # The call's sequence of collectives, where its header does not fix them (a fully sharded
        # forward's): each collective is checked against it before it is issued.
        self.segment: Segment | None = None
        # An agreement whose head the next all-reduce (sum) rides in (fddp._dist's "The data rides in the head").
        self._carry: Any = None
        # On a group whose waits are not sliced (one that also uses NCCL: a mixed "cpu:gloo,cuda:nccl"
        # one), the works of collectives on CPU tensors, not waited for yet: gloo's, whose waits are
        # still taken in slices, where a CUDA one's must not be (fddp._dist.wait's host).
        self._host: list[Any] = []
        # A batched call's identity (fddp._dist's stamp), for its first all-reduce (sum) of a
        # floating-point tensor to carry (:meth:`poison` divides the results by its verdict).
        self._stamp: int | None = None
        self._stamped: _Stamped | None = None

    @property
    def rank(self) -> int:
        """This process's rank in the group (the membership epoch's under fault tolerance)."""
        if self._rank is None:
            self._rank = rank(self.group)
        return self._rank

    def carry(self, agreement: Any) -> None:
        """Send this call's next all-reduce (sum), its only collective, in ``agreement``'s head."""
        self._carry = agreement

    def stamp(self, ident: int | None) -> None:
        """Let this call's first all-reduce (sum) of a floating-point tensor carry ``ident`` (a
        batched call's stamp, ``fddp._dist.Agreement.stamp``; ``None``: nothing to carry)."""
        self._stamp = ident

    @property
    def verdict(self) -> torch.Tensor | None:
        """Once the all-reduce that carried a stamp is waited for: on its device, a bool, true
        where every rank's stamp was the same; else ``None``."""
        return self._stamped.verdict if self._stamped is not None else None

    def poison(self, results: list[torch.Tensor]) -> list[torch.Tensor]:
        """Divide the call's floating-point ``results`` in place by :attr:`verdict`, where its
        first all-reduce carried a stamp: by 1 (exact) where the ranks ran the same call, by 0
        where not (every value becomes Inf or NaN: a mixed sum never comes out finite). A division
        per result (a bucket, a psum's flat), and no host read, on a GPU. A CPU verdict divides
        every result (a CUDA kernel reads a CPU scalar for free); a GPU one leaves a CPU result to
        the batch's head (moving it would be a host read). Returns ``results``."""
        if self._stamped is not None and not self._stamped.landed:  # a hook that never waited for it
            self.wait(self._stamped, "the all-reduce that carried the call's stamp")
        v = self.verdict
        if v is not None:
            floats = [r for r in results if r.is_floating_point() and (v.is_cpu or r.device == v.device)]
            if floats:
                torch._foreach_div_(floats, v)
        return results

    @property
    def device(self) -> torch.device:
        """Where small tensors for this group's collectives must live."""
        return collective_device(self.group)

    def _issue(self, op: str, t: torch.Tensor, tag: str | None, numel: int | None = None) -> None:
        """Check the collective against the call's sequence."""
        if self.segment is not None:
            self.segment.issue(op, t, tag, numel)

    def _count(self, t: torch.Tensor) -> None:
        self.bytes_sent += t.numel() * t.element_size()
        self.collectives += 1

    def _started(self, t: torch.Tensor, work: Any) -> Any:
        """``work``, noted as the host's where ``t`` is on the CPU of a group whose waits are not
        sliced (see :meth:`wait`)."""
        if t.is_cpu and not torch.compiler.is_compiling() and not sliced(self.group):
            self._host.append(work)
        return work

    def all_reduce(self, t: torch.Tensor, op: str = "sum", tag: str | None = None) -> Any:
        """Start an all-reduce of ``t`` in place (``op``: ``"sum"`` or ``"max"``); return its work handle.

        ``tag`` (on every method) names what the collective carries in the ranks' agreement on
        the call's sequence of collectives (``fddp._dist.issue``): a bucket of a unit, say.

        Example:
            >>> work = bucket.comm.all_reduce(bucket.buffer)
            >>> bucket.comm.wait(work, "the all-reduce")
        """
        self._count(t)
        if torch.compiler.is_compiling():
            return _TracedAllReduce(t, op, self.group)
        self._issue(f"all-reduce ({op})", t, tag)
        if self._carry is not None and op == "sum":
            agreement, self._carry = self._carry, None
            return _Carried(t, agreement)
        if self._stamp is not None and op == "sum":
            slots = _stampable(t) and stamp(self._stamp, self.world_size, t.dtype)
            if slots:
                self._stamp = None
                self._stamped = _Stamped(t, slots, self.group)
                return self._started(t, self._stamped)
        return self._started(t, dist.all_reduce(t, op=_OPS[op], group=self.group, async_op=True))

    def all_gather(self, t: torch.Tensor, tag: str | None = None) -> tuple[torch.Tensor, Any]:
        """Start gathering every rank's ``t`` (same shape on every rank); return ``(out, work)``,
        ``out`` of shape ``(world_size, *t.shape)``, valid once ``work`` is waited for.

        Example:
            >>> everyone, work = bucket.comm.all_gather(values)
            >>> bucket.comm.wait(work, "the gather")
        """
        self._count(t)
        self._issue("all-gather", t, tag)
        flat = torch.empty(self.world_size * t.numel(), dtype=t.dtype, device=t.device)
        work = _all_gather_single(flat, t.contiguous().reshape(-1), group=self.group, async_op=True)
        return flat.view(self.world_size, *t.shape), self._started(t, work)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, tag: str | None = None) -> Any:
        """Start summing ``t`` (``world_size * out.numel()`` elements) over the ranks, this rank
        receiving its slice ``[rank * n, (rank + 1) * n)`` of the sum in ``out``; return the work.

        On gloo this is what the backend's own reduce-scatter does (an all-reduce of a copy of
        ``t``, then the slice), issued here so that its wait can be taken in slices (gloo's own has
        no future, and its wait cannot be watched for a peer's failure); on NCCL it sends half an
        all-reduce's bytes.

        Example:
            >>> work = bucket.comm.reduce_scatter(shard, padded_bucket)  # as fddp.zero.ReduceScatter does
            >>> bucket.comm.wait(work, "the reduce-scatter")
        """
        if t.is_cpu:  # gloo's, on a gloo group or a mixed one
            self._check_parts("a reduce-scatter", t, out)
            self._count(t)
            self._issue("reduce-scatter", t, tag)
            return self._started(t, _SlicedReduce(out, t.clone(), self.rank, self.group))
        return self._sized("a reduce-scatter", _reduce_scatter_single, out, t, whole=t, part=out, tag=tag)

    def all_gather_into(self, out: torch.Tensor, t: torch.Tensor, tag: str | None = None) -> Any:
        """Start gathering every rank's ``t`` into ``out`` (rank ``r``'s at ``[r * n, (r + 1) * n)``);
        return the work.

        Example:
            >>> work = bucket.comm.all_gather_into(full, shard)
            >>> bucket.comm.wait(work, "the all-gather")
        """
        return self._sized("an all-gather", _all_gather_single, out, t, whole=out, part=t, tag=tag)

    def _sized(
        self, collective: str, op: Any, out: torch.Tensor, t: torch.Tensor, *, whole: torch.Tensor, part: torch.Tensor, tag: str | None
    ) -> Any:
        """Check that ``whole`` holds ``world_size`` parts, count ``t``, start ``op(out, t)``."""
        self._check_parts(collective, whole, part)
        self._count(t)
        self._issue(collective.split(" ", 1)[1], t, tag)
        return self._started(t, op(out, t, group=self.group, async_op=True))

    def _check_parts(self, collective: str, whole: torch.Tensor, part: torch.Tensor) -> None:
        if whole.numel() != self.world_size * part.numel():
            raise ValueError(
                f"fddp.{self.what}: {collective} of {part.numel()} elements per rank needs "
                f"{self.world_size} x {part.numel()} elements in all, got {whole.numel()}"
            )

    def swap(self, send: torch.Tensor, got: torch.Tensor, peer: int, tag: str | None = None) -> Any:
        """Start sending ``send`` to rank ``peer`` of the group while receiving ``got`` from it (one
        exchange); return its work.

        An all-to-all in which this rank sends nothing to anyone else: unlike a pair of
        ``isend``/``irecv``, its wait can be taken in slices (gloo aborts a point-to-point wait
        that times out), so that :func:`fddp._dist.wait` can watch for a peer's failure meanwhile.

        Example:
            >>> work = bucket.comm.swap(their_half, my_half_from_them, peer=1 - bucket.comm.rank)
            >>> bucket.comm.wait(work, "the exchange")
        """
        self._count(send)
        self._issue("exchange", send, tag, numel=send.numel() + got.numel())  # the halves differ, their sum does not
        sizes_in = [send.numel() if r == peer else 0 for r in range(self.world_size)]
        sizes_out = [got.numel() if r == peer else 0 for r in range(self.world_size)]
        return self._started(send, dist.all_to_all_single(
            got.reshape(-1), send.contiguous().reshape(-1), sizes_out, sizes_in, group=self.group, async_op=True
        ))  # fmt: skip

    def broadcast(self, t: torch.Tensor, src: int, tag: str | None = None) -> Any:
        """Start a broadcast of ``t`` from ``src`` (a rank of the group), in place; return its work."""
        self._count(t)
        self._issue("broadcast", t, tag)
        global_src = src if self.group is None else dist.get_global_rank(self.group, src)
        return self._started(t, dist.broadcast(t, src=global_src, group=self.group, async_op=True))

    def wait(self, work: Any, doing: str) -> None:
        """Wait for ``work``; on failure raise an error naming the call, the rank and ``doing``."""
        host = False
        for i, w in enumerate(self._host):
            if w is work:
                del self._host[i]
                host = True
                break
        wait(work, self.group, self.what, doing, host=host)


# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and
# reduce_scatter_single (the old names warn).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Landing:
    """A collective's work whose result lands somewhere else once complete (a copy back, a slice
    kept, a verdict made): :meth:`_land` runs at the first wait that finds the work done. A wait
    taken in slices (``fddp._dist.wait``) may return before it is, and lands nothing then."""

    __slots__ = ("work", "landed")

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self, timeout: Any = None) -> bool:
        done = self.work.wait() if timeout is None else self.work.wait(timeout)
        if not self.landed and (timeout is None or done or self.work.is_completed()):
            self._land()
            self.landed = True
        return done

    def _land(self) -> None:
        raise NotImplementedError


class _SlicedReduce(_Landing):
    """Gloo's reduce-scatter as a work whose wait can be sliced: the all-reduce of ``full``, then
    this rank's slice of it copied into ``out`` when the wait completes."""

    __slots__ = ("out", "full", "rank")

    def __init__(self, out: torch.Tensor, full: torch.Tensor, rank: int, group: dist.ProcessGroup | None) -> None:
        self.out, self.full, self.rank, self.landed = out, full, rank, False
        self.work = dist.all_reduce(full, group=group, async_op=True)

    def _land(self) -> None:
        n = self.out.numel()
        self.out.copy_(self.full.reshape(-1)[self.rank * n : (self.rank + 1) * n].view_as(self.out))
        self.full = None


class _Carried(_Landing):
    """An all-reduce (sum) of ``t`` in the DATA slots of its call's head (float64): ``wait`` copies
    the sum back into ``t`` (the in-place contract hooks rely on)."""

    __slots__ = ("t", "data")

    def __init__(self, t: torch.Tensor, agreement: Any) -> None:
        self.t, self.landed = t, False
        self.data, self.work = agreement.send_with(t)

    def _land(self) -> None:
        t = self.t
        t.copy_(self.data if t.dim() == 1 else self.data.view_as(t))  # a bucket's flat: no view to make


def _stampable(t: torch.Tensor) -> bool:
    """Whether ``t`` may go out with stamp slots appended: a plain tensor (no transform's wrapper,
    no autograd history to keep) of a real floating type."""
    return t.is_floating_point() and not t.requires_grad and not torch._C._functorch.is_functorch_wrapped_tensor(t)


_POOLED = 1 << 18  # bytes from which a stamped copy comes from the host pool (glibc maps blocks of 128 KiB and more afresh)


class _Stamped(_Landing):
    """An all-reduce (sum) of ``t`` with the call's stamp (``fddp._dist.stamp``) in trailing slots,
    through a copy (``t`` has no room for them): once it lands, the sum is copied back into ``t``
    and the verdict, on the device, is in :attr:`verdict`. It holds no reference to its Comm: the
    pair would be a cycle, which kept every call's buffer alive until a garbage collection."""

    __slots__ = ("t", "buf", "expected", "verdict")

    def __init__(self, t: torch.Tensor, slots: list[int], group: dist.ProcessGroup | None) -> None:
        k = len(slots) // 2
        src = torch.tensor(slots, dtype=t.dtype)  # what this rank sends, then what every rank gets where all agree
        if t.is_cuda:  # pinned, and not waited for: a pageable copy to the device would wait for the stream
            src = src.pin_memory().to(t.device, non_blocking=True)
        # A big one from the host pool on the CPU (a mixed group's CPU tensors): a fresh buffer
        # faults in every page, which tripled the copy; a small one is cheaper fresh than pooled.
        n = t.numel() + k
        out = new_buffer(n, t.dtype, t.device) if n * t.element_size() >= _POOLED else None
        self.buf: torch.Tensor | None = torch.cat([t.reshape(-1), src[:k]], out=out)
        self.t, self.expected, self.verdict, self.landed = t, src[k:], None, False
        self.work = dist.all_reduce(self.buf, group=group, async_op=True)

    def _land(self) -> None:
        t, buf, n = self.t, self.buf, self.t.numel()
        t.copy_(buf[:n].view_as(t))
        self.verdict = torch.eq(buf[n:], self.expected).all()
        self.buf = None


class _TracedAllReduce:
    """An all-reduce torch.compile puts in its graph (a functional collective); ``wait`` copies the
    result back into the input, the in-place contract of ``dist.all_reduce`` that hooks rely on."""

    def __init__(self, t: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> None:
        self.t = t
        self.out = funcol.all_reduce(t, op, group if group is not None else dist.group.WORLD)

    def wait(self) -> None:
        self.t.copy_(funcol.wait_tensor(self.out))
