"""A save, a restore and a read hold off Python's cyclic garbage collector
(``ckpt._runtime.gc``).

The walk of a state makes thousands of short-lived tracked objects; each few
hundred would start a collection inside the save's stall. These tests lower
the collector's threshold so that a save of a few hundred tensors would start
several collections, and record every collection through ``gc.callbacks``.
"""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path
from typing import Iterator, List

import pytest
import torch

import ckpt
from ckpt.memory import MemoryCheckpointer


@pytest.fixture
def collections() -> Iterator[List[int]]:
    """Generations of the collections that start while the test runs, with a
    threshold low enough that a save of 300 tensors would start some."""
    old = gc.get_threshold()
    was = gc.isenabled()
    gc.enable()
    gc.set_threshold(50, 5, 5)
    try:
        with watching() as seen:
            yield seen
    finally:
        gc.set_threshold(*old)
        if not was:
            gc.disable()


@contextlib.contextmanager
def watching() -> Iterator[List[int]]:
    """The generations of the collections that start inside the block."""
    seen: List[int] = []

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(watch)
    try:
        yield seen
    finally:
        gc.callbacks.remove(watch)


def young() -> None:
    """Collect the young generation now: a collection already due as a call
    begins (its first allocation, before the collector is held off, starts
    it) is the caller's allocations', not the call's."""
    gc.collect(0)


def state() -> dict:
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(150)])
    return {"model": model, "extra": {"epoch": 3, "tags": ["a", "b"]}}


def collections_per_save(path: Path, lazy: bool) -> List[int]:
    """How many collections start inside each of three saves of :func:`state`."""
    s = state()
    cp = ckpt.Checkpointer(str(path), lazy=lazy)
    counts: List[int] = []
    with watching() as seen:
        for step in range(3):
            young()
            seen.clear()
            cp.save(step, s)
            counts.append(len(seen))
            assert gc.isenabled()
    cp.wait()
    cp.close()
    return counts


@pytest.mark.parametrize("lazy", [False, True])
def test_no_collection_starts_inside_a_save(
    tmp_path: Path, collections: List[int], lazy: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At most one: the collector, on again as the save returns, may start one
    # for the save's objects still alive then (the handle, the tree).
    assert max(collections_per_save(tmp_path / "paused", lazy)) <= 1
    # The same saves with the collector left on start several each (the
    # threshold is low enough for the test to mean something).
    monkeypatch.setattr(ckpt.checkpointer, "collector_paused", contextlib.nullcontext)
    assert min(collections_per_save(tmp_path / "on", lazy)) >= 3


def test_a_save_leaves_a_collector_the_program_turned_off_off(tmp_path: Path, collections: List[int]) -> None:
    cp = ckpt.Checkpointer(str(tmp_path / "c"))
    gc.disable()
    try:
        cp.save(1, state())
        assert not gc.isenabled()
    finally:
        gc.enable()
    cp.wait()
    cp.close()


def test_a_failed_save_turns_the_collector_back_on(tmp_path: Path, collections: List[int]) -> None:
    cp = ckpt.Checkpointer(str(tmp_path / "c"))
    cp.save(1, state()).wait()
    with pytest.raises(ckpt.ConflictError):
        cp.save(1, state())
    assert gc.isenabled()
    with pytest.raises(ckpt.InvalidInputError):
        cp.save(2, {"bad": object()})
    assert gc.isenabled()
    cp.close()


def test_a_memory_tier_save_to_both_tiers_starts_no_collection_inside(
    tmp_path: Path, shm: Path, collections: List[int]
) -> None:
    cp = MemoryCheckpointer((tmp_path / "d").as_uri(), memory_dir=str(shm / "node{node}"), coordinate="none")
    s = state()
    before = len(collections)
    cp.save(1, s)
    during = len(collections) - before
    assert gc.isenabled()
    cp.wait()
    cp.close()
    assert during <= 1  # the one the collector may start as it comes back on


def collections_per_restore(path: Path) -> List[int]:
    """How many collections start inside a ``load_latest``, a ``load`` and a
    ``read_latest`` of :func:`state`, saved once (not counting the readying of
    the first save that follows a restore, which holds the collector off
    itself)."""
    cp = ckpt.Checkpointer(str(path))
    cp.save(1, state()).wait()
    restores = [lambda into: cp.load_latest(into), lambda into: cp.load(1, into), lambda into: cp.read_latest()]
    counts: List[int] = []
    with watching() as seen:
        for restore in restores:
            into = state()  # (made outside the count)
            young()
            seen.clear()
            assert restore(into) is not None
            counts.append(len(seen))
            assert gc.isenabled()
    cp.close()
    return counts


def test_no_collection_starts_inside_a_restore(
    tmp_path: Path, collections: List[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ckpt.checkpointer._ahead, "after_restore", lambda cp, state, named: None)
    # At most one, as for a save: the collector, on again as the call
    # returns, may start one for what the call made that is still alive.
    assert max(collections_per_restore(tmp_path / "paused")) <= 1
    monkeypatch.setattr(ckpt.checkpointer, "collector_paused", contextlib.nullcontext)
    assert min(collections_per_restore(tmp_path / "on")) >= 3


def test_a_failed_restore_turns_the_collector_back_on(tmp_path: Path, collections: List[int]) -> None:
    cp = ckpt.Checkpointer(str(tmp_path / "c"))
    cp.save(1, state()).wait()
    with pytest.raises(ckpt.InvalidInputError):
        cp.load_latest({"model": torch.nn.Linear(2, 2)})  # not what was saved
    assert gc.isenabled()
    with pytest.raises(ckpt.NotFoundError):
        cp.read(7)
    assert gc.isenabled()
    gc.disable()
    try:
        assert cp.load(1, state()) == 1
        assert not gc.isenabled(), "left off, as the program had it"
    finally:
        gc.enable()
    cp.close()
