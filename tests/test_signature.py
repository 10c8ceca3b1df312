"""The cross-rank signature check: options that shape the collectives, structure differences named
readably, and state that lives and dies with its process group."""

from __future__ import annotations

import os

import torch
import torch.distributed as tdist

import fddp
from dist import run


def _catch(call) -> str | None:
    try:
        call()
    except fddp.MismatchError as e:
        return str(e)
    return None


def _cap_worker() -> str | None:
    p = {"w": torch.zeros(1000)}
    # Before the signature carried the caps, gloo aborted the process: "Received data size doesn't
    # match expected size".
    return _catch(lambda: fddp.ddp_step(p, p, bucket_cap_mb=25 if fddp.rank() == 0 else 0.5, first_bucket_mb=0.001))


def test_per_rank_bucket_caps_raise_mismatch_on_every_rank_naming_the_option():
    for msg in run(_cap_worker, 2):
        assert msg is not None and "Option bucket_cap_mb: rank 0 has 25.0, rank 1 has 0.5" in msg, msg


def _reordered_worker() -> str | None:
    a, b = torch.zeros(3), torch.zeros(2)
    tree = {"a": a, "b": b} if fddp.rank() == 0 else {"b": b, "a": a}
    return _catch(lambda: fddp.ddp_step(tree, tree))


def test_a_dict_in_another_order_names_both_key_orders_and_the_fix():
    for msg in run(_reordered_worker, 2):
        assert msg is not None and "At '<root>': rank 0 has dict with keys ['a', 'b'], rank 1 has dict with keys ['b', 'a']" in msg, msg
        assert "the same keys in another order; build the dicts in the same key order on every rank" in msg, msg


def _big_tree_worker() -> str | None:
    _, params = fddp.functionalize(torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32), 8, enable_nested_tensor=False))
    if fddp.rank() == 1:
        params = {("layers.3.extra" if k == "layers.3.linear1.bias" else k): v for k, v in params.items()}
    return _catch(lambda: fddp.broadcast(params))


def test_a_structure_difference_names_the_first_key_not_a_spec_dump():
    for msg in run(_big_tree_worker, 2):
        assert msg is not None and len(msg) < 600, msg
        assert "'layers.3.linear1.bias'" in msg and "'layers.3.extra'" in msg and "... and" in msg, msg


def _new_group_worker(port: int) -> tuple:
    rank, world = fddp.rank(), fddp.world_size()
    tree = {"w": torch.zeros(3)}
    fddp.ddp_step(tree, tree)  # checked and remembered on the first group
    tdist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    fddp.init(timeout=30)  # a new default group; the harness keeps using it afterwards
    mine = tree if rank == 0 else {"w": torch.zeros(4)}  # rank 0 reuses the tree it checked before
    msg = _catch(lambda: fddp.ddp_step(mine, mine))
    return msg, fddp.ddp_step(tree, tree)["w"]  # and the new group works


def test_a_new_group_checks_trees_again():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for msg, after in run(_new_group_worker, 2, port):
        assert msg is not None and "shape=(3,)" in msg and "shape=(4,)" in msg, msg
        assert torch.equal(after, torch.zeros(3))
