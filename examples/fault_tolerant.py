"""Train a digit classifier across replica groups that may die and come back (fddp.ft on torchft).

    torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --heartbeat_timeout_ms 1000 --join_timeout_ms 5000 &
    export TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510
    REPLICA_GROUP_ID=0 torchrun --nproc-per-node=1 --master-port=29600 --max-restarts=3 examples/fault_tolerant.py &
    REPLICA_GROUP_ID=1 torchrun --nproc-per-node=1 --master-port=29601 --max-restarts=3 examples/fault_tolerant.py &

One ``torchrun`` per replica group. Each group draws its own mini-batches of scikit-learn's digits
and takes part in every step of the job's quorum: the gradients are averaged over the groups in the
quorum, weighted by their batch sizes, and every group applies the same AdamW step (``--diloco H``:
each group trains alone and the groups meet every ``H`` steps instead). Kill a group's worker
(``kill -9``): the others lose at most the step it died in and go on; torchrun starts it again
(``--max-restarts``), and it receives the live state from a peer at the others' next step. Group 0
prints one line every ``--log-every`` committed steps, and one per change of membership.
"""

from __future__ import annotations

import argparse
import os
import time
import zlib

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import fddp
import fddp.ft


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Fault-tolerant data parallelism on the digits, with fddp.ft.")
    p.add_argument("--steps", type=int, default=2000, help="committed steps (or, with --diloco, inner steps) to train")
    p.add_argument("--diloco", type=int, default=0, metavar="H", help="DiLoCo: meet every H inner steps (0: every step)")
    p.add_argument("--batch-size", type=int, default=32, help="per replica group")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-replicas", type=int, default=1, help="the fewest groups a step may commit with")
    p.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per step (to watch a short run)")
    p.add_argument("--log-every", type=int, default=100)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    fddp.init()  # this replica group's ranks (torchrun's store is the group's own)
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    x_train, x_test = torch.tensor(x_train, dtype=torch.float32), torch.tensor(x_test, dtype=torch.float32)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
    torch.manual_seed(0)
    apply_fn, params = fddp.functionalize(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)))
    loss_fn = lambda p, x, y: F.cross_entropy(apply_fn(p, x), y)  # noqa: E731
    opt = fddp.optim.adamw(args.lr)

    replicas = fddp.ft.Replicas(min_replicas=args.min_replicas)  # $TORCHFT_LIGHTHOUSE, $REPLICA_GROUP_ID
    me = replicas.replica_id
    # Each group draws its own batches; a restarted group draws new ones (the lost ones are gone).
    gen = torch.Generator().manual_seed(zlib.crc32(f"{me}/{os.getpid()}".encode()))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.randint(0, len(x_train), (args.batch_size,), generator=gen)
        return x_train[i], y_train[i]

    def report(what: str) -> None:
        if fddp.is_main():
            acc = (apply_fn(params, x_test).argmax(1) == y_test).float().mean().item()
            print(f"[{me}] step {replicas.committed_steps:5d}  groups {replicas.size} {list(replicas.members)}  "
                  f"test accuracy {acc:.3f}  {what}", flush=True)  # fmt: skip

    if args.diloco:
        outer = fddp.ft.FaultTolerantOuter(replicas, fddp.diloco.diloco(args.diloco, group=replicas.group))
        params, ostate, inner_state = outer.start(params, inner_state=opt.init(params), config={"inner": opt})  # a late group: a peer's
        grad = torch.func.grad(loss_fn)
        report("joined")
        while int(ostate.count) < args.steps:
            xb, yb = batch()
            params, inner_state = fddp.optim.apply_gradients(opt, grad(params, xb, yb), inner_state, params)
            before, size = replicas.committed_steps, replicas.size
            params, ostate, inner_state = outer.step(params, ostate, weight=len(xb), inner_state=inner_state)  # a quorum every H steps
            if replicas.committed_steps > before and (replicas.size != size or replicas.committed_steps % args.log_every == 0):
                report("synchronised")
            time.sleep(args.pace)
    else:
        # Weighted by each group's batch: the mean over the quorum's samples, however many groups are in it.
        synced = fddp.grad_and_value(loss_fn, group=replicas.group)

        def train_step(state, xb, yb):
            grads, loss = synced(state["params"], xb, yb, weight=len(xb))
            p, o = fddp.optim.apply_gradients(opt, grads, state["opt"], state["params"])
            return {"params": p, "opt": o}, loss

        state = replicas.start({"params": params, "opt": opt.init(params)}, config={"opt": opt})  # a late group gets a peer's state
        params = state["params"]
        report("joined")
        while replicas.committed_steps < args.steps:
            size = replicas.size
            state, loss, info = replicas.step(train_step, state, *batch(), return_info=True)
            params = state["params"]
            if not info.committed:
                report(f"step not committed ({type(info.error).__name__}): a group failed; retrying without it")
            elif info.size != size or replicas.committed_steps % args.log_every == 0:
                report(f"loss {float(loss):.4f}")
            time.sleep(args.pace)
    report("done")
    replicas.close()
    fddp.shutdown()
    os._exit(0)  # the quorum taken for a next step that will not come must not hold the exit


if __name__ == "__main__":
    main()
