"""Where a save's stall goes: ``SaveHandle.stall`` is the whole ``save`` call,
and ``SaveHandle.phases`` splits it (the walk of the state, the device
copies' start, the engine's save), for a plain checkpointer and for the
memory tier, whose save returns its handle.

The state here includes an object whose ``state_dict()`` takes a known time
(a sleep): the walk calls it, so the stall and the walk must include it. No
test here bounds a duration from above.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import ckpt
from ckpt.memory import MemoryCheckpointer
from test_device_copy import Net, fake_cuda, train  # noqa: F401 - the fixture is used by name

SLOW = 0.05


class Slow:
    """Stateful whose ``state_dict`` takes ``SLOW`` seconds."""

    def state_dict(self) -> Dict[str, Any]:
        time.sleep(SLOW)
        return {"w": torch.arange(1000, dtype=torch.float32)}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        pass


def _check(h: ckpt.SaveHandle, outside: float) -> None:
    p = h.phases
    assert isinstance(p, ckpt.SavePhases)
    assert p.walk >= SLOW  # the state dicts are walked in the stall
    assert p.device >= 0 and p.engine > 0 and p.before >= 0 and p.after >= 0
    assert p.total >= p.before + p.walk + p.device + p.engine + p.after - 1e-9
    assert abs(p.other - max(0.0, p.total - p.before - p.walk - p.device - p.engine - p.after)) < 1e-9
    assert h.stall == p.total
    assert p.total <= outside  # the call as its caller timed it


@pytest.mark.parametrize("lazy", [False, True])
def test_a_saves_stall_is_the_whole_call_and_its_phases_add_up(url: str, lazy: bool) -> None:
    model = torch.nn.Linear(64, 64)
    with ckpt.Checkpointer(url, lazy=lazy) as cp:
        t0 = time.perf_counter()
        h = cp.save(1, model=model, slow=Slow())
        outside = time.perf_counter() - t0
        _check(h, outside)
        # The engine's own figure is its part only, within the whole.
        assert h.wait()["stall"] <= h.stall


@pytest.mark.parametrize("durable_every", [1, 2])
def test_the_memory_tiers_save_returns_its_handle_timed_over_the_whole_call(
    tmp_path: Path, shm: Path, durable_every: int
) -> None:
    model = torch.nn.Linear(64, 64)
    with MemoryCheckpointer(
        (tmp_path / "d").as_uri(), memory_dir=str(shm / "node{node}"), coordinate="none",
        durable_every=durable_every,
    ) as mc:
        for step in (1, 2):  # with durable_every=2, one to both tiers and one to memory only
            t0 = time.perf_counter()
            h = mc.save(step, model=model, slow=Slow())
            outside = time.perf_counter() - t0
            assert h is not None and h.step == step
            _check(h, outside)
        mc.wait()


@pytest.mark.parametrize("lazy", [False, True])
def test_cuda_states_device_copies_start_is_its_own_phase(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, lazy: bool
) -> None:
    # CPU tensors through the CUDA path (the stand-in of test_device_copy.py);
    # the copies' start is made to take a known time.
    import ckpt._device.cuda as cudam

    real = cudam.DeviceCopy.start

    def slow_start(self: Any, step: int) -> Any:
        time.sleep(SLOW)
        return real(self, step)

    monkeypatch.setattr(cudam.DeviceCopy, "start", slow_start)
    model = Net(layers=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt)
    with ckpt.Checkpointer(url, lazy=lazy, rng=False) as cp:
        h = cp.save(1, model=model, optimizer=opt)
        assert h.phases is not None
        assert h.phases.device >= SLOW
        assert h.stall >= h.phases.device


def test_the_calls_two_ends_are_phases_of_their_own(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Reaping finished saves comes before the walk; the step pre-hooks come
    # after the engine's save. Each is made to take a known time.
    real_reap, real_guard = ckpt.Checkpointer._reap, ckpt.Checkpointer._guard

    def slow_reap(self: Any) -> None:
        time.sleep(SLOW)
        real_reap(self)

    def slow_guard(self: Any, obj: Any) -> None:
        time.sleep(SLOW)
        real_guard(self, obj)

    monkeypatch.setattr(ckpt.Checkpointer, "_reap", slow_reap)
    monkeypatch.setattr(ckpt.Checkpointer, "_guard", slow_guard)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ckpt.Checkpointer(url, lazy=True) as cp:
        h = cp.save(1, model=model, optimizer=opt)
        p = h.phases
        assert p is not None
        assert p.before >= SLOW and p.after >= SLOW
        assert p.walk < SLOW and p.other < SLOW  # (neither counted twice)
