"""``apply_gradients``' device path of rmsprop, adagrad, nadam, radam and adafactor, run on the CPU.

Where the step count is on the CPU these optimizers read it on the host and compute their scalars
in Python floats, as ``torch.optim`` does (``tests/test_optim_torch_more.py``). On a GPU that read
would make the host wait for the GPU at every step, so there (``fddp.optim._elementwise.on_host``
false) the scalars stay float64 tensors on the count's device. These tests force that path on the
CPU and check that it reads nothing on the host, that its float64 scalars equal the Python floats
bit for bit, count after count, and that the steps equal ``torch.optim``'s: to the bit where the
tensor forms compute the same operations (addcdiv's ``value * g / d``), within one rounding per
step where a tensor step size multiplies and adds what torch's ``add(alpha=)`` fuses (adafactor;
rmsprop's momentum with a schedule). ``tests/cuda_checks.py`` runs the path on a GPU, under sync
debug mode.
"""

from __future__ import annotations

import struct

import optree
import pytest
import torch
from test_optim_torch_more import CASES, STEPS, _grads, _model, _torch_run, _with_schedule
from torch.overrides import TorchFunctionMode

from fddp import optim
from fddp.optim import _adafactor
from fddp.optim import _elementwise as ew


@pytest.fixture
def on_device(monkeypatch):
    """The device path on the CPU: the switch the optimizers ask, answering as for a GPU's count."""
    monkeypatch.setattr(ew, "on_host", lambda count: False)


# --- no host read ------------------------------------------------------------------------------

_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
    torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy,
}  # fmt: skip


class _HostReads(TorchFunctionMode):
    """Record every host read of a tensor (on a GPU, each would wait for the GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        to_host = func is torch.Tensor.to and any(str(a).startswith("cpu") for a in (*args[1:], kwargs.get("device")))
        if func in _READS or to_host:
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


def _sched(lr: float):
    return optim.linear(lr, lr / 10, transition_steps=20)


STEADY = {
    "rmsprop": lambda lr: optim.rmsprop(lr, momentum=0.5, centered=True, weight_decay=0.1),
    "adagrad": lambda lr: optim.adagrad(lr, lr_decay=0.01, weight_decay=0.1),
    "nadam": lambda lr: optim.nadam(lr, weight_decay=0.1, decoupled_weight_decay=True),
    "radam": lambda lr: optim.radam(lr, weight_decay=0.1, decoupled_weight_decay=True),
    "adafactor": lambda lr: optim.adafactor(lr, weight_decay=0.1),
}


def _steady_reads(make, lr) -> list[str]:
    """The host reads of a steady-state apply_gradients (after two steps)."""
    params = {k: v.detach().clone() for k, v in _model().named_parameters()}
    opt = make(lr)
    state = opt.init(params)
    for step in range(2):
        params, state = optim.apply_gradients(opt, _grads(params, step), state, params)
    grads = _grads(params, 2)
    with _HostReads() as mode:
        optim.apply_gradients(opt, grads, state, params)
    return mode.reads


@pytest.mark.parametrize("schedule", [False, True], ids=["constant_lr", "schedule"])
@pytest.mark.parametrize("name", STEADY)
def test_the_device_path_reads_nothing_on_the_host(name, schedule, on_device):
    assert _steady_reads(STEADY[name], _sched(1e-2) if schedule else 1e-2) == []


@pytest.mark.parametrize("name", ["adagrad", "nadam", "radam", "adafactor"])
def test_the_host_path_reads_the_count_as_torch_does(name):
    # The CPU's path: the reads above are there, and cost nothing on the CPU (the check of the test above).
    assert "item" in _steady_reads(STEADY[name], 1e-2)


# --- the float64 scalars equal the Python floats ---------------------------------------------


def _bits(x) -> bytes:
    return struct.pack("<d", float(x))


def test_power_and_divide_round_as_python():
    # torch's float64 sqrt, rsqrt and reciprocal (its shortcuts for x ** 0.5, -0.5, -1) round
    # differently from C's pow, which Python's ** calls; ew.power and ew.divide do not.
    misses = {"sqrt": 0}
    for n in range(1, 3001):
        for x in (float(n), 1 - 0.999**n, 1 - 0.9**n):
            t = torch.tensor(x, dtype=torch.float64)
            for e in (0.5, -0.5, -1.0, -0.8, 2.0):
                assert _bits(ew.power(t, e)) == _bits(x**e), (x, e)
            assert _bits(ew.divide(1, t)) == _bits(1 / x) and _bits(ew.divide(0.3, t)) == _bits(0.3 / x), x
            misses["sqrt"] += _bits(t**0.5) != _bits(x**0.5)
    assert misses["sqrt"] > 0  # what power avoids: otherwise this test checks nothing


class _Recorder:
    """Stands in for ew.Scalars, recording each step's values."""

    def __init__(self, calls: list) -> None:
        self.calls, self.scalars = calls, ew.Scalars

    def __call__(self, **values):
        self.calls.append(values)
        return self.scalars(**values)


SCALARS = {
    "rmsprop_schedule": lambda: optim.rmsprop(_sched(0.03), momentum=0.5),
    "adagrad": lambda: optim.adagrad(0.1, lr_decay=0.013),
    "adagrad_schedule": lambda: optim.adagrad(_sched(0.1), lr_decay=0.01),
    "nadam": lambda: optim.nadam(2e-3, weight_decay=0.1, decoupled_weight_decay=True),
    "nadam_betas": lambda: optim.nadam(_sched(1e-2), betas=(0.8, 0.99), momentum_decay=1e-2),
    "radam": lambda: optim.radam(1e-3, weight_decay=0.1, decoupled_weight_decay=True),
    "radam_betas": lambda: optim.radam(_sched(1e-2), betas=(0.95, 0.9999)),
    "radam_fast": lambda: optim.radam(1e-2, betas=(0.5, 0.9)),
}
COUNTS = [*range(0, 400), *range(1000, 10**6, 9973)]


def _scalars_at(opt, count: int, monkeypatch, host: bool, calls: list) -> dict:
    params = {"w": torch.ones(2, 3), "b": torch.ones(3)}
    state = opt.init(params)
    state = state._replace(count=torch.tensor(count))
    if hasattr(state, "mu_product"):  # nadam: a product of momentum coefficients, the same in both paths
        state = state._replace(mu_product=torch.tensor(0.9 ** min(count, 50), dtype=torch.float32))
    calls.clear()
    monkeypatch.setattr(ew, "on_host", lambda c: host)
    grads = {"w": torch.full((2, 3), 0.5), "b": torch.full((3,), -0.25)}
    optim.apply_gradients(opt, grads, state, params)
    (values,) = calls
    return values


@pytest.mark.parametrize("name", SCALARS)
def test_device_scalars_equal_the_host_floats_to_the_bit(name, monkeypatch):
    opt = SCALARS[name]()
    calls: list = []
    monkeypatch.setattr(ew, "Scalars", _Recorder(calls))
    for count in COUNTS:
        host, dev = _scalars_at(opt, count, monkeypatch, True, calls), _scalars_at(opt, count, monkeypatch, False, calls)
        assert host.keys() == dev.keys()
        rectified = host.get("rectified", True)
        if "rectified" in host:
            assert bool(dev["rectified"]) == rectified, count
        for k, h in host.items():
            d = dev[k]
            if k == "rectified" or (k == "rect" and not rectified) or h is None:
                continue
            assert isinstance(h, float) and (isinstance(d, float) or d.dtype == torch.float64), (k, h, d)
            assert _bits(h) == _bits(d), (name, count, k, h, float(d))


@pytest.mark.parametrize("beta2_decay", [-0.8, -0.5, -1.0])
def test_adafactors_device_scalars_equal_the_host_floats_to_the_bit(beta2_decay, monkeypatch):
    seen: list = []
    leaf = _adafactor._leaf

    def recording(cfg, g, row, col, var, p, lr, one_minus_beta2, rho, apply, host):
        seen.append((one_minus_beta2, rho))
        return leaf(cfg, g, row, col, var, p, lr, one_minus_beta2, rho, apply, host)

    monkeypatch.setattr(_adafactor, "_leaf", recording)
    for lr in (1e-2, _sched(0.1)):
        opt = optim.adafactor(lr, beta2_decay=beta2_decay)
        params = {"w": torch.ones(2, 3)}
        for count in COUNTS:
            state = opt.init(params)._replace(count=torch.tensor(count))
            got = []
            for host in (True, False):
                seen.clear()
                monkeypatch.setattr(ew, "on_host", lambda c, host=host: host)
                optim.apply_gradients(opt, {"w": torch.full((2, 3), 0.5)}, state, params)
                got.append(seen[0])
            for h, d in zip(*got):
                assert _bits(h) == _bits(d), (beta2_decay, count, h, float(d))


# --- the steps ---------------------------------------------------------------------------------

EXACT = [name for name in CASES if not name.startswith("adafactor")]


def _applied(opt, start: dict, steps: int) -> dict:
    """The parameters after ``steps`` of ``apply_gradients`` from ``start`` (the gradients torch's runs see)."""
    params, state = start, opt.init(start)
    for step in range(steps):
        params, state = optim.apply_gradients(opt, _grads(start, step), state, params)
    return params


@pytest.mark.parametrize("name", EXACT)
def test_the_device_path_equals_torch_to_the_bit(name, on_device):
    make, T, kw = CASES[name]
    opt = make(**kw)
    start = {k: v.detach().clone() for k, v in _model().named_parameters()}
    expected = _torch_run(T, kw, start, STEPS)
    params = _applied(opt, start, STEPS)
    for k in start:
        assert torch.equal(params[k], expected[k]), (name, k, (params[k] - expected[k]).abs().max().item())


@pytest.mark.parametrize("T", ["RMSprop", "RAdam", "NAdam", "Adagrad"])
def test_the_device_path_with_a_schedule_equals_torch_to_the_bit(T, on_device):
    make = {"RMSprop": optim.rmsprop, "RAdam": optim.radam, "NAdam": optim.nadam, "Adagrad": optim.adagrad}[T]
    params, model = _with_schedule(make, getattr(torch.optim, T))
    for k, p in model.named_parameters():
        assert torch.equal(params[k], p.detach()), (T, k)


def _one_rounding(a: torch.Tensor, b: torch.Tensor, step: torch.Tensor) -> None:
    """``a`` and ``b`` (the same parameters from the same state) differ by at most what rounding
    ``step`` (the added update) once more gives: half an ulp of it, plus one of the result."""
    eps = torch.finfo(a.dtype).eps
    bound = eps * (b.abs() + step.abs())
    assert ((a - b).abs() <= bound).all(), ((a - b).abs() - bound).max().item()


ONE_MORE = {
    "adafactor": lambda lr: optim.adafactor(lr),
    "adafactor_all": lambda lr: optim.adafactor(lr, beta2_decay=-0.5, eps=(1e-20, 1e-2), d=1.5, weight_decay=0.1),
    "rmsprop_momentum_schedule": lambda lr: optim.rmsprop(_sched(lr), momentum=0.9, centered=True, weight_decay=0.1),
}


@pytest.mark.parametrize("name", ONE_MORE)
def test_where_a_step_rounds_once_more_it_stays_within_that_rounding(name, monkeypatch):
    """Each step from the same state: the new state to the bit, the parameters within one rounding
    of the update; and 30 steps agree with torch's as update + apply_updates does."""
    opt = ONE_MORE[name](0.1)
    start = {k: v.detach().clone() for k, v in _model().named_parameters()}
    params, state = start, opt.init(start)
    for step in range(STEPS):
        grads = _grads(start, step)
        monkeypatch.setattr(ew, "on_host", lambda c: False)
        dev_params, dev_state = optim.apply_gradients(opt, grads, state, params)
        monkeypatch.setattr(ew, "on_host", lambda c: True)
        new_params, new_state = optim.apply_gradients(opt, grads, state, params)
        for a, b in zip(optree.tree_leaves(dev_state), optree.tree_leaves(new_state)):
            assert torch.equal(a, b), (name, step)
        for k in params:
            _one_rounding(dev_params[k], new_params[k], new_params[k] - params[k])
        params, state = new_params, new_state
    assert max((params[k] - start[k]).abs().max().item() for k in start) > 1e-3  # it trained


def test_adafactors_device_trajectory_agrees_with_torch(on_device):
    make, T, kw = CASES["adafactor_all"]
    opt = make(**kw)
    start = {k: v.detach().clone() for k, v in _model().named_parameters()}
    expected = _torch_run(T, kw, start, STEPS)
    params = _applied(opt, start, STEPS)
    for k in start:
        torch.testing.assert_close(params[k], expected[k], rtol=1e-5, atol=1e-6)
