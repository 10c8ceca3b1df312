"""The step benchmark runs as its docs say, and what it records is what it ran.

One short launch (2 processes, 1 repeat of 1 step): the numbers are not timed here (no test
asserts a time), only that every requested mode ran on the model the benchmark was not tuned on
and that the bytes it says each mode sent are the ones its buckets hold.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_step_benchmark_runs_the_lm_and_the_optax_split(tmp_path: Path) -> None:
    out = tmp_path / "step"
    modes = ["grad_and_value", "grad_and_value_optax", "ddp_step"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(BENCHMARKS / "step.py")]
    cmd += ["--models", "lm", "--modes", *modes, "--repeats", "1", "--steps", "1", "--warmup", "1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    data = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    lm = data["results"]["lm"]
    assert (lm["values"], lm["tensors"]) == (2580608, 54)
    # The floors and DDP always run: every ratio needs them.
    assert set(lm["modes"]) == {*modes, "floor_torch", "floor_fddp", "floor_gav", "ddp"}
    for mode, r in lm["modes"].items():
        assert len(r["all_ms"]) == 1 and math.isfinite(r["median_ms"]) and r["median_ms"] > 0, (mode, r)
    assert lm["modes"]["ddp"]["ratio_to_ddp"] == 1.0
    # fp32 gradients, every value sent once per step, in DDP's buckets (1 MiB first, then 25 MiB).
    for mode in ("ddp", *modes):
        assert lm["modes"][mode]["bytes"] == 4 * lm["values"], mode
        assert lm["modes"][mode]["collectives"] == 2, mode
    assert len(data["load_avg"]["before"]) == 3


def test_overhead_benchmark_records_every_row(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    cmd = [sys.executable, str(BENCHMARKS / "overhead.py"), "--leaves", "3", "--repeats", "3", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    rows = json.loads(out.read_text())["results_us"]["3"]
    assert rows["grad overhead"] == rows["fddp.grad"] - rows["autograd.grad + no-op hooks"]
    assert rows["optimizer overhead"] == rows["fddp.optim.apply_gradients"] - rows["torch.optim.SGD.step()"]
    assert all(math.isfinite(v) for v in rows.values()) and rows["ddp_step"] > 0


def test_agreement_benchmark_times_the_head_and_its_references(tmp_path: Path) -> None:
    out = tmp_path / "agreement.json"
    script = str(BENCHMARKS / "agreement.py")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*launch, script, "--repeats", "20", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    record = json.loads(out.read_text())
    assert record["world"] == 2
    assert set(record["median_us"]) == {
        "agreement head", "all_reduce, 8 floats", "all_reduce, 40 floats", "ddp_step, 10 x 4 floats", "psum, 10 x 4 floats",
        "one-rank all_reduce", "all_reduce after 50 µs of host work", "all_reduce after 100 µs of host work",
    }  # fmt: skip
    assert all(math.isfinite(v) and v > 0 for v in record["median_us"].values())
    assert record["median_us"]["all_reduce after 100 µs of host work"] >= 100  # the host work is really done
    assert set(record["ratio_to_raw_all_reduce"]) == {
        "ddp_step, 10 x 4 floats", "psum, 10 x 4 floats", "all_reduce after 50 µs of host work", "all_reduce after 100 µs of host work",
    }  # fmt: skip


def test_round_trips_benchmark_times_every_way_a_header_could_travel(tmp_path: Path) -> None:
    out = tmp_path / "round_trips.json"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*launch, str(BENCHMARKS / "round_trips.py"), "--repeats", "5", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    record = json.loads(out.read_text())
    assert record["world"] == 2
    assert set(record["times_us"]) == {"one", "sequential", "concurrent", "side group"}
    assert all(len(ts) == 5 and all(math.isfinite(v) and v > 0 for v in ts) for ts in record["times_us"].values())


def test_checkpoint_benchmark_records_every_call(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint.json"
    cmd = [sys.executable, str(BENCHMARKS / "checkpoint.py"), "--mb", "2", "--leaves", "4", "--repeats", "1"]
    cmd += ["--dir", str(tmp_path), "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    res = json.loads(out.read_text())["results_ms"]
    calls = {"save", "load", "save_sharded", "load_sharded"}
    for clock in ("wall", "cpu"):
        assert set(res[f"{clock} verified"]) == set(res[f"{clock} unverified"]) == calls
        for k in calls:
            assert res[f"{clock} ratio"][k] == res[f"{clock} verified"][k] / res[f"{clock} unverified"][k] > 0
    assert os.listdir(tmp_path) == ["checkpoint.json"]  # nothing left behind in --dir


def test_lowcomm_benchmark_counts_one_hth_of_ddps_bytes(tmp_path: Path) -> None:
    out = tmp_path / "lowcomm.json"
    modes = ["ddp", "fddp_bf16", "diloco_H10_w0", "stream_H10_w0_int8", "diloco_H10_e3m0", "diloco_H10_eager_int2"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(BENCHMARKS / "lowcomm.py")]
    cmd += ["worker", "--out", str(out), "--modes", *modes, "--steps", "30", "--diloco-steps", "30", "--eval-every", "10",
            "--fragments", "2", "--delay", "2", "--task", "regression"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    res = json.loads(out.read_text())["results"]
    assert set(res) == set(modes)
    ddp = res["ddp"]["bytes_per_step"]
    assert ddp == 4 * res["ddp"]["values"]  # every float32 gradient, every step
    assert res["fddp_bf16"]["bytes_per_step"] / ddp == 0.5
    assert res["diloco_H10_w0"]["bytes_per_step"] / ddp == 0.1  # one all-reduce of the pseudo-gradients per 10 steps
    # Three rounds of two fragments in int8 (1 byte a value, a 4-byte scale per 256): 1/10 of a quarter.
    assert abs(res["stream_H10_w0_int8"]["bytes_per_step"] / ddp / (0.1 * (1 + 4 / 256) / 4) - 1) < 0.01
    # 4 and 2 bits a value and a 4-byte scale per 128 (eager: the syncs launched, counted as those landed).
    assert abs(res["diloco_H10_e3m0"]["bytes_per_step"] / ddp / (0.1 * (0.5 + 4 / 128) / 4) - 1) < 0.01
    assert abs(res["diloco_H10_eager_int2"]["bytes_per_step"] / ddp / (0.1 * (0.25 + 4 / 128) / 4) - 1) < 0.01
    assert all(len(r["eval_loss"]) == 3 for r in res.values())


def test_muon_benchmark_counts_the_exchange_apart(tmp_path: Path) -> None:
    out = tmp_path / "muon.json"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd = [*launch, str(BENCHMARKS / "muon.py"), "--width", "32", "--layers", "1", "--vocab", "64", "--seq", "8"]
    cmd += ["--repeats", "1", "--steps", "1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    record = json.loads(out.read_text())
    r = record["results"]
    assert set(r) == {"muon_replicated", "muon_zero1", "muon_zero2", "adamw_zero1", "adamw_zero2"}
    assert all(math.isfinite(m["median_ms"]) and m["median_ms"] > 0 for m in r.values())
    assert r["muon_replicated"]["exchange"] == r["adamw_zero2"]["exchange"] == 0
    # Each rank sends at most its pieces of the matrices (bfloat16) to their owners, and gets them back.
    assert 0 < r["muon_zero2"]["exchange"] <= 2 * 2 * record["muon_values"] // 2
    # The rest of Muon's ZeRO-2 traffic is AdamW's ZeRO-2 traffic, plus one agreement head (512 float64).
    assert r["muon_zero2"]["bytes"] - r["muon_zero2"]["exchange"] - r["adamw_zero2"]["bytes"] == 4096


def test_optim_benchmark_has_a_row_per_optimizer_and_ensemble(tmp_path: Path) -> None:
    out = tmp_path / "optim.json"
    cmd = [sys.executable, str(BENCHMARKS / "optim.py"), "--small", "--repeats", "1", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    record = json.loads(out.read_text())
    zoo, ens = record["zoo"], record["zoo_ensemble"]
    assert set(zoo) == {"rmsprop", "adagrad", "nadam", "radam", "adafactor", "lamb", "lars", "lion"}
    assert set(ens) == {"rmsprop", "adagrad", "nadam", "radam", "adafactor"}
    # The reference is the faster of torch's foreach and fused steps (fused only where torch has one).
    assert zoo["adagrad"]["reference"] in ("torch_foreach", "torch_fused") and "torch_fused_s" in zoo["adagrad"]
    assert all(math.isfinite(r["ratio"]) and r["ratio"] > 0 for r in zoo.values())
    for name in zoo:
        assert f"{name} " in proc.stdout
