"""``torch.distributed.checkpoint`` (DCP) saving into and loading from ckpt (``ckpt.dcp``).

In-process tests run DCP on a one-rank gloo group, with real DTensors; the
sharded tests run FSDP2 jobs under ``torchrun`` (``dcp_worker.py``) and
compare the full state PyTorch gathers itself, bitwise, across rank counts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import ckpt
import ckpt.cli
from ckpt.dcp import StorageReader, StorageWriter, step_of
from conftest import PYTHON, python_env
from killed import assert_same_end, run_killed

WORKER = str(Path(__file__).with_name("dcp_worker.py"))
LIMIT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mesh() -> Iterator[object]:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def state(mesh: object, seed: int = 0) -> Dict[str, object]:
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(37, 11, generator=g),
            "half": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-(2**40), 2**40, (13,), generator=g),
            "mask": torch.rand(7, generator=g) > 0.5,
            "scalar": torch.tensor(3.25, dtype=torch.float64),
            "sharded": distribute_tensor(torch.randn(9, 4, generator=g), mesh, [Shard(0)]),
        },
        "extra": {"epoch": 3, "note": "plain data, a DCP byte item"},
    }


def zeros_like(s: Dict[str, object], mesh: object) -> Dict[str, object]:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    model = {}
    for k, t in s["model"].items():
        if isinstance(t, DTensor):
            model[k] = distribute_tensor(torch.zeros(t.shape, dtype=t.dtype), mesh, [Shard(0)])
        else:
            model[k] = torch.zeros_like(t)
    return {"model": model, "extra": {"epoch": 0, "note": ""}}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    b = b.full_tensor() if hasattr(b, "full_tensor") else b
    return a.dtype == b.dtype and a.shape == b.shape and bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy()
    )


def assert_same(saved: Dict[str, object], loaded: Dict[str, object]) -> None:
    for k, t in saved["model"].items():
        assert same(t, loaded["model"][k]), k
    assert loaded["extra"] == saved["extra"]


def test_checkpoint_id_names_the_step() -> None:
    assert step_of(100) == 100
    assert step_of("step-100") == 100
    assert step_of("/ckpt/run/step_7/") == 7
    assert step_of(Path("/x/42")) == 42
    for bad in ("latest", "/ckpt/step-3/final", -1, True, 1.5):
        with pytest.raises(ValueError):
            step_of(bad)
    assert StorageWriter.validate_checkpoint_id("step-9") and StorageReader.validate_checkpoint_id("9")
    assert not StorageWriter.validate_checkpoint_id("latest")


def test_save_load_bitwise_and_readable_by_ckpt(mesh: object, url: str) -> None:
    saved = state(mesh)
    meta = dcp.save(saved, checkpoint_id="step-7", storage_writer=StorageWriter(url))
    assert "model.sharded" in meta.state_dict_metadata

    loaded = zeros_like(saved, mesh)
    dcp.load(loaded, checkpoint_id="step-7", storage_reader=StorageReader(url))
    assert_same(saved, loaded)

    # Without a checkpoint_id the reader reads the newest checkpoint.
    again = zeros_like(saved, mesh)
    dcp.load(again, storage_reader=StorageReader(url))
    assert_same(saved, again)

    # An ordinary ckpt checkpoint: the read-only checkpointer and the CLI read it.
    cp = ckpt.Checkpointer(url, read_only=True)
    assert cp.steps() == [7]
    got = cp.read_latest()
    assert got is not None and got.step == 7
    tensors = got.state["tensors"]
    for k, t in saved["model"].items():
        assert same(t, tensors[f"model.{k}"]), k
    # DCP's metadata, as plain data in the engine's encoding (no pickle).
    md = ckpt._ckpt.decode_tree(got.state["dcp"].numpy().tobytes())
    assert md["format"] == "ckpt.dcp" and md["tensors"]["model.sharded"]["chunks"] == [[[0, 0], [9, 4]]]
    assert set(got.state["bytes"]) == {"extra.epoch", "extra.note"} or set(got.state["bytes"]) == set()
    assert ckpt.cli.main(["verify", url]) == 0
    assert ckpt.cli.main(["list", url]) == 0


def test_a_state_comes_back_without_a_model(mesh: object, url: str) -> None:
    """DCP rebuilds a nested state from the checkpoint alone, by the planner's
    data (each flattened key's path), which ckpt keeps as plain data."""
    from torch.distributed.checkpoint import state_dict_loader

    load_keys = getattr(state_dict_loader, "_load_state_dict_from_keys", None)
    if load_keys is None:
        pytest.skip("this PyTorch cannot load a DCP checkpoint without a state dict")
    saved = {"model": {"a": torch.randn(3), "layers": [torch.ones(2), {"x": torch.zeros(1)}]}, "extra": {"epoch": 3}}
    dcp.save(saved, checkpoint_id=1, storage_writer=StorageWriter(url))
    got = load_keys(storage_reader=StorageReader(url))
    assert same(got["model"]["a"], saved["model"]["a"]) and same(got["model"]["layers"][1]["x"], torch.zeros(1))
    assert got["extra"] == {"epoch": 3}


def test_unchanged_tensors_are_stored_once(mesh: object, url: str, root: Path) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    n = 1 << 19  # 2 MiB of float32 each: tensors of their own chunks
    g = torch.Generator().manual_seed(1)
    s = {"a": torch.randn(n, generator=g), "b": torch.randn(n, generator=g),
         "c": distribute_tensor(torch.randn(n, generator=g), mesh, [Shard(0)])}
    writer = StorageWriter(url)

    def stored() -> int:
        return sum(f.stat().st_size for f in (root / "chunks").iterdir())

    dcp.save(s, checkpoint_id=1, storage_writer=writer)
    first = stored()
    assert first > 3 * 4 * n
    s["a"] = s["a"] + 1
    dcp.save(s, checkpoint_id=2, storage_writer=writer)
    assert stored() - first < 1.05 * 4 * n, (first, stored())  # only the changed tensor is new
    loaded = {k: torch.zeros_like(v) for k, v in s.items()}
    dcp.load(loaded, checkpoint_id=2, storage_reader=StorageReader(url))
    assert all(same(s[k], loaded[k]) for k in s)
    # A change in place, of one element, is saved too.
    s["b"][7] += 1
    dcp.save(s, checkpoint_id=3, storage_writer=writer)
    dcp.load(loaded, checkpoint_id=3, storage_reader=StorageReader(url))
    assert all(same(s[k], loaded[k]) for k in s)


def test_async_save_in_a_thread(mesh: object, url: str) -> None:
    saved = state(mesh, seed=3)
    fut = dcp.async_save(saved, checkpoint_id="step-11", storage_writer=StorageWriter(url))
    getattr(fut, "upload_completion", fut).result()
    loaded = zeros_like(saved, mesh)
    dcp.load(loaded, checkpoint_id="step-11", storage_reader=StorageReader(url))
    assert_same(saved, loaded)


def failure_of(e: CheckpointException) -> BaseException:
    (exc, _trace), = e.failures.values()
    return exc


def test_corrupt_chunk_fails_the_load_with_corrupt_error(mesh: object, url: str, root: Path) -> None:
    saved = state(mesh)
    saved["model"]["big"] = torch.randn(1 << 19)  # 2 MiB: a chunk of its own
    dcp.save(saved, checkpoint_id=5, storage_writer=StorageWriter(url))
    chunks = sorted((root / "chunks").iterdir(), key=lambda f: f.stat().st_size)
    assert ckpt.cli.main(["verify", url]) == 0

    def flip(chunk: Path) -> None:
        data = bytearray(chunk.read_bytes())
        data[len(data) // 2] ^= 0xFF
        chunk.write_bytes(bytes(data))

    flip(chunks[-1])  # the big tensor's data: read_data fails
    with pytest.raises(CheckpointException) as e:
        dcp.load(zeros_like(saved, mesh), checkpoint_id=5, storage_reader=StorageReader(url))
    assert isinstance(failure_of(e.value), ckpt.CorruptError), e.value
    assert ckpt.cli.main(["verify", url]) != 0

    flip(chunks[-1])
    assert ckpt.cli.main(["verify", url]) == 0
    flip(chunks[0])  # the small tensors and DCP's metadata: read_metadata fails
    with pytest.raises(CheckpointException) as e:
        dcp.load(zeros_like(saved, mesh), checkpoint_id=5, storage_reader=StorageReader(url))
    # (DCP reports a failed read_metadata as an AssertionError of its own, with ckpt's message.)
    assert "hash mismatch" in str(failure_of(e.value)), e.value


def test_a_step_is_written_once_and_needs_an_id(mesh: object, url: str) -> None:
    saved = state(mesh)
    writer = StorageWriter(url)
    dcp.save(saved, checkpoint_id=5, storage_writer=writer)
    with pytest.raises(CheckpointException) as e:
        dcp.save(saved, checkpoint_id=5, storage_writer=writer)
    assert isinstance(failure_of(e.value), ckpt.ConflictError), e.value
    with pytest.raises(CheckpointException) as e:
        dcp.save(saved, storage_writer=StorageWriter(url))
    assert isinstance(failure_of(e.value), ValueError), e.value
    with pytest.raises(CheckpointException) as e:
        dcp.load(zeros_like(saved, mesh), checkpoint_id=6, storage_reader=StorageReader(url))
    # DCP turns a failed read_metadata into an AssertionError of its own, with our message.
    assert "no committed checkpoint of step 6" in str(failure_of(e.value)), e.value


# ------------------------------------------------------------------ sharded jobs


def torchrun_cmd(n: int, *args: str) -> List[str]:
    return [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), WORKER, *args]


def torchrun(n: int, *args: str) -> str:
    p = subprocess.run(torchrun_cmd(n, *args), env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=LIMIT)
    assert p.returncode == 0, p.stdout[-6000:]
    return p.stdout


def rows(out: Path, mode: str, n: int) -> List[Dict]:
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(n)]


def check_loaded(out: Path, saved_by: int, loaded_by: int) -> None:
    saved = rows(out / "save", "save", saved_by)
    ref = saved[0]["digests"]
    assert len(ref) > 10 and all(r["digests"] == ref for r in saved)
    loaded = rows(out / "load", "load", loaded_by)
    for r in loaded:
        assert r["digests"] == ref
        assert r["extra"] == {"epoch": 3, "note": f"saved by {saved_by}"}


# 4 ranks: the last layer's 5 rows split 2, 2, 1, 0, so one rank holds an empty shard.
@pytest.mark.parametrize("saved_by,loaded_by", [(2, 1), (1, 2), (4, 3)])
def test_fsdp2_saved_by_n_loads_into_m_bitwise(tmp_path: Path, saved_by: int, loaded_by: int) -> None:
    url, out = (tmp_path / "ck").as_uri(), tmp_path / "out"
    torchrun(saved_by, "save", url, str(out / "save"), "--step", "4")
    torchrun(loaded_by, "load", url, str(out / "load"), "--step", "4")
    check_loaded(out, saved_by, loaded_by)
    assert ckpt.cli.main(["verify", url]) == 0
    cp = ckpt.Checkpointer(url, read_only=True)
    got = cp.read(4)
    weight = got.state["tensors"]["model.0.weight"]
    assert tuple(weight.shape) == (97, 64)  # the global tensor, assembled from the ranks' pieces


def test_fsdp2_dcp_loop_killed_with_sigkill_resumes_bitwise(tmp_path: Path) -> None:
    # 2 ranks of FSDP2 saving with dcp.save into ckpt every 4 of 16 steps; the
    # whole torchrun job is killed after step 8 is committed, mid-training.
    steps = ["--steps", "16", "--every", "4"]
    ref_url, url = (tmp_path / "ref").as_uri(), (tmp_path / "ck").as_uri()
    torchrun(2, "train", ref_url, str(tmp_path / "ref-out"), *steps)
    out = tmp_path / "out"
    run_killed(torchrun_cmd(2, "train", url, str(out), *steps, "--slow-after", "8"), python_env(), out, 8)
    committed = ckpt.Checkpointer(url, read_only=True).steps()
    assert committed and committed[-1] >= 8, committed
    log = torchrun(2, "train", url, str(out), *steps)
    assert f"resumed from {committed[-1]}" in log, log[-3000:]
    assert_same_end(tmp_path / "ref-out", out)
    assert ckpt.cli.main(["verify", url]) == 0


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_fsdp2_async_save_by_2_loads_into_1(tmp_path: Path, kind: str) -> None:
    if kind == "process":
        from torch.distributed.checkpoint import state_dict_saver

        if not hasattr(state_dict_saver.AsyncCheckpointerType, "PROCESS"):
            pytest.skip("this PyTorch has no process-based async_save")
    url, out = (tmp_path / "ck").as_uri(), tmp_path / "out"
    torchrun(2, "save", url, str(out / "save"), "--step", "8", "--async", kind)
    torchrun(1, "load", url, str(out / "load"), "--step", "8")
    check_loaded(out, 2, 1)


@pytest.mark.xfail(
    strict=False,
    reason="known intermittent: once, on a machine loaded by other builds, a rank aborted at exit "
    "('terminate called without an active exception') after the cases passed; under investigation",
)
def test_a_failure_on_one_rank_fails_the_save_on_every_rank_at_once(tmp_path: Path) -> None:
    url, out = (tmp_path / "ck").as_uri(), tmp_path / "out"
    torchrun(2, "failures", url, str(out), "--step", "5")
    ranks = [json.loads((out / f"failures-rank{r}.json").read_text())["cases"] for r in range(2)]
    for cases in ranks:
        assert cases["resolve"][0] is not None  # rank 1's RuntimeError, on both ranks
        assert cases["metadata"][0] == "UnsupportedError"  # rank 0's finish could not store it
        assert cases["dtype"][0] == "InvalidInputError"  # refused before anything was written
        assert cases["ok"][0] is None  # the step is saved after all that
        assert cases["again"][0] == "ConflictError"
        # No failure waited for a collective timeout (120 s here).
        assert all(seconds < 30 for _, seconds in cases.values()), cases
    assert ckpt.Checkpointer(url, read_only=True).steps() == [5]
    assert ckpt.cli.main(["verify", url]) == 0
