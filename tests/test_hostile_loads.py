"""A corpus of hostile pickles against every path by which fddp reads bytes it did not make (issue 38).

The corpus: ``REDUCE`` of builtins that act (``os.system``, ``eval``, ``exec``, ``subprocess.call``,
``open``) at every pickle protocol 0 to 5, a ``builtins.getattr`` chain, dotted globals that
protocol 4 resolves through a module fddp allows (``torch.distributed.checkpoint.filesystem`` +
``os.system``, issue 38's own bytes among them) by ``STACK_GLOBAL`` and by ``GLOBAL``, ``INST``,
``OBJ``, ``NEWOBJ`` and ``NEWOBJ_EX`` followed by a ``BUILD`` whose ``__setstate__`` acts, an
extension-registry code, a legacy (non-zip) torch file, a TorchScript archive, and an archive that
holds its pickle twice. Every pickle also travels hidden as the ``data.pkl`` of a zip that
``torch.save`` wrote.

The load paths: :func:`fddp.checkpoint.load` and :func:`~fddp.checkpoint.load_step` of a file; a
sharded checkpoint (with per-rank state) whose ``.metadata``, manifest or piece file is replaced,
through :func:`~fddp.checkpoint.load_sharded` and ``load_step``, written by fddp and written by
torch.distributed.checkpoint itself (no manifest, no CRC-32s: the allow-lists alone guard it);
:func:`fddp.zero.load_full` of a file, a directory, an index and a directory of pickles only; and
fddp.ft's live-state reader (the header, the transport, the chunks).

Each load must run nothing (a marker file that every live payload would create stays absent) and
raise :class:`fddp.checkpoint.CheckpointError` naming the file (or the sender). The corpus is
checked to be live: an unrestricted ``pickle.loads`` / ``torch.load(weights_only=False)`` runs it.
"""

from __future__ import annotations

import copyreg
import io
import json
import os
import pickle
import shutil
import subprocess
import warnings
import zipfile
from typing import Any, Callable, NamedTuple

import pytest
import torch

import fddp
from fddp import checkpoint as ckpt
from fddp.checkpoint import CheckpointError

_EXT_CODE = 0x7FFFFF01  # an extension code this file registers for os.system while a test runs


class Armed:
    """A class whose ``__setstate__`` acts: any ``BUILD`` of it that a loader admitted would run it."""

    def __getstate__(self) -> dict:
        return {"marker": self.marker}

    def __setstate__(self, state: dict) -> None:
        open(state["marker"], "w").close()


class _Reduce:
    """Pickles as ``fn(*args)``: a ``REDUCE`` (``INST``/``OBJ`` at low protocols for classes)."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple:
        return (self.fn, self.args)


class Blob(NamedTuple):
    name: str
    data: bytes
    live: str  # how to show the payload acts unrestricted: "pickle", "torch", or "" (no side effect to show)


def _u(s: str) -> bytes:
    """A protocol-2+ BINUNICODE of ``s``."""
    b = s.encode()
    return b"X" + len(b).to_bytes(4, "little") + b


def _s(s: str) -> bytes:
    """A protocol-4 SHORT_BINUNICODE of ``s``."""
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _pickles(marker: str) -> list[Blob]:
    """The raw hostile pickles, each creating ``marker`` when unpickled without restrictions."""
    cmd = f"touch {marker}"
    code = f"open({marker!r}, 'w').close()"
    reducers = {
        "os.system": (os.system, (cmd,)),
        "builtins.exec": (exec, (code,)),
        "builtins.eval": (eval, (code,)),
        "subprocess.call": (subprocess.call, (["touch", marker],)),
        "builtins.open": (open, (marker, "w")),
    }
    out = [
        Blob(f"REDUCE {name} protocol {p}", pickle.dumps(_Reduce(fn, args), protocol=p), "pickle")
        for name, (fn, args) in reducers.items()
        for p in range(6)
    ]
    armed = Armed()
    armed.marker = marker
    out += [Blob(f"BUILD Armed.__setstate__ protocol {p}", pickle.dumps(armed, protocol=p), "pickle") for p in range(6)]
    here = Armed.__module__
    state = b"}" + _u("marker") + _u(marker) + b"s"  # {"marker": marker}
    out += [
        # getattr(__import__("os"), "system")(cmd)
        Blob(
            "REDUCE builtins.getattr chain",
            b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\n" + _u("os") + b"\x85R" + _u("system") + b"\x86R" + _u(cmd) + b"\x85R.",
            "pickle",
        ),
        Blob("INST os.system (protocol 0)", f"(S'{cmd}'\nios\nsystem\n.".encode(), "pickle"),
        Blob("OBJ os.system (protocol 1)", f"(cos\nsystem\nS'{cmd}'\no.".encode(), "pickle"),
        Blob("NEWOBJ Armed + BUILD (protocol 2)", b"\x80\x02c" + here.encode() + b"\nArmed\n)\x81" + state + b"b.", "pickle"),
        Blob("NEWOBJ_EX Armed + BUILD (protocol 4)", b"\x80\x04" + _s(here) + _s("Armed") + b"\x93)}\x92" + state + b"b.", "pickle"),
        Blob("NEWOBJ subprocess.Popen (protocol 2)", b"\x80\x02csubprocess\nPopen\n" + _u(cmd) + b"\x85\x81.", ""),
        Blob("EXT4 -> os.system (protocol 2)", b"\x80\x02\x84" + _EXT_CODE.to_bytes(4, "little") + _u(cmd) + b"\x85R.", "pickle"),
        # Issue 38, item 1: a dotted global resolved through an allowed module (its bytes, our marker).
        Blob(
            "STACK_GLOBAL torch.distributed.checkpoint.filesystem + os.system (issue 38)",
            b"\x80\x04\x8c\x27torch.distributed.checkpoint.filesystem\x8c\x09os.system\x93" + _s(cmd) + b"\x85R.",
            "pickle",
        ),
    ]
    for module in ("torch.distributed.checkpoint.metadata", "torch.serialization", "torch._utils", "pathlib", "torch"):
        dotted = b"\x80\x04" + _s(module) + _s("os.system") + b"\x93" + _s(cmd) + b"\x85R."
        out.append(Blob(f"STACK_GLOBAL {module} + os.system", dotted, "pickle"))
    dotted = b"\x80\x04ctorch.serialization\nos.system\n" + _s(cmd) + b"\x85R."
    out.append(Blob("GLOBAL torch.serialization + os.system (protocol 4)", dotted, "pickle"))
    return out


def _genuine_zip() -> bytes:
    buf = io.BytesIO()
    torch.save({"format": "fddp-checkpoint", "version": 1, "structure": ("leaf",), "leaves": [torch.ones(2)], "paths": ["x"]}, buf)
    return buf.getvalue()


def _zipped(pkl: bytes, twice: bool = False) -> bytes:
    """A zip as torch.save writes it, with ``pkl`` as its ``data.pkl`` (``twice``: after the genuine one)."""
    src = zipfile.ZipFile(io.BytesIO(_genuine_zip()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            if info.filename.endswith("/data.pkl"):
                z.writestr(info.filename, src.read(info) if twice else pkl)
                if twice:
                    with pytest.warns(UserWarning, match="Duplicate name"):
                        z.writestr(info.filename, pkl)
            else:
                z.writestr(info.filename, src.read(info))
    return out.getvalue()


class _Script(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def corpus(marker: str) -> list[Blob]:
    """Every hostile blob: the raw pickles, each hidden in a torch.save zip, and the other formats."""
    raw = _pickles(marker)
    out = list(raw)
    out += [Blob(f"{b.name}, as a torch.save zip's data.pkl", _zipped(b.data), "torch" if b.live else "") for b in raw]
    reduce = pickle.dumps(_Reduce(os.system, (f"touch {marker}",)), protocol=2)
    buf = io.BytesIO()
    torch.save({"w": torch.ones(1), "x": _Reduce(os.system, (f"touch {marker}",))}, buf)
    out.append(Blob("torch.save of a tree with an object that runs a command", buf.getvalue(), "torch"))
    buf = io.BytesIO()
    leaf = _Reduce(os.system, (f"touch {marker}",))
    torch.save({"format": "fddp-checkpoint", "version": 1, "structure": ("leaf",), "paths": ["x"], "leaves": [leaf]}, buf)
    out.append(Blob("an fddp payload whose leaf runs a command", buf.getvalue(), "torch"))
    buf = io.BytesIO()
    torch.save({"x": _Reduce(os.system, (f"touch {marker}",))}, buf, _use_new_zipfile_serialization=False)
    out.append(Blob("a legacy (non-zip) torch file", buf.getvalue(), "torch"))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit is deprecated; its archives still exist
        torch.jit.save(torch.jit.script(_Script()), buf)
    out.append(Blob("a TorchScript archive", buf.getvalue(), ""))
    out.append(Blob("a zip holding a genuine data.pkl, then a hostile one", _zipped(reduce, twice=True), ""))
    return out


@pytest.fixture
def blobs(tmp_path):
    marker = str(tmp_path / "ran")
    copyreg.add_extension("os", "system", _EXT_CODE)
    try:
        yield marker, corpus(marker)
    finally:
        copyreg.remove_extension("os", "system", _EXT_CODE)


def _assert_refused(load: Callable[[], Any], named: str, marker: str, blob: Blob) -> None:
    try:
        load()
    except CheckpointError as e:
        assert named in str(e), f"{blob.name}: the error does not name {named}: {e}"
    except BaseException as e:  # noqa: BLE001 - anything but CheckpointError is this test's failure
        raise AssertionError(f"{blob.name}: {type(e).__name__} instead of CheckpointError: {e}") from e
    else:
        raise AssertionError(f"{blob.name}: loaded without an error")
    finally:
        ran = os.path.exists(marker)
        if ran:
            os.remove(marker)
    assert not ran, f"{blob.name}: the payload ran"


# --- the corpus is live ------------------------------------------------------------------------------


def test_the_corpus_runs_its_payload_when_loaded_without_restrictions(blobs):
    marker, corpus_ = blobs
    for blob in corpus_:
        if not blob.live:
            continue
        try:
            if blob.live == "pickle":
                pickle.loads(blob.data)
            else:
                torch.load(io.BytesIO(blob.data), weights_only=False)
        except Exception:  # noqa: BLE001 - the payload runs while the pickle loads; what comes after may fail
            pass
        assert os.path.exists(marker), f"{blob.name}: not live (an unrestricted load does not run it)"
        os.remove(marker)
    assert sum(1 for b in corpus_ if b.live) >= 80 and len(corpus_) >= 100, len(corpus_)


# --- single files ------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["load", "load_step"])
def test_single_file_loads_refuse_the_corpus(tmp_path, blobs, how):
    marker, corpus_ = blobs
    path = str(tmp_path / "ckpt-00000001.pt")
    for blob in corpus_:
        with open(path, "wb") as f:
            f.write(blob.data)
        load = (lambda: ckpt.load(path)) if how == "load" else (lambda: ckpt.load_step(path))
        _assert_refused(load, path, marker, blob)


# --- sharded checkpoints (with per-rank state) --------------------------------------------------------


def _tree(fill: float) -> dict:
    return {
        "params": fddp.zero.shard({"w": torch.full((8,), fill)}),
        "step": int(fill),
        "mine": ckpt.PerRank({"r": torch.full((2,), fill), "n": int(fill)}),
    }


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A sharded checkpoint fddp wrote (shards, a replicated scalar, per-rank state) and one that
    torch.distributed.checkpoint wrote itself (no manifest)."""
    fddp.init()
    root = tmp_path_factory.mktemp("sharded")
    ours = ckpt.save_sharded(str(root / "ours"), _tree(3.0))
    theirs = str(root / "theirs")
    torch.distributed.checkpoint.save({"w": torch.arange(8.0)}, checkpoint_id=theirs, no_dist=True)
    assert ckpt.load_sharded(ours, _tree(0.0))["step"] == 3
    assert torch.equal(ckpt.load_sharded(theirs, {"w": torch.zeros(8)})["w"], torch.arange(8.0))
    return ours, theirs


def _replace_piece(directory: str, data: bytes) -> str:
    """Make ``data`` the one piece of a DCP checkpoint of one tensor, its index updated to match."""
    meta = os.path.join(directory, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)  # this test's own checkpoint: trusted
    (index, info), = md.storage_data.items()
    piece = os.path.join(directory, info.relative_path)
    with open(piece, "wb") as f:
        f.write(data)
    md.storage_data[index] = type(info)(info.relative_path, 0, len(data))
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    return piece


_SHARDED_PATHS = [
    "ours .metadata", "ours .metadata, load_step", "ours manifest", "ours piece",
    "theirs .metadata", "theirs .metadata, load_step", "theirs piece",
]  # fmt: skip


@pytest.mark.parametrize("where", _SHARDED_PATHS)
def test_sharded_loads_refuse_the_corpus(tmp_path, blobs, sharded, where):
    marker, corpus_ = blobs
    ours, theirs = sharded
    fddp.init()
    source = ours if where.startswith("ours") else theirs
    like = _tree(0.0) if source is ours else {"w": torch.zeros(8)}
    for k, blob in enumerate(corpus_):
        directory = str(tmp_path / f"c{k}")
        shutil.copytree(source, directory)
        if where.endswith("piece"):
            if source is ours:  # every piece of a file fddp wrote has its CRC-32 in the manifest
                named = os.path.join(directory, "__0_0.distcp")
                with open(named, "wb") as f:
                    f.write(blob.data)
            else:
                named = _replace_piece(directory, blob.data)
        else:
            named = os.path.join(directory, ckpt._dcp.MANIFEST if "manifest" in where else ".metadata")
            with open(named, "wb") as f:
                f.write(blob.data)
        if "load_step" in where:
            load = lambda: ckpt.load_step(directory, like)  # noqa: E731
        else:
            load = lambda: ckpt.load_sharded(directory, like)  # noqa: E731
        _assert_refused(load, named, marker, blob)
        shutil.rmtree(directory)


# --- fddp.zero.load_full ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["file", "directory", "index", "pickles only"])
def test_load_full_refuses_the_corpus(tmp_path, blobs, where):
    marker, corpus_ = blobs
    fddp.init()
    shards = fddp.zero.shard({"w": torch.zeros(4)})
    for k, blob in enumerate(corpus_):
        directory = tmp_path / f"d{k}"
        directory.mkdir()
        if where == "file":
            named = source = str(directory / "weights.safetensors")
        elif where == "directory":
            named, source = str(directory / "model.safetensors"), str(directory)
        elif where == "index":
            (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "part-1.safetensors"}}))
            named, source = str(directory / "part-1.safetensors"), str(directory)
        else:
            named, source = str(directory / "pytorch_model.bin"), str(directory)
        with open(named, "wb") as f:
            f.write(blob.data)
        _assert_refused(lambda: fddp.zero.load_full(shards, source), named, marker, blob)
        shutil.rmtree(directory)


def test_load_full_refuses_an_index_that_points_outside_its_directory(tmp_path):
    fddp.init()
    shards = fddp.zero.shard({"w": torch.zeros(4)})
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"")
    (tmp_path / "d").mkdir()
    for target in ("../elsewhere.safetensors", str(outside)):
        (tmp_path / "d" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": target}}))
        with pytest.raises(CheckpointError, match="outside the checkpoint's directory"):
            fddp.zero.load_full(shards, str(tmp_path / "d"))
    (tmp_path / "d" / "model.safetensors.index.json").write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: not a safetensors index"):
        fddp.zero.load_full(shards, str(tmp_path / "d"))


# --- fddp.ft's live state -----------------------------------------------------------------------------


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _Peer:
    """A process group whose peer sends ``messages`` (each copied into the tensor received)."""

    def __init__(self, messages: list[torch.Tensor]) -> None:
        self.messages = list(messages)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Done:
        data = self.messages.pop(0)
        tensors[0].copy_(data[: tensors[0].numel()])
        return _Done()


@pytest.mark.parametrize("where", ["header", "transport", "chunks"])
def test_the_live_state_reader_refuses_the_corpus(blobs, where):
    pytest.importorskip("torchft")
    from fddp.ft import _transport, _wire

    marker, corpus_ = blobs
    like = {"w": torch.zeros(64, dtype=torch.uint8)}
    for blob in corpus_:
        raw = torch.frombuffer(bytearray(blob.data), dtype=torch.uint8)
        if where == "header":
            named = "the live state from replica group 1"
            load = lambda: _wire.header_of(raw, named)  # noqa: E731
        elif where == "transport":
            named = "replica group 1"
            peer = _Peer([torch.tensor([raw.numel()]), raw])
            transport = _transport.GroupTransport(peer, like=lambda: like)
            load = lambda: transport.recv_checkpoint(1, _transport.METADATA, 5, None)  # noqa: E731
        else:  # the tensors' bytes are raw bytes, never parsed: a pickle there fails the CRC-32
            packed = _wire.pack({"w": torch.zeros(len(blob.data), dtype=torch.uint8)}, step=5)
            chunks = [raw.clone()]
            named = "a peer"
            header = _wire.header_of(packed.header)
            load = lambda: _wire.unpack(header, chunks, {"w": torch.zeros(len(blob.data), dtype=torch.uint8)}, named)  # noqa: E731
        _assert_refused(load, named, marker, blob)


def test_damaged_live_state_headers_are_checkpoint_errors():
    pytest.importorskip("torchft")
    from fddp.ft import _wire

    packed = _wire.pack({"w": torch.arange(4.0), "s": (1, 2)}, step=2)
    good = _wire.header_of(packed.header)
    broken = [
        {**good, "step": None},
        {**good, "tensors": [["float32", [-1]]]},
        {**good, "tensors": [["no_such_dtype", [4]]]},
        {**good, "layout": [[0, 2, 16]]},  # misaligned for float32
        {**good, "layout": [[7, 0, 16]]},  # no such chunk
        {**good, "payload": {"d": [[{"t": []}, 1]] * 2 + [[[1], 2]]}},  # an unhashable key
        {**good, "payload": {"x": 99}},
        {**good, "payload": _deep(5_000)},  # deeper than the recursion limit
    ]
    for header in broken:
        with pytest.raises(CheckpointError, match="a peer"):
            _wire.unpack(header, [c.clone() for c in packed.chunks], {"w": torch.zeros(4), "s": (0, 0)}, "a peer")
    deep = torch.frombuffer(bytearray(b"[" * 200_000 + b"]" * 200_000), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="not JSON"):
        _wire.header_of(deep, "a peer")


def _deep(n: int) -> Any:
    x: Any = []
    for _ in range(n):
        x = [x]
    return x


# --- the DCP index: CRC before parsing, exact names, pieces inside the directory, no pickled objects ----


def test_issue_38s_metadata_is_refused_unread_by_its_crc_and_by_name_without_one(tmp_path, sharded):
    ours, theirs = sharded
    marker = tmp_path / "x"
    issue = b"\x80\x04\x8c\x27torch.distributed.checkpoint.filesystem\x8c\x09os.system\x93" + _s(f"touch {marker}") + b"\x85R."
    fddp.init()
    for source, like, expect in (
        (ours, _tree(0.0), "damaged: it does not match the CRC-32 saved in the manifest .* so it was not read"),
        (theirs, {"w": torch.zeros(8)}, "unsupported GLOBAL torch.distributed.checkpoint.filesystem.os.system"),
    ):
        directory = str(tmp_path / os.path.basename(source))
        shutil.copytree(source, directory)
        with open(os.path.join(directory, ".metadata"), "wb") as f:
            f.write(issue)
        with pytest.raises(CheckpointError, match=expect):
            ckpt.load_sharded(directory, like)
        assert not marker.exists()


def test_an_index_whose_pieces_lie_outside_the_directory_is_refused(tmp_path, sharded):
    _, theirs = sharded
    directory = str(tmp_path / "theirs")
    shutil.copytree(theirs, directory)
    meta = os.path.join(directory, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)
    (index, info), = md.storage_data.items()
    for elsewhere in ("../secret.distcp", "/etc/passwd", "sub/../../x"):
        md.storage_data[index] = type(info)(elsewhere, 0, info.length)
        with open(meta, "wb") as f:
            pickle.dump(md, f)
        with pytest.raises(CheckpointError, match="not a byte range of a file in the checkpoint's directory"):
            ckpt.load_sharded(directory, {"w": torch.zeros(8)})


def test_dcp_is_never_asked_to_unpickle_an_object(sharded):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    _, theirs = sharded
    metadata = ckpt._dcp.read_metadata(theirs, None, tensors_only=False)
    reader = ckpt._dcp.Reader(theirs, None, metadata)
    item = ReadItem(LoadItemType.BYTE_IO, MetadataIndex("opt"), torch.Size([0]), MetadataIndex("opt"), torch.Size([0]), torch.Size([0]))
    with pytest.raises(CheckpointError, match="refused to load 'opt': a pickled object"):
        reader.read_data(LoadPlan([item]), planner=None)
