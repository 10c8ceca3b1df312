"""Muon on ``fddp.zero``'s shards: each matrix orthogonalised whole by one rank, its owner.

A shard is a slice of a flat bucket, so a matrix may lie across ranks. Newton-Schulz needs the
whole matrix, so every matrix gets one owner, dealt by size (largest first, to the least loaded
rank; ties to the lower index and rank: the same deal on every rank, from the layout alone).
One step:

1. the momentum lines run on this rank's slices (elementwise: the replicated step's numbers);
2. one all-to-all sends each rank's pieces of every matrix to its owner, in the dtype
   Newton-Schulz runs in (its first operation is that cast, elementwise, so casting before
   sending changes nothing and halves the bytes of bfloat16);
3. each owner orthogonalises its matrices, whole, as the replicated step does;
4. one all-to-all sends every rank its pieces of the results back (the same splits, reversed);
5. each rank applies the step to its slices.

What any rank holds of any leaf is read from the layout (``Split.held``: the cut every rank makes
alike), so nothing is asked of the peers but the agreement, which every step makes before its
all-to-alls (a rank with other matrices, options or owners raises ``MismatchError`` on every rank
instead of sending pieces its peers do not expect).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch
import torch.distributed as dist
from torch import Tensor

from fddp import _caches, _dist
from fddp._layout import Split, SplitTree
from fddp._tree import paths

from . import _checks as checks
from . import _flat as flat
from ._base import Applied, Apply
from ._checks import Params
from ._newton_schulz import MuonConfig, MuonState, check_matrices, decayed, decays, lr_now, momentum_step, orthogonalize, step_by
from ._slices import members_of

__all__ = ["Plan", "owners", "plan", "step"]


class Plan(NamedTuple):
    """One rank's part of the exchange, for one split tree and group of matrices.

    Attributes:
        owners: each matrix's owner (by position in ``members``).
        owned: the positions of the matrices this rank owns, in order.
        send: this rank's pieces, in the order they are sent: ``(tensor, at, length, position)``;
            the results come back in the same order.
        send_splits: elements sent to each rank (received back from each, after).
        recv: what arrives, in order: ``(position, lo, hi)``, elements ``[lo, hi)`` of an owned
            matrix (flattened); the results go back in the same order.
        recv_splits: elements received from each rank (sent back to each, after).
    """

    owners: tuple[int, ...]
    owned: tuple[int, ...]
    send: tuple[tuple[int, int, int, int], ...]
    send_splits: tuple[int, ...]
    recv: tuple[tuple[int, int, int], ...]
    recv_splits: tuple[int, ...]

    def moved(self, rank: int) -> tuple[int, int]:
        """Elements this rank sends to and receives from other ranks in one all-to-all."""
        return sum(self.send_splits) - self.send_splits[rank], sum(self.recv_splits) - self.recv_splits[rank]


def owners(numels: list[int], world: int) -> tuple[int, ...]:
    """Deal matrices of these sizes to ``world`` ranks: largest first, each to the least loaded
    rank (ties: the lower index, the lower rank), so that every rank deals alike.

    Example:
        >>> owners([100, 100, 50, 50, 10], 2)
        (0, 1, 0, 1, 0)
    """
    load = [0] * world
    out = [0] * len(numels)
    for j in sorted(range(len(numels)), key=lambda j: (-numels[j], j)):
        r = min(range(world), key=lambda r: (load[r], r))
        out[j] = r
        load[r] += numels[j]
    return tuple(out)


@_caches.cached(maxsize=64)
def plan(split: Split, members: tuple[int, ...]) -> Plan:
    """This rank's exchange for the matrices ``members`` (whole-leaf indices) of ``split``."""
    world, me = split.world, split.rank
    numels = [math.prod(split.leaves[i].shape) for i in members]
    own = owners(numels, world)
    mine: dict[int, list[tuple[int, int, int, int]]] = {}  # leaf -> (start, stop, tensor, at)
    for k, pieces in enumerate(split.pieces):
        for p in pieces:
            mine.setdefault(p.leaf, []).append((p.start, p.stop, k, p.at))
    send, send_splits = [], []
    for d in range(world):
        n = 0
        for j, leaf in enumerate(members):
            if own[j] != d:
                continue
            pieces = sorted(mine.get(leaf, ()))
            lo, hi = split.held(leaf, me)
            if sum(b - a for a, b, _, _ in pieces) != hi - lo or (pieces and (pieces[0][0], pieces[-1][1]) != (lo, hi)):
                raise RuntimeError(
                    f"fddp.optim.muon: this rank's pieces of leaf {leaf} are {[(a, b) for a, b, _, _ in pieces]}, but the "
                    f"layout's cut gives it [{lo}, {hi}); these shards were not cut by fddp.zero's layout"
                )
            for a, b, k, at in pieces:
                send.append((k, at, b - a, j))
                n += b - a
        send_splits.append(n)
    owned = tuple(j for j in range(len(members)) if own[j] == me)
    recv, recv_splits = [], []
    for s in range(world):
        n = 0
        for j in owned:
            lo, hi = split.held(members[j], s)
            if hi > lo:
                recv.append((j, lo, hi))
                n += hi - lo
        recv_splits.append(n)
    return Plan(own, owned, tuple(send), tuple(send_splits), tuple(recv), tuple(recv_splits))


def _group(cfg: MuonConfig, grads: Any, *_: Any, **__: Any) -> Any:
    return grads.split.group


@_dist.entry("optim.muon", _group)
def step(
    cfg: MuonConfig, grads: SplitTree, state: MuonState, params: Params | None, request: Apply | None
) -> tuple[Any, MuonState]:
    """Muon's step on this rank's shards (a collective: every rank of the shards' group calls it).

    With ``request`` (``apply_gradients``), ``(Applied(new params), state)``; without, the updates
    ``new - p`` (``-lr * adjust * O`` where no parameters are given, for ``weight_decay=0``).
    """
    where = cfg.where
    grads.check_group(where)
    checks.check_state(state, MuonState, where, grads=grads, params=params)
    ms, treedef = checks.flatten(state.momentum_buffer)
    gs, _ = checks.check_grads(grads, treedef, where)
    ps = None
    if request is not None or cfg.weight_decay or params is not None:
        ps = checks.params_leaves(params, treedef, where, "weight_decay != 0")
        checks.check_dtypes(gs, ps, treedef, where, "params")
    split = grads.split
    members = members_of(grads)
    if not split.places or not split.leaves:
        raise TypeError(
            f"{where}: Muon on shards needs to know where every rank's cut falls in each matrix, and these shards "
            "do not record it; make them with fddp.zero.shard, fddp.zero.ReduceScatter or fddp.zero.fully_shard"
        )
    names = paths(split.spec)
    check_matrices([split.leaves[i].shape for i in members], lambda: [names[i] for i in members], where)
    dtypes = {split.leaves[i].dtype for i in members}
    if len(dtypes) > 1:
        raise TypeError(f"{where}: on shards Muon's matrices must share one dtype (one exchange), got {sorted(map(str, dtypes))}")
    pl = plan(split, members)
    group, world = split.group, split.world
    lr = lr_now(cfg, state.count)
    why = request.why if request is not None else None
    flat.note(why, f"muon on shards: {len(pl.owned)} of {len(members)} matrices orthogonalised here, out of place")

    new_ms, us = [], []
    for g, m in zip(gs, ms):
        m, u = momentum_step(cfg, g, m)
        new_ms.append(m)
        us.append(u)
    dtype = cfg.ns_dtype or next(iter(dtypes), torch.float32)
    device = gs[0].device if gs else torch.device("cpu")
    wire = _dist.data_device(group, like=device) if world > 1 else device
    if world > 1:
        _dist.count_call(group, "optim.muon")
        rows = lambda: _rows(cfg, split, members, names, pl)  # noqa: E731 - built only for a new signature
        _dist.agree(group, "optim.muon", rows, key=("optim.muon", cfg, split, members), defer=True)
    send = _cat([us[k][at : at + n] for k, at, n, _ in pl.send], dtype, wire)
    recv = _exchange(send, pl.recv_splits, pl.send_splits, group, world, "the pieces of the matrices to their owners")

    # The owners' Newton-Schulz, on whole matrices laid out as the replicated step's.
    whole = {j: torch.empty(math.prod(split.leaves[members[j]].shape), dtype=dtype, device=device) for j in pl.owned}
    at = 0
    for j, lo, hi in pl.recv:
        whole[j][lo:hi].copy_(recv[at : at + hi - lo])
        at += hi - lo
    done = {}
    for j in pl.owned:
        x = whole[j].view(split.leaves[members[j]].shape)
        done[j] = orthogonalize(x, cfg.coefficients, cfg.steps, cfg.eps, None).reshape(-1)
    back = _exchange(_cat([done[j][lo:hi] for j, lo, hi in pl.recv], dtype, wire), pl.send_splits, pl.recv_splits, group, world,
                     "the orthogonalised matrices back to their shards")  # fmt: skip

    # This rank's slices: torch's two lines, the step's size per matrix.
    decay = decays(cfg, lr)
    steps = [lr * cfg.ratio(tuple(split.leaves[i].shape)) for i in members]
    if ps is None:
        new = [torch.zeros_like(g) for g in gs]
    else:
        new = [decayed(p, decay) for p in ps]
    at = 0
    for k, a, n, j in pl.send:
        step_by(new[k][a : a + n], back[at : at + n].to(device), steps[j])
        at += n
    state = MuonState(state.count + 1, optree.tree_unflatten(treedef, new_ms))
    if request is not None:
        return Applied(optree.tree_unflatten(treedef, new)), state
    if ps is not None:
        new = [torch.sub(q, p) for q, p in zip(new, ps)]
    return optree.tree_unflatten(treedef, new), state


def _cat(pieces: list[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
    if not pieces:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat(pieces).to(device=device, dtype=dtype)


def _exchange(send: Tensor, recv_splits: tuple[int, ...], send_splits: tuple[int, ...], group: Any, world: int, what: str) -> Tensor:
    """One all-to-all of ``send`` (cut by ``send_splits``) into a new tensor cut by ``recv_splits``."""
    if world == 1:
        return send
    recv = torch.empty(sum(recv_splits), dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, list(recv_splits), list(send_splits), group=group, async_op=True)
    _dist.wait(work, group, "optim.muon", what, host=send.is_cpu)
    return recv


def _rows(cfg: MuonConfig, split: Split, members: tuple[int, ...], names: list[str], pl: Plan) -> list[tuple]:
    """What the ranks must share: the matrices, the options and the owners (not the rank, nor its pieces)."""
    lr = "a schedule" if callable(cfg.lr) else repr(cfg.lr)
    options = (
        f"lr={lr} momentum={cfg.momentum} weight_decay={cfg.weight_decay} nesterov={cfg.nesterov} "
        f"coefficients={cfg.coefficients} steps={cfg.steps} eps={cfg.eps} adjust={cfg.adjust} ns_dtype={cfg.ns_dtype}"
    )
    rows: list[tuple] = [("muon options", options, None), ("muon world", str(split.world), None)]
    for j, i in enumerate(members):
        rows.append((f"muon matrix {names[i]}", f"{tuple(split.leaves[i].shape)} {split.leaves[i].dtype} owner {pl.owners[j]}", None))
    return rows
