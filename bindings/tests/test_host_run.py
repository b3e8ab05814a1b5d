"""CPU tensors of a repeated save, taken by their storages (``ckpt._ckpt.HostRun``)."""

from __future__ import annotations

import ctypes
import gc
import threading
import weakref
from typing import Any, List

import numpy as np
import pytest
import torch

import ckpt
from ckpt._ckpt import HostRun, HostSpan, TensorRef, TensorSpec


def walked(name: str, t: torch.Tensor) -> TensorSpec:
    """The spec the walk makes of a CPU tensor (a numpy view of it)."""
    return TensorSpec(name=name, dtype="F32", shape=list(t.shape), data=t.numpy())


def test_a_run_makes_specs_over_the_bytes_of_each_storage() -> None:
    base = torch.arange(24, dtype=torch.float32)
    # Tensors that start inside their storages, as slices and views do.
    ts = [base[4:16].view(3, 4), base[16:24], torch.tensor(5.0)]
    run = HostRun([walked(f"t{i}", t) for i, t in enumerate(ts)])
    assert len(run) == 3
    specs = run.specs([t.untyped_storage() for t in ts], [t.data_ptr() for t in ts], [True, False, False])
    assert [s.name for s in specs] == ["t0", "t1", "t2"]
    assert [s.shape for s in specs] == [[3, 4], [8], []]
    assert [s.copy_now for s in specs] == [True, False, False]
    for s, t in zip(specs, ts):
        view = memoryview(s.data)
        assert view.readonly and len(s.data) == s.data.nbytes == t.nbytes
        assert view.tobytes() == t.numpy().tobytes()
    with pytest.raises((BufferError, TypeError)):
        ctypes.c_char.from_buffer(specs[1].data)  # (a writable export is refused)


@pytest.mark.parametrize(
    "case",
    ["before its storage", "past its storage's end", "another storage", "no storage", "lengths differ"],
)
def test_a_run_refuses_bytes_outside_their_storage(case: str) -> None:
    t = torch.arange(8, dtype=torch.float32)
    other = torch.zeros(8)
    run = HostRun([walked("t", t)])
    storage: Any = t.untyped_storage()
    ptrs: List[int] = [t.data_ptr()]
    flags = [False]
    if case == "before its storage":
        ptrs = [t.data_ptr() - 4]
    elif case == "past its storage's end":
        ptrs = [t.data_ptr() + 4]
    elif case == "another storage":
        storage = other.untyped_storage()
    elif case == "no storage":
        storage = object()
    else:
        flags = [False, True]
    with pytest.raises(ckpt.InvalidInputError):
        run.specs([storage], ptrs, flags)


def test_a_span_holds_its_storage_until_the_background_copy_took_it(url: str) -> None:
    # The loop lets its tensor go while a lazy save's copy waits: the span
    # keeps the memory, the checkpoint has its bytes, and once the copy is
    # done the memory is let go.
    arr = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: given back to the OS when freed
    alive = weakref.ref(arr)
    t = torch.from_numpy(arr)
    expected = arr.tobytes()
    run = HostRun([walked("t", t)])
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    go = threading.Event()
    specs = run.specs([t.untyped_storage()], [t.data_ptr()], [False])
    meta = {"ckpt": {"version": 1, "numpy": []}, "state": {"t": TensorRef("t")}}
    h = cp._native.save(0, specs, meta, go.wait)  # (the copy waits until `go`)
    del specs, t, arr
    gc.collect()
    assert alive() is not None
    go.set()
    h.wait()
    gc.collect()
    assert alive() is None
    assert cp.read(0).state["t"].numpy().tobytes() == expected
    cp.close()


def test_a_writable_span_is_a_loads_destination_inside_its_storage() -> None:
    """A restore's destination in a live CPU tensor (``HostSpan.writable``):
    written through the buffer protocol, checked against its storage, and
    keeping the storage alive."""
    base = torch.zeros(16, dtype=torch.float32)
    t = base[4:12]
    span = HostSpan.writable(t.untyped_storage(), t.data_ptr(), t.numel() * 4)
    view = memoryview(span)
    assert not view.readonly and len(span) == span.nbytes == 32
    view[:] = torch.arange(8, dtype=torch.float32).numpy().tobytes()
    view.release()
    assert torch.equal(base[4:12], torch.arange(8, dtype=torch.float32)) and base[:4].eq(0).all() and base[12:].eq(0).all()
    # Bytes outside the storage, on either side, are refused.
    for ptr, n in [(t.data_ptr(), 64), (base.data_ptr() - 4, 8)]:
        with pytest.raises(ckpt.InvalidInputError, match="not inside its storage"):
            HostSpan.writable(t.untyped_storage(), ptr, n)
    # The span holds the storage: the tensor may go.
    ref = weakref.ref(base)
    held = HostSpan.writable(base.untyped_storage(), base.data_ptr(), 64)
    del base, t
    gc.collect()
    assert ref() is None
    memoryview(held)[:4] = b"\1\0\0\0"  # (still the storage's memory, alive)
    # A save's span is read-only.
    ones = torch.ones(2)
    (spec,) = HostRun([walked("r", ones)]).specs([ones.untyped_storage()], [ones.data_ptr()], [False])
    assert memoryview(spec.data).readonly


class _NoStorage(torch.Tensor):
    """A CPU tensor whose storage cannot be had (as a subclass that does not implement it)."""

    def untyped_storage(self) -> Any:  # type: ignore[override]
        raise NotImplementedError("no storage here")


def test_a_restore_into_a_tensor_without_a_storage_goes_through_its_byte_view(tmp_path: Any) -> None:
    from ckpt._restore.plan import _bytes_of

    cp = ckpt.Checkpointer(tmp_path.as_uri(), coordinate="none", rng=False)
    cp.save(1, {"w": torch.arange(6, dtype=torch.float32)}).wait()
    live = torch.Tensor._make_subclass(_NoStorage, torch.zeros(6))
    assert isinstance(_bytes_of(live, live.data_ptr(), 24), np.ndarray)  # (not a span: no storage)
    state = {"w": live}
    assert cp.load_latest(state) == 1
    assert state["w"] is live and torch.equal(live.as_subclass(torch.Tensor), torch.arange(6, dtype=torch.float32))
    cp.close()
