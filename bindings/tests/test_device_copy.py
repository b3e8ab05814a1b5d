"""The bookkeeping of CUDA snapshots (``ckpt._device.cuda``): which host slab a save
uses, when its slots are handed out, when its copies are queued, what a
changed state or a failed save does to the pool.

This machine may have no GPU, so these tests run the real ``Checkpointer``
and ``DeviceCopy`` on CPU tensors through the device path, with a device of
the tests' own in use (``cpu_device.CpuDevice``: streams that run each copy
at once, events that are always complete). The copies' ordering on a real
device is checked by ``test_cuda.py`` on a GPU.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
from torch import nn

import ckpt
from cpu_device import CpuDevice


@pytest.fixture()
def fake_cuda(cpu_device: CpuDevice) -> Dict[str, List[int]]:
    """The tests' device in use (conftest's ``cpu_device``): its counts."""
    return cpu_device.calls


class Net(nn.Module):
    def __init__(self, layers: int = 40) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(layers))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight  # tied: one copy, one slot
        self.register_buffer("seen", torch.zeros(4))


def as_cuda_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpointer takes the (CPU) state it is given for CUDA state, as
    ``load_latest`` decides whether to ready the first save."""
    monkeypatch.setattr(ckpt._save.ahead, "cuda_device_in", lambda objs: torch.device("cpu"))


def fresh(monkeypatch: pytest.MonkeyPatch) -> Tuple[Net, torch.optim.Optimizer]:
    """A new :class:`Net` and its Adam, not stepped yet, for a job's fresh
    start whose state the checkpointer takes for CUDA state."""
    as_cuda_state(monkeypatch)
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def train(model: Net, opt: torch.optim.Optimizer) -> None:
    x = model.emb(torch.arange(16))
    for b in model.blocks:
        x = b(x)
    model.head(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    model.seen += 1


def snapshot(model: Net, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            out[f"o.{i}.{k}"] = v.clone()
    return out


def check_stored(url: str, expected: Dict[int, Dict[str, torch.Tensor]]) -> None:
    """Each step's checkpoint holds the values of :func:`snapshot` taken at its save."""
    reader = ckpt.Checkpointer(url, read_only=True, rng=False)
    for step, want in expected.items():
        got = reader.read(step).state
        for name, v in want.items():
            kind, rest = name.split(".", 1)
            if kind == "m":
                assert torch.equal(got["model"][rest], v), (step, name)
            else:
                i, k = rest.split(".")
                assert torch.equal(got["optimizer"]["state"][int(i)][k], v), (step, name)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_loop_saves_into_the_guessed_slab_and_stores_the_values_of_each_save(
    url: str, fake_cuda: Dict[str, List[int]], lazy: bool
) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt)
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False)
    expected = {}
    for step in range(1, 6):
        expected[step] = snapshot(model, opt)
        cp.save(step, model=model, optimizer=opt)
        train(model, opt)  # lazy: the step pre-hook orders it after the copies
        cp.wait()
    pool = cp._slabs
    # The first save lays its slab out from the lengths; so does the second
    # (the first slab is still held while it is written, or not yet known to
    # fit); from then on the walk hands out a free slab's slots.
    assert len(fake_cuda["into_slots"]) <= 2
    assert len(pool._slabs) <= 2
    if not lazy:
        # Eager saves into a guessed slab queue their copies during the walk,
        # in batches (or a mapping walked in bulk at once); only a save laid
        # out from the lengths queues all of them at once.
        whole = [n for n in fake_cuda["copies"] if n == max(fake_cuda["copies"])]
        assert len(whole) == len(fake_cuda["into_slots"])
        assert len(fake_cuda["copies"]) > len(whole) + 4
    cp.close()
    check_stored(url, expected)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_changed_state_drops_the_guess_and_still_stores_every_tensor(
    url: str, fake_cuda: Dict[str, List[int]], lazy: bool
) -> None:
    big = torch.arange(300, dtype=torch.float32)
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False, staging_budget=1 << 30)
    many = {f"t{i}": torch.full((100,), float(i)) for i in range(150)}
    cp.save(1, many=many, big=big)
    cp.wait()
    cp.save(2, many=many, big=big)
    cp.wait()
    # Same count, one length differs halfway: slots handed out before it must
    # move (the values change too, so a stale slot would show).
    for v in many.values():
        v.add_(1000)
    changed = dict(many)
    changed["t75"] = torch.full((7,), 75.0)
    cp.save(3, many=changed, big=big)
    cp.wait()
    # One tensor more.
    for v in many.values():
        v.add_(1000)
    cp.save(4, many=many, big=big, extra=torch.ones(3))
    cp.wait()
    reader = ckpt.Checkpointer(url, read_only=True, rng=False)
    many3 = {k: v - 1000 for k, v in many.items()}
    changed3 = dict(many3, t75=changed["t75"])
    many2 = {k: v - 2000 for k, v in many.items()}
    for step, state in [(2, many2), (3, changed3), (4, many)]:
        got = reader.read(step).state
        assert all(torch.equal(got["many"][k], v) for k, v in state.items()), step
        assert torch.equal(got["big"], big)
    assert torch.equal(reader.read(4).state["extra"], torch.ones(3))
    for s in cp._slabs._slabs:
        assert s.free(), "every slab is free once the saves are written"


def test_a_save_that_fails_in_the_walk_lets_the_guessed_slab_go(url: str, fake_cuda: Dict[str, List[int]]) -> None:
    t = {f"t{i}": torch.full((1000,), float(i)) for i in range(8)}
    # Room for one slab only: a slab kept by the failed save would block the next.
    cp = ckpt.Checkpointer(url, lazy=True, rng=False, staging_budget=40_000, busy="skip")
    cp.save(1, t=t)
    cp.wait()
    with pytest.raises(ckpt.InvalidInputError):
        cp.save(2, t=t, bad=object())
    cp.save(3, t=t)
    cp.wait()
    assert len(cp._slabs._slabs) == 1
    assert torch.equal(ckpt.Checkpointer(url, read_only=True, rng=False).read(3).state["t"]["t7"], t["t7"])
