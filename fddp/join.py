"""Uneven inputs: ranks whose data runs out at different steps keep stepping until all are done.

torch DDP needs ``Join`` (an extra all-reduce every step) or it hangs when one rank has fewer
batches. fddp needs no extra collective: a rank out of data keeps calling
``ddp_step(params, None, weight=0, return_info=True)`` -- zero weight, zero gradients, the same
buckets as everyone else -- and the sum of weights, which already rides in bucket 0, is 0 exactly
when no rank had data. Every rank reads the same sum, so all leave on the same step, before
applying an update. The whole cost is one all-zero step at the end of the epoch::

    batches = fddp.Join(loader)                # yields None once this rank is out of data
    for batch in batches:
        if batch is None:
            g, n = None, 0
        else:
            g, n = torch.func.grad(loss_fn)(params, *batch), len(batch[0])
        grads, info = fddp.ddp_step(params, g, weight=n, return_info=True)
        if batches.done(info):                 # no rank had data: leave together, without a step
            break
        updates, state = opt.update(grads, state, params)
        params = fddp.optim.apply_updates(params, updates)

Weighting by ``n`` also makes every step the exact gradient of the mean loss over the samples
that the ranks still had, and the parameters stay bitwise identical on every rank.
"""

from __future__ import annotations

from typing import Any, Generic, Iterable, Iterator, TypeVar

from fddp._tree import article
from fddp.sync import SyncInfo

__all__ = ["Join"]

T = TypeVar("T")


class Join(Generic[T]):
    """Iterate over this rank's data, then yield ``None`` until :meth:`done` says every rank is out.

    The iterator never communicates: the verdict comes from the :class:`fddp.SyncInfo` of a
    ``ddp_step`` called with ``weight=`` (this rank's sample count, 0 once it is out of data) and
    ``return_info=True``. A batch with weight 0 counts as no data.

    Args:
        iterable: this rank's shard (a ``DataLoader``, a list of batches, a generator).

    Example:
        >>> batches = fddp.Join(loader)
        >>> for batch in batches:
        ...     g, n = (None, 0) if batch is None else (grad(loss_fn)(params, *batch), len(batch[0]))
        ...     grads, info = fddp.ddp_step(params, g, weight=n, return_info=True)
        ...     if batches.done(info):
        ...         break
        ...     params = {k: p - lr * grads[k] for k, p in params.items()}
    """

    def __init__(self, iterable: Iterable[T], /) -> None:
        self._it: Iterator[T] = iter(iterable)
        self._exhausted = False
        self._done = False

    def __iter__(self) -> "Join[T]":
        return self

    def __next__(self) -> T | None:
        if self._done:
            raise StopIteration
        if not self._exhausted:
            try:
                return next(self._it)
            except StopIteration:
                self._exhausted = True
        return None

    @property
    def exhausted(self) -> bool:
        """Whether this rank's own data has run out (other ranks may still have some)."""
        return self._exhausted

    def done(self, info: SyncInfo, /) -> bool:
        """Return whether no rank contributed to the step ``info`` describes: the same on every rank.

        Call it after each synchronising ``ddp_step`` and, when it returns True, leave the loop
        before applying the update (the gradients are all zero, and an optimizer with momentum or
        weight decay would still move the parameters). Iteration also stops after a True verdict.

        Args:
            info: the :class:`fddp.SyncInfo` of ``ddp_step(..., weight=n, return_info=True)``.

        Raises:
            ValueError: ``info`` carries no weight sum (``ddp_step`` was called without ``weight=``).

        Example:
            >>> grads, info = fddp.ddp_step(params, g, weight=n, return_info=True)
            >>> if batches.done(info):
            ...     break
        """
        if not isinstance(info, SyncInfo) or info.weight is None:
            raise ValueError(
                "fddp.Join.done: expected the SyncInfo of ddp_step(..., weight=n, return_info=True) with "
                f"n this rank's sample count (0 once out of data); got {_describe(info)}"
            )
        # The weight sum comes out of the all-reduce, bitwise identical on every rank.
        self._done = bool(info.weight == 0)
        return self._done


def _describe(info: Any) -> str:
    if isinstance(info, SyncInfo):
        return "a SyncInfo with weight=None (ddp_step was called without weight=)"
    return article(type(info).__name__)
