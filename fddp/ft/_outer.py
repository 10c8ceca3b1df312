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
from fddp.ft._replicas import Replicas

__all__ = ["FaultTolerantOuter"]


def _replicated(committed: tuple) -> tuple:
    """What every member of a quorum must hold bitwise alike: the snapshot and the outer state
    (the count and the weights are per group: a group that joins has not counted the round; the
    inner optimizer's state is each group's own)."""
    state, _ = committed
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
        >>> params, state, inner_state = outer.start(params, inner_state=inner.init(params))
        >>> for x, y in batches:
        ...     params, inner_state = inner_step(params, inner_state, x, y)   # local: no communication
        ...     params, state, inner_state = outer.step(params, state, weight=len(x), inner_state=inner_state)
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
        if outer.fragments != 1 or outer.delay != 0 or outer.eager:
            raise NotImplementedError(
                f"fddp.ft.FaultTolerantOuter: fragments={outer.fragments}, delay={outer.delay}, eager={outer.eager}: "
                "streaming and eager DiLoCo keep a synchronisation in flight across inner steps, which a quorum change "
                "would cut; use fragments=1, delay=0, eager=False"
            )
        self.replicas, self.outer = replicas, outer

    def _config(self, config: Any) -> dict:
        """What every group must share: the outer step's settings (the optimizer by value) and the user's."""
        o = self.outer
        fields = ("every", "fragments", "delay", "mixing", "compression", "shard", "warmup", "optimizer")
        return {"outer": {f: getattr(o, f) for f in fields}, "user": config}

    def start(self, params: Any, /, *, inner_state: Any = None, config: Any = None) -> tuple:
        """Join the job; return the parameters and the outer state to train from.

        When the job starts, every group takes one group's parameters. A group that joins later
        waits for the others' next synchronisation (up to the Manager's ``quorum_timeout``), takes
        part in it with weight 0, and starts from its result, as they do. A group whose parameters'
        tree, shapes or dtypes, inner state, outer settings or ``config`` differ from the job's is
        refused (:class:`fddp.MismatchError` naming the difference); the others go on.

        Args:
            params: this group's initial parameters.
            inner_state: this group's inner optimizer state, to be replaced by a peer's when this
                group joins late (its step count drives a learning-rate schedule: a fresh one would
                start the schedule over); pass the same to :meth:`step`.
            config: what else the groups must share, compared by value (the inner optimizer:
                ``{"inner": inner}``); the outer step's own settings are always compared.

        Returns:
            ``(params, state)``, or ``(params, state, inner_state)`` when ``inner_state`` is given.

        Example:
            >>> params, state, inner_state = outer.start(params, inner_state=inner.init(params), config={"inner": inner})
        """
        replicas = self.replicas
        state = self.outer.init(params)
        mine = (state, inner_state)
        replicas._set_run(mine, self._config(config), 0)
        while True:
            committed, healed, intents, _ = replicas._quorum(mine, _replicated, 0)
            if max(intents) > 0:  # the others are synchronising: join their synchronisation
                return self._out(*self._join(committed, max(intents)), inner_state is not None)
            replicas._committed = committed
            # The start counts as a step (a group that joins later is then behind and takes the
            # state); it is committed only if the vote passes, like any step.
            ok, _, _ = replicas._voted(lambda: None, "a replica group failed while the job started")
            if ok:
                break
            mine = committed
        state, inner = committed
        if healed:
            params = _copy(state.snapshot)
        return self._out(params, state, inner, inner_state is not None)

    @staticmethod
    def _out(params: Any, state: DiLoCoState, inner: Any, with_inner: bool) -> tuple:
        return (params, state, inner) if with_inner else (params, state)

    def step(self, params: Any, state: DiLoCoState, /, *, weight: float | torch.Tensor = 1.0, inner_state: Any = None) -> tuple:
        """Count one inner step; at a synchronisation, run it as a fault-tolerant step.

        Between synchronisations this is ``outer.step(params, state, weight=weight)``: no quorum, no
        communication. At a synchronisation: the quorum (a group that joins receives the last
        synchronised state now, and this group's ``inner_state``), the outer step on the groups of
        the quorum, the vote. If a member fails during it, the inputs come back as they were (the
        weight counted) and the next call synchronises again with the groups that are left. If
        this group was behind (it joined, or missed a synchronisation), it takes the others' last
        synchronised state and a peer's inner optimizer state, and returns that inner state.

        Args:
            params: this group's parameters after its inner step.
            state: the outer state (from :meth:`start` or the previous call).
            weight: this inner step's weight (its sample count): the mean pseudo-gradient is
                weighted by what each group trained on since the last synchronisation.
            inner_state: this group's inner optimizer state (see :meth:`start`); not modified.

        Returns:
            ``(params, state)``, or ``(params, state, inner_state)`` when ``inner_state`` is given:
            the inner state to go on with (a peer's when this group took the others' state).

        Example:
            >>> params, state, inner_state = outer.step(params, state, weight=len(x), inner_state=inner_state)
        """
        with_inner = inner_state is not None
        t = int(state.count) + 1
        if t % self.outer.every:
            return self._out(*self.outer.step(params, state, weight=weight), inner_state, with_inner)
        last = (self.replicas._committed[0], inner_state)  # a joiner gets this group's inner state as it is now
        self.replicas._committed = last
        committed, healed, intents, _ = self.replicas._quorum(last, _replicated, t)
        if healed or max(intents) > t:  # this group fell behind: its round is lost, take the others'
            return self._out(*self._join(committed, max(intents)), with_inner)
        return self._out(*self._sync(params, state, weight, inner_state), with_inner)

    def _join(self, committed: tuple, t: int) -> tuple[Any, DiLoCoState, Any]:
        """Take part in the others' synchronisation at count ``t`` from their last synchronised state."""
        last, inner = committed
        state = last._replace(count=torch.tensor(t - 1, dtype=torch.int64),
                              weight=tuple(torch.zeros((), dtype=torch.float64) for _ in last.weight))  # fmt: skip
        return self._sync(_copy(last.snapshot), state, 0.0, inner)

    def _sync(self, params: Any, state: DiLoCoState, weight: Any, inner_state: Any) -> tuple[Any, DiLoCoState, Any]:
        replicas = self.replicas
        committed, result, _ = replicas._voted(lambda: self.outer.step(params, state, weight=weight),
                                               "a replica group of this synchronisation's quorum failed")  # fmt: skip
        if committed:
            new_params, new_state = result
            replicas._committed = (new_state, inner_state)
            return new_params, new_state, inner_state
        w = torch.as_tensor(weight, dtype=torch.float64).reshape(())
        return params, state._replace(weight=tuple(a + w for a in state.weight)), inner_state


def _copy(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.clone(), tree)
