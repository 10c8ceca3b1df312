"""Keep the docs true to the code: docstrings carry examples, the README's loop runs and trains."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import fddp

ROOT = Path(__file__).resolve().parent.parent


def _public(module: types.ModuleType) -> list[tuple[str, object]]:
    return [(f"{module.__name__}.{name}", getattr(module, name)) for name in module.__all__]


def _documented_objects() -> list[tuple[str, object]]:
    """Every public function and class of fddp, fddp.optim, fddp.checkpoint, fddp.zero and fddp.diloco."""
    out = []
    for module in (fddp, fddp.optim, fddp.checkpoint, fddp.zero, fddp.diloco):
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


def test_readme_loop_trains(tmp_path: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(_python_block(ROOT / "README.md"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # torchrun's variables, if the suite itself runs under torchrun, would make this a rank of that job.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    losses = [float(m) for m in re.findall(r"epoch \d+: loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 10, proc.stdout
    assert losses[-1] < losses[0] / 4, losses


def test_readme_commands_are_the_quickstart_commands() -> None:
    def commands(path: Path) -> list[str]:
        return re.findall(r"^python -m venv .*$", path.read_text(), re.MULTILINE)

    readme = commands(ROOT / "README.md")
    assert len(readme) == 2 and "torchrun --standalone --nproc-per-node=2" in readme[0]
    assert readme[1].endswith("python -m pytest -q")
    assert commands(ROOT / "docs" / "quickstart.md") == readme
    # CI runs the README's test command.
    assert "\npython -m pytest -q\n" in (ROOT / ".ci" / "run").read_text()


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
    assert len(blocks) == 2, "the Join and PowerSGD loops"
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


def test_lowcomm_loop_runs(tmp_path: Path) -> None:
    (block,) = _marked_blocks(ROOT / "docs" / "lowcomm.md", "run by tests/test_docs.py")
    script = tmp_path / "lowcomm_loop.py"
    # every=30 over the prelude's 5 batches would only count: sync every 2nd step instead.
    script.write_text(PRELUDE + block.replace("every=30", "every=2") + CHECK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", block + proc.stderr
