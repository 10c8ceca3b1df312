"""A quorum's store, as fddp's error channel reads it: every operation bounded in time.

The channel of a fault-tolerant epoch lives on the quorum's store, which one member group hosts
(torchft's primary). A member that dies closes its sockets and the store's clients fail at once;
a member that *hangs* (stopped, swapping, stuck in I/O) leaves them waiting: ``TCPStore.check``
and ``get`` do not honour their timeout against a server that accepts but never answers. The
channel is read between the slices of every wait, so such a read would hold the wait past the
collective's own timeout. Here each operation runs on a helper thread and the caller gives up
after ``deadline``: the channel then reads as silent, and the collective's timeout decides.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any

from torchft.process_group import create_store_client

__all__ = ["BoundedStore"]


class BoundedStore:
    """The store at ``address`` (``host:port/prefix``), connected lazily, each call bounded.

    Only what ``fddp._dist._channel`` uses: ``set``, ``compare_set``, ``check``, ``get``, ``wait``. A read
    that does not finish within ``deadline`` raises ``TimeoutError``; while it is still stuck, later
    calls raise at once (the host is unresponsive: asking again would only queue behind it). Writes
    (a failure being posted: rare, and the peers depend on it) may take up to ``connect_timeout``.
    The connection is made at once, on the helper thread, so that the first post does not pay for it.

    Example:
        >>> store = BoundedStore("127.0.0.1:29500/torchft/3/0/fddp", deadline=1.0)
        >>> store.set("k", "v")
    """

    def __init__(self, address: str, deadline: float, connect_timeout: float = 10.0) -> None:
        self.address, self.deadline, self._connect_timeout = address, deadline, connect_timeout
        self._store: Any = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0  # calls queued or running on the helper thread
        self._thread = threading.Thread(target=self._serve, name="fddp-ft-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """The helper thread: connect, then one operation at a time, in order."""
        error: BaseException | None = None
        try:
            self._store = create_store_client(self.address, timeout=datetime.timedelta(seconds=self._connect_timeout))
        except BaseException as e:  # noqa: BLE001 - every call then reports it
            error = e
        while True:
            fn, args, box, done = self._jobs.get()
            if fn is None:
                return
            try:
                if error is not None:
                    raise error
                box.append((True, getattr(self._store, fn)(*args)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            finally:
                with self._lock:
                    self._outstanding -= 1
                done.set()

    def _call(self, fn: str, *args: Any, deadline: float | None = None) -> Any:
        """Run ``store.<fn>(*args)`` on the helper thread; raise ``TimeoutError`` past the deadline.
        A read (no ``deadline`` of its own) behind a call still running gives up at once."""
        with self._lock:
            if deadline is None and self._outstanding:
                raise TimeoutError(f"fddp.ft: the quorum's store at {self.address} is not answering")
            self._outstanding += 1
        box: list = []
        done = threading.Event()
        self._jobs.put((fn, args, box, done))
        if not done.wait(self.deadline if deadline is None else deadline):
            raise TimeoutError(f"fddp.ft: the quorum's store at {self.address} did not answer within {self.deadline:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value, deadline=max(self.deadline, self._connect_timeout))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", key, expected, desired, deadline=max(self.deadline, self._connect_timeout))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = None if timeout is None else timeout.total_seconds() + self.deadline
        self._call("wait", keys, *(() if timeout is None else (timeout,)), deadline=limit)

    def close(self) -> None:
        """Stop the helper thread (once it is free). The owner must call it: the thread holds the
        store alive, so it is never collected by itself."""
        self._jobs.put((None, (), None, None))
