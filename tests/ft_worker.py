"""One rank of one replica group of a fault-tolerant run, for tests/test_ft.py and benchmarks/ft.py.

``python tests/ft_worker.py --lighthouse ADDR --replica N --out DIR --steps S [--mode replicated|diloco]``

Trains a small float64 MLP on batches that depend only on (replica, rank, key), so a reference can
replay the run from the logs: every attempted step (replicated) or inner step and synchronisation
(DiLoCo) appends one JSON line to ``DIR/log-<replica>-<incarnation>[-<rank>].jsonl``; at the end the
state goes to ``DIR/final-<replica>-<incarnation>[-<rank>].pt`` (fddp.checkpoint). The run starts
as soon as the process is up (no waiting for the other groups), as a user's would.

``--die-at K --phase P`` SIGKILLs this process in phase ``P`` of its K-th attempt (replicated: its
K-th step; DiLoCo: its K-th synchronisation): ``forward`` (inside the loss, before any collective),
``allreduce`` (after its first bucket was sent), ``vote`` (entering the vote), ``heal`` (while it
receives a peer's state: K counts the transfers), ``sync`` (DiLoCo's all-reduce, = ``allreduce``),
``save`` (inside a checkpoint save, before the rename). ``--ranks R --rank I --store-port P``: a
replica group of R ranks (rank 0 hosts the group's store at P); the gradient is averaged inside
the group first, then across the groups. ``--no-numpy`` blocks numpy once fddp is imported (the
live-state transfer must not need it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import socket
import sys
import threading
import time

import optree
import torch
import torch.distributed as dist

import fddp
import fddp.ft
from fddp.ft._identity import state_checksum
from fddp.sync import hooks

DIM, HIDDEN = 8, 16


def batch(replica: int, key: int, n: int, dim: int = DIM, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s (rank ``rank``'s) batch number ``key``: the same wherever it is drawn."""
    g = torch.Generator().manual_seed(1_000_003 * replica + 7_919 * rank + key)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    y = (x[:, :1] * 0.5 - x[:, 1:2] * 0.25 + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)).tanh()
    return x, y


def init_params(seed: int, dim: int = DIM, hidden: int = HIDDEN, dtype: torch.dtype = torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": (torch.randn(hidden, dim, generator=g, dtype=torch.float64) / dim**0.5).to(dtype),
        "b1": torch.zeros(hidden, dtype=dtype),
        "w2": (torch.randn(1, hidden, generator=g, dtype=torch.float64) / hidden**0.5).to(dtype),
        "b2": torch.zeros(1, dtype=dtype),
    }


def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if os.environ.get("FT_DIE") == "forward":
        os.kill(os.getpid(), signal.SIGKILL)
    h = torch.tanh(x @ p["w1"].T + p["b1"])
    return ((h @ p["w2"].T + p["b2"] - y) ** 2).mean()


def batch_size(replica: int, rank: int = 0) -> int:
    return 6 + 2 * replica + rank  # groups (and ranks) contribute different sample counts: the mean is weighted


@dataclasses.dataclass(frozen=True)
class DieInAllReduce(hooks.WeightedMean):
    """The weighted mean; on the process told to (``$FT_DIE``), SIGKILL once the first bucket is on its way."""

    def launch(self, state, bucket):
        pending, state = super().launch(state, bucket)
        if bucket.index == 0 and os.environ.get("FT_DIE") in ("allreduce", "sync"):
            time.sleep(0.05)  # the bucket is on the wire; the peer is waiting for the next ones
            os.kill(os.getpid(), signal.SIGKILL)
        return pending, state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def block_numpy() -> None:
    sys.modules["numpy"] = None  # type: ignore[assignment]

    def no_numpy(self, *a, **k):
        raise ModuleNotFoundError("No module named 'numpy' (blocked by the test)")

    torch.Tensor.numpy = no_numpy  # type: ignore[method-assign]


def arm_phases(a: argparse.Namespace, replicas: fddp.ft.Replicas) -> None:
    """Wrap the vote, the state transfer and the checkpoint write so that $FT_DIE kills in them."""
    vote = replicas._vote

    def vote_then_die():
        if os.environ.get("FT_DIE") == "vote":
            os.kill(os.getpid(), signal.SIGKILL)
        return vote()

    replicas._vote = vote_then_die
    transport = replicas._transport
    recv = transport.recv_checkpoint
    received = [0]

    def recv_checkpoint(*args, **kwargs):
        received[0] += 1
        if a.phase == "heal" and received[0] == a.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return recv(*args, **kwargs)

    transport.recv_checkpoint = recv_checkpoint
    from fddp.checkpoint import _codec

    write = _codec.write

    def write_then_die(f, payload):
        write(f, payload)
        if os.environ.get("FT_DIE") == "save":
            os.kill(os.getpid(), signal.SIGKILL)  # written, not yet renamed over the checkpoint

    _codec.write = write_then_die


def fail_configure(quorum_id: int) -> None:
    """Make gloo's rendezvous for ``quorum_id`` fail, as one that timed out on a loaded machine
    (inside torchft's reconfiguration, where a real one fails)."""
    from torchft.process_group import ProcessGroupGloo

    configure = ProcessGroupGloo.configure

    def failing(self, store_addr, replica_id, rank, world_size, qid=None, *args, **kwargs):
        if qid == quorum_id:
            raise TimeoutError(f"gloo rendezvous for quorum {qid} timed out (injected by the test)")
        return configure(self, store_addr, replica_id, rank, world_size, qid, *args, **kwargs)

    ProcessGroupGloo.configure = failing


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10, help="committed steps (replicated) or synchronisations (diloco) to reach")
    ap.add_argument("--mode", choices=["replicated", "zero2", "diloco"], default="replicated")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--delay", type=int, default=0)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--phase", default="allreduce", choices=["forward", "allreduce", "vote", "heal", "sync", "save"])
    ap.add_argument("--no-numpy", action="store_true")
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--quorum-every", type=int, default=1)
    ap.add_argument("--warn-alone-after", type=float, default=-1.0, help="seconds (<0: the default)")
    ap.add_argument("--on-divergence", default="heal")
    ap.add_argument("--bucket-kb", type=float, default=0.25)
    ap.add_argument("--dim", type=int, default=DIM)
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=0, help="fixed batch size (0: 6 + 2 * replica + rank)")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per step (a slower step)")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--quorum-timeout", type=float, default=30.0)
    ap.add_argument("--fail-configure", type=int, default=0, help="configuring for this quorum id fails (a gloo rendezvous timed out)")
    ap.add_argument("--save-every", type=int, default=0, help="checkpoint the state every this many steps")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--store-port", type=int, default=0)
    ap.add_argument("--wait", default="", help="wait for this file before starting (a process started early, as a restart)")
    ap.add_argument("--pause", action="append", default=[], help="STEP:FILE: before that step, wait for FILE")
    ap.add_argument("--want", type=int, default=0, help="also run until the last --after steps had this many groups")
    ap.add_argument("--after", type=int, default=3)
    ap.add_argument("--until", default="", help="also run until this file exists (and, if it holds a step, until that step)")
    a = ap.parse_args()
    if a.no_numpy:
        block_numpy()
    torch.set_num_threads(1)
    while a.wait and not os.path.exists(a.wait):
        time.sleep(0.01)
    port = a.store_port or free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=a.rank, world_size=a.ranks,
                            timeout=datetime.timedelta(seconds=a.timeout))  # fmt: skip
    t_up = time.time()
    alone = [dist.new_group([r]) for r in range(a.ranks)] if a.ranks > 1 else [None]  # each rank writes its own final file
    a.own_group = alone[a.rank]
    extra = {} if a.warn_alone_after < 0 else {"warn_alone_after": a.warn_alone_after}
    replicas = fddp.ft.Replicas(
        lighthouse=a.lighthouse, replica_id=f"replica_{a.replica}", store=("127.0.0.1", port), min_replicas=a.min_replicas,
        timeout=a.timeout, quorum_timeout=a.quorum_timeout, connect_timeout=5.0, hostname="127.0.0.1", max_retries=5,
        quorum_every=a.quorum_every, on_divergence=a.on_divergence, **extra,
    )  # fmt: skip
    arm_phases(a, replicas)
    if a.fail_configure:
        fail_configure(a.fail_configure)
    dtype = getattr(torch, a.dtype)
    params = init_params(100 * a.incarnation + a.replica + 1, a.dim, a.hidden, dtype)  # every incarnation starts elsewhere
    suffix = f"-{a.rank}" if a.rank else ""
    log = open(os.path.join(a.out, f"log-{a.replica}-{a.incarnation}{suffix}.jsonl"), "a", buffering=1)

    def emit(**rec):
        log.write(json.dumps({"t": time.time(), **rec}) + "\n")

    emit(event="up", t_up=t_up)
    sizes: list[int] = []

    def more() -> bool:
        if a.until:
            if not os.path.exists(a.until):
                return True
            target = open(a.until).read().strip()
            if target:  # the step to stop at, the same for every group
                return replicas.committed_steps < int(target)
        return replicas.committed_steps < a.steps or (a.want > 0 and sizes[-a.after :].count(a.want) < a.after)

    def pause_at(s: int) -> None:
        for p in a.pause:
            at, _, f = p.partition(":")
            if s == int(at) and not os.path.exists(f):
                emit(event="paused", step=s)
                while not os.path.exists(f):
                    time.sleep(0.01)

    def save(tree) -> None:
        if a.rank == 0:
            fddp.checkpoint.save(os.path.join(a.out, f"ckpt-{a.replica}.pt"), tree, group=dist.group.WORLD)

    cap = a.bucket_kb / 1024
    n = a.batch or batch_size(a.replica, a.rank)
    try:
        if a.mode in ("replicated", "zero2"):
            replicated(a, replicas, params, dtype, n, cap, emit, sizes, more, pause_at, save)
        else:
            diloco(a, replicas, params, dtype, n, cap, emit, sizes, more, pause_at)
    except Exception as e:  # the error the test asserts on: its class and message, in the log
        emit(event="error", kind=type(e).__name__, error=str(e)[:3000])
        log.close()
        replicas.close()
        os._exit(3)
    stores = sum(t.name == "fddp-ft-store" for t in threading.enumerate())  # the epoch's only: older ones are closed
    emit(event="done", step=replicas.committed_steps, stores=stores)
    log.close()
    replicas.close()
    os._exit(0)  # a quorum taken for a step that will not come must not hold the exit


def replicated(a, replicas, params, dtype, n, cap, emit, sizes, more, pause_at, save) -> None:
    opt = fddp.optim.sgd(a.lr, momentum=0.5)
    hook = DieInAllReduce()
    several = a.ranks > 1
    if several:  # inside the group, then across the groups: the weights compose (the global sample-weighted mean)
        local = torch.func.grad(loss_fn)

        def grads_of(p, x, y):
            g, info = fddp.ddp_step(p, local(p, x, y), weight=len(x), return_info=True, bucket_cap_mb=cap, first_bucket_mb=cap)
            g = fddp.ddp_step(p, g, group=replicas.group, weight=info.weight, bucket_cap_mb=cap, first_bucket_mb=cap,
                              compression=hook)  # fmt: skip
            return g, None
    else:
        gv = fddp.grad_and_value(loss_fn, group=replicas.group, bucket_cap_mb=cap, first_bucket_mb=cap, compression=hook)

        def grads_of(p, x, y):
            return gv(p, x, y, weight=len(x))

    def train_step(state, x, y):
        grads, loss = grads_of(state["params"], x, y)
        params, opt_state = fddp.optim.apply_gradients(opt, grads, state["opt"], state["params"])
        if a.pace:
            time.sleep(a.pace)
        return {"params": params, "opt": opt_state}, loss

    if a.mode == "zero2":
        # ZeRO-2 inside the replica group (its own ranks), fault tolerance across the groups: rank i
        # of every group holds the same slices, so the slices' gradients average across the groups
        # as any tree does, and a joining rank takes its peer rank's slices and optimizer state.
        reduce_scatter = fddp.grad_and_value(loss_fn, bucket_cap_mb=cap, first_bucket_mb=cap, compression=fddp.zero.ReduceScatter(),
                                             return_info=True)  # fmt: skip

        def train_step(state, x, y):  # noqa: F811 - this mode's step
            shards = state["params"]
            full = fddp.zero.gather(shards).wait()
            g, loss, info = reduce_scatter(full, x, y, weight=len(x))  # this rank's slice of the group's mean
            plain = {str(k): t for k, t in enumerate(g.shards)}
            mean = fddp.ddp_step({str(k): t for k, t in enumerate(shards.shards)}, plain, group=replicas.group, weight=info.weight,
                                 bucket_cap_mb=cap, first_bucket_mb=cap, compression=hook)  # fmt: skip
            g = fddp.zero.Sharded([mean[str(k)] for k in range(len(g.shards))], g.layout)
            shards, opt_state = fddp.optim.apply_gradients(opt, g, state["opt"], shards)
            if a.pace:
                time.sleep(a.pace)
            return {"params": shards, "opt": opt_state}, loss

        params = fddp.zero.shard(params, bucket_cap_mb=cap, first_bucket_mb=cap)

    state = replicas.start({"params": params, "opt": opt.init(params)}, config={"opt": opt, "hidden": a.hidden})
    emit(event="started", step=replicas.committed_steps, members=list(replicas.members))
    attempt = 0
    while more():
        attempt += 1
        if attempt == a.die_at and a.phase != "heal":
            os.environ["FT_DIE"] = a.phase
        s = replicas.committed_steps
        pause_at(s)
        x, y = batch(a.replica, s, n, a.dim, a.rank)
        x, y = x.to(dtype), y.to(dtype)
        t0 = time.time()
        before = state_checksum(state)
        state, loss, info = replicas.step(train_step, state, x, y, return_info=True)
        sizes.append(info.size if info.committed else 0)
        error = None if info.error is None else f"{type(info.error).__name__}: {info.error}"[:300]
        # The step committed (info.step - 1), which is a later one than s when this group healed
        # inside step(); key: what its batch was drawn for.
        emit(event="step", step=info.step - 1 if info.committed else s, key=s, committed=info.committed, members=list(info.members),
             size=info.size, healed=info.healed,
             t0=t0, t1=time.time(), quorum_s=info.quorum_s, loss=None if loss is None else float(loss), before=before,
             after=state_checksum(state), error=error)  # fmt: skip
        if a.save_every and info.committed and replicas.committed_steps % a.save_every == 0:
            save(state)
    suffix = f"-{a.rank}" if a.rank else ""
    if a.mode == "zero2":  # the full parameters, as the replay has them (and the slices' optimizer state)
        state = {"params": fddp.zero.gather(state["params"]).wait(), "opt": list(optree.tree_leaves(state["opt"]))}
    fddp.checkpoint.save(os.path.join(a.out, f"final-{a.replica}-{a.incarnation}{suffix}.pt"), state, group=a.own_group)


def diloco(a, replicas, params, dtype, n, cap, emit, sizes, more, pause_at) -> None:
    inner = fddp.optim.sgd(a.lr)
    # The DiLoCo paper's outer step (not fddp's default, the mean): momentum carries state across rounds.
    nesterov = fddp.optim.sgd(0.7, momentum=0.9, nesterov=True)
    outer_step = fddp.diloco.diloco(a.every, nesterov, group=replicas.group, compression=DieInAllReduce(), bucket_cap_mb=cap,
                                    first_bucket_mb=cap, fragments=a.fragments, delay=a.delay)  # fmt: skip
    outer = fddp.ft.FaultTolerantOuter(replicas, outer_step)
    params, ostate, inner_state = outer.start(params, inner_state=inner.init(params), config={"inner": inner, "hidden": a.hidden})
    emit(event="started", step=replicas.committed_steps, members=list(replicas.members))
    if replicas.committed_steps > 1:  # joined the others' synchronisation
        sizes.append(replicas.size)
    i = 0
    syncs = 0
    while more():
        i += 1
        key = 1000 * a.incarnation + i
        x, y = batch(a.replica, key, n, a.dim)
        x, y = x.to(dtype), y.to(dtype)
        rnd = replicas.committed_steps
        grads = torch.func.grad(loss_fn)(params, x, y)
        params, inner_state = fddp.optim.apply_gradients(inner, grads, inner_state, params)
        if a.pace:
            time.sleep(a.pace)
        emit(event="inner", round=rnd, key=key, n=n)
        at_sync = (int(ostate.count) + 1) % a.every == 0
        if at_sync:
            syncs += 1
            if syncs == a.die_at:
                os.environ["FT_DIE"] = "sync"
        t0 = time.time()
        before = replicas.committed_steps
        params, ostate, inner_state = outer.step(params, ostate, weight=float(n), inner_state=inner_state)
        if at_sync:
            sizes.append(replicas.size if replicas.committed_steps > before else 0)
            emit(event="sync", t0=t0, t1=time.time(), before=before, after=replicas.committed_steps, members=list(replicas.members),
                 count=int(ostate.count), inner_steps=int(inner_state.count) if hasattr(inner_state, "count") else None)  # fmt: skip
    fddp.checkpoint.save(os.path.join(a.out, f"final-{a.replica}-{a.incarnation}.pt"),
                         {"params": params, "snapshot": ostate.snapshot, "inner": inner_state})  # fmt: skip


if __name__ == "__main__":
    main()
