"""The control plane off the data path: headers on a gloo side group (what NCCL groups use), and
no host read of a collective's result per call.

On an NCCL group a header that lived on the GPU would be read back by the host at every call (a
device-to-host sync, which torch DDP never makes); ``fddp._dist.control_group`` gives such groups
a gloo side group of the same ranks for their headers. No GPU here: ``SIDE_CONTROL`` makes a gloo
group take the same path, and the steady-state, mismatch and announcement cases of
``test_early.py`` run through it. The second test counts, with a ``TorchFunctionMode``, every
host read (``item``, ``tolist``, ``float``, ``bool``, ``.cpu()``...) of a tensor that went through
a data-group collective, over steady-state steps: on CUDA each would be a sync per step. The
last one makes the data group's collectives complete only seconds after they are issued (NCCL's
asynchrony) and checks that the steady-state calls return long before.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import fddp
from dist import run


def _params(n: int = 5) -> dict:
    return {"w": torch.arange(n, dtype=torch.float32), "b": torch.ones(2)}


def _side_group() -> dist.ProcessGroup:
    """A fresh gloo group whose headers travel on a side group, as an NCCL group's do."""
    import fddp._dist._groups as groups

    g = dist.new_group(backend="gloo")
    groups.SIDE_CONTROL = True
    try:
        groups.control_group(g)  # decided at the first header: here, on every rank alike
    finally:
        groups.SIDE_CONTROL = False
    return g


def _headers_on(g: dist.ProcessGroup) -> tuple[list, object]:
    """Record the group of every head all-reduce (float64, the head's size); returns the
    record and the original function, to put back."""
    import fddp._dist._header as header

    seen: list = []
    original = dist.all_reduce

    def spy(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if t.dtype == torch.float64 and t.numel() == header.HEAD:
            seen.append(group)
        return original(t, op=op, group=group, async_op=async_op)

    dist.all_reduce = spy
    return seen, original


def _cases_worker() -> tuple:
    import fddp._dist._groups as groups

    g = _side_group()
    control = groups.state(g).control
    headers, original = _headers_on(g)
    try:
        return _cases(g, control, headers)
    finally:
        dist.all_reduce = original


def _cases(g: dist.ProcessGroup, control: dist.ProcessGroup, headers: list) -> tuple:
    r = fddp.rank()
    params = fddp.broadcast(_params(), group=g)
    outs = [fddp.ddp_step(params, {k: v * (r + 1) * (s + 1) for k, v in params.items()}, group=g) for s in range(3)]
    fn = fddp.grad_and_value(lambda p, x: sum((v * x).sum() for v in p.values()), group=g)
    outs += [fn(params, torch.tensor(float(r + 1)))[0] for _ in range(2)]
    errors = []
    for mode in ("tree", "raise"):
        for _ in range(2):
            fddp.ddp_step(params, params, group=g)  # steady state
        try:
            if r == 1 and mode == "tree":
                fddp.ddp_step(_params(6), _params(6), group=g)
            elif r == 1:
                fddp.ddp_step(params, {"w": torch.zeros(3)}, group=g)  # announced in place of the header
            else:
                fddp.ddp_step(params, params, group=g)
        except Exception as e:  # noqa: BLE001 - the test compares the ranks' errors
            errors.append(type(e).__name__)
        outs.append(fddp.ddp_step(params, {k: v * (r + 1) for k, v in params.items()}, group=g))  # still in step
    on_control = all(h is control for h in headers)
    return control is not g and isinstance(control, dist.ProcessGroup), on_control, len(headers), errors, [
        {k: v.clone() for k, v in o.items()} for o in outs
    ]


def test_headers_on_a_side_group_keep_every_guarantee():
    results = run(_cases_worker, 2, timeout=120)
    for r, (side, on_control, n_headers, errors, outs) in enumerate(results):
        assert side and on_control and n_headers >= 10, (side, on_control, n_headers)
        assert errors == (["MismatchError", "PeerError"] if r == 0 else ["MismatchError", "ValueError"]), errors
        for s in range(3):
            for k in outs[s]:
                torch.testing.assert_close(outs[s][k], _params()[k] * 1.5 * (s + 1), rtol=0, atol=0)
        for o in outs[3:5]:
            assert all(torch.equal(v, torch.full_like(v, 1.5)) for v in o.values())
        for o in outs[5:]:
            for k in o:
                torch.testing.assert_close(o[k], _params()[k] * 1.5, rtol=0, atol=0)


_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
}  # fmt: skip


class _HostReads(TorchFunctionMode):
    """Count host reads of tensors whose storage a data-group collective wrote."""

    def __init__(self, storages: set) -> None:
        super().__init__()
        self.storages, self.reads = storages, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        to_host = func is torch.Tensor.to and any(str(a).startswith("cpu") for a in (*args[1:], kwargs.get("device")))
        if t is not None and (func in _READS or to_host) and t.untyped_storage().data_ptr() in self.storages:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def _reads_worker() -> dict:
    g = _side_group()
    control = fddp._dist.control_group(g)
    storages: set = set()
    names = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
    originals = {n: getattr(dist, n) for n in names}

    def spy(name):
        def issue(t, *args, **kwargs):
            group = kwargs.get("group")
            if group is not control or control is g:  # headers on the data group count as reads
                storages.add(t.untyped_storage().data_ptr())
                kept.append(t)  # alive until the step ends: its memory is not reused by a header meanwhile
            return originals[name](t, *args, **kwargs)

        return issue

    r = fddp.rank()
    params = fddp.broadcast({"w": torch.randn(6, 4), "b": torch.zeros(4)}, group=g)
    opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(1e-2))
    state = opt.init(params)
    loss = lambda p, x: ((x @ p["w"] + p["b"]) ** 2).mean()  # noqa: E731
    gv = fddp.grad_and_value(loss, group=g, return_info=True, check_finite=True)
    x = torch.randn(3, 6) + r
    counts = {}
    kept: list = []
    for step in range(4):  # the first calls learn their signatures (and may read); the later ones are steady
        storages.clear()
        kept.clear()
        for n in names:
            setattr(dist, n, spy(n))
        mode = _HostReads(storages)
        try:
            with mode:
                grads, _, info = gv(params, x)
                new_params, new_state = fddp.optim.apply_gradients(opt, grads, state, params)
                params, state = fddp.apply_if_finite(info.finite, (new_params, new_state), (params, state))
                g2 = fddp.ddp_step(params, grads, group=g, weight=3.0 + r, return_info=True)[0]
                g3 = fddp.ddp_step(params, g2, group=g)
        finally:
            for n in names:
                setattr(dist, n, originals[n])
        counts[step] = list(mode.reads)
        del g3
    return counts


def test_no_host_read_of_a_collective_result_per_step():
    for counts in run(_reads_worker, 2, timeout=120):
        assert counts[2] == [] and counts[3] == [], counts  # steady state: nothing read on the host


def _side_failure_worker() -> tuple:
    """On an NCCL group the data's waits are the stream's, but a head's is the host's, on the
    gloo side group: it must read the channel like a gloo wait. Here the group counts as NCCL
    for the waits (``_waits.sliced``), its heads on a side group: rank 1 posts a fatal failure
    and stays alive; rank 0, waiting in its next call's head, must raise PeerError at once."""
    import time

    from fddp._dist import _waits

    g = _side_group()
    real = _waits.sliced
    _waits.sliced = lambda group: group is not g and real(group)  # noqa: E731 - g waits as NCCL's would
    try:
        params = fddp.broadcast(_params(), group=g)
        if fddp.rank() == 1:
            fddp._dist.fail(g, "test", RuntimeError("this rank's stream is gone"))
            time.sleep(4)  # alive: no lost connection to notice, only the posted failure
            return None
        t0 = time.monotonic()
        try:
            fddp.ddp_step(params, params, group=g)
            got = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads it
            got = f"{type(e).__name__}: {e}"
        return time.monotonic() - t0, got
    finally:
        _waits.sliced = real


def test_a_head_wait_on_the_side_group_reads_a_peers_posted_failure():
    # Before: a plain wait on the side group, until its timeout (30 s here, 30 min by default).
    (took, got), _ = run(_side_failure_worker, 2, timeout=60)
    assert got.startswith("PeerError") and "this rank's stream is gone" in got and took < 3.0, (took, got)


def _mixed_worker() -> dict:
    """A group whose backends read ``"cpu:gloo,cuda:nccl"`` (``fddp.init``'s default on a GPU
    machine): fddp must take it for the NCCL group it is to CUDA tensors. Its CUDA collectives are
    gloo's CPU ones here; only torch's record of its backends is the mixed one, so what is tested
    is fddp's reading of it (no ``SIDE_CONTROL``, no patched
    waits): heads on a side group, NCCL's plain waits, known calls batched, a watcher."""
    import time

    from fddp._dist import _groups, _waits, _watcher

    g = dist.new_group(backend="gloo")
    real, real_digest = dist.get_backend_config, fddp._dist.replica_digest
    dist.get_backend_config = lambda group=None: "cpu:gloo,cuda:nccl" if group is g else real(group)  # noqa: E731
    # The values are a GPU's to the sampled fingerprint, which reads none there (as in _nccl_like).
    fddp._dist.replica_digest = lambda leaves, depth="full": None if depth == "sampled" else real_digest(leaves, depth)  # noqa: E731
    try:
        r = fddp.rank()
        params = fddp.broadcast(_params(), group=g)
        grads = {k: v * (r + 1) for k, v in params.items()}
        for _ in range(2):  # the first calls learn their signatures
            fddp.ddp_step(params, grads, group=g), fddp.psum(grads, group=g)
        heads, original = _headers_on(g)
        try:
            outs = [(fddp.ddp_step(params, grads, group=g), fddp.psum(grads, group=g)) for _ in range(3)]
            steady = list(heads)
            fddp._dist.settle("the test", final=True)  # the batch's check, sent and read
            settled = list(heads[len(steady) :])
        finally:
            dist.all_reduce = original
        control = _groups.control_group(g)
        out = {
            "side group": control is not g,
            "sliced": _waits.sliced(g),
            "batched": _waits.batched(g),
            "watched": g in _watcher._watched,
            "steady heads": len(steady),
            "settle heads on the side group": [h is control for h in settled],
            "values": [(o["w"].tolist(), s["b"].tolist()) for o, s in outs],
        }
        # A CPU collective on such a group is gloo's: its wait is still taken in slices that read
        # the channel (aborting a group does not end a gloo wait). Rank 1 posts a fatal failure
        # while rank 0 waits in a known psum's all-reduce, and stays alive.
        if r == 1:
            time.sleep(0.5)
            fddp._dist.fail(g, "test", RuntimeError("this rank's stream is gone"))
            time.sleep(5)  # alive: no lost connection to notice, only the posted failure
            return out
        t0 = time.monotonic()
        try:
            fddp.psum(grads, group=g)
            out["failure"] = "no error"
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["failure"] = f"{type(e).__name__}: {e}"
        out["took"] = time.monotonic() - t0
        return out
    finally:
        dist.get_backend_config, fddp._dist.replica_digest = real, real_digest


def test_a_mixed_gloo_nccl_group_is_taken_for_an_nccl_one():
    # Before: "cpu:gloo,cuda:nccl" != "nccl", so fddp took the default GPU group for gloo: a head
    # per call, on the host, and waits with a timeout, which torch's NCCL wait turns into a host
    # wait for the GPU at every bucket.
    for r, out in enumerate(run(_mixed_worker, 2, timeout=90)):
        expected = {k: v * 1.5 for k, v in _params().items()}
        assert out.pop("values") == [(expected["w"].tolist(), (expected["b"] * 2).tolist())] * 3, out
        if r == 0:  # before Comm told the wait its tensors were on the CPU: a plain wait, which hung (90 s here)
            failure, took = out.pop("failure"), out.pop("took")
            assert failure.startswith("PeerError") and "this rank's stream is gone" in failure and took < 3.0, (took, failure)
        assert out == {
            "side group": True, "sliced": False, "batched": True, "watched": True,
            "steady heads": 0, "settle heads on the side group": [True],
        }, out  # fmt: skip


class _Late:
    """A collective's work that completes ``after`` seconds after its issue. With ``work`` (a
    head's, on the gloo side group): its ``wait`` blocks until then, and for ``work``; else it
    returns at once, as an NCCL work's does (it only orders the stream)."""

    def __init__(self, after: float, work: object = None) -> None:
        import time

        self.done_at, self.work = time.monotonic() + after, work

    def wait(self, timeout: object = None) -> bool:
        import time

        if self.work is None:
            return True
        left = self.done_at - time.monotonic()
        time.sleep(max(0.0, left if timeout is None else min(left, timeout.total_seconds())))  # type: ignore[attr-defined]
        if time.monotonic() < self.done_at:
            return False
        return self.work.wait() if timeout is None else self.work.wait(timeout)  # type: ignore[attr-defined]

    def is_completed(self) -> bool:
        import time

        return time.monotonic() >= self.done_at and (self.work is None or self.work.is_completed())  # type: ignore[attr-defined]


def _nccl_like(g: dist.ProcessGroup, late_s: float, data: bool = True):
    """Make ``g`` behave as an NCCL group whose heads travel on its gloo side group, on a machine
    without a GPU: its waits are NCCL's (``_waits.sliced``); its collectives return a work that
    completes ``late_s`` later and whose wait returns at once (``data``: they run, at issue, so
    the values stay right; else they are skipped, as mismatched NCCL collectives would leave
    the host free); its heads arrive ``late_s`` after they are sent (their wait blocks until
    then); and its values are a GPU's to the sampled replica digest (which reads none: that would
    make the host wait for the stream). Returns the names of g's collectives issued so far (cleared by the caller) and
    a function that puts everything back."""
    from fddp._dist import _waits

    control = fddp._dist.control_group(g)
    issued: list = []
    originals = {n: getattr(dist, n) for n in ("all_reduce", "broadcast")}

    def late(name):
        def issue(*args, **kwargs):
            group = kwargs.get("group")
            if group is control:  # a head: real, but it arrives late
                return _Late(late_s, originals[name](*args, **{**kwargs, "async_op": True}))
            if group is not g:
                return originals[name](*args, **kwargs)
            if data:
                originals[name](*args, **{**kwargs, "async_op": False})
            issued.append(name)
            return _Late(late_s)

        return issue

    real_sliced, real_digest = _waits.sliced, fddp._dist.replica_digest
    for n in originals:
        setattr(dist, n, late(n))
    _waits.sliced = lambda group: group is not g and real_sliced(group)  # noqa: E731
    fddp._dist.replica_digest = lambda leaves, depth="full": None if depth == "sampled" else real_digest(leaves, depth)

    def restore() -> None:
        _waits.sliced, fddp._dist.replica_digest = real_sliced, real_digest
        for n, f in originals.items():
            setattr(dist, n, f)

    return issued, restore


@contextlib.contextmanager
def _nccl_group(late_s: float = 0.0, data: bool = False):
    """A fresh side-controlled group (``_side_group``), NCCL-like for the block (``_nccl_like``;
    by default its heads on time and its data's collectives skipped): yields ``(group, issued)``."""
    g = _side_group()
    issued, restore = _nccl_like(g, late_s, data)
    try:
        yield g, issued
    finally:
        restore()


def _late_worker(directory: str) -> dict:
    """NCCL's asynchrony on gloo (``_nccl_like``): a call that waited for a collective or for
    its own head to arrive, or polled one, would take ``late_s``. Each call comes ``late_s``
    after the previous one, whose head has arrived by then (the next call reads it)."""
    import time

    from fddp import checkpoint as ckpt

    late_s = 1.0
    g = _side_group()
    r = fddp.rank()
    params = fddp.broadcast({"w": torch.randn(6, 4), "b": torch.zeros(4)}, group=g)
    opt = fddp.optim.chain(fddp.optim.clip_by_global_norm(1.0), fddp.optim.adamw(1e-2))
    state = opt.init(params)
    gv = fddp.grad_and_value(lambda p, x: ((x @ p["w"] + p["b"]) ** 2).mean(), group=g)
    x = torch.randn(3, 6) + r
    steps = {
        "grad_and_value": lambda: gv(params, x)[0],
        "ddp_step": lambda: fddp.ddp_step(params, params, group=g),
        "psum": lambda: fddp.psum(params, group=g),
        "clip_by_global_norm": lambda: fddp.optim.clip_by_global_norm(1.0).update(params, opt.init(params)[0]),
        "apply_gradients": lambda: fddp.optim.apply_gradients(opt, params, state, params),
    }
    took: dict = {}

    def timed(what: str, fn, rest: bool = True) -> None:
        """Run ``fn`` with g NCCL-like; note its time and collectives; let its head arrive (``rest``)."""
        issued, restore = _nccl_like(g, late_s)
        try:
            t0 = time.monotonic()
            fn()
            took[what] = (time.monotonic() - t0, len(issued))
        finally:
            restore()
        if rest:
            time.sleep(late_s)

    with ckpt.Manager(directory, every=None, signals=(), group=g) as manager:
        for step in range(3):  # the first calls learn their signatures (and wait); the last ones are steady
            for what, fn in steps.items():
                timed(what, fn, rest=what != "apply_gradients")  # Manager.step follows at once: the boundary's head is on its way
            timed("Manager.step", lambda: manager.step(step, {"params": params}))  # noqa: B023 - called at once
    fddp._dist.settle()
    return took


def test_steady_state_calls_wait_neither_for_their_collectives_nor_for_their_heads(tmp_path):
    for r, took in enumerate(run(_late_worker, 2, str(tmp_path), timeout=120)):
        for what in ("grad_and_value", "ddp_step", "psum"):
            seconds, issued = took[what]
            assert issued >= 1 and seconds < 0.5, (r, what, seconds, issued)  # a late collective and head, not waited for
        for what in ("apply_gradients", "clip_by_global_norm", "Manager.step"):
            seconds, issued = took[what]
            assert issued == 0 and seconds < 0.5, (r, what, seconds, issued)  # replicated: nothing to send


def _batched_worker(directory: str) -> dict:
    """On an NCCL-like group (``_nccl_like``, its data collectives skipped), known calls send no
    head: they are checked in a batch by the head that the step boundary sends, read at the next
    boundary, where a difference raises on every rank, naming the first call in which the ranks
    differ, and the group carries no more calls."""
    from fddp._dist import _agreement

    r = fddp.rank()
    out: dict = {}
    params = _params()
    opt = fddp.optim.sgd(0.1)
    state = opt.init(params)

    def steps(g, n: int, last=None) -> None:
        for i in range(n):
            fddp.ddp_step(params, params, group=g)
            fddp.psum(params, group=g) if last is None or i < n - 1 else last()
            fddp.optim.apply_gradients(opt, params, state, params)

    # 1. Known calls send only their data; a step boundary sends one head; UNHEADED calls, one.
    with _nccl_group() as (g, issued):
        heads, original = _headers_on(g)
        try:
            steps(g, 2)  # the first calls learn their signatures (and send heads)
            heads.clear(), issued.clear()
            steps(g, 3)
            out["per_step"] = (len(heads), len(issued))
            heads.clear()
            for _ in range(_agreement.UNHEADED):
                fddp.psum(params, group=g)
            out["long"] = len(heads)
            fddp._dist.settle("the test", final=True)
            out["owing"] = len(_agreement._owing)
        finally:
            dist.all_reduce = original
    # 1b. A SyncBatchNorm layer's calls (its forward's, inside fn, and its backward's) are known
    # calls too: a step sends only its boundary's head, not one per layer and direction.
    with _nccl_group() as (g, issued):
        heads, original = _headers_on(g)
        try:
            apply_fn, bn = fddp.functionalize(fddp.SyncBatchNorm(3, group=g))
            bn = fddp.broadcast(bn, group=g)
            gv = fddp.grad_and_value(lambda p, x: apply_fn(p, x).pow(2).sum(), group=g)
            x = torch.arange(12.0).reshape(4, 3) + r
            counted = []
            for _ in range(4):
                heads.clear()
                grads, _ = gv(bn, x)
                fddp.optim.apply_gradients(opt, grads, opt.init(bn), bn)
                counted.append(len(heads))
            out["syncbn_heads"] = counted[2:]  # the first steps learn their signatures
            fddp._dist.settle("the test", final=True)
        finally:
            dist.all_reduce = original
    # 2. Two known calls that differ (ddp_step here, psum there) in a batch: every call returns,
    # and so does the boundary that sends its check; the next boundary raises.
    with _nccl_group() as (g, issued):
        steps(g, 2)
        fddp.ddp_step(params, params, group=g) if r == 0 else fddp.psum(params, group=g)
        fddp.optim.apply_gradients(opt, params, state, params)
        out["returned"] = True
        try:
            fddp.optim.apply_gradients(opt, params, state, params)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["next"] = f"{type(e).__name__}: {e} {getattr(e, '__notes__', '')}"
        try:
            fddp.psum(params, group=g)
        except Exception as e:  # noqa: BLE001
            out["after"] = type(e).__name__
    # 3. One rank's psum of another shape (new there, so it sends a head; known here, batched):
    # the first difference is named row by row.
    with _nccl_group() as (g, issued):
        steps(g, 2)
        try:
            fddp.psum({"w": torch.zeros(7), "b": torch.ones(2)} if r == 1 else params, group=g)
            fddp.optim.apply_gradients(opt, params, state, params)
            fddp.optim.apply_gradients(opt, params, state, params)
        except Exception as e:  # noqa: BLE001
            out["shape"] = f"{type(e).__name__}: {e}"
    # 4. A rank that fails before sending anything: fatal (its peers issued the call's collectives
    # without a head); the peer raises PeerError at its next boundary.
    with _nccl_group() as (g, issued):
        steps(g, 2)
        try:
            fddp.ddp_step(params, {"w": torch.zeros(3)} if r == 1 else params, group=g)
        except Exception as e:  # noqa: BLE001
            out["announced"] = type(e).__name__
        try:
            fddp.optim.apply_gradients(opt, params, state, params)
            fddp.optim.apply_gradients(opt, params, state, params)
        except Exception as e:  # noqa: BLE001
            out["peer"] = f"{type(e).__name__}: {e}"
    # 5. A checkpoint due after such a step makes and reads the outstanding check before it writes.
    import os
    import time

    from fddp import checkpoint as ckpt

    with _nccl_group() as (g, issued):
        try:
            with ckpt.Manager(directory, every=1, signals=(), group=g) as manager:
                steps(g, 2)
                fddp.ddp_step(params, params, group=g) if r == 0 else fddp.psum(params, group=g)
                fddp.optim.apply_gradients(opt, params, state, params)
                try:
                    manager.step(3, {"params": params})
                except Exception as e:  # noqa: BLE001
                    out["save"] = type(e).__name__
        except Exception as e:  # noqa: BLE001 - the Manager's close on a failed group
            out["close"] = type(e).__name__
    out["saved"] = sorted(os.listdir(directory))
    # 6. Between calls, with batched calls outstanding (their collectives may still wait on the
    # stream), a peer's posted failure aborts the group: the watcher reads its channel.
    from fddp._dist import _watcher

    def aborted_within(aborted: list, seconds: float) -> bool:
        """Whether the watcher called the group's abort (recorded in ``aborted``) within ``seconds``."""
        t0 = time.monotonic()
        while not aborted and time.monotonic() - t0 < seconds:
            time.sleep(0.05)
        return bool(aborted)

    aborted: list = []
    with _nccl_group() as (g, issued):
        _watcher.watch(g, abort=lambda: aborted.append(True))
        steps(g, 2)
        fddp.ddp_step(params, params, group=g)
        dist.barrier()  # every rank outside any call, with its batch outstanding
        if r == 1:
            fddp._dist.fail(g, "ddp_step", RuntimeError("this rank's stream is gone"))
        out["aborted"] = aborted_within(aborted, 5) if r != 1 else bool(aborted)
        try:
            fddp.psum(params, group=g)
        except Exception as e:  # noqa: BLE001
            out["aborted_then"] = type(e).__name__
        try:  # the boundary says so too, once: its outstanding check can no longer be made
            fddp.optim.apply_gradients(opt, params, state, params)
        except Exception as e:  # noqa: BLE001
            out["aborted_then"] += f" {type(e).__name__}"
        fddp.optim.apply_gradients(opt, params, state, params)
    # 7. A batch whose ranks differ, and hosts away from fddp after the boundary sent its check
    # (blocked on a stream that the mismatched collectives hold, say): the watcher reads the
    # arrived head and aborts; the next boundary names the difference.
    aborted = []
    with _nccl_group() as (g, issued):
        _watcher.watch(g, abort=lambda: aborted.append(True))
        steps(g, 2)
        fddp.ddp_step(params, params, group=g) if r == 0 else fddp.psum(params, group=g)
        fddp.optim.apply_gradients(opt, params, state, params)  # sends the batch's check
        out["watched"] = aborted_within(aborted, 5)
        try:
            fddp.optim.apply_gradients(opt, params, state, params)
        except Exception as e:  # noqa: BLE001
            out["watched_then"] = f"{type(e).__name__}: {e}"
    # 8. An agreement used as a barrier (a checkpoint's) meets its peers even when known: it waits.
    with _nccl_group(0.5) as (g, issued):
        for _ in range(3):
            t0 = time.monotonic()
            fddp._dist.agree(g, "checkpoint.save", [("checkpoint", "the barrier after rank 0 wrote x", None)])
            out["barrier"] = time.monotonic() - t0
    # 9. Two groups whose batches the ranks began in opposite orders: a final check sends every
    # group's head before it waits for any (waiting for A's first, rank 0 would wait for rank 1,
    # which waits for B's).
    with _nccl_group() as (a, _), _nccl_group() as (b, _):
        for first, second in ((a, b), (a, b)) if r == 0 else ((a, b), (b, a)):
            fddp.psum(params, group=first)
            fddp.psum(params, group=second)
        t0 = time.monotonic()
        fddp._dist.settle("the test", final=True)
        out["crossed"] = time.monotonic() - t0
    # 10. A thread's own group (metrics, say): the main thread's boundary leaves its batch alone,
    # however far that thread has got (here: two calls on rank 0, one on rank 1, when it comes).
    import threading

    got: dict = {}
    halfway, boundary_done = threading.Event(), threading.Event()

    def metrics(m: dist.ProcessGroup) -> None:
        try:
            fddp.psum(params, group=m)  # learnt: sends a head
            for i in range(2):
                fddp.psum(params, group=m)
                if i == (1 if r == 0 else 0):  # the main thread's boundary comes now
                    halfway.set()
                    boundary_done.wait(10)
            fddp._dist.settle("the metrics thread", final=True)
            got["metrics"] = "ok"
        except Exception as e:  # noqa: BLE001
            got["metrics"] = f"{type(e).__name__}: {e}"

    with _nccl_group() as (m, _), _nccl_group() as (g, issued):
        steps(g, 2)
        t = threading.Thread(target=metrics, args=(m,))
        t.start()
        halfway.wait(10)
        try:
            fddp.optim.apply_gradients(opt, params, state, params)
            got["main"] = "ok"
        except Exception as e:  # noqa: BLE001
            got["main"] = f"{type(e).__name__}: {e}"
        boundary_done.set()
        t.join(30)
        fddp._dist.settle("the test", final=True)
        out["threads"] = (got.get("main"), got.get("metrics"))
    # 11. A difference that a head finds before any collective of the call, with no batched call
    # before it on any rank (two new trees): raised, and the group is still in step.
    with _nccl_group() as (g, issued):
        try:
            fddp.psum({"w": torch.zeros(7 if r == 1 else 5)}, group=g)
        except Exception as e:  # noqa: BLE001
            out["in_step"] = type(e).__name__
        fddp.psum(params, group=g)
        out["in_step"] += " then ok"
    out["owing_at_end"] = len(_agreement._owing)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_known_calls_are_checked_in_a_batch_and_a_difference_raises_at_the_next_boundary(world, tmp_path):
    for r, out in enumerate(run(_batched_worker, world, str(tmp_path), timeout=120)):
        assert out["per_step"] == (3, 6), out  # 3 steps: one head each (their boundary's), and the data's 6 collectives
        assert out["long"] == 1 and out["owing"] == 0, out  # UNHEADED calls without a boundary: one head
        assert out["syncbn_heads"] == [1, 1], out  # the boundary's (before: 2, the layer's own head too)
        assert out["returned"], out
        assert out["next"].startswith("MismatchError") and "rank 0's call 6 was fddp.ddp_step" in out["next"], out
        assert "rank 1's call 6 was fddp.psum" in out["next"] and "carries no more" in out["next"], out
        assert out["after"] == "PeerError", out
        assert out["shape"].startswith("MismatchError") and "(fddp.psum) differs" in out["shape"] and "7" in out["shape"], out
        assert out.get("announced") == ("ValueError" if r == 1 else None), out
        assert out["peer"].startswith("PeerError") and ("rank 1 failed in fddp.ddp_step" in out["peer"] or r == 1), out
        assert out["save"] == "MismatchError" and not out["saved"], out  # raised before any write
        assert out["aborted"] == (r != 1) and out["aborted_then"] == "PeerError PeerError", out  # the failing rank aborts nothing
        assert out["watched"] and out["watched_then"].startswith("MismatchError"), out
        assert "rank 0's call 6 was fddp.ddp_step" in out["watched_then"], out
        assert out["barrier"] >= 0.45, out  # its head, 0.5 s late, waited for
        assert out["threads"] == ("ok", "ok") and out["in_step"] == "MismatchError then ok", out
        assert out["crossed"] < 5.0 and out["owing_at_end"] == 0, out


def _stamp_worker() -> dict:
    """On an NCCL-like group whose collectives run (``_nccl_like``'s ``data``), a known call's
    identity rides in its first all-reduce (``fddp._dist.stamp``): matched calls give the exact
    mean or sum, and calls that differ (``ddp_step`` here, ``psum`` there, of the same sizes,
    so their collectives pair) give no finite value on any rank, before any host learns of the
    difference (the next boundary raises)."""
    from fddp._dist import _agreement

    r = fddp.rank()
    out: dict = {}
    x = torch.arange(6.0) + r
    params = {"w": x.clone(), "b": torch.full((3,), 2.0 * r)}
    opt = fddp.optim.sgd(0.1)
    state = opt.init(params)
    with _nccl_group(data=True) as (g, issued):
        gv = fddp.grad_and_value(lambda p, x: (p["w"] * x).sum() + p["b"].sum(), group=g)
        for _ in range(3):  # the first calls learn their signatures (a head each); then steady (stamped)
            mean = fddp.ddp_step(params, params, group=g)
            summed = fddp.psum(params, group=g)
            averaged = fddp.pmean(params, group=g)
            weighted = fddp.ddp_step(params, params, group=g, weight=2.0)  # the weight rides last, the stamp after it
            grads, _ = gv(params, x)
            fddp.optim.apply_gradients(opt, params, state, params)
        results = {"ddp_step": mean, "psum": summed, "pmean": averaged, "weighted": weighted, "grad": grads}
        out["steady"] = {k: {n: v.tolist() for n, v in t.items()} for k, t in results.items()}
        mixed = fddp.ddp_step(params, params, group=g) if r == 0 else fddp.psum(params, group=g)
        out["mixed"] = {n: v.tolist() for n, v in mixed.items()}

        try:
            fddp.optim.apply_gradients(opt, params, state, params)
            fddp.optim.apply_gradients(opt, params, state, params)
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["next"] = f"{type(e).__name__}: {e}"
    # The batch's UNHEADED-th known call sends the batch's head (read later): it carries a stamp too.
    with _nccl_group(data=True) as (g, issued):
        for _ in range(2):  # learn
            fddp.ddp_step(params, params, group=g), fddp.psum(params, group=g)
            fddp.optim.apply_gradients(opt, params, state, params)
        for _ in range(_agreement.UNHEADED - 1):
            fddp.psum(params, group=g)
        last = fddp.ddp_step(params, params, group=g) if r == 0 else fddp.psum(params, group=g)
        out["mixed_64th"] = {n: v.tolist() for n, v in last.items()}
        try:  # its head names the difference at the boundary after next
            fddp.optim.apply_gradients(opt, params, state, params)
            fddp.optim.apply_gradients(opt, params, state, params)
        except fddp.MismatchError:
            pass
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_known_calls_stamp_leaves_no_value_of_a_mixed_sum_finite_on_any_rank(world):
    half = (world - 1) / 2  # the ranks' mean offset: w and x are arange(6) + rank, b is 2 * rank
    for out in run(_stamp_worker, world, timeout=120):
        steady = out["steady"]
        assert steady["ddp_step"] == steady["pmean"] == steady["weighted"] == {"w": [i + half for i in range(6)], "b": [2 * half] * 3}, out
        assert steady["psum"] == {"w": [world * i + world * half for i in range(6)], "b": [2 * world * half] * 3}, out
        assert steady["grad"] == {"w": [i + half for i in range(6)], "b": [1.0] * 3}, out  # d/dw = x, averaged
        assert not any(math.isfinite(v) for leaf in out["mixed"].values() for v in leaf), out  # every value Inf or NaN
        assert not any(math.isfinite(v) for leaf in out["mixed_64th"].values() for v in leaf), out
        assert out["next"].startswith("MismatchError") and "was fddp.ddp_step" in out["next"], out
