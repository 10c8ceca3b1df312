"""Tests for fddp.checkpoint: round trips, `like=` validation, compact views, crash safety, safety
against code in checkpoint files, and the keep-last-N directory helpers."""

from __future__ import annotations

import collections
import enum
import errno
import os
import pickle
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

import fddp
from dist import run as dist_run
from fddp import checkpoint as ckpt
from fddp.checkpoint import CheckpointError
from fddp.checkpoint import _single as single_file  # the module that opens and writes the file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class AdamState(NamedTuple):
    count: torch.Tensor
    mu: dict
    nu: dict


class EmptyState(NamedTuple):
    pass


def make_tree(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g, dtype=torch.float64)}
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    return {
        "params": params,
        "opt": (
            AdamState(torch.tensor(seed, dtype=torch.int32), zeros, {k: v + 1 for k, v in zeros.items()}),
            EmptyState(),
        ),
        "step": 100 + seed,
        "rng": torch.get_rng_state(),
        "py_rng": random.Random(seed).getstate(),
        "misc": [None, True, 1.5, "name", b"raw", 2**70, 1 + 2j],
        "ordered": collections.OrderedDict([("z", torch.ones(1)), ("a", torch.arange(3))]),
        "int_keys": {0: torch.ones(2), 1: torch.zeros(2)},
    }


def assert_tree_equal(a, b, path="tree"):
    assert type(a) is type(b), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_tree_equal(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


# ----------------------------------------------------------------------------- round trips


def test_round_trip_with_like_restores_types_and_values(tmp_path):
    tree = make_tree(1)
    path = ckpt.save(tmp_path / "c.pt", tree)
    assert path == str(tmp_path / "c.pt")
    loaded = ckpt.load(path, like=make_tree(2))
    assert_tree_equal(loaded, tree)
    assert isinstance(loaded["opt"][0], AdamState)
    # The restored RNG states are usable as such.
    torch.set_rng_state(loaded["rng"])
    random.Random().setstate(loaded["py_rng"])


def test_round_trip_without_like_generates_namedtuples(tmp_path):
    tree = make_tree(0)
    path = ckpt.save(tmp_path / "c.pt", tree)
    loaded = ckpt.load(path)
    state, empty = loaded["opt"]
    assert type(state).__name__ == "AdamState" and state._fields == ("count", "mu", "nu")
    assert not isinstance(state, AdamState)
    assert type(empty).__name__ == "EmptyState" and empty._fields == ()
    assert torch.equal(state.nu["w"], tree["opt"][0].nu["w"])
    assert type(loaded["ordered"]) is collections.OrderedDict
    assert loaded["py_rng"] == tree["py_rng"] and loaded["misc"] == tree["misc"]
    # Same generated class on a second load, so trees from two loads have equal types.
    assert type(ckpt.load(path)["opt"][0]) is type(state)


def test_root_leaf_and_empty_containers(tmp_path):
    for tree in [torch.arange(5), 7, None, {}, [], (), {"a": []}]:
        p = ckpt.save(tmp_path / "x.pt", tree)
        assert_tree_equal(ckpt.load(p), tree)
        assert_tree_equal(ckpt.load(p, like=tree), tree)


def test_save_does_not_modify_input_and_detaches(tmp_path):
    w = torch.randn(3, requires_grad=True)
    p = torch.nn.Parameter(torch.randn(2))
    tree = {"w": w * 2, "p": p}
    path = ckpt.save(tmp_path / "c.pt", tree)
    loaded = ckpt.load(path)
    assert type(loaded["p"]) is torch.Tensor and not loaded["p"].requires_grad
    assert torch.equal(loaded["w"], (w * 2).detach())
    # With like, requires_grad follows the expected leaf.
    again = ckpt.load(path, like={"w": torch.zeros(3, requires_grad=True), "p": torch.zeros(2)})
    assert again["w"].requires_grad and not again["p"].requires_grad


class Color(enum.IntEnum):
    RED = 1


@pytest.mark.parametrize(
    "tree, where",
    [
        ({"a": [1, object()]}, r"at 'a/1'"),
        ({"a": (Color.RED,)}, r"at 'a/0'.*subclass of int"),  # would pickle its class
        ({Color.RED: 1}, r"dict key.*at '<root>'"),
        ({"a": {"b": {1, 2}}}, r"at 'a/b'.*set"),
    ],
)
def test_unsupported_leaf_is_rejected_at_save_with_path(tmp_path, tree, where):
    with pytest.raises(TypeError, match=where):
        ckpt.save(tmp_path / "c.pt", tree)
    assert not os.listdir(tmp_path)  # nothing written, not even a temporary file


def test_like_moves_to_like_device_and_meta_keeps_map_location(tmp_path):
    path = ckpt.save(tmp_path / "c.pt", {"w": torch.ones(2)})
    out = ckpt.load(path, like={"w": torch.empty(2, device="meta")})
    assert out["w"].device.type == "cpu" and torch.equal(out["w"], torch.ones(2))
    # map_location reaches torch.load.
    assert ckpt.load(path, map_location="meta")["w"].device.type == "meta"


# ----------------------------------------------------------------------------- like= errors


P = "at 'params/"  # fddp's path format: keys from the root joined by /
OPT = "at 'opt/0"


def case(id, mutate, where, what):
    return pytest.param(mutate, where, what, id=id)


@pytest.mark.parametrize(
    "mutate, where, what",
    [
        case("extra-key", lambda t: t["params"].pop("b"), P + "b'", "expected no such key.*found an entry"),
        case("missing-key", lambda t: t["params"].update(c=torch.ones(1)), P + "c'",
             "expected an entry, found no such key in the checkpoint"),
        case("shape", lambda t: t["params"].update(w=torch.zeros(3, 5)), P + "w'",
             r"shape \(3, 5\).*found.*shape \(3, 4\)"),
        case("dtype", lambda t: t["params"].update(b=torch.zeros(4)), P + "b'",
             "torch.float32, found.*torch.float64"),
        case("tensor-vs-int", lambda t: t.update(step=torch.tensor(1)), "at 'step'", "expected tensor.*found int"),
        case("float-vs-int", lambda t: t.update(step=1.0), "at 'step'", "expected a float, found int"),
        case("tuple-vs-list", lambda t: t.update(misc=tuple(t["misc"])), "at 'misc'",
             "expected tuple of length 7, found list"),
        case("length", lambda t: t["misc"].pop(), "at 'misc'", "length 6, found list of length 7"),
        case("namedtuple-fields", lambda t: t.update(opt=(EmptyState(), EmptyState())), OPT + "'",
             r"fields \(\), found NamedTuple AdamState"),
        case("tuple-vs-namedtuple", lambda t: t.update(opt=(tuple(t["opt"][0]), EmptyState())), OPT + "'",
             "expected tuple of length 3, found NamedTuple"),
        case("nested-in-state", lambda t: t["opt"][0].mu.update(w=torch.zeros(3, 4, dtype=torch.float16)),
             OPT + "/mu/w'", "float16"),
    ],
)
def test_like_mismatch_names_the_leaf(tmp_path, mutate, where, what):
    path = ckpt.save(tmp_path / "c.pt", make_tree(0))
    like = make_tree(0)
    mutate(like)
    with pytest.raises(CheckpointError, match=where) as info:
        ckpt.load(path, like=like)
    assert str(tmp_path / "c.pt") in str(info.value)
    assert re.search(what, str(info.value)), str(info.value)
    assert isinstance(info.value, ValueError)


# ----------------------------------------------------------------------------- compact views


def test_views_of_a_big_buffer_are_saved_compactly(tmp_path):
    bucket = torch.randn(4_000_000)  # 16 MB flat buffer, as the fast path keeps parameters
    tree = {
        "w": bucket[100:112].view(3, 4),
        "b": bucket[200:204],
        "t": bucket[1000:1012].view(4, 3).t(),  # non-contiguous view
    }
    path = ckpt.save(tmp_path / "c.pt", tree)
    assert os.path.getsize(path) < 64 * 1024, os.path.getsize(path)
    assert_tree_equal(ckpt.load(path), {k: v.contiguous() for k, v in tree.items()})
    assert bucket.untyped_storage().nbytes() == 16_000_000  # the buffer itself is untouched
    # Reference: plain torch.save of the view writes the whole storage.
    torch.save(tree["w"], tmp_path / "plain.pt")
    assert os.path.getsize(tmp_path / "plain.pt") > 15_000_000


# ----------------------------------------------------------------------------- crash safety

# The child saves a new checkpoint and is SIGKILLed at a chosen point of the write. The hooks
# only decide *when* it stops; the write path (temporary file, fsync, rename) is the real one.
CHILD = textwrap.dedent(
    """
    import io, os, sys, time
    import torch
    from fddp import checkpoint as ckpt
    mode, directory, target = sys.argv[1], sys.argv[2], sys.argv[3]
    real_save = torch.save

    def stop(msg):
        print(msg, flush=True)
        time.sleep(600)

    if mode == "mid-write":
        # Write half of the serialized bytes to the real temporary file, then stop.
        def partial_save(obj, f):
            buf = io.BytesIO()
            real_save(obj, buf)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            stop(f"PARTIAL {f.name}")
        torch.save = partial_save
    else:
        # The temporary file is complete and fsynced; stop just before the rename.
        real_replace = os.replace
        def slow_replace(src, dst):
            stop(f"BEFORE_RENAME {src}")
            real_replace(src, dst)
        os.replace = slow_replace

    new = {"w": torch.full((256, 256), 2.0), "step": 2}
    if target == "step":
        ckpt.save_step(directory, 2, new, keep=1)
    else:
        ckpt.save(target, new)
    """
)


def kill_at_first_line(args: list[str], env: dict[str, str]) -> str:
    """Run ``python -c *args``, wait (bounded) for its first line of output, SIGKILL it there; return the line."""
    proc = subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "child never reached the stop point"
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    return line


def run_and_kill(mode: str, directory, target: str) -> str:
    # The child is the next run of this job: this process gives the directory up to it first.
    ckpt._lock.release(str(directory))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return kill_at_first_line([CHILD, mode, str(directory), target], env).split(" ", 1)[1].strip()


def test_sigkill_mid_write_leaves_previous_checkpoint(tmp_path):
    old = {"w": torch.full((256, 256), 1.0), "step": 1}
    first = ckpt.save_step(tmp_path, 1, old, keep=1)
    tmp_file = run_and_kill("mid-write", tmp_path, "step")
    # A torn temporary file is on disk, and it is neither taken for a checkpoint nor loadable.
    assert os.path.exists(tmp_file) and ".tmp-" in tmp_file
    assert 0 < os.path.getsize(tmp_file)
    assert ckpt.steps(tmp_path) == [(1, first)]
    assert ckpt.latest(tmp_path) == first
    assert_tree_equal(ckpt.load(ckpt.latest(tmp_path), like=old), old)
    with pytest.raises(CheckpointError, match="tmp-"):
        ckpt.load(tmp_file)


def test_sigkill_before_rename_keeps_old_file_at_same_path(tmp_path):
    old = {"w": torch.full((256, 256), 1.0), "step": 1}
    path = ckpt.save(tmp_path / "model.pt", old)
    tmp_file = run_and_kill("before-rename", tmp_path, path)
    assert os.path.exists(tmp_file)  # complete, but never renamed into place
    assert_tree_equal(ckpt.load(path, like=old), old)
    assert ckpt.latest(tmp_path, prefix="model") is None  # not a step-numbered name


def test_exception_during_write_removes_temporary_and_keeps_old(tmp_path, monkeypatch):
    old = {"w": torch.ones(3)}
    path = ckpt.save(tmp_path / "c.pt", old)

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save(path, {"w": torch.zeros(3)})
    assert os.listdir(tmp_path) == ["c.pt"]
    monkeypatch.undo()
    assert_tree_equal(ckpt.load(path), old)


# ----------------------------------------------------------------------------- code in files


class Evil:
    """Unpickling this creates the file `marker`: a stand-in for arbitrary code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("how", ["torch.save", "inside-fddp-payload", "raw-pickle"])
def test_malicious_pickle_is_refused_without_running(tmp_path, how):
    marker = tmp_path / "pwned"
    path = tmp_path / "ckpt-00000009.pt"
    if how == "torch.save":
        torch.save({"w": torch.ones(1), "x": Evil(marker)}, path)
    elif how == "inside-fddp-payload":
        payload = {"format": "fddp-checkpoint", "version": 1, "structure": ("leaf",), "paths": ["tree"], "leaves": [Evil(marker)]}
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(Evil(marker), f)
    with pytest.raises(CheckpointError, match="refused") as info:
        ckpt.load(path)
    assert str(path) in str(info.value)
    assert not marker.exists()
    # The payload is real: an unsafe load does run it.
    if how == "raw-pickle":
        with open(path, "rb") as f:
            pickle.load(f)
    else:
        torch.load(path, weights_only=False)
    assert marker.exists()


def test_corrupt_and_foreign_files_are_clear_errors(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00not a checkpoint" * 10)
    with pytest.raises(CheckpointError, match="garbage.pt"):
        ckpt.load(garbage)

    good = ckpt.save(tmp_path / "good.pt", {"w": torch.randn(1000)})
    data = open(good, "rb").read()
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated.pt"):
        ckpt.load(truncated)

    foreign = tmp_path / "state_dict.pt"
    torch.save({"w": torch.ones(1)}, foreign)
    with pytest.raises(CheckpointError, match="state_dict.pt: not an fddp checkpoint"):
        ckpt.load(foreign)

    future = tmp_path / "future.pt"
    torch.save({"format": "fddp-checkpoint", "version": 99}, future)
    with pytest.raises(CheckpointError, match="version 99"):
        ckpt.load(future)

    bad_structure = tmp_path / "bad.pt"
    torch.save({"format": "fddp-checkpoint", "version": 1, "structure": ("dict", ("a",), ()), "leaves": []}, bad_structure)
    with pytest.raises(CheckpointError, match="corrupt"):
        ckpt.load(bad_structure)

    with pytest.raises(FileNotFoundError):
        ckpt.load(tmp_path / "missing.pt")


# ----------------------------------------------------------------------------- directory helpers


def test_save_step_keeps_last_n_and_latest(tmp_path):
    d = tmp_path / "run"
    assert ckpt.latest(d) is None and ckpt.steps(d) == []
    for s in [1, 2, 10, 11, 100]:
        ckpt.save_step(d, s, {"step": s, "w": torch.full((2,), float(s))}, keep=3)
    assert [s for s, _ in ckpt.steps(d)] == [10, 11, 100]
    assert ckpt.latest(d) == os.path.join(d, "ckpt-00000100.pt")  # by number, not by name order
    assert ckpt.load(ckpt.latest(d))["step"] == 100
    # Noise in the directory is ignored.
    (d / "ckpt-00000500.pt.tmp-1234").write_bytes(b"torn")
    (d / "ckpt-00000600.pt").write_bytes(b"truncated copy")
    (d / "other-00000700.pt").write_bytes(b"")
    (d / "ckpt-latest.pt").write_bytes(b"")
    assert ckpt.latest(d) == os.path.join(d, "ckpt-00000100.pt")
    # keep=None keeps everything; other prefixes are separate series.
    ckpt.save_step(d, 101, {"step": 101}, keep=None)
    ckpt.save_step(d, 1, {"step": 1}, prefix="ema", keep=1)
    assert [s for s, _ in ckpt.steps(d)] == [10, 11, 100, 101]
    assert [s for s, _ in ckpt.steps(d, prefix="ema")] == [1]


def test_save_step_never_deletes_the_new_file(tmp_path):
    for s in [10, 20]:
        ckpt.save_step(tmp_path, s, {"step": s}, keep=2)
    path = ckpt.save_step(tmp_path, 5, {"step": 5}, keep=2)  # restarted from an older step
    assert os.path.exists(path)
    assert [s for s, _ in ckpt.steps(tmp_path)] == [5, 20]


def test_save_step_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        ckpt.save_step(tmp_path, 1, {}, keep=0)
    with pytest.raises(ValueError, match="step"):
        ckpt.save_step(tmp_path, -1, {})


# ----------------------------------------------------------------------------- ranks


class _Done:
    """A finished collective, as ``dist.all_reduce(..., async_op=True)`` returns."""

    def wait(self) -> bool:
        return True


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None, async_op=False: calls.append(group) or _Done())
    # The faked world has no process group object to number calls on (fddp's timeout message does).
    monkeypatch.setattr(single_file._ranks, "count_call", lambda group, what: None)
    # Nor a group state to agree on (the per-call header, tested with real ranks elsewhere): the
    # barrier is that header alone, counted here.
    monkeypatch.setattr(single_file._ranks._dist, "agree", lambda group, what, rows: calls.append(group))
    path = ckpt.save_step(tmp_path, 3, {"w": torch.ones(1)})
    assert path.endswith("ckpt-00000003.pt")
    assert os.listdir(tmp_path) == []
    assert calls == [None]  # save_step waits for rank 0 by default
    ckpt.save(tmp_path / "x.pt", {"w": torch.ones(1)})
    assert calls == [None]  # save does not: rank 0 alone may call it

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    ckpt.save_step(tmp_path, 3, {"w": torch.ones(1)}, barrier=False)
    assert sorted(os.listdir(tmp_path)) == [ckpt._lock.NAME, "ckpt-00000003.pt"]  # rank 0 holds the directory
    assert calls == [None]


def _save_then_latest_worker(directory: str, rounds: int) -> list[int]:
    """The quick start's pattern: every rank saves, then every rank loads the newest checkpoint."""
    seen = []
    for step in range(1, rounds + 1):
        ckpt.save_step(directory, step, {"w": torch.full((64, 64), float(step)), "step": step}, keep=2)
        seen.append(ckpt.load(ckpt.latest(directory))["step"])
    return seen


def test_every_rank_finds_the_checkpoint_just_saved():
    directory = tempfile.mkdtemp(prefix="fddp-ckpt-")
    try:
        for seen in dist_run(_save_then_latest_worker, 2, directory, 30):
            # Never an older step; a newer one is possible, since rank 0 may already be writing the next.
            older = [(step, s) for step, s in enumerate(seen, 1) if s < step]
            assert not older, f"(step saved, step read) where a rank read an older checkpoint: {older}"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _failed_write_worker(directory: str) -> str:
    blocker = os.path.join(directory, "file")  # a file where the checkpoint directory should be
    if fddp.rank() == 0:
        open(blocker, "w").close()
    try:
        ckpt.save_step(os.path.join(blocker, "ckpt"), 1, {"w": torch.ones(2)})
    except Exception as e:  # noqa: BLE001 - each rank reports what it raised
        return f"{type(e).__name__}: {e}"
    return "returned"


def test_a_failed_write_raises_on_every_rank_instead_of_hanging():
    directory = tempfile.mkdtemp(prefix="fddp-ckpt-")
    try:
        on_rank0, on_rank1 = dist_run(_failed_write_worker, 2, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert on_rank0.startswith(("FileExistsError", "NotADirectoryError")), on_rank0
    # The peer learns it from the call scope, with rank 0's own error, in place of the barrier.
    assert on_rank1.startswith("PeerError") and "rank 0 failed in fddp.checkpoint.save_step" in on_rank1, on_rank1
    assert on_rank0.split(":", 1)[0] in on_rank1 and "still in step" in on_rank1, on_rank1


# ----------------------------------------------------------------------------- a full disk


class _FullDisk:
    """A file object that takes ``room`` bytes, then fails as a full disk does (ENOSPC)."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def _assert_disk_full_error(info, path, old, directory) -> None:
    e = info.value
    assert e.errno == errno.ENOSPC and e.filename == str(path), repr(e)
    assert "the disk is full" in str(e) and str(path) in str(e), str(e)
    assert not [n for n in os.listdir(directory) if ".tmp-" in n], "a temporary file was left behind"
    assert_tree_equal(ckpt.load(path, like=old), old)


def test_a_full_disk_is_named_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    old = {"w": torch.ones(10), "step": 1}
    path = ckpt.save_step(tmp_path, 1, old)
    real_open = open
    monkeypatch.setattr(single_file, "open", lambda file, mode="r": _FullDisk(real_open(file, mode), 2000), raising=False)
    with pytest.raises(OSError) as info:  # torch.save itself says "RuntimeError: ... unexpected pos"
        ckpt.save_step(tmp_path, 1, {"w": torch.zeros(10_000), "step": 2})
    _assert_disk_full_error(info, path, old, tmp_path)


def test_a_full_tmpfs_is_named_and_keeps_the_previous_checkpoint(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {proc.stderr.strip() or proc.returncode}")
    try:
        old = {"w": torch.ones(10), "step": 1}
        path = ckpt.save(mount / "c.pt", old)
        with pytest.raises(OSError) as info:
            ckpt.save(path, {"w": torch.zeros(100_000), "step": 2})
        _assert_disk_full_error(info, path, old, mount)
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_views_saved_on_cpu_and_restored_to_like_device(tmp_path):
    bucket = torch.randn(1_000_000, device="cuda")
    tree = {"w": bucket[:12].view(3, 4), "step": 1}
    path = ckpt.save(tmp_path / "c.pt", tree)
    assert os.path.getsize(path) < 64 * 1024
    assert ckpt.load(path, map_location=None)["w"].device.type == "cpu"
    out = ckpt.load(path, like={"w": torch.empty(3, 4, device="cuda"), "step": 0})
    assert out["w"].device.type == "cuda" and torch.equal(out["w"], tree["w"])


# ----------------------------------------------------------------------------- damaged files (issue 23, items 4 and 9)


def _flip_byte_of(path, needle: bytes) -> None:
    """Flip the lowest bit of the middle byte of ``needle``, found once in the file at ``path``."""
    data = bytearray(open(path, "rb").read())
    at = data.find(needle)
    assert at >= 0 and data.find(needle, at + 1) < 0, "the bytes to damage must occur exactly once"
    data[at + len(needle) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def test_a_flipped_byte_in_a_tensor_is_an_error_naming_the_file_and_leaf(tmp_path):
    w = torch.arange(1000, dtype=torch.float32)
    path = ckpt.save(tmp_path / "c.pt", {"params": {"w": w, "b": torch.ones(3)}, "step": 1})
    _flip_byte_of(path, w[400:600].numpy().tobytes())
    # The reference: torch itself loads the damaged file without complaint, one value changed.
    raw = torch.load(path, weights_only=True)["leaves"]
    assert not torch.equal(next(t for t in raw if isinstance(t, torch.Tensor) and t.numel() == 1000), w)
    with pytest.raises(CheckpointError, match=r"damaged: the data of leaf 'params/w'") as info:
        ckpt.load(path)
    assert str(path) in str(info.value) and "CRC-32" in str(info.value)
    with pytest.raises(CheckpointError, match="'params/w'"):
        ckpt.load(path, like={"params": {"w": w, "b": torch.ones(3)}, "step": 0})


def test_a_flipped_byte_in_the_pickled_scalars_is_an_error(tmp_path):
    step = 123456789  # pickled as BININT: its four little-endian bytes, once in the file
    path = ckpt.save(tmp_path / "c.pt", {"w": torch.ones(2), "step": step})
    _flip_byte_of(path, step.to_bytes(4, "little"))
    assert torch.load(path, weights_only=True)["leaves"][1] != step  # torch loads the wrong step silently
    with pytest.raises(CheckpointError, match="damaged.*data.pkl.*CRC-32") as info:
        ckpt.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.99])
def test_a_truncated_file_is_a_checkpoint_error_naming_the_path(tmp_path, fraction):
    good = ckpt.save(tmp_path / "good.pt", {"w": torch.randn(1000), "s": 3})  # at 90%: OSError EINVAL in torch
    data = open(good, "rb").read()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(CheckpointError, match="truncated or damaged") as info:
        ckpt.load(cut)
    assert str(cut) in str(info.value)


class _RunsACommand:
    def __reduce__(self):
        return (os.system, ("echo never run",))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_pickle_refusal_keeps_the_diagnosis_and_drops_the_advice_to_run_it(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"x": _RunsACommand()}, path)
    with pytest.raises(CheckpointError, match="refused") as info:
        ckpt.load(path)
    message = str(info.value)
    assert f"unsupported GLOBAL {os.system.__module__}.system" in message, message
    assert "weights_only" not in message and "trusted source" not in message, message


# ----------------------------------------------------------------------------- stale temporaries (issue 23, item 8)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_next_save_step_removes_the_temporary_of_a_killed_write(tmp_path):
    first = ckpt.save_step(tmp_path, 1, {"w": torch.full((256, 256), 1.0), "step": 1}, keep=5)
    torn = run_and_kill("mid-write", tmp_path, "step")  # a torn ckpt-00000002.pt.tmp-...
    assert os.path.exists(torn) and ckpt.steps(tmp_path) == [(1, first)]
    with pytest.warns(UserWarning, match="took over .* its process is no longer running"):  # the killed run's lock
        second = ckpt.save_step(tmp_path, 3, {"w": torch.ones(1), "step": 3}, keep=5)  # another step of the series
    assert not os.path.exists(torn)
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(first), os.path.basename(second), ckpt._lock.NAME])


def test_the_next_save_removes_the_temporary_of_a_write_killed_before_its_rename(tmp_path):
    path = ckpt.save(tmp_path / "model.pt", {"w": torch.full((256, 256), 1.0)})
    complete = run_and_kill("before-rename", tmp_path, path)
    (tmp_path / "other.pt.tmp-x").write_bytes(b"another destination's")
    ckpt.save(path, {"w": torch.ones(1)})
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "other.pt.tmp-x"] and not os.path.exists(complete)


def test_temporaries_that_may_belong_to_a_live_writer_are_kept(tmp_path):
    from fddp.checkpoint import _temp

    target = str(tmp_path / "ckpt-00000005.pt")
    live_here = _temp.new_name(target, pid=os.getppid())  # a running process of this host
    other_host = _temp.new_name(target, host=_temp.HOST_ID ^ 1, pid=_dead_pid())
    dead_here = _temp.new_name(target, pid=_dead_pid())
    mine_abandoned = _temp.new_name(target)  # this process, by no write under way
    mine_writing = _temp.new_name(target)
    old_style = target + ".tmp-1234"  # an older fddp's name: its writer's host is unknown
    for p in (live_here, other_host, dead_here, mine_abandoned, mine_writing, old_style):
        open(p, "wb").close()
    os.mkdir(str(tmp_path / "ckpt-00000006.pt") + ".tmp-x")  # a temporary directory: never a step either
    two_hours_ago = time.time() - 7200
    os.utime(other_host, (two_hours_ago, two_hours_ago))
    with _temp.writing(mine_writing):
        with pytest.warns(UserWarning, match=r"not deleted automatically.*rm -r") as warned:
            ckpt.save_step(tmp_path, 7, {"step": 7}, keep=None)
    assert [str(w.message).count(other_host) for w in warned] == [2]  # the old one from elsewhere, named
    left = set(os.listdir(tmp_path))
    assert {os.path.basename(p) for p in (dead_here, mine_abandoned)}.isdisjoint(left)
    assert {os.path.basename(p) for p in (live_here, other_host, mine_writing, old_style)} <= left
    assert [s for s, _ in ckpt.steps(tmp_path)] == [7] and ckpt.latest(tmp_path).endswith("ckpt-00000007.pt")


# ----------------------------------------------------------------------------- a rank that does not come


def _skipped_save_worker(directory: str) -> str:
    import datetime

    group = dist.new_group(timeout=datetime.timedelta(seconds=3))
    try:
        if fddp.rank() == 1:
            return "skipped"  # rank 1 never calls save_step: rank 0 must not wait for ever
        try:
            ckpt.save_step(directory, 1, {"w": torch.ones(2)}, group=group)
        except RuntimeError as e:
            return str(e)
        return "returned"
    finally:
        dist.barrier()  # rank 1 keeps its end of `group` open until rank 0 has given up waiting
        dist.destroy_process_group(group)


def test_a_rank_that_skips_save_step_is_a_clear_timeout_on_the_others():
    directory = tempfile.mkdtemp(prefix="fddp-ckpt-")
    try:
        on_rank0, on_rank1 = dist_run(_skipped_save_worker, 2, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert on_rank1 == "skipped"
    # The wait that times out is the call's agreement, before the barrier's own bytes.
    assert on_rank0.startswith("fddp.checkpoint.save_step: rank 0 of 2 timed out during the agreement on this call"), on_rank0
    assert "call 1 to fddp.checkpoint.save_step" in on_rank0 and "same order" in on_rank0, on_rank0


# ----------------------------------------------------------------------------- sharded checkpoints: damage, stale temporaries


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_flipped_byte_in_a_sharded_piece_is_an_error_naming_the_file_and_leaf(tmp_path):
    import torch.distributed.checkpoint as dcp

    fddp.init()
    w = torch.arange(1000, dtype=torch.float32)
    directory = ckpt.save_sharded(str(tmp_path / "ckpt"), {"params": fddp.zero.shard({"w": w, "b": torch.ones(3)}), "step": 1})
    like = {"params": fddp.zero.shard({"w": torch.zeros(1000), "b": torch.zeros(3)}), "step": 0}
    piece = os.path.join(directory, "__0_0.distcp")
    _flip_byte_of(piece, w[400:600].numpy().tobytes())
    # The reference: torch.distributed.checkpoint's own reader loads the damaged piece without complaint.
    raw = {"params": {"w": torch.zeros(1000)}}
    dcp.load(raw, storage_reader=dcp.FileSystemReader(directory), no_dist=True)
    assert not torch.equal(raw["params"]["w"], w) and (raw["params"]["w"] != w).sum() == 1
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: damaged: the piece of leaf 'params.w' at offset \(0,\)"):
        ckpt.load_sharded(directory, like)
    # DCP's index of the pieces is checked too.
    metadata = os.path.join(directory, ".metadata")
    data = bytearray(open(metadata, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(metadata, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"\.metadata: .*damaged"):
        ckpt.load_sharded(directory, like)


SHARDED_CHILD = textwrap.dedent(
    """
    import sys, time
    import torch, torch.distributed.checkpoint as dcp
    import fddp

    def stop(self, metadata, results):  # every piece is written; DCP's index and the rename are not
        print("WRITTEN", flush=True)
        time.sleep(600)

    dcp.FileSystemWriter.finish = stop
    fddp.init()
    fddp.checkpoint.save_sharded(sys.argv[1], {"params": fddp.zero.shard({"w": torch.ones(250_000)}), "step": 1})
    """
)


def test_the_next_save_sharded_removes_the_temporary_of_a_killed_save(tmp_path):
    directory = str(tmp_path / "step-00000100")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    assert kill_at_first_line([SHARDED_CHILD, directory], env) == "WRITTEN\n"
    (stale,) = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    size = sum(os.path.getsize(os.path.join(tmp_path, stale, n)) for n in os.listdir(tmp_path / stale))
    assert size > 1_000_000 and not os.path.exists(directory)  # as large as the checkpoint, never renamed
    fddp.init()
    like = {"params": fddp.zero.shard({"w": torch.zeros(250_000)}), "step": 0}
    ckpt.save_sharded(directory, {"params": fddp.zero.shard({"w": torch.full((250_000,), 2.0)}), "step": 2})
    assert os.listdir(tmp_path) == ["step-00000100"]
    state = ckpt.load_sharded(directory, like)
    assert state["step"] == 2 and torch.equal(fddp.zero.gather(state["params"]).wait()["w"], torch.full((250_000,), 2.0))


def test_a_save_sharded_that_fails_removes_its_temporary(tmp_path, monkeypatch):
    from fddp.checkpoint import _sharded

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    fddp.init()
    monkeypatch.setattr(_sharded, "_finish", full_disk)  # after every piece is written, before the rename
    with pytest.raises(OSError, match="No space left"):
        ckpt.save_sharded(str(tmp_path / "ckpt"), {"params": fddp.zero.shard({"w": torch.ones(1000)}), "step": 1})
    assert os.listdir(tmp_path) == []
