"""Bad input gets an error that names what arrived, where (the leaf's path), and the fix.

Each case here used to end in an error from deep inside torch (``result type Float can't be cast
to the desired output type Long``, ``torch.cat(): input types can't be cast``, ``zeros_like():
argument 'input' must be Tensor``, ``leaf '<root>' is Linear``), in a silently wrong result (NaN
gradients for a step where no rank had data, complex gradients sent in half precision without
their imaginary part), or in advice that did not fit (launch with torchrun, when already under
torchrun). Where ranks are involved, two gloo ranks raise the same error and stay in step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fddp
from dist import run
from fddp import optim


def _message(fn) -> str:
    """The message of the TypeError/ValueError ``fn()`` raises (an AssertionError when it raises none)."""
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError("no error")


# --- gradient dtypes: integers and bools are no gradients; complex ones cannot travel in half precision ---


def _dtype_worker() -> dict:
    params = {"w": torch.zeros(3), "step": torch.zeros((), dtype=torch.int64)}
    grads = {"w": torch.ones(3), "step": torch.ones((), dtype=torch.int64)}
    out = {"int": _message(lambda: fddp.ddp_step(params, grads))}
    params = {"w": torch.zeros(3), "x": torch.zeros(2, dtype=torch.bool), "y": torch.zeros(2, dtype=torch.int32)}
    grads = {"w": torch.ones(3), "x": torch.ones(2, dtype=torch.bool), "y": torch.ones(2, dtype=torch.int32)}
    out["bool"] = _message(lambda: fddp.ddp_step(params, grads))  # two bad leaves: the first in the tree is named
    # Both ranks raised after agreeing on the call: the next one runs, and averages right.
    g = fddp.ddp_step({"w": torch.zeros(3)}, {"w": torch.full((3,), float(fddp.rank()))})
    out["after"] = g["w"]
    return out


def test_integer_and_bool_gradients_name_the_leaf_on_every_rank():
    for out in run(_dtype_worker, 2):
        assert "fddp.ddp_step: gradients must be floating point or complex, but grad 'step' is torch.int64" in out["int"], out
        assert "but grad 'x' is torch.bool" in out["bool"], out
        assert "fddp.sync_buffers" in out["int"]  # where integer state goes instead
        assert torch.equal(out["after"], torch.full((3,), 0.5))


def _complex_worker() -> dict:
    rank = fddp.rank()
    params = {"c": torch.zeros(4, 4, dtype=torch.complex64), "r": torch.zeros(3)}
    # Integer-valued parts: the mean over two ranks is exact.
    grads = {"c": torch.full((4, 4), complex(1 + rank, 2 - 4 * rank), dtype=torch.complex64), "r": torch.full((3,), 1.0 + rank)}
    out = {}
    cases = {
        "bf16": dict(compression="bf16"),
        "fp16": dict(compression="fp16"),
        "powersgd": dict(
            compression=fddp.PowerSGD(rank=1, start_iter=0),
            compression_state=fddp.PowerSGD(rank=1, start_iter=0).init(params),
            return_info=True
        ),
        "zero-cast": dict(compression=fddp.zero.ReduceScatter(inner=fddp.Cast(torch.bfloat16))),
    }
    for name, kwargs in cases.items():
        out[name] = _message(lambda: fddp.ddp_step(params, grads, **kwargs))
    step = fddp.grad_and_value(lambda p: (p["c"].abs() ** 2).sum() + p["r"].sum(), compression="bf16")
    out["grad_and_value"] = _message(lambda: step(params))
    out["plain"] = fddp.ddp_step(params, grads)  # complex gradients travel fine uncompressed
    return out


def test_complex_gradients_with_compression_name_the_leaf_and_the_fix():
    for out in run(_complex_worker, 2):
        for name in ("bf16", "fp16", "zero-cast", "grad_and_value"):
            assert "cannot carry grad 'c', a torch.complex64 leaf" in out[name], (name, out[name])
            assert "no imaginary part" in out[name] and "compression=None" in out[name], out[name]
        assert "compression='bf16'" in out["bf16"] and "compression='fp16'" in out["fp16"]
        assert "PowerSGD" in out["powersgd"] and "conjugate transposes" in out["powersgd"], out["powersgd"]
        assert torch.equal(out["plain"]["c"], torch.full((4, 4), complex(1.5, 0.0), dtype=torch.complex64))
        assert torch.equal(out["plain"]["r"], torch.full((3,), 1.5))


# --- weights ---------------------------------------------------------------------------------------


def _bad_weight_worker() -> dict:
    p, g = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    step = fddp.grad_and_value(lambda q: q["w"].sum())
    bad = {
        "str": "3", "negative": -1, "nan": float("nan"), "inf": float("inf"), "tensor nan": torch.tensor(float("nan")),
        "bool": True, "vector": torch.ones(2),
    }  # fmt: skip
    out = {k: _message(lambda: fddp.ddp_step(p, g, weight=w)) for k, w in bad.items()}
    out["grad_and_value str"] = _message(lambda: step(p, weight="3"))
    return out


def test_bad_weights_are_refused_with_what_arrived():
    out = run(_bad_weight_worker, 1)[0]
    assert out["str"] == (
        "TypeError: fddp.ddp_step: weight must be a number or a one-element tensor (this rank's sample count), got str '3'"
    )
    for k, shown in (("negative", "-1.0"), ("nan", "nan"), ("inf", "inf"), ("tensor nan", "nan")):
        assert out[k] == f"ValueError: fddp.ddp_step: weight must be a finite number >= 0 (this rank's sample count), got {shown}", out[k]
    assert "got bool True" in out["bool"] and "got shape (2,)" in out["vector"]
    assert out["grad_and_value str"].startswith("TypeError: fddp.grad_and_value: weight must be a number"), out


def _weightless_worker() -> dict:
    """Every rank out of data (weight 0), its gradients NaN (the mean of an empty loss)."""
    out = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64):
        p, g = {"w": torch.zeros(5, dtype=dtype)}, {"w": torch.full((5,), float("nan"), dtype=dtype)}
        for compression in (None, "bf16"):
            if compression and dtype.is_complex:
                continue
            grads, info = fddp.ddp_step(p, g, weight=0, compression=compression, return_info=True)
            out[(str(dtype), compression)] = (grads["w"], float(info.weight))
    step = fddp.grad_and_value(lambda q, x: (q["w"] * x).mean(), return_info=True)
    grads, _, info = step({"w": torch.zeros(3)}, torch.zeros(0, 3), weight=0)  # an empty batch: NaN
    out["grad_and_value"] = (grads["w"], float(info.weight))
    rs = fddp.zero.ReduceScatter(strategy="reduce_scatter")
    shards = fddp.ddp_step({"w": torch.zeros(300)}, {"w": torch.ones(300)}, weight=0, compression=rs)
    out["zero"] = (torch.cat([s.reshape(-1) for s in shards.shards]), 0.0)
    return out


def test_weight_zero_on_every_rank_gives_zero_gradients_in_every_dtype():
    for out in run(_weightless_worker, 2):
        assert len(out) == 11  # 9 dtype and compression pairs, grad_and_value, ZeRO
        for case, (g, total) in out.items():
            assert total == 0.0 and not g.isnan().any() and torch.equal(g, torch.zeros_like(g)), (case, g)


# --- optimizers: init, arguments in the wrong place, and the state's name ------------------------------


OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1, momentum=0.9),
    "adamw": lambda: optim.adamw(1e-3),
    "accumulate": lambda: optim.accumulate(optim.sgd(0.1), 2),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_init_names_a_leaf_that_is_no_tensor(name):
    msg = _message(lambda: OPTIMIZERS[name]().init({"a": {"b": [torch.zeros(2), 1.5]}}))
    assert msg.startswith(f"TypeError: {name}.init: every parameter must be a tensor, but leaf 'a/b/1' is float"), msg
    assert "torch.tensor(value)" in msg


def test_state_in_the_wrong_place_says_where_it_went():
    params = {"w": torch.zeros(3)}
    grads = {"w": torch.ones(3)}
    for opt, state_name in ((optim.adamw(1e-3), "an AdamState"), (optim.sgd(0.1), "an SGDState")):
        state = opt.init(params)
        msg = _message(lambda: optim.apply_gradients(opt, grads, params, state))
        assert f"the 4th argument is {state_name} (an optimizer state) where the parameters go" in msg, msg
        assert "apply_gradients(opt, grads, state, params)" in msg
        msg = _message(lambda: optim.apply_gradients(opt, state, grads, params))
        assert f"the 2nd argument is {state_name} (an optimizer state) where the gradients go" in msg, msg
        msg = _message(lambda: opt.update(grads, params, state))
        assert f"got the optimizer state ({state_name}) as params and a dict as the state" in msg, msg
        assert "update(grads, state, params)" in msg
    msg = _message(lambda: optim.sgd(0.1).update(grads, optim.adam().init(params), params))
    assert "sgd.update: expected an SGDState (from this optimizer's init) as the state, got AdamState" in msg, msg
    chained = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    msg = _message(lambda: optim.apply_gradients(chained, grads, params, chained.init(params)))
    assert "the 4th argument is a tuple (an optimizer state)" in msg, msg


def test_no_message_says_a_before_a_vowel():
    """fddp's "a <Name>" grammar, in the optimizer, checkpoint and Join messages."""
    params = {"w": torch.zeros(3)}
    msg = _message(lambda: optim.adamw(1e-3).update(params, {"w": 1}, params))
    assert "expected an AdamState" in msg and "a AdamState" not in msg, msg
    msg = _message(lambda: fddp.Join([1]).done(3))
    assert "got an int" in msg, msg


# --- a module where values go ----------------------------------------------------------------------------


def _module_worker() -> dict:
    model = torch.nn.Linear(2, 2)
    _, params = fddp.functionalize(model)
    return {
        "ddp_step": _message(lambda: fddp.ddp_step(model, params)),
        "ddp_step grads": _message(lambda: fddp.ddp_step(params, model)),
        "grad": _message(lambda: fddp.grad(lambda p: p)(model)),
        "grad_and_value": _message(lambda: fddp.grad_and_value(lambda p, m: p["bias"].sum(), argnums=1)(params, model)),
        "broadcast": _message(lambda: fddp.broadcast(model)),
        "verify_replicas": _message(lambda: fddp.verify_replicas(model)),
        "sync_buffers": _message(lambda: fddp.sync_buffers(model)),
        "nested": _message(lambda: fddp.ddp_step({"net": model}, {"net": model})),
    }


def test_a_module_where_params_go_says_functionalize():
    out = run(_module_worker, 1)[0]
    fix = "call `apply_fn, params = fddp.functionalize(model)` and pass params"
    for what in ("ddp_step", "grad", "grad_and_value", "broadcast", "verify_replicas"):
        assert out[what].startswith(f"TypeError: fddp.{what}: "), out[what]
        assert "got the module Linear itself" in out[what] and fix in out[what], out[what]
    assert "fddp.ddp_step: params must be a pytree of tensors" in out["ddp_step"]
    assert "fddp.ddp_step: grads must be a pytree of tensors" in out["ddp_step grads"]
    assert "fddp.grad_and_value: argument 1 (argnums=1) must be" in out["grad_and_value"]
    assert "fddp.sync_buffers: buffers must be a pytree" in out["sync_buffers"]
    assert "functionalize_with_buffers(model)" in out["sync_buffers"]
    assert "leaf 'net' is Linear" in out["nested"] and fix in out["nested"], out["nested"]

    opt = optim.adamw(1e-3)
    model = torch.nn.Linear(2, 2)
    _, params = fddp.functionalize(model)
    grads = {k: torch.ones_like(v) for k, v in params.items()}
    state = opt.init(params)
    for msg, start in (
        (_message(lambda: opt.init(model)), "adamw.init: expected the parameters as a pytree of tensors"),
        (_message(lambda: opt.update(grads, state, model)), "adamw.update: params must be a pytree of tensors"),
        (_message(lambda: opt.update(model, state, params)), "adamw.update: grads must be a pytree of tensors"),
        (_message(lambda: optim.apply_gradients(opt, grads, state, model)), "fddp.optim.apply_gradients: params must be"),
        (_message(lambda: optim.apply_gradients(opt, model, state, params)), "fddp.optim.apply_gradients: grads must be"),
    ):
        assert msg.startswith("TypeError: " + start) and fix in msg, msg


# --- the process group not initialised: advice for where the process runs ----------------------------------


def test_not_initialised_says_what_fits_the_environment():
    script = textwrap.dedent(
        """
        import sys, torch, fddp
        def message():
            try:
                fddp.ddp_step({"w": torch.ones(1)}, {"w": torch.ones(1)})
            except RuntimeError as e:
                return str(e)
        print(message())
        if sys.argv[1] == "shutdown":
            fddp.init(); fddp.shutdown()
            print(message())
        """
    )
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}

    def lines(env: dict, arg: str = "-") -> list[str]:
        proc = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, timeout=120, env={**base, **env})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    start = "fddp.ddp_step: the torch.distributed process group is not initialised. "
    (plain,) = lines({})
    assert plain.startswith(start + "Call fddp.init() first") and "torchrun --nproc-per-node=N" in plain, plain
    (under,) = lines(torchrun)
    assert "torchrun's variables are set here (RANK=1, WORLD_SIZE=2): call fddp.init()" in under, under
    assert "launch" not in under, under  # it was launched already
    (partial,) = lines({"RANK": "1", "WORLD_SIZE": "2"})
    assert "only partly set (RANK, WORLD_SIZE set; MASTER_ADDR, MASTER_PORT missing)" in partial, partial
    first, after = lines({}, "shutdown")
    assert "fddp.shutdown() ended this process's group earlier; call fddp.init() again" in after, after


# --- ZeRO's shards: the fix for the stage the tree is at ----------------------------------------


def test_stage3_shards_errors_point_to_the_gathered_tree_and_to_init_on_the_shards():
    fddp.init()
    apply_fn, shards = fddp.zero.fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    message = _message(lambda: fddp.verify_replicas(shards))
    assert "fddp.verify_replicas: got fully sharded parameters (ZeRO stage 3" in message
    assert "fddp.verify_replicas(fddp.zero.unshard(shards))" in message and "need no sync" not in message
    fddp.verify_replicas(fddp.zero.unshard(shards))  # what it says to do works
    # The optimizer state made from the gathered tree, stepped with the shards: stage 3's fix.
    opt = optim.adamw(1e-3)
    state = opt.init(fddp.zero.unshard(shards))
    grads = torch.func.grad(lambda s: apply_fn(s, torch.randn(3, 4)).square().mean())(shards)
    for step in (lambda: optim.apply_gradients(opt, grads, state, shards), lambda: opt.update(grads, state, shards)):
        message = _message(step)
        assert "ZeRO stage 3" in message and "state = opt.init(shards)" in message, message
        assert "ReduceScatter" not in message and "fddp.zero.shard(" not in message, message
    optim.apply_gradients(opt, grads, opt.init(shards), shards)  # and the fix works
    # Stage 2's shards keep stage 2's words, pointing to the gathered tree too.
    stage2 = fddp.zero.shard(fddp.zero.unshard(shards))
    assert "verify_replicas(fddp.zero.unshard(shards))" in _message(lambda: fddp.verify_replicas(stage2))
    assert "ReduceScatter" in _message(lambda: opt.update(stage2, opt.init(fddp.zero.unshard(shards)), stage2))
