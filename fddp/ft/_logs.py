"""torchft's logs, quiet by default: fddp's own lines stay readable.

torchft's Rust core logs at INFO to stderr from the moment it is imported (every quorum request,
vote and heartbeat decision: a few lines per step, over 95% of a run's log), unless ``RUST_LOG``
says otherwise; its Manager also warns on every reconfiguration of a CPU run that it cannot reset
NCCL's flight recorder (there is none to reset). This module runs before torchft is imported: it
sets ``RUST_LOG=warn`` when the environment does not set it, and drops that one warning when no
GPU is present. ``RUST_LOG=info`` brings the Rust lines back (set it before ``import fddp.ft``);
``logging.getLogger("torchft").setLevel(logging.INFO)`` with a handler shows the Python side.
"""

from __future__ import annotations

import logging
import os

__all__ = ["quiet_torchft"]

_FLIGHT_RECORDER = "Unable to reset NCCL flight recorder"


class _NoFlightRecorderOnCpu(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if _FLIGHT_RECORDER not in str(record.msg):
            return True
        import torch

        return torch.cuda.is_available()


def quiet_torchft() -> None:
    """Quiet torchft's INFO lines unless ``RUST_LOG`` is set; drop its flight-recorder warning on CPU runs."""
    os.environ.setdefault("RUST_LOG", "warn")
    logger = logging.getLogger("torchft.manager")
    if not any(isinstance(f, _NoFlightRecorderOnCpu) for f in logger.filters):
        logger.addFilter(_NoFlightRecorderOnCpu())
