"""A ``ddp_step`` started now and finished later, and the cross-rank agreement on a configuration.

Low-communication training (``fddp.diloco``) needs two things ``fddp.sync`` has but does not
expose: a synchronisation whose collectives run while the caller computes (streaming DiLoCo's
fragments stay in flight for ``delay`` inner steps), and the agreement on what is not a tree's
signature (``every``, the outer optimizer, the step count, the snapshot's checksums). Both live here, in one file, so that
every use of the sync's internals by ``fddp.diloco`` is in one place.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fddp import _dist
from fddp.sync._reducer import SyncInfo
from fddp.sync._setup import as_weight, check_state, make_options, setup

__all__ = ["InFlight", "start"]


class InFlight:
    """A synchronisation whose buckets are on their way: :meth:`wait` returns the mean tree.

    Made by :func:`start`. Every bucket's collectives have been issued; the backend moves them
    while the caller runs (gloo and NCCL progress on their own threads). A hook that needs more
    than one round trip (PowerSGD's ``Q``) issues the later rounds inside :meth:`wait`.

    Not a tensor: it cannot be checkpointed. ``fddp.diloco``'s ``settle`` turns the in-flight
    work of a state into tensors before a save.
    """

    __slots__ = ("_sync", "_reducer", "_result", "_error")

    def __init__(self, sync: Any, reducer: Any) -> None:
        self._sync, self._reducer = sync, reducer
        self._result: tuple[Any, SyncInfo] | None = None
        self._error: BaseException | None = None

    def wait(self) -> tuple[Any, SyncInfo]:
        """Wait for every bucket; return ``(mean tree, info)``, the same objects on a second call.

        A failure (a peer gone, the group's timeout, a hook's error) raises here, and again on
        every later call: the collectives of a failed synchronisation are not retried.
        """
        if self._error is not None:
            raise self._error
        if self._result is None:
            try:
                flats, info = self._sync.close(self._reducer)
            except BaseException as e:
                self._error = e
                self._sync = self._reducer = None
                raise
            self._result = (self._sync.tree(flats, self._reducer.made_views(flats)), info)
            self._sync = self._reducer = None
        return self._result

    def __repr__(self) -> str:
        return f"InFlight({'done' if self._result is not None else 'failed' if self._error else 'pending'})"


def start(
    params: Any, grads: Any, /, *, what: str, weight: float | torch.Tensor | None = None, compression_state: Any = None, **options: Any
) -> InFlight:
    """Start ``fddp.ddp_step(params, grads, ..., return_info=True)``; return at once.

    The same buckets, hooks, signature check and arithmetic as ``ddp_step``: the mean (or the
    sharded mean, with ``fddp.zero.ReduceScatter``) that :meth:`InFlight.wait` returns is bitwise
    the one ``ddp_step`` would have returned. ``grads`` is copied into the buckets before this
    returns, so the caller may change or drop it.

    Args:
        params: the tree that fixes the buckets.
        grads: a tree of tensors of the same structure (no ``None`` leaves).
        what: the public function's name, for messages (``"diloco.step"``).
        weight: this rank's weight, as :func:`fddp.ddp_step`'s.
        compression_state: a stateful hook's state, as :func:`fddp.ddp_step`'s.
        **options: ``group``, ``bucket_cap_mb``, ``first_bucket_mb``, ``compression``: as
            :func:`fddp.ddp_step`'s.

    Example:
        >>> pending = start(params, pseudo_grads, what="diloco.step")
        >>> mean, info = pending.wait()
    """
    with _dist.call(options.get("group"), what):  # the collectives are issued here; only their waits come later
        sync_options = make_options(what, **options, return_info=True, weighted=weight is not None)
        w = None if weight is None else as_weight(weight, what)
        check_state(sync_options, compression_state, what, options.get("compression"))
        options = sync_options
        sync = setup(params, options, what, compression_state, weight=w, agree=False)
        sync.announce()
        reducer = sync.reducer(compression_state)
        reducer.push([g.detach() for g in optree.tree_leaves(grads, none_is_leaf=True)])
    return InFlight(sync, reducer)

