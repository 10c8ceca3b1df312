"""Low-communication training: local SGD and (streaming, compressed) DiLoCo as a pure outer step.

Each rank trains its own copy of the parameters for ``every`` inner steps without communicating;
then the ranks average their *pseudo-gradients* (the snapshot taken at the last synchronisation
minus their parameters) with fddp's bucketed all-reduce and any comm hook, and an outer optimizer
(any ``fddp.optim`` transformation) steps the snapshot with the mean. One synchronisation every
``every`` steps sends what data parallelism sends every step. Two lines join a local loop::

    outer = fddp.diloco.diloco(every=50)       # outer SGD at lr 1 (the ranks' mean); any fddp.optim
    state = outer.init(params)
    for x, y in loader:
        grads = torch.func.grad(loss_fn)(params, x, y)              # local: no communication
        params, opt_state = fddp.optim.apply_gradients(inner, grads, opt_state, params)
        params, state = outer.step(params, state)                   # syncs every 50th call

``fddp.diloco.local_sgd(every=H)`` averages the parameters (outer SGD, learning rate 1: also
``diloco``'s default outer step: docs/lowcomm.md says how it was chosen); ``warmup=W``
makes the first ``W`` inner steps synchronous. Streaming DiLoCo (``fragments=F, delay=tau,
mixing=alpha``) synchronises ``F`` groups of leaves at staggered steps, each overlapping ``tau``
inner steps; ``fragments=[["embed", "blocks.0"], ["blocks.1", "head"]]`` names them by leaf prefix.
``compression=fddp.diloco.Quantize(bits=4)`` (or ``bits=2``, or ``fddp.diloco.TopK(0.01)``) sends the
pseudo-gradients in 4 or 2 bits, or their top 1%, with error feedback; ``eager=True`` never waits
for a synchronisation (it overlaps the whole next round). Before every synchronisation the ranks
agree on the configuration, the step count and checksums of the snapshot: stale or mismatched
state is an error on every rank. The state (:class:`DiLoCoState`) is a
pytree of tensors: :mod:`fddp.checkpoint` saves it, after :meth:`DiLoCo.settle` when a fragment
is in flight, and a resumed run continues bitwise.

Example:
    >>> outer = fddp.diloco.local_sgd(every=8)
    >>> state = outer.init(params)
    >>> params, state = outer.step(params, state)
"""

from fddp.diloco._compress import Quantize, ResidualState, TopK
from fddp.diloco._outer import DiLoCo, DiLoCoState, Flight, OuterInfo, diloco, local_sgd

__all__ = ["DiLoCo", "DiLoCoState", "Flight", "OuterInfo", "Quantize", "ResidualState", "TopK", "diloco", "local_sgd"]
