"""Live state from a peer over the replica groups' own process group, in fddp's wire format.

torchft's Manager asks its *checkpoint transport* to send the state to the replica groups that are
behind, and a group that is behind to receive it, while it forms a quorum. Its default transport
pickles the state over HTTP from a server bound to every interface; its process-group transport
pickles the metadata and needs numpy. This one sends :mod:`fddp.ft._wire`'s payload (JSON and raw
bytes, CRC-checked, no code) with point-to-point sends on the reconfigured process group the
quorum has just made: no new socket, and only the addresses the job already uses.

Per receiver, three messages in order: the header's length (one int64), the header, the chunks.
"""

from __future__ import annotations

import datetime
from typing import Any, Callable

import torch
from torchft.checkpointing.transport import CheckpointTransport

from fddp.checkpoint import CheckpointError
from fddp.ft import _wire

__all__ = ["GroupTransport", "TransferError", "METADATA"]

METADATA = "fddp-live-v1"  # what the sender advertises; a receiver checks it before it waits for bytes
_TAG = 7
_MAX_HEADER = 1 << 30  # bytes: a header describes the tree, its tensors travel apart


class TransferError(RuntimeError):
    """The live state did not get through: the peer died or hung mid-transfer (the quorum will change)."""


def _wait(work: Any, timeout: datetime.timedelta, doing: str, peer: int) -> None:
    try:
        ok = work.wait(timeout)
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError subclasses on a lost peer or a timeout
        raise TransferError(f"fddp.ft: {doing} replica group {peer} failed: {e}") from e
    if ok is False:
        raise TransferError(f"fddp.ft: {doing} replica group {peer} timed out after {timeout.total_seconds():g} s")


class GroupTransport(CheckpointTransport[dict]):
    """torchft's checkpoint transport interface, over the replica groups' process group.

    Args:
        group: the reconfigurable process group the Manager configures (``send``/``recv`` by
            quorum rank).
        like: returns the tree a received state must match (this group's own, as the Manager
            would send it): its structure, shapes and dtypes are checked, and received tensors land
            on its devices.

    Example:
        >>> transport = GroupTransport(pg, like=lambda: manager_state_dict)
    """

    def __init__(self, group: Any, like: Callable[[], Any]) -> None:
        self._group, self._like = group, like
        self.sent: list[int] = []  # the receivers of the last send (for tests and info)
        self.received_from: int | None = None

    def metadata(self) -> str:
        return METADATA

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: datetime.timedelta) -> None:
        if torch.cuda.is_available():
            # torchft calls this on its executor thread, inside its recovery stream: the copies of
            # the live state to the host would not wait for the training stream's kernels that
            # are still writing it (the host runs ahead). Heals are rare: one device-wide sync.
            torch.cuda.synchronize()
        packed = _wire.pack(state_dict, step)
        size = torch.tensor([packed.header.numel()], dtype=torch.int64)
        for dst in dst_ranks:
            works = [self._group.send([size], dst, _TAG), self._group.send([packed.header], dst, _TAG)]
            works += [self._group.send([c], dst, _TAG) for c in packed.chunks if c.numel()]
            for w in works:
                _wait(w, timeout, "sending the live state to", dst)
        self.sent = list(dst_ranks)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: datetime.timedelta) -> dict:
        if metadata != METADATA:
            raise CheckpointError(
                f"fddp.ft: replica group {src_rank} offers its state through {metadata!r}, not fddp's transport "
                f"({METADATA!r}); every replica group of the job must run fddp.ft"
            )
        size = torch.zeros(1, dtype=torch.int64)
        _wait(self._group.recv([size], src_rank, _TAG), timeout, "receiving the live state from", src_rank)
        if not 0 < int(size) <= _MAX_HEADER:
            raise CheckpointError(f"fddp.ft: replica group {src_rank} announces a live-state header of {int(size)} bytes")
        raw = torch.empty(int(size), dtype=torch.uint8)
        _wait(self._group.recv([raw], src_rank, _TAG), timeout, "receiving the live state from", src_rank)
        where = f"fddp.ft: the live state from replica group {src_rank}"
        header = _wire.header_of(raw, where)  # JSON only: nothing the peer sent runs
        chunks = _wire.chunks_for(header, where)
        works = [self._group.recv([c], src_rank, _TAG) for c in chunks if c.numel()]
        for w in works:
            _wait(w, timeout, "receiving the live state from", src_rank)
        tree, sent_step = _wire.unpack(header, chunks, self._like(), where)
        if sent_step != step:
            raise CheckpointError(f"fddp.ft: replica group {src_rank} sent its state at step {sent_step}, expected step {step}")
        self.received_from = src_rank
        return tree

    def disallow_checkpoint(self) -> None:
        pass  # every send completes inside send_checkpoint: nothing outlives the quorum

    def shutdown(self, wait: bool = True) -> None:
        pass
