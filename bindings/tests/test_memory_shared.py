"""A step that the memory tier (``ckpt.memory``) saves to both of its tiers
is walked once and crosses to the host once: both engines save the same
snapshot, from one slab of one pool.

The CUDA cases run on CPU tensors routed through the CUDA path, with
``torch.cuda``'s streams and events replaced by stand-ins (the ``fake_cuda``
test double of ``test_device_copy.py``, which says why). On a GPU,
``test_cuda.py`` runs the memory tier on real device tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import ckpt
from ckpt.memory import MemoryCheckpointer
from test_device_copy import (  # noqa: F401 - the fixture is used by name
    Net, check_stored, fake_cuda, fresh, snapshot, train,
)


@pytest.mark.parametrize("lazy", [False, True])
def test_both_tiers_store_one_snapshot_of_cuda_state_copied_once(
    tmp_path: Path, shm: Path, fake_cuda: Dict[str, List[int]], walks: List[int], lazy: bool
) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt)
    durable = (tmp_path / "durable").as_uri()
    cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none", lazy=lazy,
                            durable_every=2, rng=False)
    tensors = len(snapshot(model, opt)) - 1  # the tied head weight is one tensor, one copy
    expected = {}
    for step in range(1, 6):
        before, copied = len(walks), sum(fake_cuda["copies"])
        expected[step] = snapshot(model, opt)
        cp.save(step, model=model, optimizer=opt)
        train(model, opt)  # lazy: the step pre-hook orders it after both saves' copies
        cp.wait()
        # Steps 1, 3 and 5 go to both tiers, all the same with one walk and one copy.
        assert len(walks) - before == 1, step
        assert sum(fake_cuda["copies"]) - copied == tensors, step
    # One pool, the durable checkpointer's, for both tiers.
    assert cp.memory._slabs is None and cp.durable._slabs is not None
    assert len(cp.durable._slabs._slabs) <= 2
    cp.close()
    check_stored(durable, {s: expected[s] for s in (1, 3, 5)})
    check_stored(cp.own.url, {s: expected[s] for s in (4, 5)})
    # Each tier's manifest says what it is: only the memory tier's records its saver.
    assert all("memory" not in m["ckpt"] for m in _ckpt_meta(tmp_path / "durable"))
    assert all("memory" in m["ckpt"] for m in _ckpt_meta(cp.own.path))


def test_a_restart_from_the_memory_tier_readies_its_first_save(
    tmp_path: Path, shm: Path, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, bulk: List[bool]
) -> None:
    # Restored from host memory, the state is walked once, out of any save,
    # so that the first save after the restart takes it in bulk too.
    model, opt = fresh(monkeypatch)
    train(model, opt)
    durable = (tmp_path / "durable").as_uri()

    def tiers() -> MemoryCheckpointer:
        return MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none", lazy=True, rng=False)

    with tiers() as cp:
        cp.save(1, model=model, optimizer=opt)
    train(model, opt)  # then lost: the restart goes back to step 1
    cp = tiers()
    assert cp.load_latest(model=model, optimizer=opt) == 1 and cp.last_source == "memory"
    bulk.clear()
    train(model, opt)
    expected = {2: snapshot(model, opt)}
    cp.save(2, model=model, optimizer=opt)
    train(model, opt)
    cp.close()
    assert bulk == [True, True], bulk
    check_stored(cp.own.url, expected)


def _ckpt_meta(root: Path) -> List[Dict[str, Any]]:
    """Each committed manifest's ``ckpt`` metadata, decoded."""
    reader = ckpt.Checkpointer(root.as_uri(), read_only=True, rng=False)
    return [reader._native.meta(s, a) for s, a in reader._native.committed()]


def test_a_step_the_durable_tier_refuses_is_raised_and_the_memory_tier_keeps_it(tmp_path: Path, shm: Path) -> None:
    durable = (tmp_path / "durable").as_uri()
    with ckpt.Checkpointer(durable, coordinate="none") as other:
        other.save(3, {"w": torch.zeros(4)})  # step 3 is committed in the durable tier already
    cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none")
    with pytest.raises(ckpt.ConflictError):
        cp.save(3, {"w": torch.ones(4)})
    cp.close()
    assert sorted(cp.own.committed()) == [3]
    got = ckpt.Checkpointer(cp.own.url, read_only=True).read(3).state
    assert torch.equal(got["w"], torch.ones(4))
    assert torch.equal(ckpt.Checkpointer(durable, read_only=True).read(3).state["w"], torch.zeros(4))


def test_an_eager_step_of_cpu_state_is_copied_once_for_both_tiers(tmp_path: Path, shm: Path) -> None:
    durable = (tmp_path / "durable").as_uri()
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "b": torch.ones(8)}
    cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none", rng=False)
    cp.save(1, state)
    state["w"] += 1  # the loop goes on at once: eager saves took their snapshot
    memory, durable_save = cp.memory._unwaited[-1], cp.durable._unwaited[-1]
    # The memory tier's engine copied the state; the durable one saved that copy.
    assert memory.wait()["copied_bytes"] == (4 << 16) + 32
    assert durable_save.wait()["copied_bytes"] == 0
    cp.close()
    for root in (cp.own.url, durable):
        got = ckpt.Checkpointer(root, read_only=True, rng=False).read(1).state
        assert torch.equal(got["w"], torch.arange(1 << 16, dtype=torch.float32)), root
        assert torch.equal(got["b"], torch.ones(8)), root
