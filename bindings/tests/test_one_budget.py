"""One staging budget: a checkpointer's host slabs (where CUDA snapshots
land, ``ckpt._device.slabs``) and its CPU tensors' staging buffers are
charged to the engine's one pool, so with ``staging_budget=B`` both together
stay within B. A save that needs more waits (``busy="wait"``, woken when a
slab comes free) or is skipped (``busy="skip"``).

The slabs are taken from the real pool on the CPU (no copies are queued:
what is checked is the budget, not the device).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable, List, Tuple

import pytest

import ckpt
from ckpt import _ckpt
from ckpt._device.slabs import SlabPool, _Slab

MiB = 1 << 20
PAGE = 4096
#: Three slab-sized pieces of 3 MiB (and a page each) fit; a fourth does not.
BUDGET = 9 * MiB


def _in_flight(tmp_path: Path, busy: str) -> Tuple[_ckpt.Checkpointer, SlabPool, _Slab, threading.Event, _ckpt.SaveHandle]:
    """A lazy save of 3 MiB from a slab and 3 MiB of CPU bytes, held in
    flight (its slab's copies "still landing") until the event is set."""
    owner = ckpt.Checkpointer(tmp_path.as_uri(), lazy=True, rng=False, staging_budget=BUDGET, busy=busy)
    cp, pool = owner._native, owner._pool(True)
    slab = pool.take([3 * MiB], 1)
    gate = threading.Event()
    specs = [
        _ckpt.TensorSpec(name="gpu", dtype="U8", shape=(3 * MiB,), data=slab.slot_objs()[0]),
        _ckpt.TensorSpec(name="cpu", dtype="U8", shape=(3 * MiB,), data=bytearray(3 * MiB)),
    ]
    handle = cp.save(1, specs, {"state": None}, _waits_for(gate))
    assert slab.native.in_use()
    return cp, pool, slab, gate, handle


def _waits_for(gate: threading.Event) -> Callable[[], None]:
    def ready() -> None:
        gate.wait(30)

    return ready


def test_a_slab_that_does_not_fit_beside_cpu_staging_waits_for_one_to_come_free(tmp_path: Path) -> None:
    # In flight: 3 MiB of slab and 3 MiB of CPU staging (a page more each);
    # a second slab of 3 MiB would take the whole more than the 9 MiB.
    cp, pool, first, gate, handle = _in_flight(tmp_path, "wait")
    got: List[_Slab] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take([3 * MiB], 2)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive(), "the CPU staging and the first slab leave no room for a second"
    assert len(pool._slabs) == 1
    gate.set()
    handle.wait(30)
    waiter.join(10)
    assert not waiter.is_alive() and got, "woken once the first save let its memory go"
    # The first slab reused, or a second one made where idle CPU buffers were freed.
    held = sum(s.native.charged for s in pool._slabs) + cp.staging_idle_bytes()
    assert held <= BUDGET
    pool.close()


def test_a_slab_that_does_not_fit_beside_cpu_staging_is_skipped(tmp_path: Path) -> None:
    cp, pool, first, gate, handle = _in_flight(tmp_path, "skip")
    with pytest.raises(ckpt.SkippedError):
        pool.take([3 * MiB], 2)
    assert pool._slabs == [first]
    gate.set()
    handle.wait(30)
    assert pool.take([3 * MiB], 3) is first
    pool.close()


def test_cpu_staging_that_does_not_fit_beside_a_slab_is_skipped(tmp_path: Path) -> None:
    cp, pool, first, gate, handle = _in_flight(tmp_path, "skip")
    more = _ckpt.TensorSpec(name="cpu", dtype="U8", shape=(4 * MiB,), data=bytearray(4 * MiB))
    with pytest.raises(ckpt.SkippedError):
        cp.save(2, [more], {"state": None})  # 3 + 3 + 4 MiB: more than 9
    gate.set()
    handle.wait(30)
    pool.close()  # drops the free slab: its 3 MiB go back
    cp.save(3, [more], {"state": None}).wait(30)


def test_a_dropped_slab_gives_its_budget_back(tmp_path: Path) -> None:
    cp = _ckpt.Checkpointer(tmp_path.as_uri(), staging_budget=BUDGET, busy="skip")
    pool = SlabPool(cp)
    small = pool.take([2 * MiB], 1)
    assert small.native.charged == 2 * MiB + PAGE, "the slab holds its pages of the budget"
    big = pool.take([8 * MiB], 2)  # another layout: the free small slab is dropped to make room
    assert pool._slabs == [big] and small.native.charged == 0
    pool.close()
    assert big.native.charged == 0


def test_a_slab_its_save_let_go_of_holds_no_budget_until_a_save_takes_it_again(tmp_path: Path) -> None:
    # Once the first save is done, its free slab gives its 3 MiB back: a CPU
    # save of 7 MiB fits the 9 MiB (it would wait for them for ever if the
    # free slab kept them, as nothing else would give them back).
    cp, pool, first, gate, handle = _in_flight(tmp_path, "wait")
    gate.set()
    handle.wait(30)
    assert first.free() and first.native.charged == 0
    more = _ckpt.TensorSpec(name="cpu", dtype="U8", shape=(7 * MiB,), data=bytearray(7 * MiB))
    done = threading.Event()

    def save() -> None:
        cp.save(2, [more], {"state": None}).wait(30)
        done.set()

    threading.Thread(target=save, daemon=True).start()
    assert done.wait(20), "the CPU save waited for budget a free slab held"
    # The next save that takes the slab charges it again.
    assert pool.take([3 * MiB], 3) is first
    assert first.native.charged == 3 * MiB + PAGE
    held = first.native.charged + cp.staging_idle_bytes()
    assert held <= BUDGET
    pool.close()
