"""Training that survives a dead replica group without a restart, on torchft.

A job is several *replica groups* (each one ``torchrun``: one process or several); torchft's
Lighthouse forms a quorum of the live ones, and a Manager in each group reconfigures a process
group across the quorum when it changes. :class:`Replicas` is this group's place in it: its steps
are pure functions committed only when every member finished them; a group that dies costs the
others at most the step it died in; a group that starts (again) takes a live peer's state, in
fddp's own wire format (CRC-checked, no pickle), over that process group; and after every change
of membership the members check that they hold the same state at the same step.

Needs ``pip install "fddp[ft]"`` (torchft). The Lighthouse: ``torchft_lighthouse`` (see the docs'
"Fault tolerance" page) or :func:`lighthouse` in-process.

Example:
    >>> replicas = fddp.ft.Replicas(min_replicas=1)    # $TORCHFT_LIGHTHOUSE, $REPLICA_GROUP_ID
    >>> state = replicas.start({"params": params, "opt": opt.init(params)}, config={"opt": opt})
    >>> for x, y in batches:
    ...     state, loss = replicas.step(train_step, state, x, y)   # train_step uses group=replicas.group
"""

from fddp.ft._logs import quiet_torchft

quiet_torchft()  # before torchft is imported: its Rust core reads RUST_LOG once, at import

from fddp.ft._lighthouse import Lighthouse, lighthouse  # noqa: E402
from fddp.ft._outer import FaultTolerantOuter  # noqa: E402
from fddp.ft._replicas import Replicas  # noqa: E402
from fddp.ft._results import DivergedError, Quorum, StateLostError, StepFailed, StepInfo  # noqa: E402

__all__ = ["DivergedError", "FaultTolerantOuter", "Lighthouse", "Quorum", "Replicas", "StateLostError", "StepFailed", "StepInfo",
           "lighthouse"]  # fmt: skip
