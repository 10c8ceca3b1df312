"""One replica group of a fault-tolerant run, for tests/test_ft.py and benchmarks/ft.py.

``python tests/ft_worker.py --lighthouse ADDR --replica N --out DIR --steps S [--mode replicated|diloco]``

Trains a small float64 MLP on batches that depend only on (replica, key), so a reference can
replay the run from the logs: every attempted step (replicated) or inner step and synchronisation
(DiLoCo) appends one JSON line to ``DIR/log-<replica>-<incarnation>.jsonl``; at the end the state
goes to ``DIR/final-<replica>-<incarnation>.pt`` (fddp.checkpoint). ``--die-at K`` SIGKILLs this
process inside the all-reduce of its K-th attempt (after its first buckets were sent): a death
during the all-reduce. ``--no-numpy`` blocks numpy once fddp is imported (the live-state transfer
must not need it).
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

import torch
import torch.distributed as dist

import fddp
import fddp.ft
from fddp.sync import hooks

DIM, HIDDEN = 8, 16


def batch(replica: int, key: int, n: int, dim: int = DIM) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s batch number ``key``: the same wherever it is drawn."""
    g = torch.Generator().manual_seed(1_000_003 * replica + key)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    y = (x[:, :1] * 0.5 - x[:, 1:2] * 0.25 + 0.1 * torch.randn(n, 1, generator=g, dtype=torch.float64)).tanh()
    return x, y


def init_params(seed: int, dim: int = DIM, hidden: int = HIDDEN, dtype: torch.dtype = torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(hidden, dim, generator=g, dtype=dtype) / dim**0.5,
        "b1": torch.zeros(hidden, dtype=dtype),
        "w2": torch.randn(1, hidden, generator=g, dtype=dtype) / hidden**0.5,
        "b2": torch.zeros(1, dtype=dtype),
    }


def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ p["w1"].T + p["b1"])
    return ((h @ p["w2"].T + p["b2"] - y) ** 2).mean()


def batch_size(replica: int) -> int:
    return 6 + 2 * replica  # groups contribute different sample counts: the mean is weighted


@dataclasses.dataclass(frozen=True)
class DieInAllReduce(hooks.WeightedMean):
    """The weighted mean; on the process told to (``$FT_DIE``), SIGKILL once the first bucket is on its way."""

    def launch(self, state, bucket):
        pending, state = super().launch(state, bucket)
        if bucket.index == 0 and os.environ.get("FT_DIE") == "now":
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--incarnation", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10, help="committed steps (replicated) or synchronisations (diloco) to reach")
    ap.add_argument("--mode", choices=["replicated", "diloco"], default="replicated")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--no-numpy", action="store_true")
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--bucket-kb", type=float, default=0.25)
    ap.add_argument("--dim", type=int, default=DIM)
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--batch", type=int, default=0, help="fixed batch size (0: 6 + 2 * replica)")
    ap.add_argument("--pace", type=float, default=0.0, help="seconds to sleep per step (a slower step)")
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--wait", default="", help="wait for this file before starting (a process started early, as a restart)")
    ap.add_argument("--go", default="", help="wait for this file before the first quorum (all groups' Managers are up)")
    ap.add_argument("--pause", action="append", default=[], help="STEP:FILE: before that step, wait for FILE")
    ap.add_argument("--want", type=int, default=0, help="also run until the last --after steps had this many groups")
    ap.add_argument("--after", type=int, default=3)
    a = ap.parse_args()
    if a.no_numpy:
        block_numpy()
    torch.set_num_threads(1)
    while a.wait and not os.path.exists(a.wait):
        time.sleep(0.01)
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=a.timeout))  # fmt: skip
    t_up = time.time()
    replicas = fddp.ft.Replicas(
        lighthouse=a.lighthouse, replica_id=f"replica_{a.replica}", store=("127.0.0.1", port), min_replicas=a.min_replicas,
        timeout=a.timeout, quorum_timeout=30.0, connect_timeout=5.0, hostname="127.0.0.1", max_retries=5,
    )  # fmt: skip
    dtype = getattr(torch, a.dtype)
    params = init_params(100 * a.incarnation + a.replica + 1, a.dim, a.hidden, dtype)  # every incarnation starts elsewhere
    log = open(os.path.join(a.out, f"log-{a.replica}-{a.incarnation}.jsonl"), "a", buffering=1)

    def emit(**rec):
        log.write(json.dumps({"t": time.time(), **rec}) + "\n")

    emit(event="up", t_up=t_up)
    while a.go and not os.path.exists(a.go):
        time.sleep(0.01)
    sizes: list[int] = []

    def more() -> bool:
        return replicas.committed_steps < a.steps or (a.want > 0 and sizes[-a.after :].count(a.want) < a.after)
    cap = a.bucket_kb / 1024
    n = a.batch or batch_size(a.replica)
    if a.mode == "replicated":
        opt = fddp.optim.sgd(0.05, momentum=0.5)
        hook = DieInAllReduce()
        gv = fddp.grad_and_value(loss_fn, group=replicas.group, bucket_cap_mb=cap, first_bucket_mb=cap, compression=hook)

        def train_step(state, x, y):
            grads, loss = gv(state["params"], x, y, weight=len(x))
            params, opt_state = fddp.optim.apply_gradients(opt, grads, state["opt"], state["params"])
            if a.pace:
                time.sleep(a.pace)
            return {"params": params, "opt": opt_state}, loss

        state = replicas.start({"params": params, "opt": opt.init(params)})
        emit(event="started", step=replicas.committed_steps, members=list(replicas.members))
        attempt = 0
        while more():
            attempt += 1
            if attempt == a.die_at:
                os.environ["FT_DIE"] = "now"
            s = replicas.committed_steps
            for p in a.pause:
                at, _, f = p.partition(":")
                if s == int(at) and not os.path.exists(f):
                    emit(event="paused", step=s)
                    while not os.path.exists(f):
                        time.sleep(0.01)
            x, y = batch(a.replica, s, n, a.dim)
            x, y = x.to(dtype), y.to(dtype)
            t0 = time.time()
            state, loss, info = replicas.step(train_step, state, x, y, return_info=True)
            sizes.append(info.size if info.committed else 0)
            emit(event="step", step=s, committed=info.committed, members=list(info.members), size=info.size, healed=info.healed,
                 t0=t0, quorum_s=info.quorum_s, loss=None if loss is None else float(loss),
                 error=None if info.error is None else f"{type(info.error).__name__}: {info.error}"[:300])  # fmt: skip
        final = state
    else:
        inner = fddp.optim.sgd(0.05)
        # The DiLoCo paper's outer step (not fddp's default, the mean): momentum carries state across rounds.
        nesterov = fddp.optim.sgd(0.7, momentum=0.9, nesterov=True)
        diloco = fddp.diloco.diloco(a.every, nesterov, group=replicas.group, compression=DieInAllReduce(),
                                    bucket_cap_mb=cap, first_bucket_mb=cap)  # fmt: skip
        outer = fddp.ft.FaultTolerantOuter(replicas, diloco)
        params, ostate, inner_state = outer.start(params, inner_state=inner.init(params))
        emit(event="started", step=replicas.committed_steps, members=list(replicas.members))
        if replicas.committed_steps > 1:  # joined the others' synchronisation
            sizes.append(replicas.size)
        i = 0
        syncs = 0
        while more():
            i += 1
            key = 1000 * a.incarnation + i
            x, y = batch(a.replica, key, n, a.dim)
            rnd = replicas.committed_steps
            grads = torch.func.grad(loss_fn)(params, x, y)
            params, inner_state = fddp.optim.apply_gradients(inner, grads, inner_state, params)
            emit(event="inner", round=rnd, key=key, n=n)
            at_sync = (int(ostate.count) + 1) % a.every == 0
            if at_sync:
                syncs += 1
                if syncs == a.die_at:
                    os.environ["FT_DIE"] = "now"
            t0 = time.time()
            before = replicas.committed_steps
            params, ostate = outer.step(params, ostate, weight=float(n), inner_state=inner_state)
            if at_sync:
                sizes.append(replicas.size if replicas.committed_steps > before else 0)
            if at_sync:
                emit(event="sync", t0=t0, before=before, after=replicas.committed_steps, members=list(replicas.members),
                     count=int(ostate.count))  # fmt: skip
        final = {"params": params, "snapshot": ostate.snapshot}
    fddp.checkpoint.save(os.path.join(a.out, f"final-{a.replica}-{a.incarnation}.pt"), final)
    stores = sum(t.name == "fddp-ft-store" for t in threading.enumerate())  # the epoch's only: older ones are closed
    emit(event="done", step=replicas.committed_steps, stores=stores)
    log.close()
    replicas.close()
    os._exit(0)  # a quorum taken for a step that will not come must not hold the exit


if __name__ == "__main__":
    main()
