"""Run every example briefly, as a user would (``torchrun``, 2 processes), and check that it trains.

Each run is a real launch: ``python -m torch.distributed.run --standalone --nproc-per-node=2``
with a handful of steps. Most examples write ``metrics.json`` and a PNG into ``--out-dir``; the
tests read the metrics to check that the loss fell (and, where the example makes a stronger claim,
that claim) and that the plot file is a PNG. ``examples/resume.py`` (a kill-and-resume fault test)
is run by tests/test_fault.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_docs import quickstart_output_patterns
from test_readme import zero3_command

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TIMEOUT_S = 240  # one launch; on 2 shared cores a launch takes seconds, a hang takes forever
# A gloo group destroyed only at interpreter shutdown can abort a worker with this; fddp.init and
# fddp.shutdown make sure the group is gone before (tests/test_shutdown.py).
TEARDOWN_ABORT = "terminate called without an active exception"


def launch(script: str, *args: str, nproc: int | None = 2, tmp: Path) -> str:
    """Run ``examples/<script>`` under torchrun with ``nproc`` processes (plain python when None)."""
    cmd = [sys.executable]
    if nproc is not None:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(EXAMPLES / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert TEARDOWN_ABORT not in proc.stderr, f"a worker aborted at exit:\n{proc.stderr}"
    return proc.stdout


def read_outputs(out_dir: Path) -> dict:
    png = out_dir / "curves.png"
    assert png.is_file(), f"no plot at {png}"
    assert png.read_bytes()[:8] == PNG_MAGIC, f"{png} is not a PNG"
    return json.loads((out_dir / "metrics.json").read_text())


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_train_digits_trains_and_resumes_to_the_same_numbers(tmp_path: Path) -> None:
    # An uninterrupted 3-epoch run...
    out = launch("train_digits.py", "--epochs", "3", "--out-dir", "full", tmp=tmp_path)
    assert "final test accuracy" in out
    full = read_outputs(tmp_path / "full")
    assert full["world_size"] == 2
    losses = [h["train_loss"] for h in full["history"]]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0], losses
    assert full["history"][-1]["test_acc"] > full["history"][0]["test_acc"]

    # ...and one stopped after epoch 2 (23 steps an epoch: 1437 samples, 32 per rank) then restarted.
    launch("train_digits.py", "--epochs", "3", "--max-steps", "46", "--out-dir", "resumed", tmp=tmp_path)
    assert [h["epoch"] for h in read_outputs(tmp_path / "resumed")["history"]] == [1, 2]
    out = launch("train_digits.py", "--epochs", "3", "--out-dir", "resumed", tmp=tmp_path)
    assert "resumed from" in out and "epoch 2, step 46" in out, out
    resumed = read_outputs(tmp_path / "resumed")
    # Params, optimizer state and data order all come back, so the numbers are the same, exactly.
    numbers = lambda h: {k: v for k, v in h.items() if k != "samples_per_s"}  # noqa: E731 - timing varies
    assert [numbers(h) for h in resumed["history"]] == [numbers(h) for h in full["history"]]


def test_train_digits_output_is_the_quickstarts_and_a_finished_run_says_so(tmp_path: Path) -> None:
    # One process (the cheapest launch): the quick start shows 2, the lines are the same otherwise.
    first = launch("train_digits.py", "--epochs", "2", "--max-steps", "30", "--out-dir", "one", nproc=None, tmp=tmp_path)
    again = launch("train_digits.py", "--epochs", "2", "--max-steps", "30", "--out-dir", "one", nproc=None, tmp=tmp_path)
    assert "training on" not in again and "nothing to train: the run in one already finished" in again, again
    lines = first.splitlines() + again.splitlines()
    for pattern in quickstart_output_patterns():
        assert any(pattern.match(line) for line in lines), f"no output line like the quick start's {pattern.pattern!r}:\n{first}{again}"


def test_train_digits_with_powersgd_resumes_bitwise_and_reaches_the_uncompressed_accuracy(tmp_path: Path) -> None:
    # PowerSGD's state (per-rank residuals, warm-start factors) goes through every step and into
    # the checkpoint as each rank's own: a run stopped after epoch 2 and restarted ends where an
    # uninterrupted one does, to the bit.
    psgd = ("--compression", "powersgd", "--powersgd-rank", "1", "--powersgd-start", "10", "--epochs", "3")
    launch("train_digits.py", *psgd, "--out-dir", "full", tmp=tmp_path)
    launch("train_digits.py", *psgd, "--max-steps", "46", "--out-dir", "resumed", tmp=tmp_path)
    # One checkpoint per epoch, each a directory holding every rank's own PowerSGD state (PerRank).
    saved = sorted((tmp_path / "resumed" / "ckpt").iterdir())
    assert [p.name for p in saved] == ["ckpt-00000001", "ckpt-00000002"] and all((p / "fddp-manifest.pt").is_file() for p in saved)
    out = launch("train_digits.py", *psgd, "--out-dir", "resumed", tmp=tmp_path)
    assert "resumed from" in out
    numbers = lambda m: [{k: v for k, v in h.items() if k != "samples_per_s"} for h in m["history"]]  # noqa: E731
    assert numbers(read_outputs(tmp_path / "resumed")) == numbers(read_outputs(tmp_path / "full"))

    # The default run (20 epochs), uncompressed and with rank-1 PowerSGD after two epochs: the
    # test accuracies (360 digits) agree within one point.
    launch("train_digits.py", "--out-dir", "none", tmp=tmp_path)
    launch("train_digits.py", "--compression", "powersgd", "--out-dir", "powersgd", tmp=tmp_path)
    none, powersgd = (read_outputs(tmp_path / d) for d in ("none", "powersgd"))
    assert powersgd["compression"] == "powersgd" and len(powersgd["history"]) == 20
    assert powersgd["history"][-1]["test_acc"] >= none["history"][-1]["test_acc"] - 0.01, (none["history"][-1], powersgd["history"][-1])


def test_train_digits_runs_under_plain_python(tmp_path: Path) -> None:
    out = launch("train_digits.py", "--epochs", "2", "--max-steps", "30", "--out-dir", "one", nproc=None, tmp=tmp_path)
    assert "training on 1 process(es)" in out
    history = read_outputs(tmp_path / "one")["history"]
    assert history[0]["step"] == 23 and history[1]["step"] == 30  # 1437 samples, 64 a batch
    assert history[1]["train_loss"] < history[0]["train_loss"]


def test_transformer_lm_trains(tmp_path: Path) -> None:
    launch(
        "transformer_lm.py",
        *("--steps", "40", "--warmup", "5", "--micro-batch", "32", "--accum", "2", "--eval-every", "40"),
        *("--out-dir", "lm"),
        tmp=tmp_path,
    )
    m = read_outputs(tmp_path / "lm")
    assert m["world_size"] == 2 and m["step"] == list(range(1, 41))
    assert mean(m["loss"][-5:]) < mean(m["loss"][:5]) - 0.2, m["loss"]
    assert m["lr"][0] == 0.0 and max(m["lr"]) == pytest.approx(3e-3, rel=0.05)  # warmup, then decay
    assert m["lr"][-1] < max(m["lr"])


def test_transformer_lm_fully_sharded_fits_a_budget_the_full_state_exceeds(tmp_path: Path) -> None:
    # The README's command, shortened to 30 steps (the memory it prints does not depend on them),
    # prints the lines the README quotes.
    args, quoted = zero3_command()
    out = launch(
        "transformer_lm.py",
        *args,
        *("--steps", "30", "--warmup", "5", "--micro-batch", "32", "--eval-every", "30", "--out-dir", "lm3"),
        tmp=tmp_path,
    )
    for line in quoted:
        assert line in out.splitlines(), f"the README quotes {line!r}; the command printed:\n{out}"
    assert "exceeds the budget of 10.0 MiB; sharded over 2 ranks it fits" in out
    m = read_outputs(tmp_path / "lm3")
    mem = m["memory"]
    assert mem["unsharded"] > mem["budget"] >= mem["total"]  # 16 bytes a value, unsharded, would not fit
    assert mem["params"] + mem["grads"] + mem["adamw_state"] <= mem["unsharded"] / 2 + 4 * 4 * 64 * 8  # 1/2, padding
    assert mean(m["loss"][-5:]) < mean(m["loss"][:5]) - 0.2, m["loss"]


def test_transformer_lm_trains_with_muon_on_shards(tmp_path: Path) -> None:
    # Muon for the blocks' matrices on ZeRO-3's shards (each matrix orthogonalised by its owner), AdamW for the rest.
    launch(
        "transformer_lm.py",
        *("--muon", "--fully-shard", "--steps", "30", "--warmup", "5", "--micro-batch", "32", "--eval-every", "30"),
        *("--out-dir", "lm-muon"),
        tmp=tmp_path,
    )
    m = read_outputs(tmp_path / "lm-muon")
    assert m["world_size"] == 2 and m["step"] == list(range(1, 31))
    assert mean(m["loss"][-5:]) < mean(m["loss"][:5]) - 0.2, m["loss"]


def test_ensemble_vmap_trains_every_member(tmp_path: Path) -> None:
    launch("ensemble_vmap.py", "--members", "4", "--epochs", "2", "--out-dir", "ens", tmp=tmp_path)
    m = read_outputs(tmp_path / "ens")
    first, last = m["history"][0], m["history"][-1]
    assert len(last["member_loss"]) == 4
    assert all(b < a for a, b in zip(first["member_loss"], last["member_loss"])), (first, last)
    # Different initialisations give different members.
    assert len(set(first["member_loss"])) == 4


def test_port_from_ddp_matches_torch_ddp(tmp_path: Path) -> None:
    out = launch("port_from_ddp.py", "--epochs", "1", "--out-dir", "port", tmp=tmp_path)
    assert "largest parameter difference" in out
    m = read_outputs(tmp_path / "port")
    assert len(m["ddp_loss"]) == len(m["fddp_loss"]) == 29  # 1797 samples, 2 ranks, 32 per rank
    assert mean(m["fddp_loss"][-5:]) < mean(m["fddp_loss"][:5])
    # Same init, same batches, same SGD arithmetic: only float rounding may differ.
    assert m["fddp_loss"] == pytest.approx(m["ddp_loss"], abs=1e-5)
    assert m["max_param_diff"] < 1e-5


def test_uneven_accumulate_trains(tmp_path: Path) -> None:
    # This example prints its loss (full training set, every epoch) and writes no files.
    out = launch("uneven_accumulate.py", "--epochs", "3", "--samples", "800", tmp=tmp_path)
    losses = [float(x) for x in re.findall(r"^epoch +\d+ +steps +\d+ +loss ([0-9.]+)$", out, re.MULTILINE)]
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0], out


def test_meta_learning_matches_one_process_full_batch_run(tmp_path: Path) -> None:
    # The learning rate's hypergradient flows back through every ddp_step; sharded over 2 ranks,
    # the outer loop must compute what one process computes on the full batches.
    args = ("--outer-steps", "6", "--inner", "2")
    launch("meta_learning.py", *args, "--out-dir", "two", tmp=tmp_path)
    launch("meta_learning.py", *args, "--out-dir", "one", nproc=None, tmp=tmp_path)
    two, one = read_outputs(tmp_path / "two"), read_outputs(tmp_path / "one")
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert two["lr"][-1] != two["args"]["lr"]  # the learning rate did move
    for a, b in zip(two["lr"] + two["val_loss"], one["lr"] + one["val_loss"]):
        assert abs(a - b) <= 1e-9 * abs(b), (two, one)


def test_hf_gpt2_trains_samples_and_saves_a_model_that_loads_back(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[hf]'")
    import torch

    out = launch("hf_gpt2.py", "--out-dir", "hf", tmp=tmp_path)
    m = json.loads((tmp_path / "hf" / "metrics.json").read_text())
    assert m["world_size"] == 2 and mean(m["loss"][-5:]) < mean(m["loss"][:5]) / 4, m["loss"]
    assert m["sample"].startswith("klmnop"), out  # it learnt the alphabet, and generate ran on the module
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf" / "model")
    assert model.lm_head.weight is model.transformer.wte.weight  # saved and loaded tied
    prompt = torch.tensor([[10, 11, 12]])  # "klm"
    again = model.generate(prompt, attention_mask=prompt * 0 + 1, max_new_tokens=8, do_sample=False)
    assert "".join("abcdefghijklmnopqrstuvwxyz_"[i] for i in again[0].tolist()) == m["sample"]


def test_zero_trains_sharded_and_resumes_on_one_process(tmp_path: Path) -> None:
    # 2 processes, a sharded checkpoint after step 20; then the same run resumed from it on 1.
    out = launch("zero.py", "--steps", "40", "--save-at", "20", "--out-dir", "two", tmp=tmp_path)
    assert "on 2 process(es)" in out
    two = read_outputs(tmp_path / "two")
    losses = [h["loss"] for h in two["history"]]
    assert len(losses) == 40 and mean(losses[-5:]) < mean(losses[:5]) / 3, losses
    assert two["test_acc"] > 0.8
    # ZeRO: this rank holds half of AdamW's two moments, plus under 64 float32 of padding each (one bucket).
    assert two["state_bytes"] <= two["replicated_state_bytes"] / 2 + 2 * 64 * 4
    launch("zero.py", "--steps", "40", "--resume", "two/ckpt-00000020", "--out-dir", "one", nproc=None, tmp=tmp_path)
    one = read_outputs(tmp_path / "one")
    assert one["world_size"] == 1 and [h["step"] for h in one["history"]] == list(range(21, 41))
    # The same global batches: only the order of the sums differs from the 2-process run.
    for h in one["history"]:
        assert h["loss"] == pytest.approx(two["history"][h["step"] - 1]["loss"], abs=1e-5), h
    assert one["test_acc"] == pytest.approx(two["test_acc"], abs=0.01)


def test_diloco_streams_int8_fragments_checkpoints_mid_run_and_trains(tmp_path: Path) -> None:
    # Streaming DiLoCo with int8 pseudo-gradients. H=20, F=2, tau=3: fragment 1 launches at 17, 37,
    # 57 and merges 3 steps later, so the checkpoint after step 59 (half of 118) holds it in flight.
    out = launch("diloco.py", "--steps", "118", "--every", "20", "--fragments", "2", "--delay", "3", "--mixing", "0.5",
                 "--compression", "int8", "--out-dir", "run", tmp=tmp_path)  # fmt: skip
    assert "final test accuracy" in out
    # It prints where its outputs and its mid-run checkpoint (every rank's own state) are.
    (saved,) = re.findall(r"^step   59  checkpoint of every rank's state: (\S+) ", out, re.M)
    assert saved == os.path.join("run", "ckpt", "ckpt-00000059") and (tmp_path / saved / "fddp-manifest.pt").is_file()
    assert "wrote run/metrics.json and run/curves.png" in out
    m = read_outputs(tmp_path / "run")
    assert m["world_size"] == 2 and m["test_acc"][-1] > 0.8, m["test_acc"]
    assert m["test_loss"][-1] < m["test_loss"][0] / 2
    # 9610 values: float32 would send 4 bytes of each every 20 steps; int8 (and a scale per 256) sends 1.
    assert m["bytes"][-1] / 118 < 9610 * 4 / 20 / 3.5


def test_contrastive_trains_on_the_global_batch(tmp_path: Path) -> None:
    out = launch("contrastive.py", "--steps", "60", "--out-dir", "ctr", tmp=tmp_path)
    assert "held-out retrieval" in out
    m = read_outputs(tmp_path / "ctr")
    first, last = m["history"][0], m["history"][-1]
    assert m["global_batch"] == 2 * 64
    assert last["loss"] < first["loss"] - 0.5, (first, last)
    assert last["test_retrieval"] > 2 * first["test_retrieval"], (first, last)  # chance is 1/256
