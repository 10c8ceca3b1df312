"""A leaf of which this rank holds flat ranges, described to torch.distributed.checkpoint as boxes.

A shard of :mod:`fddp.zero` holds, of each leaf it touches, one range of the leaf's elements in
flatten order, at an arbitrary offset. DCP describes the pieces of a tensor as boxes (an offset
and a size per dimension), so a flat range of a ``(R, C)`` leaf becomes up to three boxes: the end
of one row, whole rows, the start of another. Each box is a contiguous run of the range, so each
is a view of the shard, reshaped. Stored in the leaf's own shape, the checkpoint reads back into
any layout: fddp's shards on any number of ranks, a module's full tensors
(``torch.distributed.checkpoint.state_dict.get_model_state_dict``), FSDP2's row chunks.

DTensor cannot describe such pieces (its ``Shard(0)`` is a ``torch.chunk`` range), so
:class:`Pieces` implements DCP's checkpointable protocol itself (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``, as torch's own ``LocalShardsWrapper`` does).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

__all__ = ["Pieces", "boxes"]

try:  # DCP's planner types (torch >= 2.4 has them; the protocol hooks are duck-typed)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
except ImportError:  # pragma: no cover - builds without torch.distributed
    pass

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, start in the flat range


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[Box]:
    """The boxes that elements ``start:stop`` (flatten order) of a tensor of ``shape`` make up.

    Each box is ``(offsets, sizes, first)``: its corner, its extent, and the flat index of its
    first element; its elements are ``first : first + prod(sizes)``, in order. At most
    ``2 * len(shape) - 1`` boxes, in flatten order.

    Example:
        >>> list(boxes((3, 4), 2, 11))  # the end of row 0, row 1, the start of row 2
        [((0, 2), (1, 2), 2), ((1, 0), (1, 4), 4), ((2, 0), (1, 3), 8)]
    """
    if start >= stop:
        return
    if not shape:  # a 0-d tensor: one element
        yield ((), (), 0)
        return
    if len(shape) == 1:
        yield ((start,), (stop - start,), start)
        return
    inner = _numel(shape[1:])
    row, last = divmod(start, inner)[0], stop // inner
    if start % inner:  # the end of a first, partial row
        end = min(stop, (row + 1) * inner)
        for off, size, first in boxes(shape[1:], start - row * inner, end - row * inner):
            yield ((row, *off), (1, *size), first + row * inner)
        start, row = end, row + 1
    if start >= stop:
        return
    if last > row:  # whole rows
        yield ((row,) + (0,) * (len(shape) - 1), (last - row, *shape[1:]), start)
        start = last * inner
    if start < stop:  # the start of a last, partial row
        for off, size, first in boxes(shape[1:], 0, stop - start):
            yield ((last, *off), (1, *size), first + start)


class Pieces(torch.Tensor):
    """A tensor of ``shape`` of which this rank holds some flat ranges; for DCP only.

    ``pieces`` are ``(start, flat)`` pairs: ``flat`` (1-D) holds elements ``start : start +
    flat.numel()`` of the leaf in flatten order, and is written from (when saving) or read into
    (when loading) through the views of its boxes.
    """

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], pieces: list[tuple[int, torch.Tensor]], dtype: torch.dtype, device: torch.device) -> "Pieces":
        r = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)
        r._boxes = {}
        for a, flat in pieces:
            for off, size, first in boxes(tuple(shape), int(a), int(a) + flat.numel()):
                r._boxes[off] = flat[first - a : first - a + _numel(size)].view(size)
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:  # DCP may detach what it is given
            return args[0]
        raise NotImplementedError(f"fddp's checkpoint pieces support no tensor operations (got {func})")

    def __create_write_items__(self, fqn: str, obj: Any) -> list:
        views = list(self._boxes.items())
        props = TensorProperties.create_from_tensor(views[0][1]) if views else TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape),
                    properties=props,
                    size=self.size(),
                ),
            )
            for off, view in views
        ]

    def __create_chunk_list__(self) -> list:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=view.shape) for off, view in self._boxes.items()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        view = self._boxes.get(tuple(index.offset) if index.offset is not None else None)
        if view is None:
            raise ValueError(f"fddp checkpoint: no piece of {index.fqn} at offset {index.offset}")
        return view
