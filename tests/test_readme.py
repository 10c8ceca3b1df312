"""The README's claims that a test can check: the paths it names exist, the suite has as many tests
as it says, the examples it lists write what it says, and the commands it quotes print what it
quotes (the ZeRO-3 command here; the training loop in tests/test_docs.py, the examples' outputs in
tests/test_examples.py, which reads its ZeRO-3 flags from the README through :func:`zero3_command`)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


def zero3_command() -> tuple[list[str], list[str]]:
    """The README's ZeRO-3 command (the arguments after the script) and the output lines it quotes."""
    for i, block in enumerate(blocks := re.findall(r"```(\w+)\n(.*?)```", README, re.DOTALL)):
        lang, body = block
        if lang == "bash" and "examples/transformer_lm.py --fully-shard" in body:
            args = shlex.split(body.split("examples/transformer_lm.py", 1)[1])
            quoted = blocks[i + 1][1].strip().splitlines() if blocks[i + 1][0] == "text" else []
            return args, quoted
    raise AssertionError("the README shows no `examples/transformer_lm.py --fully-shard` command")


def test_every_path_the_readme_names_exists() -> None:
    named = set(re.findall(r"\b((?:examples|benchmarks|tools|docs|tests|\.ci)/[\w./-]*[\w/])", README))
    assert len(named) > 20, named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"the README names paths that do not exist: {missing}"


def test_the_suite_has_as_many_tests_as_the_readme_says() -> None:
    m = re.search(r"The suite has (\d+) tests, (\d+) of them marked `cuda`", README)
    assert m, "the README states the suite's size as 'The suite has N tests, M of them marked `cuda`'"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", "-p", "no:cacheprovider"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    found = re.search(r"^(\d+)/(\d+) tests collected", proc.stdout, re.MULTILINE)
    assert found, proc.stdout[-2000:] + proc.stderr[-2000:]
    cuda, total = int(found.group(1)), int(found.group(2))
    assert (total, cuda) == (int(m.group(1)), int(m.group(2))), (
        f"the README says {m.group(1)} tests, {m.group(2)} marked cuda; the suite has {total}, {cuda} marked cuda: "
        "update the README's sentence"
    )


def test_the_examples_table_lists_scripts_that_write_what_it_says() -> None:
    table = README[README.index("## Examples") :]
    scripts = re.findall(r"^\| `examples/(\w+\.py)", table, re.MULTILINE)
    assert set(scripts) >= {"train_digits.py", "zero.py", "diloco.py", "transformer_lm.py"}, scripts
    assert {f"{s}" for s in scripts} == {p.name for p in (ROOT / "examples").glob("*.py")}, "every example is in the table"
    m = re.search(r"all but (.*?) write\s+`metrics\.json` and\s+`curves\.png`", table, re.DOTALL)
    assert m, "the sentence on what the examples write"
    exceptions = set(re.findall(r"`(\w+\.py)`", m.group(1)))
    for script in set(scripts) - exceptions:
        source = (ROOT / "examples" / script).read_text()
        assert "metrics.json" in source and "curves.png" in source, f"{script} does not write metrics.json and curves.png"


def test_the_zero3_command_shows_what_it_claims() -> None:
    """The budget it sets must be exceeded by the unsharded state, or the command shows nothing."""
    args, quoted = zero3_command()
    assert "--budget-mb" in args and "--steps" in args, args
    (verdict,) = [line for line in quoted if line.startswith("the unsharded training state")]
    claim = r"the unsharded training state \(([\d.]+) MiB\) exceeds the budget of ([\d.]+) MiB; sharded over 2 ranks it fits"
    m = re.fullmatch(claim, verdict)
    assert m and float(m.group(1)) > float(m.group(2)) == float(args[args.index("--budget-mb") + 1]), verdict
    (rank0,) = [line for line in quoted if line.startswith("rank 0:")]
    per_rank = float(re.search(r"([\d.]+) MiB per rank", rank0).group(1))
    assert per_rank <= float(m.group(2)) < float(m.group(1)), rank0
    # docs/examples.md shows the same command and the same lines.
    examples = (ROOT / "docs" / "examples.md").read_text()
    assert "examples/transformer_lm.py " + " ".join(args) in examples
    assert all(line in examples for line in quoted)
