"""A restore's CUDA destinations filled through a host slab
(``ckpt._device.cuda.HostStage``): the groups its read comes in, the copies of each
group started while the next is read, how its new slab is page-locked (during
the read, by default; in the background once copied; after the read), and a
restore through ``load_latest`` that falls back from a checkpoint damaged in
a later group.

No GPU here: the live "device" tensors are CPU tensors, and the streams and
the page locking are those of the tests' own device (``cpu_device.py``;
``test_cuda.py`` restores into CUDA tensors on a GPU). What is
checked is the stage's order of work and bookkeeping, and the values.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch

import ckpt
import ckpt._device.hoststage as hs
import ckpt._device.cuda as cudam
import ckpt._restore.plan as restore_mod
from conftest import logged
from cpu_device import CpuDevice
from test_device_copy import fake_cuda  # noqa: F401 - the fixture is used by name
from test_slab_pool import _counting_locks

# ----------------------------------------------------------------- groups


def test_groups_cover_the_slots_in_order_and_halve_towards_the_end() -> None:
    rng = random.Random(7)
    for _ in range(300):
        lens = [rng.choice([0, 1, 100, 5000, 70_000]) for _ in range(rng.randrange(0, 60))]
        tail = rng.choice([1, 1000, 50_000])
        got = hs.groups(lens, tail)
        if not lens:
            assert got == []
            continue
        assert got[0][0] == 0 and got[-1][1] == len(lens)
        assert all(a < b for a, b in got), "no empty group"
        assert all(got[i][1] == got[i + 1][0] for i in range(len(got) - 1)), "contiguous"
        after = 0
        for i in range(len(got) - 1, -1, -1):
            a, b = got[i]
            size = sum(lens[a:b])
            if len(got) > 1:  # each group closed once it held tail bytes and all after it
                assert size >= max(tail, after)
            if i > 0:  # ...and not later (the first also takes what is left before it)
                assert sum(lens[a + 1 : b]) < max(tail, after)
            after += size


def test_groups_of_four_gib_are_few_and_end_small() -> None:
    lens = [4 << 20] * 1024  # 4 GiB in tensors of 4 MiB
    got = hs.groups(lens)
    sizes = [sum(lens[a:b]) for a, b in got]
    assert len(got) <= 8
    assert sizes[-1] == hs.TAIL_BYTES  # what is copied after the read
    assert sizes == sorted(sizes, reverse=True)
    assert hs.groups([1000]) == [(0, 1)]  # a small restore is one group


# ----------------------------------------------------------------- one stage


def _restore_stage(pool: cudam.SlabPool, n: int = 2) -> Tuple[cudam.HostStage, List[torch.Tensor], List[torch.Tensor]]:
    """A restore's stage for ``n`` live tensors (the first two as before), and the values its read brings."""
    live = [torch.zeros(1000), torch.zeros(300_000)] + [torch.zeros(100_000) for _ in range(n - 2)]
    stored = [torch.arange(1000, dtype=torch.float32), torch.linspace(-1, 1, 300_000)]
    stored += [torch.full((100_000,), float(i + 3)) for i in range(n - 2)]
    stage = cudam.HostStage(pool)
    for t in live:
        stage.add(t)
    return stage, live, stored


def _read_into(buf: Any, value: torch.Tensor) -> None:
    """What the engine's read does to a stage's buffer."""
    buf[:] = value.view(torch.uint8).numpy()


def _eventually(cond: Callable[[], bool], within: float = 5.0) -> bool:
    end = time.monotonic() + within
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


def _fill(stage: cudam.HostStage, stored: List[torch.Tensor], on_read: Callable[[int, List[int]], None]) -> List[List[int]]:
    """``stage.fill`` with a stand-in engine: each request is a slot's index,
    whose buffer it fills; ``on_read(call, slots)`` runs before each call's
    reads. Returns the slots of each call."""
    bufs = stage.buffers()
    calls: List[List[int]] = []

    def read(requests: List[Any]) -> None:
        slots = [r for r in requests if isinstance(r, int)]
        on_read(len(calls), slots)
        calls.append(slots)
        for i in slots:
            _read_into(bufs[i], stored[i])

    stage.fill(read, ["head"], list(range(len(stored))))
    return calls


@pytest.mark.parametrize("way", ["later", "during", "held"])
def test_each_groups_copies_start_while_the_next_group_is_read(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """The restore's time is the read and the last group's copies: every
    earlier group has reached its live tensors while a later one is read."""
    monkeypatch.setattr(hs, "TAIL_BYTES", 400_000)
    pool = cudam.SlabPool()
    if way == "held":  # a slab a save left locked
        pool.prepare(pool.take([8 << 20], 1), None, whole=True)
    else:
        monkeypatch.setattr(cudam.HostStage, "lock", way)
    stage, live, stored = _restore_stage(pool, 8)
    seen: List[bool] = []

    def on_read(call: int, slots: List[int]) -> None:
        if call:  # the slots read by earlier calls are in their live tensors
            done = [i for i in range(len(stored)) if i < slots[0]]
            seen.append(_eventually(lambda: all(torch.equal(live[i], stored[i]) for i in done)))

    calls = _fill(stage, stored, on_read)
    assert len(calls) > 2 and sorted(i for c in calls for i in c) == list(range(8))
    assert seen and all(seen), seen
    assert stage.early_bytes == sum(t.numel() * 4 for t in live)
    stage.copy_back()
    assert all(torch.equal(t, v) for t, v in zip(live, stored))
    assert pool.restore_locks == [way]
    pool.close()


def test_locked_after_the_read_nothing_is_copied_before_the_lock(
    cpu_device: CpuDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "after" way copies only from locked memory: nothing reaches the
    device until the read is done and the slab locked."""
    monkeypatch.setattr(hs, "TAIL_BYTES", 400_000)
    monkeypatch.setattr(cudam.HostStage, "lock", "after")
    copied_at_lock: List[bool] = []
    pool = cudam.SlabPool()
    stage, live, stored = _restore_stage(pool, 8)
    cpu_device.lock_with = lambda a, n, quiet: copied_at_lock.append(
        any(torch.equal(t, v) for t, v in zip(live, stored))) or True
    untouched: List[bool] = []
    calls = _fill(stage, stored, lambda call, slots: untouched.append(not any(t.any() for t in live)))
    assert len(calls) > 2 and all(untouched)
    assert stage.early_bytes == 0
    stage.copy_back()
    assert copied_at_lock == [False]
    assert all(torch.equal(t, v) for t, v in zip(live, stored))
    assert pool.restore_locks == ["after"]
    pool.close()


def test_a_failed_read_waits_for_the_copies_it_started_and_raises(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group that fails to read (a damaged chunk) ends the fill with that
    error, once the copies already queued have landed: the next attempt
    reuses the slab."""
    monkeypatch.setattr(hs, "TAIL_BYTES", 400_000)
    pool = cudam.SlabPool()
    stage, live, stored = _restore_stage(pool, 8)
    landed: List[bool] = []
    real_copy = hs._copy

    def slow_copy(pairs: Any, streams: Any) -> None:
        time.sleep(0.05)
        real_copy(pairs, streams)
        landed.append(True)

    monkeypatch.setattr(hs, "_copy", slow_copy)

    def on_read(call: int, slots: List[int]) -> None:
        if call == 2:
            raise ckpt.CorruptError("a damaged chunk (stand-in)")

    with pytest.raises(ckpt.CorruptError, match="stand-in"):
        _fill(stage, stored, on_read)
    assert len(landed) == 2, "both groups read were copied, and waited for"
    assert stage.slab is not None and stage.slab.free()
    pool.close()


# ----------------------------------------------------------------- page locking


def test_locked_later_a_restore_copies_then_locks_its_new_slab_in_the_background(
    cpu_device: CpuDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "later" way: nothing is locked while the restore runs; the copies
    come from pageable memory, and once they have landed the slab is locked
    once, whole, on the pool's thread; the first save takes it."""
    monkeypatch.setattr(cudam.HostStage, "lock", "later")
    calls: List[Tuple[int, int, bool, str, bool]] = []
    pool = cudam.SlabPool()
    stage, live, stored = _restore_stage(pool)

    def lock(address: int, n: int, quiet: bool) -> bool:
        copied = all(torch.equal(t, v) for t, v in zip(live, stored))
        calls.append((address, n, quiet, threading.current_thread().name, copied))
        time.sleep(0.02)
        return True

    cpu_device.lock_with = lock
    calls_at_read = _fill(stage, stored, lambda call, slots: None)
    assert calls_at_read == [[0, 1]]
    stage.copy_back()
    assert all(torch.equal(t, v) for t, v in zip(live, stored))
    assert pool.restore_locks == ["later"] and stage.how == "later"
    assert stage.lock_s == 0 and stage.to_device_s > 0  # what RestorePhases.lock and .to_device report
    slab = stage.slab
    assert slab is not None
    pool.settle(slab)
    assert slab.locked and slab.prepared
    assert [(a, n, q, c) for a, n, q, _, c in calls] == [(slab.native.address, slab.nbytes, False, True)], \
        "once, whole, after the copies"
    assert calls[0][3].startswith("ckpt-d2h")
    got = pool.take([8, 4000, 1_200_000], 1)  # the first save takes it, laid out anew
    assert got is slab and len(calls) == 1
    pool.close()


def test_locked_after_its_read_a_restore_locks_its_new_slab_on_its_own_thread(
    cpu_device: CpuDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cudam.HostStage, "lock", "after")
    calls: List[Tuple[int, int, bool, str]] = []

    def lock(address: int, n: int, quiet: bool) -> bool:
        calls.append((address, n, quiet, threading.current_thread().name))
        time.sleep(0.02)  # the runtime's part, timed as the stage's lock
        return True

    cpu_device.lock_with = lock
    pool = cudam.SlabPool()
    stage, live, stored = _restore_stage(pool)
    for buf, v in zip(stage.buffers(), stored):
        _read_into(buf, v)
    assert calls == [], "nothing locked during the read"
    stage.copy_back()
    slab = stage.slab
    assert slab is not None and slab.locked and slab.prepared
    assert calls == [(slab.native.address, slab.nbytes, False, threading.current_thread().name)], "once, whole"
    assert pool.restore_locks == ["after"] and stage.how == "after"
    assert stage.lock_s >= 0.02 and stage.to_device_s > 0
    assert all(torch.equal(t, v) for t, v in zip(live, stored))
    got = pool.take([8, 4000, 1_200_000], 1)
    assert got is slab and len(calls) == 1
    pool.close()


def test_by_default_a_restore_locks_its_new_slab_while_its_read_fills_it(
    cpu_device: CpuDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default way ("during"; on an H200 host the fastest restore of
    4 GiB, cold or from the page cache): the lock runs on the pool's thread
    while the read fills the slab, the copies to the device only after it,
    and what the read wrote before and after it is what is restored; the
    first save takes the slab and locks nothing more."""
    assert cudam.HostStage.lock == "during"
    entered, release = threading.Event(), threading.Event()
    calls: List[Tuple[int, int, bool, str]] = []
    copied_at_lock: List[bool] = []
    mapped: List[bool] = []  # the pages mapped first, changing no byte the read wrote
    real_populate = cudam.SlabPool._populate_beside_read

    def populate(slab: Any) -> bool:
        mapped.append(real_populate(slab))
        return mapped[-1]

    def lock(address: int, n: int, quiet: bool) -> bool:
        assert mapped, "mapped before locked"
        calls.append((address, n, quiet, threading.current_thread().name))
        copied_at_lock.append(any(t.any() for t in live))
        entered.set()
        assert release.wait(10)
        return True

    monkeypatch.setattr(cudam.SlabPool, "_populate_beside_read", staticmethod(populate))
    cpu_device.lock_with = lock
    pool = cudam.SlabPool()
    stage, live, stored = _restore_stage(pool)
    bufs = stage.buffers()
    _read_into(bufs[0], stored[0])
    assert entered.wait(10), "the lock started during the read"
    _read_into(bufs[1], stored[1])  # the read goes on while the runtime locks
    release.set()
    stage.copy_back()
    slab = stage.slab
    assert slab is not None and slab.locked and slab.prepared
    assert calls == [(slab.native.address, slab.nbytes, True, calls[0][3])], "once, whole, quietly"
    assert calls[0][3].startswith("ckpt-d2h")
    assert pool.restore_locks == ["during"] and stage.how == "during"
    assert copied_at_lock == [False], "the copies queue behind the lock"
    assert all(torch.equal(t, v) for t, v in zip(live, stored))
    got = pool.take([8, 4000, 1_200_000], 1)  # the first save takes it, laid out anew
    assert got is slab and len(calls) == 1
    pool.close()


def test_a_restore_locks_after_its_read_where_the_runtime_refused_during_it(
    cpu_device: CpuDevice, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pages the read holds may not be pinned at that moment: the slab is
    then locked after the read, and the restore is whole."""
    monkeypatch.setattr(cudam.HostStage, "lock", "during")
    calls: List[bool] = []

    def lock(address: int, n: int, quiet: bool) -> bool:
        calls.append(quiet)
        return not quiet

    cpu_device.lock_with = lock
    pool = cudam.SlabPool()
    stage, live, stored = _restore_stage(pool)
    for buf, v in zip(stage.buffers(), stored):
        _read_into(buf, v)
    stage.copy_back()
    assert calls == [True, False], "refused during the read, locked after it"
    assert stage.slab is not None and stage.slab.locked
    assert pool.restore_locks == ["after"]
    assert all(torch.equal(t, v) for t, v in zip(live, stored))
    # A save takes that memory, laid out anew, and locks nothing more.
    got = pool.take([8, 4000, 1_200_000], 1)
    assert got is stage.slab and calls == [True, False]
    pool.close()


def test_a_read_only_readers_restore_locks_its_slab_only_while_it_is_open(
    cpu_device: CpuDevice, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    """No save will use a read-only reader's slab: locked "later", it is
    never locked; locked "during" the read (the default, which copies
    faster than pageable memory), it is unlocked when the reader closes."""
    calls = _counting_locks()
    monkeypatch.setattr(cudam.HostStage, "lock", "later")
    pool = cudam.SlabPool()
    stage = cudam.HostStage(pool, keep=False)
    live, stored = [torch.zeros(1000)], [torch.arange(1000, dtype=torch.float32)]
    stage.add(live[0])
    _fill(stage, stored, lambda call, slots: None)
    stage.copy_back()
    pool.drain()
    assert calls["lock"] == [] and stage.slab is not None and not stage.slab.locked
    assert pool.restore_locks == ["unlocked"]
    assert torch.equal(live[0], stored[0])
    pool.close()
    # Through the checkpointer: its read_only option makes such a reader.
    monkeypatch.setattr(restore_mod, "_on_device", lambda t: True)
    with ckpt.Checkpointer(url, rng=False) as cp:
        cp.save(1, {"w": stored[0]}).wait()
    calls["lock"].clear()  # (the save's own slab)
    calls["unlock"].clear()
    for way in ("later", "during"):
        monkeypatch.setattr(cudam.HostStage, "lock", way)
        live = [torch.zeros(1000)]
        with ckpt.Checkpointer(url, rng=False, read_only=True) as cp:
            assert cp.load_latest({"w": live[0]}) == 1
            assert cp.last_restore is not None and cp.last_restore.slab == ("unlocked" if way == "later" else "during")
            locked = list(calls["lock"])
        assert torch.equal(live[0], stored[0])
        assert len(locked) == (way == "during"), calls
        assert calls["unlock"] == [a for a, _ in locked], "unlocked at the close"
@pytest.mark.parametrize("way", ["later", "after"])
def test_a_restore_the_runtime_will_not_lock_at_all_stays_pageable_and_whole(
    cpu_device: CpuDevice, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    monkeypatch.setattr(cudam.HostStage, "lock", way)
    cpu_device.lock_with = lambda address, n, quiet: False
    pool = cudam.SlabPool()
    stage, live, stored = _restore_stage(pool)
    for buf, v in zip(stage.buffers(), stored):
        _read_into(buf, v)
    stage.copy_back()
    assert stage.slab is not None
    pool.settle(stage.slab)
    assert not stage.slab.locked
    # Later: the refusal comes in the background, after the restore returned.
    assert pool.restore_locks == ["later" if way == "later" else "pageable"]
    assert all(torch.equal(t, v) for t, v in zip(live, stored))
    assert pool.take([8, 4000, 1_200_000], 1) is stage.slab, "a save still takes it, pageable"
    pool.close()


def test_a_slab_a_save_left_locked_is_not_locked_again_by_a_restore(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting_locks()
    pool = cudam.SlabPool()
    saved = pool.take([4000, 1_200_000], 1)
    pool.prepare(saved, None, whole=True)
    stage, live, stored = _restore_stage(pool)
    for buf, v in zip(stage.buffers(), stored):
        _read_into(buf, v)
    stage.copy_back()
    assert stage.slab is saved and len(calls["lock"]) == 1
    assert pool.restore_locks == ["held"]
    assert all(torch.equal(t, v) for t, v in zip(live, stored))
    pool.close()


def test_an_unknown_way_of_locking_is_refused_before_anything_is_read(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cudam.HostStage, "lock", "sometime")
    stage, _, _ = _restore_stage(cudam.SlabPool())
    with pytest.raises(ckpt.InvalidInputError, match="later"):
        stage.buffers()
    assert stage.slab is None


# ----------------------------------------------------------------- through load_latest


def _device_state(seed: int) -> Dict[str, torch.Tensor]:
    """Tensors of 3 MiB (each its own chunk), the last of 4 MiB."""
    g = torch.Generator().manual_seed(seed)
    out = {f"a{i}": torch.randn(768 * 1024, generator=g) for i in range(7)}
    out["a7"] = torch.randn(1 << 20, generator=g)
    return out


def test_load_latest_reads_device_tensors_in_groups_and_falls_back_from_a_damaged_late_group(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, url: str, root: Path
) -> None:
    """A checkpoint damaged in its last group is found only after earlier
    groups were copied into the live tensors: ``load_latest`` then restores
    the previous checkpoint into all of them, bitwise."""
    monkeypatch.setattr(hs, "TAIL_BYTES", 3 << 20)
    monkeypatch.setattr(restore_mod, "_on_device", lambda t: True)  # these CPU tensors stand for CUDA ones
    reads: List[int] = []
    real_fill = hs.HostStage.fill

    def fill(self: Any, read: Any, head: Any, slots: Any) -> None:
        real_fill(self, lambda reqs: (reads.append(len(reqs)), read(reqs))[1], head, slots)

    monkeypatch.setattr(hs.HostStage, "fill", fill)
    one, two = _device_state(1), _device_state(2)
    with ckpt.Checkpointer(url, rng=False) as cp:
        cp.save(1, dict(one)).wait()
        before = {p for p in root.rglob("*") if p.is_file()}
        cp.save(2, dict(two)).wait()
    live = {k: torch.zeros_like(v) for k, v in one.items()}
    cp = ckpt.Checkpointer(url, rng=False)
    assert cp.load_latest(live) == 2
    assert all(torch.equal(live[k], two[k]) for k in two)
    assert len(reads) > 2, "read in groups"
    p = cp.last_restore
    assert p is not None and p.slab == "during"
    cp.close()

    new = [p for p in root.rglob("*") if p.is_file() and p not in before and "chunks" in str(p)]
    last = max(new, key=lambda p: p.stat().st_size)  # a7's chunk: the last group's
    data = bytearray(last.read_bytes())
    data[len(data) // 2] ^= 0xFF
    last.write_bytes(bytes(data))
    live = {k: torch.zeros_like(v) for k, v in one.items()}
    reads.clear()
    cp = ckpt.Checkpointer(url, rng=False)
    with logged(r"resumed from step 1, passing over 1 newer: step 2 .*damaged"):
        assert cp.load_latest(live) == 1
    assert all(torch.equal(live[k], one[k]) for k in one)
    assert len(reads) > 4, "the damaged one failed in a later group, then the previous one was read whole"
    # Both attempts used one slab (the failed one's copies waited for),
    # locked during the first one's read, which the first save takes.
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1
    restored = pool._slabs[0]
    assert pool.restore_locks == ["held"]
    cp.save(3, live).wait()
    assert restored.locked and pool._slabs == [restored], "no new slab"
    assert all(torch.equal(cp.read(3).state[k], one[k]) for k in one)
    cp.close()
