"""The Lighthouse in this process (for tests and single-machine runs): torchft's server, with an
address that names the host it is bound to."""

from __future__ import annotations

from typing import NamedTuple

from torchft.coordination import LighthouseServer

__all__ = ["Lighthouse", "lighthouse"]


class Lighthouse(NamedTuple):
    """A running Lighthouse.

    Attributes:
        address: what replica groups pass as ``lighthouse=`` (or ``$TORCHFT_LIGHTHOUSE``).
        server: torchft's ``LighthouseServer`` (``shutdown()`` stops it).

    Example:
        >>> lh = fddp.ft.lighthouse(min_replicas=1)
        >>> lh.address
        'http://127.0.0.1:41233'
        >>> lh.shutdown()
    """

    address: str
    server: LighthouseServer

    def shutdown(self) -> None:
        """Stop the Lighthouse (a running job's quorums wait for one to be back)."""
        self.server.shutdown()


def lighthouse(
    bind: str = "127.0.0.1:0",
    *,
    min_replicas: int = 1,
    join_timeout: float = 1.0,
    heartbeat_timeout: float = 1.0,
    quorum_tick: float = 0.01,
) -> Lighthouse:
    """Start torchft's Lighthouse in this process; the job's other processes reach it at ``.address``.

    The same as ``torchft_lighthouse --bind BIND --min_replicas N --join_timeout_ms ...
    --heartbeat_timeout_ms ... --quorum_tick_ms ...`` (what the docs start on a real job).

    Args:
        bind: ``host:port`` to listen on (port 0: any free port). Bind the address the job uses,
            not every interface.
        min_replicas: the fewest replica groups a quorum may have.
        join_timeout: seconds a quorum that could form waits for groups that heartbeat but have not
            asked to join (a group still starting).
        heartbeat_timeout: seconds without a heartbeat after which a group is dead: the survivors'
            stall when one dies is about this long.
        quorum_tick: seconds between the Lighthouse's looks at a quorum that is waiting.

    Example:
        >>> lh = fddp.ft.lighthouse(min_replicas=1)
        >>> replicas = fddp.ft.Replicas(lighthouse=lh.address, replica_id="a")
    """
    host = bind.rsplit(":", 1)[0].strip("[]")
    server = LighthouseServer(
        bind=bind, min_replicas=min_replicas, join_timeout_ms=int(join_timeout * 1000),
        quorum_tick_ms=max(1, int(quorum_tick * 1000)), heartbeat_timeout_ms=int(heartbeat_timeout * 1000),
    )  # fmt: skip
    port = server.address().rsplit(":", 1)[1]
    # torchft names the machine's hostname; a host that is bound names itself (a network namespace
    # may not resolve the hostname to the address it listens on).
    address = server.address() if host in ("", "0.0.0.0", "::") else f"http://{host}:{port}"
    return Lighthouse(address, server)
