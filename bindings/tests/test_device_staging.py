"""Lazy saves with ``device_staging``: CUDA state is first copied into device
memory, the optimizer's step waits only for that copy, and the copy to the
host goes on from there.

This machine may have no GPU: as in ``test_device_copy.py``, CPU tensors take
the device path on the tests' own device (``cpu_device.CpuDevice``: copies
run at once). Here its events also remember how many copy calls were queued
before them, so the tests see which copies the step was made to wait for.
``test_cuda.py`` checks the same on a GPU.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import pytest
import torch

import ckpt
import ckpt._device.cuda as cudam
from ckpt._device.device import Event, Stream, using
from cpu_device import CpuDevice, CpuEvent, CpuStream
from test_device_copy import Net, check_stored, fake_cuda, snapshot, train  # noqa: F401 - the fixture is used by name


@pytest.fixture()
def waits(cpu_device: CpuDevice) -> Iterator[List[int]]:
    """For each event the current stream (the training's) was made to wait
    for, the number of copy calls queued before the event was recorded."""
    waited: List[int] = []

    class Recorded(CpuEvent):
        def __init__(self, at: int) -> None:
            self.at = at

    class Current(CpuStream):
        pass

    class Waits(CpuDevice):
        def record(self, stream: Stream, blocking: bool = False) -> Event:
            return Recorded(len(self.calls["copies"]))

        def current_stream(self, device: torch.device) -> Stream:
            return Current()

        def wait(self, stream: Stream, event: Event) -> None:
            if isinstance(stream, Current):
                assert isinstance(event, Recorded)
                waited.append(event.at)

    device = Waits()
    device.calls = cpu_device.calls  # (counted as the fixture's)
    with using(device):
        yield waited


def _loop(url: str, device_staging: int, saves: int = 4) -> ckpt.Checkpointer:
    torch.manual_seed(0)
    model = Net(layers=6)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False, device_staging=device_staging)
    expected = {}
    for step in range(1, saves + 1):
        expected[step] = snapshot(model, opt)
        cp.save(step, model=model, optimizer=opt)
        train(model, opt)  # the step pre-hook orders it after the copies it must wait for
        cp.wait()
    check_stored(url, expected)
    return cp


def _state_bytes() -> int:
    torch.manual_seed(0)
    model = Net(layers=6)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt)
    seen = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}
    return sum(seen.values()) + sum(v.nbytes for s in opt.state.values() for v in s.values())


def test_everything_staged_the_step_waits_for_the_copy_on_the_device_only(
    url: str, fake_cuda: Dict[str, List[int]], waits: List[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether the step could go on before the slab was prepared (populated,
    # page-locked: a process's first save waits for that otherwise).
    before_prepare: List[bool] = []
    real_prepare = cudam.SlabPool.prepare

    def prepare(self: cudam.SlabPool, slab: Any, device: Any, whole: bool = False) -> None:
        owner = slab.owner
        before_prepare.append(owner is not None and owner._readable is not None and owner._readable.done())
        real_prepare(self, slab, device, whole)

    monkeypatch.setattr(cudam.SlabPool, "prepare", prepare)
    cp = _loop(url, device_staging=1 << 20)
    assert before_prepare and all(before_prepare)
    # Per save: the copy into device memory, then from it to the host.
    per_save = 2
    assert len(fake_cuda["copies"]) == 4 * per_save
    assert fake_cuda["copies"][0] == fake_cuda["copies"][1], "every tensor staged, every one sent on"
    # The step waited for an event recorded after the save's first copy call
    # (into device memory), before the one to the host.
    assert waits == [per_save * k + 1 for k in range(4)]
    pool = cp._slabs
    assert pool is not None and len(pool._stages) == 1
    stage = next(iter(pool._stages.values()))
    assert stage.numel() <= 1 << 20
    cp.close()


def test_what_does_not_fit_goes_straight_to_the_host_and_the_step_waits_for_it(
    url: str, fake_cuda: Dict[str, List[int]], waits: List[int]
) -> None:
    state = _state_bytes()
    cp = _loop(url, device_staging=state // 2)
    # Per save: into device memory, the rest straight to the host, the staged
    # part to the host.
    per_save = 3
    assert len(fake_cuda["copies"]) == 4 * per_save
    first = fake_cuda["copies"][:per_save]
    assert first[0] == first[2] and first[0] + first[1] >= 2, first
    # The step waits for the copies straight to the host too, not for the
    # staged ones' trip from device memory.
    assert waits == [per_save * k + 2 for k in range(4)]
    cp.close()


def test_without_device_staging_the_step_waits_for_every_copy(
    url: str, fake_cuda: Dict[str, List[int]], waits: List[int]
) -> None:
    _loop(url, device_staging=0).close()
    assert len(fake_cuda["copies"]) == 4
    assert waits == [1, 2, 3, 4]


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_device_staging_must_be_a_count_of_bytes(url: str, bad: Any) -> None:
    with pytest.raises(ckpt.InvalidInputError, match="device_staging"):
        ckpt.Checkpointer(url, device_staging=bad)


def test_no_room_on_the_device_copies_straight_to_the_host(
    url: str, fake_cuda: Dict[str, List[int]], waits: List[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(self: cudam.SlabPool, device: Any, nbytes: int) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(cudam.SlabPool, "_new_stage", no_memory)
    with pytest.warns(UserWarning, match="no device memory for device_staging"):
        cp = _loop(url, device_staging=1 << 20)  # every save's values are stored
    assert len(fake_cuda["copies"]) == 4, "one copy per save, straight to the host"
    assert cp._slabs is not None and cp._slabs.device_staging == 0
    cp.close()
