"""The boundary between the Python package and the native module: typed
arguments, Checkpointer.gc, the allocator's settings, the public surface."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

import ckpt
from ckpt import _ckpt
from conftest import PYTHON, python_env

# ------------------------------------------------------------ typed arguments


def test_a_tensor_spec_checks_itself_when_made() -> None:
    data = np.zeros(6, dtype=np.float32)
    spec = _ckpt.TensorSpec(name="w", dtype="F32", shape=(2, 3), data=data)
    assert (spec.name, spec.dtype, spec.shape, spec.copy_now, spec.shard) == ("w", "F32", [2, 3], False, None)
    assert spec.data is data
    with pytest.raises(ckpt.UnsupportedError, match="F33"):
        _ckpt.TensorSpec(name="w", dtype="F33", shape=(2, 3), data=data)
    with pytest.raises(ckpt.InvalidInputError, match="one entry per dimension"):
        _ckpt.Shard([4, 3], [2])
    with pytest.raises(ckpt.InvalidInputError, match="tensor `w`"):
        _ckpt.TensorSpec(name="w", dtype="F32", shape=(2, 3), data=data, shard=_ckpt.Shard([4], [2]))
    with pytest.raises(TypeError):
        _ckpt.TensorSpec("w", "F32", (2, 3), data)  # type: ignore[misc]  # keywords only


def test_replace_changes_only_what_it_is_given() -> None:
    shard = _ckpt.Shard([4, 3], [2, 0])
    spec = _ckpt.TensorSpec(name="w", dtype="F32", shape=(2, 3), data=b"x" * 24, shard=shard)
    now = spec.replace(copy_now=True)
    assert now.copy_now and now.data == b"x" * 24 and now.shard is shard and now.name == "w"
    other = spec.replace(data=b"y" * 24)
    assert other.data == b"y" * 24 and not other.copy_now
    assert not spec.copy_now and spec.data == b"x" * 24, "the original is frozen"


def test_native_save_and_load_into_take_typed_objects(url: str) -> None:
    cp = _ckpt.Checkpointer(url)
    whole = np.arange(12, dtype=np.float32)
    piece = np.arange(6, dtype=np.int16)
    tensors = [
        _ckpt.TensorSpec(name="whole", dtype="F32", shape=(3, 4), data=whole),
        _ckpt.TensorSpec(name="sharded", dtype="I16", shape=(2, 3), data=piece, shard=_ckpt.Shard([4, 3], [2, 0])),
    ]
    cp.save(5, tensors, {"state": None}).wait(30)
    with pytest.raises(TypeError):
        cp.save(6, [("whole", "F32", (3, 4), whole, False, None)], {"state": None})  # type: ignore[list-item]

    meta, table = cp.contents(5, cp.committed()[-1][1])
    assert meta == {"state": None}
    info = table["sharded"]
    assert (info.dtype, info.global_shape, info.pieces, info.nbytes) == ("I16", [4, 3], 1, 24)
    assert (table["whole"].global_shape, table["whole"].nbytes) == ([3, 4], 48)

    got_whole = np.zeros(12, dtype=np.float32)
    got_piece = np.zeros(6, dtype=np.int16)
    cp.load_into(
        5,
        cp.committed()[-1][1],
        [
            _ckpt.LoadTarget(name="whole", dtype="F32", shape=(3, 4), dest=got_whole.view(np.uint8)),
            _ckpt.LoadTarget(
                name="sharded", dtype="I16", shape=(2, 3), dest=got_piece.view(np.uint8), shard=_ckpt.Shard([4, 3], [2, 0])
            ),
        ],
    )
    assert (got_whole == whole).all() and (got_piece == piece).all()
    wrong = _ckpt.LoadTarget(name="whole", dtype="F64", shape=(3, 4), dest=np.zeros(12).view(np.uint8))
    with pytest.raises(ckpt.InvalidInputError):
        cp.load_into(5, cp.committed()[-1][1], [wrong])


# ------------------------------------------------------------------------ gc


def _save_steps(url: str, steps: range) -> None:
    with ckpt.Checkpointer(url, rng=False) as cp:
        for s in steps:
            cp.save(s, w=np.full(1000, s, dtype=np.float32), same=np.arange(64, dtype=np.float64))


def test_gc_retires_what_keep_last_no_longer_keeps(url: str, root: Path) -> None:
    _save_steps(url, range(1, 5))
    chunks_before = set((root / "chunks").iterdir())
    cp = ckpt.Checkpointer(url, keep_last=2, rng=False, gc_grace=0)
    report = cp.gc()
    assert isinstance(report, _ckpt.GcReport)
    assert [s for s, _ in report.retired] == [1, 2]
    assert report.incomplete_removed == [] and not report.chunk_sweep_skipped
    chunks_after = set((root / "chunks").iterdir())
    assert chunks_after < chunks_before
    assert report.chunks_deleted == len(chunks_before - chunks_after)
    assert cp.steps() == [3, 4]
    state = {"w": np.zeros(1000, dtype=np.float32), "same": np.zeros(64)}
    assert cp.load_latest(state) == 4
    assert (state["w"] == 4).all() and (state["same"] == np.arange(64)).all()
    again = cp.gc()
    assert (again.retired, again.chunks_deleted) == ([], 0), "nothing left to collect"


def test_gc_deletes_orphaned_data(url: str, root: Path) -> None:
    _save_steps(url, range(1, 3))
    # What a crash between writing data and committing leaves: a chunk no
    # manifest references.
    orphan = root / "chunks" / ("ab" * 32)
    orphan.write_bytes(b"left behind")
    # Young garbage may be a save in flight elsewhere: kept through the grace period.
    report = ckpt.Checkpointer(url, rng=False).gc()
    assert report.chunks_deleted == 0 and orphan.exists()
    cp = ckpt.Checkpointer(url, rng=False, gc_grace=0)  # no retention: every checkpoint stays
    report = cp.gc()
    assert report.retired == [] and report.chunks_deleted == 1
    assert not orphan.exists()
    assert cp.steps() == [1, 2]
    assert cp.read_latest() is not None


# ------------------------------------------------------------------ allocator


def _purge_delay(env: dict[str, str]) -> list[str]:
    code = "import os, ckpt; print(os.environ.get('MIMALLOC_PURGE_DELAY'), ckpt._ckpt._mimalloc_purge_delay())"
    out = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_import_sets_the_purge_delay_through_mimalloc_not_the_environment() -> None:
    env = python_env()
    env.pop("MIMALLOC_PURGE_DELAY", None)
    assert _purge_delay(env) == ["None", "0"]


def test_a_purge_delay_the_user_set_stays() -> None:
    env = python_env()
    env["MIMALLOC_PURGE_DELAY"] = "250"
    assert _purge_delay(env) == ["250", "250"]


# -------------------------------------------------------------------- surface


def test_the_package_exports_what_users_call() -> None:
    assert all(hasattr(ckpt, n) for n in ckpt.__all__)
    assert "TensorRef" not in ckpt.__all__ and not hasattr(ckpt, "TensorRef")
    assert callable(ckpt.Checkpointer.gc)
    for private in ("resolve", "agree"):
        assert not hasattr(ckpt.distributed, private)
        assert private not in ckpt.distributed.__all__
    # The two coordinators, and the protocols a coordinator of your own follows.
    assert set(ckpt.distributed.__all__) == {"TorchCoordinator", "MPICoordinator", "mpi_world_size", "Coordinator", "Link"}
