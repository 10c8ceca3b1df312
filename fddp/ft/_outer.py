"""DiLoCo and local SGD across replica groups that come and go: the quorum only at synchronisations.

``fddp.diloco``'s outer step is pure: ``outer.step(params, state)`` counts an inner step, and every
``every`` steps averages the pseudo-gradients over its group and steps the snapshot. Here its group
is :class:`fddp.ft.Replicas`' group, and a synchronisation is a fault-tolerant step: a quorum, the
outer step, a vote. Inner steps take no quorum and pay nothing. A group that joins (or fell behind)
receives the last synchronised state (snapshot, outer optimizer state) at the others' next
synchronisation and takes part in it with weight 0, so the mean is over the groups that trained.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fddp.diloco import DiLoCo, DiLoCoState
from fddp.ft._replicas import Replicas, _transient

__all__ = ["FaultTolerantOuter"]


def _replicated(state: DiLoCoState) -> tuple:
    """What every member of a quorum must hold bitwise alike: the snapshot and the outer state
    (the count and the weights are per group: a group that joins has not counted the round)."""
    return state.snapshot, state.outer_state


class FaultTolerantOuter:
    """``outer.step`` across the replica groups of a fault-tolerant job.

    Args:
        replicas: this replica group's :class:`fddp.ft.Replicas`.
        outer: ``fddp.diloco.diloco(every=H, group=replicas.group)`` or
            ``fddp.diloco.local_sgd(every=H, group=replicas.group)``; one fragment, no delay (a
            streaming synchronisation stays in flight across inner steps, beyond one quorum).

    Example:
        >>> outer = fddp.ft.FaultTolerantOuter(replicas, fddp.diloco.diloco(every=50, group=replicas.group))
        >>> params, state = outer.start(params)
        >>> for x, y in batches:
        ...     params, inner_state = inner_step(params, inner_state, x, y)   # local: no communication
        ...     params, state = outer.step(params, state, weight=len(x))
    """

    def __init__(self, replicas: Replicas, outer: DiLoCo) -> None:
        if not isinstance(outer, DiLoCo):
            raise TypeError(
                f"fddp.ft.FaultTolerantOuter: outer must be fddp.diloco.diloco(...) or local_sgd(...), got {type(outer).__name__}"
            )
        if outer.group is not replicas.group:
            raise ValueError(
                "fddp.ft.FaultTolerantOuter: make the outer step with group=replicas.group (it averages across the replica groups)"
            )
        if outer.fragments != 1 or outer.delay != 0:
            raise NotImplementedError(
                f"fddp.ft.FaultTolerantOuter: fragments={outer.fragments}, delay={outer.delay}: streaming DiLoCo keeps a "
                "synchronisation in flight across inner steps, which a quorum change would cut; use fragments=1, delay=0"
            )
        self.replicas, self.outer = replicas, outer

    def start(self, params: Any, /) -> tuple[Any, DiLoCoState]:
        """Join the job; return the parameters and the outer state to train from.

        When the job starts, every group takes one group's parameters. A group that joins later
        waits for the others' next synchronisation (up to the Manager's ``quorum_timeout``), takes
        part in it with weight 0, and starts from its result, as they do.

        Example:
            >>> params, state = outer.start(params)
        """
        state = self.outer.init(params)
        self.replicas._like_state = state
        committed, healed, intents, _ = self.replicas._quorum(state, _replicated, 0)
        if max(intents) > 0:  # the others are synchronising: join their synchronisation
            return self._join(committed, max(intents))
        self.replicas.manager.should_commit()  # the start counts as a step: a group that joins later is behind
        self.replicas._committed = committed
        if healed:
            params = _copy(committed.snapshot)
        return params, committed

    def step(self, params: Any, state: DiLoCoState, /, *, weight: float | torch.Tensor = 1.0) -> tuple[Any, DiLoCoState]:
        """Count one inner step; at a synchronisation, run it as a fault-tolerant step.

        Between synchronisations this is ``outer.step(params, state, weight=weight)``: no quorum, no
        communication. At a synchronisation: the quorum (a group that joins receives the last
        synchronised state now), the outer step on the groups of the quorum, the vote. If a member
        fails during it, the inputs come back as they were (the weight counted) and the next call
        synchronises again with the groups that are left.

        Args:
            params: this group's parameters after its inner step.
            state: the outer state (from :meth:`start` or the previous call).
            weight: this inner step's weight (its sample count): the mean pseudo-gradient is
                weighted by what each group trained on since the last synchronisation.

        Returns:
            ``(params, state)``.
        """
        t = int(state.count) + 1
        if t % self.outer.every:
            return self.outer.step(params, state, weight=weight)
        last = self.replicas._committed
        committed, healed, intents, _ = self.replicas._quorum(last, _replicated, t)
        if healed or max(intents) > t:  # this group fell behind: its round is lost, take the others'
            return self._join(committed, max(intents))
        return self._sync(params, state, weight)

    def _join(self, committed: DiLoCoState, t: int) -> tuple[Any, DiLoCoState]:
        """Take part in the others' synchronisation at count ``t`` from their last synchronised state."""
        state = committed._replace(count=torch.tensor(t - 1, dtype=torch.int64),
                                   weight=tuple(torch.zeros((), dtype=torch.float64) for _ in committed.weight))  # fmt: skip
        return self._sync(_copy(committed.snapshot), state, 0.0)

    def _sync(self, params: Any, state: DiLoCoState, weight: Any) -> tuple[Any, DiLoCoState]:
        replicas = self.replicas
        error: BaseException | None = None
        try:
            new_params, new_state = self.outer.step(params, state, weight=weight)
        except Exception as e:
            error = e
            replicas.manager.report_error(e)
            if not _transient(e):
                replicas.manager.should_commit()
                raise
        if replicas.manager.should_commit():
            replicas._failures = 0
            replicas._committed = new_state
            return new_params, new_state
        replicas._fail(error or RuntimeError("a replica group of this synchronisation's quorum failed"))
        w = torch.as_tensor(weight, dtype=torch.float64).reshape(())
        return params, state._replace(weight=tuple(a + w for a in state.weight))


def _copy(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.clone(), tree)
