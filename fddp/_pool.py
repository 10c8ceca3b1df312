"""The host buffer pool: flat CPU buffers reused once nothing refers to them any more.

Fresh host memory is expensive: glibc hands large freed blocks back to the OS and every page of a
new buffer then faults on first touch, which made copying a gradient into a new bucket cost several
times the copy itself. A buffer handed out here is kept and handed out again only once its storage
has no other user: no view (gradients returned to the caller, optimizer state), no alias
(``detach()``, numpy) and no collective in flight. So reuse is never observable, and the functions
built on it stay pure. GPU memory has torch's caching allocator and is not pooled.

Only plain eager tensors ever enter the pool: under ``torch.compile`` tracing or a ``torch.func``
transform, buffers are allocated normally.
"""

from __future__ import annotations

import threading

import torch

from fddp import _caches

__all__ = ["new_buffer", "release"]

_functorch = torch._C._functorch
_storage_users = getattr(torch._C, "_storage_Use_Count", None)


class _HostBuffers:
    def __init__(self, per_key: int = 16) -> None:
        # Per (size, dtype): a step's buckets and the previous step's, or an optimizer's params,
        # state, their successors and its temporaries (fddp.optim's flat buffers share sizes).
        self.per_key = per_key
        self.free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.lock = threading.Lock()  # the use check and the hand-out must not interleave

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if (
            device.type != "cpu"
            or _storage_users is None
            or torch.compiler.is_compiling()
            or _functorch.peek_interpreter_stack() is not None
        ):
            return torch.empty(numel, dtype=dtype, device=device)
        with self.lock:
            kept = self.free.setdefault((numel, dtype), [])
            for t in kept:
                # 2: the kept tensor itself and the storage object made to ask. Held in a local
                # while asking: torch 2.4 does not keep a tensor's Python storage object alive, so
                # ``_storage_users(t.untyped_storage()._cdata)`` frees it before the count is read
                # (1 there, 2 on torch 2.13, for the same unshared buffer: the pool reused buffers
                # still in use).
                storage = t.untyped_storage()
                if _storage_users(storage._cdata) == 2:
                    # A view holds its own reference to the storage, so the buffer counts as in
                    # use from now on, even before anything else refers to it.
                    return t.view(numel)
            t = torch.empty(numel, dtype=dtype, device=device)
            if len(kept) >= self.per_key:
                # All in use (other models' parameters, say, held for long): forget the oldest,
                # which stays valid for its users, so that the running loop's buffers are kept.
                kept.pop(0)
            kept.append(t)
            return t.view(numel)

    def clear(self) -> None:
        with self.lock:
            self.free.clear()


_host_buffers = _HostBuffers()
_caches.register("fddp._pool._host_buffers", _host_buffers.clear)


def new_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Return an uninitialised 1-D buffer, reusing an unreferenced host one if there is one.

    Example:
        >>> new_buffer(4, torch.float32, torch.device("cpu")).shape
        torch.Size([4])
    """
    return _host_buffers.take(numel, dtype, device)


def release() -> None:
    """Forget the kept host buffers, so that their memory can go back to the OS.

    Buffers still in use stay valid; they are simply not reused. :func:`fddp.clear_caches` calls this.
    """
    _host_buffers.clear()
