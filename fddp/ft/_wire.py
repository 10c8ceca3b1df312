"""A tree on the wire: the checkpoint codec's payload as a JSON header and the tensors' raw bytes.

``fddp.checkpoint``'s codec turns a tree into plain data (its structure as tuples and strings, the
leaves' paths, CRC-32s of every tensor's bytes) and back, checking the result against an expected
tree. A live transfer sends that payload without ``torch.save``: the plain data as JSON (every
value tagged with its type, so that a tuple stays a tuple and a float round-trips to the bit) and
the tensors as the bytes they hold, in a few packed chunks. Decoding runs no code of the sender's
(no pickle, not even a restricted one), and the codec's ``decode`` verifies every CRC-32 and the
tree against the receiver's own.

This module knows payloads and bytes, not process groups: ``fddp.ft._transport`` moves them.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import torch

from fddp.checkpoint import _codec

__all__ = ["Packed", "pack", "unpack", "header_of", "chunks_for"]

MAGIC = "fddp-live"
VERSION = 1
_CHUNK = 16 << 20  # bytes per chunk: small leaves share one, a bigger leaf travels alone
_ALIGN = 64  # each leaf starts at a multiple of this in its chunk (a typed view needs alignment)

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


class Packed(NamedTuple):
    """A payload ready to send.

    Attributes:
        header: the JSON header, as UTF-8 bytes in a uint8 tensor.
        chunks: uint8 tensors, in order: the tensors' bytes (a leaf's bytes never span two chunks).
    """

    header: torch.Tensor
    chunks: list[torch.Tensor]


def _plain(x: Any, tensors: list[torch.Tensor]) -> Any:
    """``x`` as JSON values, each tagged with its type (tensors become references into ``tensors``)."""
    if x is None or isinstance(x, (bool, str)) or (type(x) is int):
        return x
    if type(x) is float:
        return {"f": x.hex()}  # exact, and inf/nan survive
    if type(x) is complex:
        return {"c": [x.real.hex(), x.imag.hex()]}
    if type(x) is bytes:
        return {"b": x.hex()}
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return {"x": len(tensors) - 1}
    if type(x) is tuple:
        return {"t": [_plain(v, tensors) for v in x]}
    if type(x) is list:
        return [_plain(v, tensors) for v in x]
    if type(x) is dict:
        return {"d": [[_plain(k, tensors), _plain(v, tensors)] for k, v in x.items()]}
    raise TypeError(f"fddp.ft: cannot send a {type(x).__qualname__} in a payload")


def _value(x: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`_plain`."""
    if x is None or isinstance(x, (bool, str, int)):
        return x
    if isinstance(x, list):
        return [_value(v, tensors) for v in x]
    if isinstance(x, dict) and len(x) == 1:
        (tag, v), = x.items()
        if tag == "f":
            return float.fromhex(v)
        if tag == "c":
            return complex(float.fromhex(v[0]), float.fromhex(v[1]))
        if tag == "b":
            return bytes.fromhex(v)
        if tag == "x":
            if type(v) is not int or not 0 <= v < len(tensors):
                raise IndexError(f"tensor reference {v!r} of {len(tensors)}")
            return tensors[v]
        if tag == "t":
            return tuple(_value(e, tensors) for e in v)
        if tag == "d":
            return {_value(k, tensors): _value(e, tensors) for k, e in v}
    raise ValueError(f"fddp.ft: a payload header holds an unknown value {str(x)[:80]!r}")


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack(tree: Any, step: int) -> Packed:
    """Encode ``tree`` (the codec's payload: structure, paths, CRC-32s) for sending at ``step``.

    Example:
        >>> packed = pack({"w": torch.ones(3)}, step=7)
        >>> tree, step = unpack(header_of(packed.header), packed.chunks, like={"w": torch.zeros(3)}, where="a peer")
    """
    payload = _codec.encode(tree)
    tensors: list[torch.Tensor] = []
    plain = _plain(payload, tensors)
    chunks: list[torch.Tensor] = []
    layout: list[list[int]] = []  # per tensor: chunk, offset, nbytes
    pending: list[tuple[int, torch.Tensor]] = []  # small leaves waiting for their shared chunk
    fill = 0

    def close() -> None:
        nonlocal pending, fill
        if pending:
            buf = torch.empty(fill, dtype=torch.uint8)
            for offset, b in pending:
                buf[offset : offset + b.numel()].copy_(b)
            chunks.append(buf)
        pending, fill = [], 0

    for t in tensors:
        b = t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        if b.numel() >= _CHUNK // 2:
            close()
            layout.append([len(chunks), 0, b.numel()])
            chunks.append(b)  # alone, without a copy (the codec already made it a compact CPU tensor)
            continue
        if fill + b.numel() > _CHUNK:
            close()
        layout.append([len(chunks), fill, b.numel()])
        pending.append((fill, b))
        fill = _padded(fill + b.numel())
    close()
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    header = {"format": MAGIC, "version": VERSION, "step": step, "payload": plain, "tensors": specs, "layout": layout,
              "chunks": [c.numel() for c in chunks]}  # fmt: skip
    raw = json.dumps(header, separators=(",", ":")).encode()
    # Cloned: a storage of torch's own, not a Python object that a backend thread might free (_header.build).
    return Packed(torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone(), chunks)


def header_of(raw: torch.Tensor, where: str = "fddp.ft: a peer's live state") -> dict:
    """The header sent as ``raw`` (a uint8 tensor), checked for its format marker and version.

    Parsed as JSON only: whatever the bytes are (a pickle, say), nothing of them runs.

    Raises:
        fddp.checkpoint.CheckpointError: naming ``where``: not JSON, not fddp's live state, or another version.
    """
    try:
        # The bytes through a memoryview: bytes(storage) would copy them one Python int at a time.
        header = json.loads(bytes(_codec.tensor_bytes(raw.reshape(-1).to(torch.uint8))).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _codec.CheckpointError(f"{where}: a live-state header that is not JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(header, dict) or header.get("format") != MAGIC:
        raise _codec.CheckpointError(f"{where}: the peer sent something that is not fddp live state (no format marker)")
    if header.get("version") != VERSION:
        raise _codec.CheckpointError(f"{where}: the peer sends live-state version {header.get('version')!r}; this fddp reads {VERSION}")
    return header


def chunks_for(header: dict, where: str = "fddp.ft: a peer's live state") -> list[torch.Tensor]:
    """Empty chunks of the sizes ``header`` announces, to receive into."""
    sizes = header.get("chunks")
    if not isinstance(sizes, list) or not all(type(n) is int and n >= 0 for n in sizes):
        raise _codec.CheckpointError(f"{where}: a live-state header without valid chunk sizes")
    return [torch.empty(n, dtype=torch.uint8) for n in sizes]


def _count(x: Any) -> bool:
    return type(x) is int and x >= 0


def unpack(header: dict, chunks: list[torch.Tensor], like: Any, where: str) -> tuple[Any, int]:
    """Rebuild the tree a peer packed; return it and the step it was sent at.

    Every tensor is checked against its CRC-32 and the tree against ``like`` (structure, shapes
    and dtypes; leaves land on ``like``'s devices) by the codec's ``decode``.

    Raises:
        fddp.checkpoint.CheckpointError: a damaged or foreign header, a tensor that fails its
            CRC-32, or a tree that does not match ``like``, naming the leaf.
    """
    specs, layout, step = header.get("tensors"), header.get("layout"), header.get("step")
    if not isinstance(specs, list) or not isinstance(layout, list) or len(specs) != len(layout):
        raise _codec.CheckpointError(f"{where}: a live-state header without a layout for every tensor")
    if type(step) is not int:
        raise _codec.CheckpointError(f"{where}: a live-state header without a step")
    tensors = []
    for spec, place in zip(specs, layout):
        ok = isinstance(spec, list) and len(spec) == 2 and isinstance(place, list) and len(place) == 3
        dtype, shape = spec if ok else (None, None)
        d = _DTYPES.get(dtype) if isinstance(dtype, str) else None
        ok = ok and d is not None and isinstance(shape, list) and all(_count(n) for n in shape) and all(_count(n) for n in place)
        if not ok:
            raise _codec.CheckpointError(f"{where}: a live-state header with a bad tensor entry ({str(spec)[:80]}, {str(place)[:80]})")
        chunk, offset, nbytes = place
        if not (chunk < len(chunks)) or offset + nbytes > chunks[chunk].numel() or offset % d.itemsize:
            raise _codec.CheckpointError(f"{where}: a live-state header with a tensor outside its chunk ({dtype}, {shape})")
        n = math.prod(shape)
        if n * d.itemsize != nbytes:
            raise _codec.CheckpointError(f"{where}: a tensor of shape {shape} and dtype {dtype} cannot hold {nbytes} bytes")
        raw = chunks[chunk][offset : offset + nbytes]
        tensors.append(raw.view(d).reshape(shape) if n else torch.empty(shape, dtype=d))
    try:
        payload = _value(header.get("payload"), tensors)
    except (ValueError, TypeError, IndexError, KeyError, OverflowError, RecursionError) as e:
        raise _codec.CheckpointError(f"{where}: a damaged live-state payload ({type(e).__name__}: {str(e)[:200]})") from None
    return _codec.decode(payload, like, where), step
