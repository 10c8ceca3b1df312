"""The README's claims that a test can check: the paths it names exist, its test command is what
.ci/run runs, and, on the examples page the README links, the examples it lists write what it says
and the ZeRO-3 command prints what it quotes (the training loop is checked in tests/test_docs.py,
the examples' outputs in tests/test_examples.py, which reads the ZeRO-3 flags through
:func:`zero3_command`).

The README states how many tests the suite collects, with the commit it counted them at; no test
compares that number with the suite, which would fail on every commit that adds a test."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
EXAMPLES = (ROOT / "docs" / "examples.md").read_text()


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


def zero3_command() -> tuple[list[str], list[str]]:
    """The ZeRO-3 command of docs/examples.md (the arguments after the script) and the output lines it quotes."""
    for i, block in enumerate(blocks := re.findall(r"```(\w+)\n(.*?)```", EXAMPLES, re.DOTALL)):
        lang, body = block
        body = body.replace("\\\n", " ")  # a command continued over several lines
        if lang == "bash" and re.search(r"examples/transformer_lm\.py\s+--fully-shard", body):
            args = shlex.split(body.split("examples/transformer_lm.py", 1)[1])
            quoted = blocks[i + 1][1].strip().splitlines() if blocks[i + 1][0] == "text" else []
            return args, quoted
    raise AssertionError("docs/examples.md shows no `examples/transformer_lm.py --fully-shard` command")


def test_every_path_the_readme_names_exists() -> None:
    # Not \b: it does not match before ".ci/run" (a dot after a space or a backtick).
    named = set(re.findall(r"(?<![\w./-])((?:examples|benchmarks|tools|docs|tests|\.ci)/[\w./-]*[\w/])", README))
    assert {".ci/run", "examples/train_digits.py", "docs/zero.md"} <= named, named
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"the README names paths that do not exist: {missing}"


def _commands(text: str) -> list[list[str]]:
    """Each ``python -m venv ...`` command of ``text``, its continuation lines joined, split at ``&&``."""
    joined = text.replace("\\\n", " ")
    return [[" ".join(step.split()) for step in c.split("&&")] for c in re.findall(r"^python -m venv .*$", joined, re.MULTILINE)]


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """.ci/run installed `.[test,examples,docs,hf,ft]` while the README's command installed `.[test]`:
    three test files skipped at collection for a reader who ran the README's command."""
    (demo, tests) = _commands(README)
    assert tests[-2] == "python -m pytest -q", tests
    installs = [step for step in tests if step.startswith("pip install")]
    assert installs[0].startswith("pip install torch==") and installs[-1] == 'pip install -e ".[test]"', installs
    ci = [line.split("#", 1)[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    ci_installs = [line for line in ci if line.startswith("pip install")]
    assert ci_installs == installs, f".ci/run installs {ci_installs}; the README's test command {installs}"
    # The same test runs, in the same order: the default selection, then the slow fault-tolerance cases.
    runs = [step for step in tests if step.startswith("python -m pytest")]
    assert runs == [line for line in ci if line.startswith("python -m pytest")], (runs, ci)
    # The demo's extra is part of the test extra, so the two commands can share the README's .venv.
    pyproject = (ROOT / "pyproject.toml").read_text()
    (test_extra,) = re.findall(r"^test = \[(.*)\]", pyproject, re.MULTILINE)
    (demo_extra,) = re.findall(r'pip install -e "\.\[(\w+)\]"', " ".join(demo))
    assert f"fddp[{demo_extra}," in test_extra or re.search(rf"fddp\[[\w,]*\b{demo_extra}\b", test_extra), test_extra


def test_the_test_extra_brings_what_every_test_file_imports() -> None:
    """test_ft.py, test_hf.py and test_site.py skip at collection without torchft, transformers and
    mkdocs; the test extra must bring each (through the extras it names)."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = dict(re.findall(r"^(\w+) = \[(.*)\]", pyproject[pyproject.index("[project.optional-dependencies]") :], re.MULTILINE))
    test = extras["test"]
    named = [name for group in re.findall(r"fddp\[([\w,]+)\]", test) for name in group.split(",")]
    brought = test + "".join(extras[name] for name in named)
    skipped_without = set(re.findall(r'importorskip\("(\w+)"', "".join(p.read_text() for p in (ROOT / "tests").glob("*.py"))))
    assert {"torchft", "transformers", "mkdocs"} <= skipped_without, skipped_without
    for module in skipped_without:
        assert re.search(rf'"{module}[\w-]*[=<>\[]|"{module}"', brought), f"the test extra does not bring {module}: {test}"


def test_the_examples_table_lists_scripts_that_write_what_it_says() -> None:
    table = EXAMPLES
    scripts = re.findall(r"^\| `examples/(\w+\.py)", table, re.MULTILINE)
    assert set(scripts) >= {"train_digits.py", "zero.py", "diloco.py", "transformer_lm.py"}, scripts
    assert {f"{s}" for s in scripts} == {p.name for p in (ROOT / "examples").glob("*.py")}, "every example is in the table"
    m = re.search(r"(?i:all but) (.*?) write\s+`metrics\.json` and\s+`curves\.png`", table, re.DOTALL)
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
