"""The core every fddp capability plugs into: a call scope, one agreement, one replica digest.

A capability that communicates uses exactly three things from here (``docs/design.md`` draws the
picture):

- **the call scope**: its public functions are decorated with :func:`entry`, so a failure on one
  rank, anywhere in the call, becomes a :class:`PeerError` on every rank of the group within a
  fraction of a second instead of a hang (``_scope``; failures posted in ``_failures``, and the
  waits that watch for them in ``_waits``);
- **the agreement**: before its collectives move, it calls :func:`agree` (or
  :func:`start_agreement`, where :func:`can_carry` lets a small sum ride in the call's head) with
  rows that describe what the ranks must share; a difference is a :class:`MismatchError` on every
  rank naming it (``_agreement``, the head's layout in ``_header``, the diagnosis in
  ``_diagnosis``, collectives its head does not fix in ``_sequences``);
- **the replica digest**: values that must be equal on every rank are compared through
  :func:`replica_digest` and nothing else (``_digest``).

Below them: what is remembered per group and membership epoch (``_groups``) and the store records
through which ranks talk outside collectives (``_channel``). Each is one file; imports point down:
``_channel, _errors -> _digest, _groups -> _header, _watcher -> _failures -> _waits ->
_diagnosis -> _sequences -> _agreement -> _scope``.
"""

from fddp._dist._agreement import (
    Agreed,
    Agreement,
    agree,
    agreements,
    can_carry,
    request,
    settle,
    signature_digest,
    start_agreement,
    take_requested,
)
from fddp._dist._channel import Failure
from fddp._dist._diagnosis import describe_token, name_difference
from fddp._dist._digest import MASK, checksum, digest, replica_digest, traced_digest
from fddp._dist._errors import MismatchError, PeerError, collective
from fddp._dist._failures import fail, raise_if_failed_here
from fddp._dist._groups import (
    Checks,
    begin_epoch,
    call_count,
    checks,
    collective_device,
    control_group,
    count_call,
    data_device,
    epoch,
    rank,
    set_checks,
    size,
    uses_nccl,
)
from fddp._dist._header import PREEMPT, UNWRITTEN, WRITTEN, stamp
from fddp._dist._scope import backward_scope, call, entry, owe
from fddp._dist._sequences import Segment
from fddp._dist._waits import sliced, wait

__all__ = [
    "MASK",
    "PREEMPT",
    "UNWRITTEN",
    "WRITTEN",
    "Agreed",
    "Agreement",
    "Checks",
    "Failure",
    "MismatchError",
    "PeerError",
    "Segment",
    "agree",
    "agreements",
    "backward_scope",
    "begin_epoch",
    "call",
    "call_count",
    "can_carry",
    "checks",
    "checksum",
    "collective",
    "collective_device",
    "control_group",
    "count_call",
    "data_device",
    "describe_token",
    "digest",
    "entry",
    "epoch",
    "fail",
    "name_difference",
    "owe",
    "raise_if_failed_here",
    "rank",
    "replica_digest",
    "request",
    "set_checks",
    "settle",
    "signature_digest",
    "size",
    "sliced",
    "stamp",
    "start_agreement",
    "take_requested",
    "traced_digest",
    "uses_nccl",
    "wait",
]
