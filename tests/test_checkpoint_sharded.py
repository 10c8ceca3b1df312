"""Sharded and per-rank checkpoints: one rotation API with single files, module-keyed DCP interop
with torch.distributed.checkpoint's own state dicts, shape checks, values that differ across ranks,
and damaged files (issue 34's checkpoint items, issue 30 item 7)."""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint import REPO, kill_at_first_line
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

import fddp
from dist import run as dist_run
from fddp import checkpoint as ckpt
from fddp.checkpoint import CheckpointError, PerRank, _dcp
from fddp.zero import _layout as _shard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

V1 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sharded-v1")


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Sequential(torch.nn.Linear(7, 3)))


def _zeros(tree):
    return {k: torch.zeros_like(v) for k, v in tree.items()}


def _full(shards) -> dict:
    return fddp.zero.gather(shards).wait()


# ----------------------------------------------------------------------------- shapes (issue 30 item 7)


@pytest.mark.parametrize("shape", [(6, 4), (24,), (2, 12)])
def test_a_leaf_never_loads_into_another_shape_of_as_many_elements(tmp_path, shape):
    fddp.init()
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    directory = ckpt.save_sharded(str(tmp_path / "c"), {"params": fddp.zero.shard({"w": w}), "ema": w.clone()})
    for like in (
        {"params": fddp.zero.shard({"w": torch.zeros(shape)}), "ema": w.clone()},  # a sharded leaf
        {"params": fddp.zero.shard({"w": torch.zeros(4, 6)}), "ema": torch.zeros(shape)},  # a replicated one
        {"params": {"w": torch.zeros(shape)}, "ema": w.clone()},  # a sharded leaf into a replicated tree
    ):
        with pytest.raises(CheckpointError, match=rf"expected shape {re.escape(str(shape))}.*found shape \(4, 6\)"):
            ckpt.load_sharded(directory, like)
    state = ckpt.load_sharded(directory, {"params": fddp.zero.shard({"w": torch.zeros(4, 6)}), "ema": torch.zeros(4, 6)})
    assert torch.equal(_full(state["params"])["w"], w) and torch.equal(state["ema"], w)


def test_a_version_1_checkpoint_still_loads_and_checks_shapes():
    fddp.init()
    like = {"params": fddp.zero.shard({"w": torch.zeros(4, 6), "b": torch.zeros(3)}), "step": 0}
    state = ckpt.load_sharded(V1, like)
    assert state["step"] == 7
    full = _full(state["params"])
    assert torch.equal(full["w"], torch.arange(24, dtype=torch.float32).reshape(4, 6))
    assert torch.equal(full["b"], torch.tensor([1.0, 2.0, 3.0]))
    with pytest.raises(CheckpointError, match=r"'params/w'.*expected shape \(6, 4\).*found shape \(4, 6\)"):
        ckpt.load_sharded(V1, {"params": fddp.zero.shard({"w": torch.zeros(6, 4), "b": torch.zeros(3)}), "step": 0})


# ----------------------------------------------------------------------------- interop with DCP's module state dicts


def test_fddp_shards_load_into_a_module_through_dcp_and_back(tmp_path):
    """Stage 2 and stage 3 shards are keyed by the module's own names: dcp.load fills get_model_state_dict."""
    fddp.init()
    apply_fn, params = fddp.functionalize(_model(0))
    stage2 = ckpt.save_sharded(str(tmp_path / "stage2"), fddp.zero.shard(params))
    _, shards3 = fddp.zero.fully_shard(_model(0))
    stage3 = ckpt.save_sharded(str(tmp_path / "stage3"), {"model": shards3, "step": 3})
    for directory, nest in ((stage2, lambda sd: sd), (stage3, lambda sd: {"model": sd})):
        module = _model(1)  # other values: every one must come from the checkpoint
        sd = get_model_state_dict(module)
        dcp.load(nest(sd), checkpoint_id=directory, no_dist=True)  # as torchtitan reads a checkpoint
        set_model_state_dict(module, sd)
        for name, p in module.named_parameters():
            assert torch.equal(p.detach(), params[name]), (directory, name)


def test_a_checkpoint_dcp_wrote_from_a_module_loads_into_fddp_shards(tmp_path):
    fddp.init()
    module = _model(2)
    directory = str(tmp_path / "theirs")
    dcp.save(get_model_state_dict(module), checkpoint_id=directory, no_dist=True)
    expected = {k: v.detach() for k, v in module.named_parameters()}
    _, params = fddp.functionalize(_model(3))
    got = ckpt.load_sharded(directory, fddp.zero.shard(_zeros(params)))
    assert all(torch.equal(_full(got)[k], v) for k, v in expected.items())
    apply3, like3 = fddp.zero.fully_shard(_model(4))  # stage 3: the units of another module instance
    got3 = _full(ckpt.load_sharded(directory, like3))
    assert all(torch.equal(got3[k], v) for k, v in expected.items())
    x = torch.randn(2, 5)
    torch.testing.assert_close(apply3(ckpt.load_sharded(directory, like3), x), module(x), rtol=0, atol=0)
    # torchtitan's layout: the model under "model", next to pickled Python objects fddp never reads.
    titan = str(tmp_path / "titan")
    dcp.save({"model": get_model_state_dict(module), "train_state": {"step": 5}}, checkpoint_id=titan, no_dist=True)
    got = ckpt.load_sharded(titan, {"model": fddp.zero.shard(_zeros(params))})
    assert all(torch.equal(_full(got["model"])[k], v) for k, v in expected.items())
    with pytest.raises(CheckpointError, match=r"'train_state/step'.*expected an int, found a pickled object, which fddp does not load"):
        ckpt.load_sharded(titan, {"model": fddp.zero.shard(_zeros(params)), "train_state": {"step": 0}})
    with pytest.raises(CheckpointError, match=r"'params/0.bias' \(key 'params.0.bias'\).*found no such key"):
        ckpt.load_sharded(directory, {"params": fddp.zero.shard(_zeros(params))})
    with pytest.raises(CheckpointError, match=r"'0.weight'.*expected shape \(5, 7\)"):
        ckpt.load_sharded(directory, fddp.zero.shard({**_zeros(params), "0.weight": torch.zeros(5, 7)}))


# ----------------------------------------------------------------------------- one rotation API for every kind


def test_save_step_rotates_single_file_and_sharded_checkpoints_together(tmp_path):
    fddp.init()
    params = {"w": torch.randn(4, 6), "b": torch.randn(3)}
    replicated = {"params": params, "step": 1}
    first = ckpt.save_step(tmp_path, 1, replicated, keep=2)
    assert first.endswith("ckpt-00000001.pt")
    opt = fddp.optim.adamw()
    shards = fddp.zero.shard(params)
    for step in (2, 3):
        tree = {"params": shards, "opt": opt.init(shards), "step": step, "local": PerRank({"seen": torch.tensor([step])})}
        path = ckpt.save_step(tmp_path, step, tree, keep=2)
        assert path == ckpt.step_path(tmp_path, step, sharded=True) and os.path.isdir(path)
    assert [s for s, _ in ckpt.steps(tmp_path)] == [2, 3] and ckpt.latest(tmp_path) == path  # the file pruned too
    like = {"params": fddp.zero.shard(_zeros(params)), "opt": opt.init(shards), "step": 0, "local": PerRank({"seen": torch.tensor([0])})}
    state = ckpt.load_step(ckpt.latest(tmp_path), like)
    assert state["step"] == 3 and torch.equal(state["local"]["seen"], torch.tensor([3]))  # PerRank comes back unwrapped
    assert all(torch.equal(_full(state["params"])[k], v) for k, v in params.items())
    # The same step saved again replaces it; a file of a step replaces that step's directory.
    again = ckpt.save_step(tmp_path, 3, {**tree, "step": 33}, keep=2)
    assert ckpt.load_step(again, like)["step"] == 33
    assert ckpt.save_step(tmp_path, 3, replicated, keep=2).endswith(".pt")
    assert [s for s, _ in ckpt.steps(tmp_path)] == [2, 3] and ckpt.latest(tmp_path).endswith("ckpt-00000003.pt")
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    with pytest.raises(ValueError, match="barrier=False does not apply"):
        ckpt.save_step(tmp_path, 4, tree, barrier=False)
    with pytest.raises(TypeError, match="needs `like`"):
        ckpt.load_step(ckpt.step_path(tmp_path, 2, sharded=True))


SHARDED_STEP_CHILD = textwrap.dedent(
    """
    import sys, time
    import torch, torch.distributed.checkpoint as dcp
    import fddp

    def stop(self, metadata, results):  # every piece is written; DCP's index and the rename are not
        print("WRITTEN", flush=True)
        time.sleep(600)

    dcp.FileSystemWriter.finish = stop
    fddp.init()
    tree = {"params": fddp.zero.shard({"w": torch.full((250_000,), 2.0)}), "step": 2}
    fddp.checkpoint.save_step(sys.argv[1], 2, tree, keep=1)
    """
)


def test_a_sharded_save_step_killed_mid_write_leaves_latest_at_the_previous_step(tmp_path):
    fddp.init()
    like = {"params": fddp.zero.shard({"w": torch.zeros(250_000)}), "step": 0}
    first = ckpt.save_step(tmp_path, 1, {"params": fddp.zero.shard({"w": torch.ones(250_000)}), "step": 1}, keep=1)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    ckpt._lock.release(str(tmp_path))  # the child is the next run of this job
    assert kill_at_first_line([SHARDED_STEP_CHILD, str(tmp_path)], env) == "WRITTEN\n"
    (torn,) = [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert torn.startswith("ckpt-00000002.tmp-")
    assert ckpt.latest(tmp_path) == first and ckpt.load_step(first, like)["step"] == 1  # keep=1 pruned nothing yet
    with pytest.warns(UserWarning, match="took over"):  # the killed run's lock
        ckpt.save_step(tmp_path, 3, {"params": fddp.zero.shard({"w": torch.full((250_000,), 3.0)}), "step": 3}, keep=1)
    assert sorted(os.listdir(tmp_path)) == [ckpt._lock.NAME, "ckpt-00000003"]  # the torn temporary and the old step are gone


# ----------------------------------------------------------------------------- two ranks: per-rank state, values that differ


def _two_ranks_worker(directory: str) -> dict:
    rank = fddp.rank()
    g = torch.Generator().manual_seed(0)
    params = {"emb": torch.randn(10, 7, generator=g), "w": torch.randn(6, 5, generator=g), "b": torch.randn(3, generator=g)}
    shards = fddp.zero.shard(params)
    # Some leaf is cut inside a row here, so that its pieces are stored as several boxes.
    shapes = {k: tuple(v.shape) for k, v in sorted(params.items())}
    cuts = [a % shape[-1] or (a + n) % shape[-1] for (shape, pieces) in zip(shapes.values(), _shard.leaf_pieces(shards.layout))
            for _, a, _, n in pieces if len(shape) > 1]  # fmt: skip
    opt = fddp.optim.adamw()
    local = {"x": torch.full((4,), float(rank)), "count": rank}
    tree = {"params": shards, "opt": opt.init(shards), "step": 5, "ema": {"b": params["b"] * 2}, "local": PerRank(local)}
    for step in (1, 2, 3):
        ckpt.save_step(directory, step, {**tree, "step": step}, keep=2)
    out = {"mid_row": any(cuts), "steps": [s for s, _ in ckpt.steps(directory)], "params": params}
    like = {"params": fddp.zero.shard(_zeros(params)), "opt": opt.init(shards), "step": 0, "ema": {"b": torch.zeros(3)},
            "local": PerRank({"x": torch.zeros(4), "count": 0})}  # fmt: skip
    state = ckpt.load_step(ckpt.latest(directory), like)
    out["local"] = (state["local"]["x"].tolist(), state["local"]["count"], state["step"])
    out["loaded"] = _full(state["params"])
    # Refused on every rank, before anything is written: a value stored once that differs...
    try:
        ckpt.save_sharded(directory + "-differ", {"params": shards, "ema": {"b": params["b"] + rank}})
    except fddp.MismatchError as e:
        out["differ"] = str(e)
    try:  # ... a Python value that differs (a step count one rank is behind on) ...
        ckpt.save_step(directory, 4, {"params": shards, "step": 4 + rank})
    except fddp.MismatchError as e:
        out["step_differs"] = str(e)
    try:  # ... and a leaf that only one rank has, which DCP alone would silently leave out.
        ckpt.save_sharded(directory + "-extra", {"params": shards, **({"extra": torch.ones(2)} if rank == 1 else {})})
    except fddp.MismatchError as e:
        out["extra"] = str(e)
    # A write that fails on one rank (a full disk there): every rank raises the same CheckpointError,
    # naming the rank and its error, and the checkpoint that is there stays.
    original = _dcp.Writer.write_data
    if rank == 1:
        def full(self, *args, **kwargs):
            raise OSError(28, "No space left on device")
        _dcp.Writer.write_data = full
    try:
        ckpt.save_sharded(directory + "-full", {"params": shards})
    except Exception as e:  # noqa: BLE001 - each rank reports what it raised
        out["full"] = f"{type(e).__name__}: {e}"
    finally:
        _dcp.Writer.write_data = original
    torch.distributed.barrier()  # rank 0 removes the failed save's temporary after the ranks' verdict
    out["written"] = sorted(n for n in os.listdir(os.path.dirname(directory)) if n != os.path.basename(directory))
    out["steps_after"] = [s for s, _ in ckpt.steps(directory)]
    return out


def test_per_rank_state_and_values_that_differ_across_ranks():
    root = tempfile.mkdtemp(prefix="fddp-ckpt-")
    directory = os.path.join(root, "run")
    try:
        r0, r1 = dist_run(_two_ranks_worker, 2, directory)
        assert r0["mid_row"] and r0["steps"] == [2, 3] == r0["steps_after"]
        assert r0["local"] == ([0.0] * 4, 0, 3) and r1["local"] == ([1.0] * 4, 1, 3)  # each rank its own
        for r in (r0, r1):
            assert all(torch.equal(r["loaded"][k], v) for k, v in r0["params"].items())
        for what, where in (("differ", "'ema/b' (key 'ema.b')"), ("step_differs", "'step'")):
            assert r0[what] == r1[what] and f"the ranks hold different values at {where}" in r0[what], r0[what]
            assert "fddp.checkpoint.PerRank" in r0[what] and "nothing was written" in r0[what]
        assert r0["extra"] == r1["extra"] and "rank 1 has 'extra' (tensor shape=(2,)" in r0["extra"], (r0["extra"], r1["extra"])
        for r in (r0, r1):
            assert r["full"].startswith("CheckpointError") and "rank(s) [1] of the group failed to write it" in r["full"], r["full"]
            assert "OSError: [Errno 28] No space left on device" in r["full"], r["full"]
        assert r0["written"] == [] and r1["written"] == []
        # Saved by 2 ranks, read on 1 process: the shards reshard, DCP reads them into a module's
        # state dict (pieces cut inside a row, stored as boxes), per-rank state is refused.
        path = ckpt.step_path(directory, 3, sharded=True)
        params = r0["params"]
        sd = {"params": _zeros(params)}
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        assert all(torch.equal(sd["params"][k], v) for k, v in params.items())
        fddp.init()
        opt = fddp.optim.adamw()
        shards = fddp.zero.shard(_zeros(params))
        local = PerRank({"x": torch.zeros(4), "count": 0})
        like = {"params": shards, "opt": opt.init(shards), "step": 0, "ema": {"b": torch.zeros(3)}, "local": local}
        with pytest.raises(CheckpointError, match=r"per-rank state at 'local/count'.*2 ranks' own state.*this group has 1"):
            ckpt.load_step(path, like)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------- damaged files (issue 30 item 7)


def _fuzz(directory: str, load, expected, seconds: float, seed: int) -> dict:
    """Damage the checkpoint's files one at a time (flipped bytes, truncation), load, put them back.

    Every load must give the saved values or raise CheckpointError naming the checkpoint; returns
    how many of each outcome.
    """
    rnd = random.Random(seed)
    files = sorted(os.path.join(dp, n) for dp, _, ns in os.walk(directory) for n in ns) if os.path.isdir(directory) else [directory]
    seen = {"same": 0, "refused": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        path = rnd.choice(files)
        data = open(path, "rb").read()
        bad = bytearray(data)
        if rnd.random() < 0.2:
            del bad[rnd.randrange(len(bad)) :]
        else:
            for _ in range(rnd.choice([1, 1, 2, 8])):
                bad[rnd.randrange(len(bad))] ^= rnd.randrange(1, 256)
        open(path, "wb").write(bytes(bad))
        try:
            got = load()
        except CheckpointError as e:
            assert directory in str(e), f"{path}: the error does not name the checkpoint: {e}"
            seen["refused"] += 1
        else:  # a byte nothing reads (padding, a zip header's spare field): the values are intact
            assert expected(got), f"{path}: a damaged file loaded other values"
            seen["same"] += 1
        finally:
            open(path, "wb").write(data)
    return seen


def _set_in_central_directory(path: str, member: str, offset: int, value: bytes) -> None:
    """Overwrite bytes of the zip central-directory record of the member whose name ends in ``member``."""
    data = bytearray(open(path, "rb").read())
    at = data.find(b"PK\x01\x02")
    while at >= 0 and not data[at + 46 : at + 46 + int.from_bytes(data[at + 28 : at + 30], "little")].endswith(member.encode()):
        at = data.find(b"PK\x01\x02", at + 4)
    assert at >= 0, f"no {member} in {path}"
    data[at + offset : at + offset + len(value)] = value
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize(
    "offset, value, why",
    [
        (10, (23).to_bytes(2, "little"), "compression method is not supported"),  # zipfile: NotImplementedError
        (8, (0x01 | 0x800).to_bytes(2, "little"), "encrypted"),  # RuntimeError
        (8, (0x40 | 0x800).to_bytes(2, "little"), "strong encryption"),  # NotImplementedError
        (6, (232).to_bytes(2, "little"), "zip file version 23.2"),  # NotImplementedError
    ],
)
def test_a_damaged_zip_header_is_a_checkpoint_error_not_zipfiles_own(tmp_path, offset, value, why):
    """A flipped bit in a central-directory record makes zipfile raise its own errors; fddp names the file."""
    fddp.init()
    directory = ckpt.save_sharded(str(tmp_path / "sharded"), {"params": fddp.zero.shard({"w": torch.ones(4, 6)}), "step": 1})
    single = ckpt.save(tmp_path / "single.pt", {"w": torch.ones(4, 6), "step": 1})
    manifest = os.path.join(directory, "fddp-manifest.pt")
    for path in (manifest, single):
        _set_in_central_directory(path, "data.pkl", offset, value)
    with pytest.raises(CheckpointError, match=rf"{re.escape(manifest)}: truncated or damaged: .*{why}"):
        ckpt.load_sharded(directory, {"params": fddp.zero.shard({"w": torch.zeros(4, 6)}), "step": 0})
    with pytest.raises(CheckpointError, match=rf"{re.escape(single)}: truncated or damaged: .*{why}"):
        ckpt.load(single)


def test_damaged_sharded_and_single_file_checkpoints_are_checkpoint_errors(tmp_path):
    """About 5 s each of random byte flips and truncations: never a wrong value, never another exception.

    Before, zipfile's NotImplementedError ("compression method is not supported") and RuntimeError ("encrypted")
    escaped from the manifest's damaged headers.
    """
    fddp.init()
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 6, generator=g), "b": torch.randn(3, generator=g)}
    tree = {"params": fddp.zero.shard(params), "ema": {"w": torch.randn(4, 6, generator=g)}, "step": 7,
            "local": PerRank({"rng": torch.Generator().manual_seed(1).get_state(), "n": 3})}  # fmt: skip
    directory = ckpt.save_sharded(str(tmp_path / "sharded"), tree)
    like = {"params": fddp.zero.shard(_zeros(params)), "ema": {"w": torch.zeros(4, 6)}, "step": 0,
            "local": PerRank({"rng": torch.Generator().get_state(), "n": 0})}  # fmt: skip

    def same(got) -> bool:
        full = _full(got["params"])
        same_params = all(torch.equal(full[k], v) for k, v in params.items())
        same_local = got["local"]["n"] == 3 and torch.equal(got["local"]["rng"], tree["local"].tree["rng"])
        return same_params and same_local and torch.equal(got["ema"]["w"], tree["ema"]["w"]) and got["step"] == 7

    assert same(ckpt.load_sharded(directory, like))
    seen = _fuzz(directory, lambda: ckpt.load_sharded(directory, like), same, 5.0, seed=0)
    assert seen["refused"] > 50, seen
    single = {"params": params, "step": 7, "name": "run", "rng": torch.Generator().manual_seed(1).get_state()}
    path = ckpt.save(tmp_path / "single.pt", single)

    def same_single(got) -> bool:
        same_params = all(torch.equal(got["params"][k], v) for k, v in params.items())
        return same_params and got["step"] == 7 and got["name"] == "run" and torch.equal(got["rng"], single["rng"])

    seen = _fuzz(path, lambda: ckpt.load(path, like=single), same_single, 5.0, seed=1)
    assert seen["refused"] > 50, seen
