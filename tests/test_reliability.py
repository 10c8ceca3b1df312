"""Reliability: skipping non-finite steps on every rank, loss scaling, replica checks, timeouts.

References: ``torch.amp.GradScaler`` (scale schedule, skipped steps), torch DDP with GradScaler (a
NaN on one rank skips the step everywhere), and plain ``torch.equal`` on bytes for checksums.
"""

from __future__ import annotations

import copy
import datetime
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as tdist
import torch.nn.functional as F
from torch.func import grad, vmap

import fddp
import fddp._dist
import fddp.optim
from dist import count_all_reduces, run
from fddp.sync import checksum
from models import make_batch, make_model

# --- DynamicLossScale against torch.amp.GradScaler -------------------------------------------

PATTERN = [True] * 3 + [False] + [True] * 7 + [False, False] + [True] * 5  # finite or not, per step


@pytest.mark.parametrize(
    "init_scale, growth_factor, backoff_factor, growth_interval",
    [(2.0**16, 2.0, 0.5, 3), (3.0, 1.1, 0.3, 2), (2.0**126, 2.0, 0.5, 1)],  # the last one grows to inf
)
def test_loss_scale_matches_grad_scaler(init_scale, growth_factor, backoff_factor, growth_interval):
    """Scale, growth tracker, unscaled gradients and parameters follow GradScaler + torch.optim.SGD."""
    torch.manual_seed(0)
    w0 = torch.randn(5)
    x = torch.randn(len(PATTERN), 5)
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor, growth_interval=growth_interval
    )
    loss_scale = fddp.DynamicLossScale(init_scale, growth_factor, backoff_factor, growth_interval)
    ls = loss_scale.init()
    params = {"w": w0.clone()}
    fopt = fddp.optim.sgd(lr=0.1, momentum=0.9)
    state = fopt.init(params)

    def loss_fn(p, xi, bad):
        return (p["w"] * xi).sum() * (float("inf") if bad else 1.0)

    grown = False
    for i, finite in enumerate(PATTERN):
        scaler.scale(loss_fn({"w": w}, x[i], not finite)).backward()
        scaler.unscale_(opt)
        torch_grad = w.grad.clone()
        torch_finite = bool(torch.isfinite(torch_grad).all())  # GradScaler skips the step otherwise
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

        g = grad(lambda p: loss_scale.scale_loss(ls, loss_fn(p, x[i], not finite)))(params)
        g = loss_scale.unscale_grads(ls, g)
        ok = torch.isfinite(g["w"]).all()
        assert bool(ok) == torch_finite, i  # with a huge scale, finite gradients overflow too
        updates, new_state = fopt.update(g, state, params)
        before = params
        params, state = fddp.apply_if_finite(ok, (fddp.optim.apply_updates(params, updates), new_state), (params, state))
        ls = loss_scale.update(ls, ok)
        assert torch.equal(params["w"], before["w"]) != torch_finite, i  # skipped exactly when not finite

        if torch_finite:
            assert torch.equal(g["w"], torch_grad), i
        assert ls.scale.item() == scaler.get_scale(), (i, ls.scale.item(), scaler.get_scale())
        assert ls.growth_tracker.item() == scaler._growth_tracker.item(), i
        # fddp.optim.sgd and torch.optim.SGD round differently (see test_optim); skips are exact above.
        torch.testing.assert_close(params["w"], w.detach(), rtol=1e-6, atol=1e-7, msg=f"step {i}")
        grown |= ls.scale.item() > init_scale
    assert grown and ls.scale.dtype == torch.float32 and ls.growth_tracker.dtype == torch.int32


def test_loss_scale_defaults_are_grad_scalers():
    s, ls = torch.amp.GradScaler("cpu"), fddp.DynamicLossScale()
    assert (ls.init_scale, ls.growth_factor, ls.backoff_factor, ls.growth_interval) == (
        s.get_scale(), s.get_growth_factor(), s.get_backoff_factor(), s.get_growth_interval()
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"init_scale": 0.0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 2.5}, "growth_interval"),
    ],
)
def test_loss_scale_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fddp.DynamicLossScale(**kwargs)


# --- apply_if_finite ----------------------------------------------------------------------------


def test_apply_if_finite_selects_whole_trees():
    new = {"a": torch.ones(3), "n": (torch.full((2,), 2.0), torch.tensor(5))}
    old = {"a": torch.zeros(3), "n": (torch.zeros(2), torch.tensor(4))}
    for finite, want in [(torch.tensor(True), new), (torch.tensor(False), old), (True, new), (torch.tensor([False]), old)]:
        out = fddp.apply_if_finite(finite, new, old)
        assert optree_equal(out, want)
    shared = torch.ones(2)
    assert fddp.apply_if_finite(torch.tensor(False), {"s": shared}, {"s": shared})["s"] is shared


def optree_equal(a, b) -> bool:
    import optree

    la, sa = optree.tree_flatten(a)
    lb, sb = optree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(la, lb))


def test_apply_if_finite_under_vmap_selects_per_member():
    new = {"w": torch.arange(6.0).reshape(3, 2)}
    old = {"w": -torch.ones(3, 2)}
    finite = torch.tensor([True, False, True])
    out = vmap(fddp.apply_if_finite)(finite, new, old)
    assert torch.equal(out["w"], torch.tensor([[0.0, 1.0], [-1.0, -1.0], [4.0, 5.0]]))


@pytest.mark.parametrize(
    "finite, new, old, error, parts",
    [
        (torch.tensor(1.0), {"a": torch.ones(1)}, {"a": torch.ones(1)}, TypeError, ["bool", "torch.float32"]),
        (torch.tensor([True, False]), {"a": torch.ones(1)}, {"a": torch.ones(1)}, TypeError, ["one element", "(2,)"]),
        (True, {"a": torch.ones(1)}, {"b": torch.ones(1)}, ValueError, ["same tree structure"]),
        (True, {"a": {"b": torch.ones(2)}}, {"a": {"b": torch.ones(3)}}, ValueError, ["'a/b'", "(2,)", "(3,)"]),
        (True, {"a": torch.ones(2)}, {"a": torch.ones(2, dtype=torch.float64)}, ValueError, ["'a'", "float64"]),
        (True, {"step": 2}, {"step": 1}, TypeError, ["'step'", "must be a tensor"]),
    ],
)
def test_apply_if_finite_errors_name_the_leaf(finite, new, old, error, parts):
    with pytest.raises(error) as e:
        fddp.apply_if_finite(finite, new, old)
    for part in parts:
        assert part in str(e.value), (part, str(e.value))


# --- A NaN on one rank: every rank skips the step, as torch DDP + GradScaler does ----------------

NAN_STEP, STEPS, LR = 2, 6, 0.05


def one_nan(g: torch.Tensor) -> torch.Tensor:
    return g.flatten().index_fill(0, torch.tensor([7]), float("nan")).view_as(g)


def _nan_worker():
    rank = fddp.rank()
    # torch's reference: DDP averages the NaN into every rank's gradients; GradScaler skips the step.
    ddp = torch.nn.parallel.DistributedDataParallel(make_model("mlp"))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    poison = {"on": False}
    target = dict(ddp.module.named_parameters())["5.weight"]  # a middle layer: not the first bucket
    target.register_hook(lambda g: one_nan(g) if poison["on"] else g)

    apply_fn, params = fddp.functionalize(make_model("mlp"))
    params = fddp.broadcast(params)
    fopt = fddp.optim.sgd(lr=LR, momentum=0.9)
    state = fopt.init(params)
    loss_scale = fddp.DynamicLossScale(growth_interval=2)
    ls = loss_scale.init()
    # A second replica through fddp.grad_and_value (the overlapped path), poisoned through its input.
    params2, state2, ls2 = params, state, ls
    sync = dict(check_finite=True, return_info=True, bucket_cap_mb=0.004, first_bucket_mb=0.001)
    history = []
    for step in range(STEPS):
        x, y = make_batch("mlp", seed=100 * step + rank)
        poison["on"] = step == NAN_STEP and rank == 1
        scaler.scale(F.cross_entropy(ddp(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

        g = grad(lambda p: loss_scale.scale_loss(ls, F.cross_entropy(apply_fn(p, x), y)))(params)
        if poison["on"]:
            g["5.weight"] = one_nan(g["5.weight"])
        g, info = fddp.ddp_step(params, g, check_finite=True, return_info=True, bucket_cap_mb=0.004, first_bucket_mb=0.001)
        g = loss_scale.unscale_grads(ls, g)
        updates, new_state = fopt.update(g, state, params)
        new_params = fddp.optim.apply_updates(params, updates)
        before = copy.deepcopy((params, state))
        params, state = fddp.apply_if_finite(info.finite, (new_params, new_state), (params, state))
        ls = loss_scale.update(ls, info.finite)
        unchanged = optree_equal((params, state), before)

        x2 = x.index_fill(0, torch.tensor([3]), float("nan")) if poison["on"] else x
        scaled = lambda p: loss_scale.scale_loss(ls2, F.cross_entropy(apply_fn(p, x2), y))  # noqa: E731
        g2, _, info2 = fddp.grad_and_value(scaled, **sync)(params2)
        g2 = loss_scale.unscale_grads(ls2, g2)
        updates2, new_state2 = fopt.update(g2, state2, params2)
        new_params2 = fddp.optim.apply_updates(params2, updates2)
        params2, state2 = fddp.apply_if_finite(info2.finite, (new_params2, new_state2), (params2, state2))
        ls2 = loss_scale.update(ls2, info2.finite)

        history.append((bool(info.finite), bool(info2.finite), unchanged, ls.scale.item(), ls2.scale.item(), scaler.get_scale()))
    torch_params = {k: p.detach() for k, p in ddp.module.named_parameters()}
    return history, params, params2, torch_params


def test_nan_on_one_rank_skips_the_step_on_every_rank():
    (h0, p0, q0, t0), (h1, p1, q1, _) = run(_nan_worker, 2, timeout=90)
    assert h0 == h1, "the ranks disagree"
    for step, (finite, finite2, unchanged, scale, scale2, torch_scale) in enumerate(h0):
        assert finite == finite2 == (step != NAN_STEP) and unchanged == (step == NAN_STEP), (step, h0)
        assert scale == scale2 == torch_scale, (step, h0)
    for k in p0:
        assert torch.equal(p0[k], p1[k]) and torch.equal(q0[k], q1[k]), f"replicas differ at {k}"
        assert torch.equal(p0[k], q0[k]), f"ddp_step and grad_and_value paths differ at {k}"
        torch.testing.assert_close(p0[k], t0[k], rtol=0, atol=1e-6, msg=f"param {k} vs torch DDP + GradScaler")


FINITE_CASES = [  # (leaf, index, value, rank that holds it, compression) -> finite?
    (None, 0, 0.0, 0, None, True),
    ("a", 0, float("nan"), 0, None, False),
    ("a", 999, float("nan"), 1, None, False),
    ("b", 3, float("inf"), 1, None, False),
    ("c", 299, -float("inf"), 0, None, False),
    ("a", 5, 6e4, 1, "fp16", True),  # 6e4 / 2 + 1 / 2 fits in fp16
    ("a", 5, 2e5, 1, "fp16", False),  # 2e5 / 2 does not: the overflow is in what was reduced
]


def _finite_worker():
    params = {
        "a": torch.zeros(1000), "b": torch.zeros(7, dtype=torch.float64), "c": torch.zeros(300, dtype=torch.bfloat16), "e": torch.zeros(0)
    }
    verdicts = []
    for leaf, i, value, who, compression, _ in FINITE_CASES:
        g = {k: torch.ones_like(v) for k, v in params.items()}
        if leaf is not None and fddp.rank() == who:
            g[leaf][i] = value
        opts = dict(check_finite=True, return_info=True, bucket_cap_mb=0.001, first_bucket_mb=0.001, compression=compression)
        _, info = fddp.ddp_step(params, g, **opts)
        _, _, info2 = fddp.grad_and_value(lambda p: sum((p[k] * g[k]).sum() for k in p), **opts)(params)
        verdicts.append((bool(info.finite), bool(info2.finite)))
    return verdicts


def test_finite_check_sees_any_nan_or_inf_in_any_bucket_the_same_on_every_rank():
    expected = [(ok, ok) for *_, ok in FINITE_CASES]
    assert run(_finite_worker, 2) == [expected, expected]


# --- verify_replicas ------------------------------------------------------------------------------


def one_ulp_up(x: torch.Tensor, i: int) -> torch.Tensor:
    """A copy of the 1-d ``x`` with element ``i`` one ulp higher (the imaginary part for complex, +1 for ints)."""
    x = x.clone()
    if x.is_complex():
        x = torch.view_as_real(x)
        x[i, 1] = torch.nextafter(x[i, 1], torch.tensor(float("inf"), dtype=x.dtype))
        return torch.view_as_complex(x)
    if x.is_floating_point():
        x[i] = torch.nextafter(x[i], torch.tensor(float("inf"), dtype=x.dtype))
    else:
        x[i] += 1
    return x


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.complex64]
)
def test_checksum_sees_every_one_ulp_change_and_swap(dtype):
    g = torch.Generator().manual_seed(0)
    exact = dtype in (torch.int64, torch.uint8)
    t = (torch.randint(0, 9, (7, 4), generator=g) if exact else torch.randn(7, 4, generator=g)).to(dtype)
    c = checksum(t)
    flat = t.reshape(-1)
    for i in range(flat.numel()):
        u = one_ulp_up(flat, i)
        assert not torch.equal(u, flat) and checksum(u) != c, i
    swapped = flat.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert checksum(swapped) != c
    assert checksum(t.t().contiguous().t()) == c  # layout does not matter, only values in order
    bucket = torch.cat([flat[:1], flat])  # a view that starts one element into its storage
    assert checksum(bucket[1:].view(t.shape)) == c
    odd = flat[:3]  # an odd number of bytes for 1- and 2-byte dtypes: the last word is zero-padded
    assert checksum(one_ulp_up(odd, 2)) != checksum(odd) == checksum(odd.clone())
    assert checksum(torch.tensor([0.0])) != checksum(torch.tensor([-0.0]))


def _verify_worker(case: str):
    rank = fddp.rank()
    tree = {"a": torch.arange(6.0).reshape(2, 3), "b": [torch.ones(4, dtype=torch.bfloat16), torch.arange(3)]}
    if case in ("ulp", "two") and rank == 1:
        tree["b"][0][2] = 1.0078125  # 1 + 2**-7: one bf16 ulp above 1
    if case == "two" and rank == 1:
        tree["a"][1, 1] = 5.0
    if case == "shape" and rank == 1:
        tree["b"][1] = torch.arange(4)
    with count_all_reduces() as calls:
        try:
            fddp.verify_replicas(tree)
            fddp.verify_replicas(tree)
        except fddp.MismatchError as e:
            return str(e)
    return [n for n, _ in calls], calls.headers


def test_verify_replicas_passes_with_one_small_all_reduce():
    for calls, headers in run(_verify_worker, 2, "equal"):
        assert calls == [6, 6] and headers == 2  # each call: its agreement, then [checksums, -checksums] of 3 leaves


@pytest.mark.parametrize(
    "case, parts",
    [
        # The fix comes with it: the forgotten broadcast first, then what else makes replicas drift.
        ("ulp", ["at leaf 'b/0': rank 1 differs from rank 0", "fddp.broadcast(params) was not called", "fddp.sync_buffers"]),
        ("two", ["at leaf 'a' (and 1 more of the 3 leaves): rank 1 differs from rank 0"]),
        ("shape", ["'b/1'", "shape=(3,)", "shape=(4,)"]),
    ],
)
def test_verify_replicas_raises_on_every_rank(case, parts):
    messages = run(_verify_worker, 2, case)
    assert messages[0] == messages[1] and isinstance(messages[0], str), messages
    for part in parts:
        assert part in messages[0], (part, messages[0])


# --- timeouts: a rank that skips a collective -----------------------------------------------------


def _skip_worker(what: str):
    group = tdist.new_group(timeout=datetime.timedelta(seconds=2))  # short, for this test only
    p = {"w": torch.zeros(3)}
    call = {"ddp_step": lambda: fddp.ddp_step(p, p, group=group), "verify_replicas": lambda: fddp.verify_replicas(p, group=group)}[what]
    call()  # both ranks: the signature is checked and remembered
    n = fddp._dist.call_count(group, what) + 1
    message = None
    if fddp.rank() == 0:
        try:
            call()
        except RuntimeError as e:
            message = str(e)
    else:
        time.sleep(3)  # alive but absent, as a stuck or diverged rank would be
    tdist.destroy_process_group(group)
    return message, n


@pytest.mark.parametrize(
    "what, doing", [("ddp_step", "the agreement on this call"), ("verify_replicas", "the agreement on this call")]
)
def test_a_skipped_collective_times_out_with_a_clear_error(what, doing):
    (message, n), (other, _) = run(_skip_worker, 2, what, timeout=60)
    assert other is None
    # fddp's words only: gloo's own (kept after the colon) are "Timed out waiting ..." when idle and
    # "Application timeout caused pair closure" under load.
    parts = [f"fddp.{what}: rank 0 of 2 timed out during {doing}", f"(call {n} to fddp.{what} in this process)", "skipped"]
    for part in parts:
        assert part in message, (part, message)


# --- fddp.init(timeout=...) under torchrun's environment, in fresh processes -----------------------

INIT_SCRIPT = """
import os, sys, time, torch, fddp
fddp.init(timeout=float(sys.argv[1]))
p = {"w": torch.zeros(2)}
fddp.ddp_step(p, p); fddp.ddp_step(p, p)
if fddp.rank() == fddp.world_size() - 1:
    if sys.argv[2] == "die":
        os._exit(0)  # gone without a word
    time.sleep(float(sys.argv[1]) + 5)  # stuck
    os._exit(0)
try:
    fddp.ddp_step(p, p)
except RuntimeError as e:
    print("ERROR:", e, flush=True)
    time.sleep(2)  # rank 0 hosts the store (no torchrun agent here): the other survivor reads the dead rank there
    os._exit(3)  # skip teardown: gloo may abort() at exit with a broken connection, hiding the code
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_STUCK = [
    "fddp.ddp_step: rank 0 of 2 timed out",
    "during the agreement on this call (call 3 to fddp.ddp_step in this process)",
    "the process group's timeout (fddp.init(timeout=...)) bounds the wait",
]  # fddp's words only: gloo's after them vary with load (see the test above)
# A peer that dies is named, never the rank that reports it (on 3 ranks, from the processes on this host).
_DIED = [
    "fddp.ddp_step: rank {last} failed in fddp.ddp_step",
    "ConnectionError: it died or closed its connection while its peers waited in the agreement",
]


@pytest.mark.parametrize("fault, world, parts", [("stuck", 2, _STUCK), ("die", 2, _DIED), ("die", 3, _DIED)])
def test_init_timeout_bounds_the_wait_for_a_missing_peer(fault, world, parts):
    env = dict(os.environ, WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(INIT_SCRIPT), "3", fault],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for r in range(world)
    ]
    try:
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    last = world - 1
    assert procs[last].returncode == 0, outs[last]
    for r in range(last):
        assert procs[r].returncode == 3, outs[r]
        for part in parts:
            assert part.format(last=last) in outs[r], (part, outs[r])
        assert f"rank {r} failed" not in outs[r]


def test_init_rejects_a_bad_timeout():
    for bad in (0, -1.0, "10"):
        with pytest.raises(ValueError, match="timeout"):
            fddp.init(timeout=bad)
