"""A gradient-accumulation window of a fully sharded forward: ``apply_fn.no_sync()``.

torch DDP's ``no_sync()`` and FSDP2's ``set_requires_gradient_sync(False)``: while the window is
open, the backward of every micro-batch keeps its gradients local, each bucket's full-size
cotangent added into the window's sum (FSDP2's unsharded ``.grad``) instead of reduce-scattered,
and returns zero gradient shards. The first backward after the window closes adds the sum to its
own cotangents and reduces each bucket once, as its backward reaches it: one reduction for the
whole window, overlapped with that backward as every stage-3 reduction is.

With ``keep_gathered`` (FSDP2's ``reshard_after_backward=False``) each bucket is gathered once, by
the window's first forward, and kept until the closing backward has run: the micro-batches
after the first gather nothing, in forward or backward, at the cost of the full parameters held
for the window. A kept bucket is reused only for the very shard tensor it was gathered from, at
the version it had (an optimizer step inside the window gathers again).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

__all__ = ["Window", "key"]


def key(t: torch.Tensor) -> tuple:
    """What identifies a shard's memory: where it starts, its shape, strides and dtype."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


@dataclasses.dataclass(eq=False)
class Window:
    """One accumulation window: its local gradient sums and, optionally, its kept gathers.

    Attributes:
        keep_gathered: keep each bucket's gathered buffer from the window's first gather to the
            end of the closing backward.
        open: inside the ``with`` block: backwards add to the sums and reduce nothing.
        sums: per bucket, the window's local full-size gradient sum (in the reduction's dtype).
        kept: per bucket, ``(shard key, shard version, full buffer)`` of its kept gather.
    """

    keep_gathered: bool
    open: bool = False
    sums: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    kept: dict[int, tuple[Any, int, torch.Tensor]] = dataclasses.field(default_factory=dict)

    def rows(self, shards: Sequence[torch.Tensor]) -> list[tuple]:
        """Signature rows: every rank must be in the same window state, with the same buckets
        still gathered for these (plain) shards: the call's collectives depend on both."""
        if self.open:
            state = "open: the backward reduces nothing"
        else:
            state = "closing: the backward reduces the window's sums with its own"
        if self.keep_gathered:
            held = [k for k, s in enumerate(shards) if self.kept_full(k, key(s), s._version) is not None]
            state += f"; gathered buffers kept, {len(held)} held ({held[:8]}{'...' if len(held) > 8 else ''})"
        return [("accumulation window", state, None)]

    def add(self, k: int, ct: torch.Tensor, dtype: torch.dtype) -> None:
        """Add bucket ``k``'s local cotangent to the window's sum (an open window's backward)."""
        s = self.sums.get(k)
        if s is None:
            self.sums[k] = ct.to(dtype, memory_format=torch.contiguous_format, copy=True)
        else:
            s.add_(ct)

    def take(self, k: int, ct: torch.Tensor) -> torch.Tensor:
        """The closing backward's cotangent of bucket ``k`` with the window's sum added (the sum's
        memory reused: ``s + ct`` rounds as ``ct + s``, and as FSDP2's ``.grad`` accumulates)."""
        s = self.sums.pop(k, None)
        return ct if s is None else s.add_(ct)

    def kept_full(self, k: int, key: Any, version: int) -> torch.Tensor | None:
        """Bucket ``k``'s kept full buffer, if it was gathered from this shard as it is now."""
        got = self.kept.get(k)
        if got is None or got[0] != key or got[1] != version:
            return None
        return got[2]

    def keep(self, k: int, key: Any, version: int, full: torch.Tensor) -> None:
        if self.keep_gathered:
            self.kept[k] = (key, version, full)

    def finish(self) -> None:
        """The closing backward has run: let every kept buffer and sum go."""
        self.sums.clear()
        self.kept.clear()
