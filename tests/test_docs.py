"""Keep the docs true to the code: docstrings carry examples, the README's loop runs and trains."""

from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.util
import inspect
import io
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import optree
import pytest
import torch

import fddp
from dist import run

ROOT = Path(__file__).resolve().parent.parent


def _public(module: types.ModuleType) -> list[tuple[str, object]]:
    return [(f"{module.__name__}.{name}", getattr(module, name)) for name in module.__all__]


def _documented_objects() -> list[tuple[str, object]]:
    """Every public function and class of fddp, fddp.optim, fddp.checkpoint, fddp.zero, fddp.diloco
    and (with torchft installed) fddp.ft."""
    out = []
    modules = [fddp, fddp.optim, fddp.checkpoint, fddp.zero, fddp.diloco]
    if importlib.util.find_spec("torchft") is not None:
        modules.append(importlib.import_module("fddp.ft"))
    for module in modules:
        for name, obj in _public(module):
            if inspect.isfunction(obj) or inspect.isclass(obj):
                out.append((name, obj))
    return out


@pytest.mark.parametrize("name,obj", _documented_objects(), ids=lambda x: x if isinstance(x, str) else "")
def test_public_api_has_docstring_with_example(name: str, obj: object) -> None:
    doc = inspect.getdoc(obj)
    assert doc, f"{name} has no docstring"
    if inspect.isclass(obj) and (issubclass(obj, Exception) or _is_state_record(obj)):
        return  # an exception or an optimizer/compressor state record: described, not called
    assert re.search(r"^Example:$", doc, re.MULTILINE), f"{name}'s docstring has no 'Example:' section"


def _is_state_record(cls: type) -> bool:
    """A NamedTuple whose name ends in State (SGDState, AdamState, ...): plain data, made by init."""
    return issubclass(cls, tuple) and hasattr(cls, "_fields") and cls.__name__.endswith("State")


def _python_block(path: Path) -> str:
    text = path.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    loops = [b for b in blocks if "fddp.init()" in b and "for epoch in" in b]
    assert len(loops) == 1, f"{path}: expected one complete training loop, found {len(loops)}"
    return loops[0]


def test_readme_loop_is_the_docs_loop() -> None:
    assert _python_block(ROOT / "README.md") == _python_block(ROOT / "docs" / "index.md")


def test_readme_loop_trains_under_torchrun(tmp_path: Path) -> None:
    """The README's loop, saved as loop.py and run as it says: two ranks under torchrun."""
    source = _python_block(ROOT / "README.md")
    command = "torchrun --standalone --nproc-per-node=2 loop.py"
    assert command in source.splitlines()[0], "the loop's first line says how to run it"
    script = tmp_path / "loop.py"
    script.write_text(source)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # torchrun's variables, if the suite itself runs under torchrun, would make this a rank of that job.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    argv = [sys.executable, "-m", "torch.distributed.run", *command.split()[1:]]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses = [float(m) for m in re.findall(r"^epoch \d+: mean training loss ([0-9.]+) \(all ranks\)$", proc.stdout, re.M)]
    assert len(losses) == 10, proc.stdout  # rank 0 alone prints, once per epoch
    assert losses[-1] < losses[0] / 4, losses
    (accuracy,) = re.findall(r"^test accuracy ([0-9.]+) on 360 held-out samples$", proc.stdout, re.M)
    assert float(accuracy) > 0.9, proc.stdout
    # The output the README shows after the loop is the loop's, numbers aside.
    readme = (ROOT / "README.md").read_text()
    sample = re.search(r"```text\n(.*?)```", readme[readme.index(source) :], re.DOTALL).group(1)
    for line in sample.splitlines():
        if line != "...":
            parts = re.split(r"(\d+(?:\.\d+)?)", line)  # numbers (even positions hold the text between)
            pattern = "".join(r"[0-9]+(?:\.[0-9]+)?" if k % 2 else re.escape(p) for k, p in enumerate(parts))
            assert re.search(f"^{pattern}$", proc.stdout, re.M), f"the README shows {line!r}; the loop printed:\n{proc.stdout}"


def test_readme_commands_are_the_quickstart_commands() -> None:
    def commands(path: Path) -> list[str]:
        """Each ``python -m venv ...`` command, its backslash-continued lines joined into one."""
        text = path.read_text().replace("\\\n", " ")
        return [" ".join(c.split()) for c in re.findall(r"^python -m venv .*$", text, re.MULTILINE)]

    readme = commands(ROOT / "README.md")
    assert len(readme) == 2 and "torchrun --standalone --nproc-per-node=2" in readme[0]
    assert readme[1].endswith("python -m pytest -q && python -m pytest -q -m slow_ft tests/test_ft.py")
    assert commands(ROOT / "docs" / "quickstart.md") == readme
    # CI runs the README's test command (tests/test_readme.py compares the two in full).
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npython -m pytest -q\n" in ci and "\npython -m pytest -q -m slow_ft tests/test_ft.py\n" in ci


PRELUDE = """
import torch, torch.nn.functional as F, fddp
fddp.init()
torch.manual_seed(0)
apply_fn, params = fddp.functionalize(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)))
opt = fddp.optim.sgd(lr=0.1)
opt_state = opt.init(params)
xs, ys = torch.randn(5, 4, 8), torch.randint(0, 3, (5, 4))
loader = list(zip(xs, ys))
def loss_fn(params, x, y):
    return F.cross_entropy(apply_fn(params, x), y)
before = {k: v.clone() for k, v in params.items()}
"""
CHECK = "\nassert all(not torch.equal(before[k], params[k]) for k in params), 'the loop did not train'\nprint('ok')\n"


def _marked_blocks(path: Path, marker: str) -> list[str]:
    return re.findall(rf"<!-- {re.escape(marker)}[^\n]*-->\n```python\n(.*?)```", path.read_text(), re.DOTALL)


def test_concepts_loops_run(tmp_path: Path) -> None:
    blocks = _marked_blocks(ROOT / "docs" / "concepts.md", "run by tests/test_docs.py")
    assert len(blocks) == 3, "the Join, PowerSGD and injected-hyperparameter loops"
    for i, block in enumerate(blocks):
        script = tmp_path / f"loop{i}.py"
        script.write_text(PRELUDE + block + CHECK)
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", block + proc.stderr


def test_quickstart_lists_every_flag_of_the_main_example() -> None:
    source = (ROOT / "examples" / "train_digits.py").read_text()
    flags = set(re.findall(r'add_argument\("(--[a-z-]+)"', source))
    text = (ROOT / "docs" / "quickstart.md").read_text()
    listed = set(re.findall(r"`(--[a-z-]+)`", text[text.index("Flags:") :].split("\n\n")[0]))
    assert listed == flags, f"quickstart lists {sorted(listed)}, train_digits.py has {sorted(flags)}"


def quickstart_output_patterns() -> list[re.Pattern]:
    """The quick start's sample output lines, numbers and paths made wildcards."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    lines = [line for block in re.findall(r"```text\n(.*?)```", text, re.DOTALL) for line in block.splitlines()]
    patterns = []
    for line in lines:
        if line.strip() == "...":
            continue
        parts = re.split(r"(runs/digits|\d[\d.,]*|\s+)", line)
        wild = {"runs/digits": r"\S+?"}
        regex = "".join(
            wild.get(p) or (r"[\d.,]+" if p[:1].isdigit() else r"\s+" if p.isspace() else re.escape(p)) for p in parts
        )
        patterns.append(re.compile(regex + "$"))
    return patterns


def test_zero_loop_runs(tmp_path: Path) -> None:
    (block,) = _marked_blocks(ROOT / "docs" / "zero.md", "run by tests/test_docs.py")
    script = tmp_path / "zero_loop.py"
    script.write_text(PRELUDE + block + CHECK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", block + proc.stderr


# --- the BatchNorm loop: two ranks, against torch DDP with broadcast_buffers=True --------------------

# torch 2.13 renamed DDP's broadcast_buffers (deprecated) to forward_sync_buffers: the same broadcast.
_DDP_ARGS = inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
BROADCAST_BUFFERS = {"forward_sync_buffers" if "forward_sync_buffers" in _DDP_ARGS else "broadcast_buffers": True}


PER_STEP_SYNC = "buffers = fddp.sync_buffers(buffers)  # rank 0's statistics on every rank, as DDP before each forward"


def _batchnorm_block() -> str:
    text = (ROOT / "docs" / "concepts.md").read_text()
    (block,) = re.findall(r"<!-- the BatchNorm loop below [^\n]*-->\n```python\n(.*?)```", text, re.DOTALL)
    # What the DDP reference below repeats: keep the two in step.
    for line in ("fddp.optim.sgd(lr=0.05, momentum=0.9)", "F.cross_entropy(out, y)", "fddp.shutdown()\n", PER_STEP_SYNC):
        assert line in block, line
    return block.replace("fddp.shutdown()\n", "")  # the test's process group outlives the loop


def _run_block(block: str) -> tuple[dict, list, str]:
    """Run the docs' loop, recording the initial module and every forward (train: x, y; eval: x)."""
    seen: dict = {"events": []}
    real_functionalize, real_grad_and_value = fddp.functionalize_with_buffers, fddp.grad_and_value

    def functionalize_with_buffers(model, **kwargs):
        seen["model"] = copy.deepcopy(model)
        apply_fn, params, buffers = real_functionalize(model, **kwargs)

        def recording(p, b, x):
            if not model.training:
                seen["events"].append(("eval", x))
            return apply_fn(p, b, x)

        return recording, params, buffers

    def grad_and_value(fn, *args, **kwargs):
        step = real_grad_and_value(fn, *args, **kwargs)

        def recording(params, buffers, x, y):
            seen["events"].append(("train", x, y))
            return step(params, buffers, x, y)

        return recording

    ns: dict = {}
    out = io.StringIO()
    fddp.functionalize_with_buffers, fddp.grad_and_value = functionalize_with_buffers, grad_and_value
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block, "docs/concepts.md", "exec"), ns)
    finally:
        fddp.functionalize_with_buffers, fddp.grad_and_value = real_functionalize, real_grad_and_value
    return ns, seen, out.getvalue()


def _batchnorm_loop_worker(block: str, directory: str) -> dict:
    os.chdir(directory)  # the loop checkpoints to runs/bn
    ns, seen, printed = _run_block(block)
    trained = {"params": ns["params"], "buffers": ns["buffers"], "opt_state": ns["opt_state"]}
    module = {k: v.detach().clone() for k, v in [*ns["model"].named_parameters(), *ns["model"].named_buffers()]}

    # torch DDP from the same module on the same batches, evaluating where the loop did.
    ddp = torch.nn.parallel.DistributedDataParallel(seen["model"], **BROADCAST_BUFFERS)
    torch_opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for event in seen["events"]:
        if event[0] == "train":
            ddp.train()
            torch_opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(event[1]), event[2]).backward()
            torch_opt.step()
        else:
            ddp.eval()
            with torch.no_grad():
                reference_logits = ddp(event[1])
    reference = dict(seen["model"].named_parameters()), dict(seen["model"].named_buffers())

    resumed, seen_again, printed_again = _run_block(block)  # finds the last checkpoint: nothing left to train
    os.makedirs("variant", exist_ok=True)  # both ranks
    os.chdir("variant")  # a fresh run without the sync before each training forward (the docs say why)
    variant = _run_block(block.replace(PER_STEP_SYNC, "pass"))[0]
    return {
        "trained": trained, "module": module, "logits": ns["logits"], "printed": printed,
        "reference": ({k: v.detach() for k, v in reference[0].items()}, reference[1]), "reference_logits": reference_logits,
        "events": [e[0] for e in seen["events"]], "events_again": len(seen_again["events"]), "printed_again": printed_again,
        "resumed": {"params": resumed["params"], "buffers": resumed["buffers"], "opt_state": resumed["opt_state"]},
        "variant": {"params": variant["params"], "buffers": variant["buffers"]},
    }  # fmt: skip


def test_batchnorm_loop_matches_ddp_and_resumes(tmp_path: Path) -> None:
    results = run(_batchnorm_loop_worker, 2, _batchnorm_block(), str(tmp_path), timeout=180)
    for r in results:
        assert r["events"] == (["train"] * 14 + ["eval"]) * 3, r["events"]  # 448 samples, 2 ranks, 16 a batch
        ref_params, ref_buffers = r["reference"]
        for k, v in ref_params.items():  # float32 after 42 steps
            torch.testing.assert_close(r["trained"]["params"][k], v, rtol=0, atol=1e-5, msg=k)
        for k, v in ref_buffers.items():
            torch.testing.assert_close(r["trained"]["buffers"][k], v, rtol=0, atol=1e-5, msg=k)
        torch.testing.assert_close(r["logits"], r["reference_logits"], rtol=0, atol=1e-4)
        for k, v in {**r["trained"]["params"], **r["trained"]["buffers"]}.items():  # load_into wrote the module
            assert torch.equal(r["module"][k], v), k
        # The second run resumed from the checkpoint of epoch 2, and had nothing left to train.
        assert r["events_again"] == 0 and r["printed_again"] == ""
        for part in ("params", "buffers"):
            for k, v in r["trained"][part].items():
                assert torch.equal(r["resumed"][part][k], v), (part, k)
        for a, b in zip(optree.tree_leaves(r["resumed"]["opt_state"]), optree.tree_leaves(r["trained"]["opt_state"])):
            assert torch.equal(a, b)
        # BatchNorm's training forward never reads its statistics: syncing them before eval and saving only
        # gives the same values, to the bit.
        for part in ("params", "buffers"):
            for k, v in r["trained"][part].items():
                assert torch.equal(r["variant"][part][k], v), (part, k)
    lines = results[0]["printed"].splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1", "epoch 2"] and results[1]["printed"] == "", lines
    accuracy = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert accuracy[-1] > 0.5, lines  # four classes: chance is 0.25
    # Every rank evaluated with rank 0's statistics, as under DDP.
    for k, v in results[0]["trained"]["buffers"].items():
        assert torch.equal(results[1]["trained"]["buffers"][k], v), k


def test_lowcomm_loop_runs(tmp_path: Path) -> None:
    (block,) = _marked_blocks(ROOT / "docs" / "lowcomm.md", "run by tests/test_docs.py")
    script = tmp_path / "lowcomm_loop.py"
    # every=30 over the prelude's 5 batches would only count: sync every 2nd step instead.
    script.write_text(PRELUDE + block.replace("every=30", "every=2") + CHECK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", block + proc.stderr


def test_bf16_loss_in_float32(tmp_path: Path) -> None:
    """docs/zero.md's mixed-precision loss: under param_dtype=bf16 the logits are bf16; the docs cast
    them to float32 before the loss, which then matches a float64 loss on the same logits (a bf16
    loss is off by up to half its step, about 0.004 at 2.3)."""
    (block,) = re.findall(r"<!-- the bf16 loss below [^\n]*-->\n```python\n(.*?)```", (ROOT / "docs" / "zero.md").read_text(), re.DOTALL)
    prelude = (
        "import torch, torch.nn.functional as F, fddp\nfddp.init()\ntorch.manual_seed(0)\n"
        "model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))\n"
        "x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))\n"
    )
    check = (
        "\nlogits = apply_fn(shards, x)\n"
        "reference = F.cross_entropy(logits.double(), y)\n"
        "bf16 = F.cross_entropy(logits, y)\n"
        "assert logits.dtype == bf16.dtype == torch.bfloat16, (logits.dtype, bf16.dtype)\n"
        "assert loss.dtype == torch.float32 and abs(loss.item() - reference.item()) < 1e-6, (loss, reference)\n"
        "assert abs(bf16.item() - reference.item()) > 1e-4, (bf16, reference)  # what the cast avoids\n"
        "import optree\n"
        "assert {g.dtype for g in optree.tree_leaves(grads)} == {torch.float32}\n"
        "fddp.shutdown()\nprint('ok')\n"
    )
    script = tmp_path / "bf16_loss.py"
    script.write_text(prelude + block + check)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", block + proc.stdout + proc.stderr
