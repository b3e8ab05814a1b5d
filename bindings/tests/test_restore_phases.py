"""Where a restore's time goes: ``Checkpointer.last_restore`` splits a
``load_latest`` or ``load`` call that restored a checkpoint into the plan,
the engine's read, the ranks' agreement, a CUDA host slab's locking and
copies to the device, and the apply, with the time spent on damaged newer
checkpoints apart.

The state here includes an object whose ``state_dict()`` and
``load_state_dict()`` each take a known time (a sleep): the plan calls the
first, the apply the second. No test here bounds a duration from above.
CUDA restores are checked in ``test_cuda.py`` (the slab's lock and copies)
and at the slab's level in ``test_slab_pool.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict

import pytest
import torch

import ckpt
from conftest import logged

SLOW = 0.05


class Slow:
    """Stateful whose ``state_dict`` and ``load_state_dict`` take ``SLOW`` seconds each."""

    def __init__(self) -> None:
        self.w = torch.arange(1000, dtype=torch.float32)

    def state_dict(self) -> Dict[str, Any]:
        time.sleep(SLOW)
        return {"w": self.w}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        time.sleep(SLOW)
        self.w = sd["w"]


def _check(p: Any, outside: float, damaged: bool = False) -> None:
    assert isinstance(p, ckpt.RestorePhases)
    assert p.plan >= SLOW  # the live state dicts are taken in the plan
    assert p.apply >= SLOW  # ...and handed back in the apply
    assert p.read > 0 and p.agree >= 0 and p.other >= 0
    assert (p.damaged > 0) == damaged
    assert p.lock == 0 and p.to_device == 0 and p.slab is None  # no CUDA state
    assert p.total >= p.plan + p.read + p.agree + p.lock + p.to_device + p.apply + p.damaged - 1e-9
    assert p.total <= outside  # the call as its caller timed it


def test_a_restores_phases_add_up_within_the_call(url: str) -> None:
    model = torch.nn.Linear(256, 256)
    with ckpt.Checkpointer(url) as cp:
        cp.save(1, model=model, slow=Slow()).wait()
        cp.save(2, model=model, slow=Slow()).wait()
    with ckpt.Checkpointer(url) as cp:
        assert cp.last_restore is None  # before any restore
        t0 = time.perf_counter()
        assert cp.load_latest(model=model, slow=Slow()) == 2
        _check(cp.last_restore, time.perf_counter() - t0)
        latest = cp.last_restore
        t0 = time.perf_counter()
        assert cp.load(1, model=model, slow=Slow()) == 1
        _check(cp.last_restore, time.perf_counter() - t0)
        assert cp.last_restore is not latest
        # A load that restores nothing leaves the last restore's phases as they were.
        before = cp.last_restore
        with pytest.raises(ckpt.NotFoundError):
            cp.load(7, model=model)
        assert cp.last_restore is before


def test_a_fresh_start_has_no_restore_phases(url: str) -> None:
    with ckpt.Checkpointer(url) as cp:
        assert cp.load_latest(model=torch.nn.Linear(4, 4)) is None
        assert cp.last_restore is None


def test_damaged_newer_checkpoints_are_counted_apart(url: str, root: Path) -> None:
    cp = ckpt.Checkpointer(url, rng=False)
    cp.save(1, big=torch.zeros(1 << 16), slow=Slow()).wait()
    before = {p for p in root.rglob("*") if p.is_file()}
    cp.save(2, big=torch.arange(1 << 16, dtype=torch.float32), slow=Slow()).wait()
    new = [p for p in root.rglob("*") if p.is_file() and p not in before and "manifest" not in str(p)]
    target = max(new, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))

    big = torch.empty(1 << 16)
    t0 = time.perf_counter()
    with logged(r"resumed from step 1, passing over 1 newer: step 2 .*damaged"):
        assert cp.load_latest(big=big, slow=Slow()) == 1
    outside = time.perf_counter() - t0
    p = cp.last_restore
    _check(p, outside, damaged=True)
    assert p is not None and p.damaged >= SLOW  # step 2's plan took the live state dict too
    cp.close()
