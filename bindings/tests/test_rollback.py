"""A rollback: a job goes back to an earlier checkpoint (after a loss spike),
discards the later ones with ``discard_after`` and trains on; a restart then
resumes from the new run, not from the one it left. (Two ranks under
torch.distributed: ``test_distributed.py``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch

import ckpt
from ckpt.memory import MemoryCheckpointer


def job() -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, shift: int = 0) -> None:
    g = torch.Generator().manual_seed(step + shift)
    loss = model(torch.randn(4, 8, generator=g)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    out = {f"m.{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, s in opt.state_dict()["state"].items():
        out.update({f"o.{pid}.{k}": v.clone() for k, v in s.items()})
    return out


def same(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def memory_tier(durable: str, shm: Path, keep_in_memory: int = 4, durable_every: int = 2) -> MemoryCheckpointer:
    """A memory tier of one process over ``durable``, its node's memory under ``shm``."""
    return MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none", rng=False,
                              keep_in_memory=keep_in_memory, durable_every=durable_every)


def test_a_rollback_discards_the_later_steps_and_a_restart_resumes_the_new_run(url: str, root: Path) -> None:
    model, opt = job()
    saved = {}
    with ckpt.Checkpointer(url, keep_last=3, rng=False) as cp:
        for step in range(1, 6):
            train(model, opt, step)
            saved[step] = snapshot(model, opt)
            cp.save(step, model=model, optimizer=opt)
    assert cp.steps() == [3, 4, 5]

    # The loss spiked after step 3: go back to it and train on other batches.
    model, opt = job()
    cp = ckpt.Checkpointer(url, keep_last=3, rng=False)
    assert cp.load(3, model=model, optimizer=opt) == 3
    assert same(snapshot(model, opt), saved[3])
    with pytest.raises(ckpt.ConflictError, match=r"step 4 is already committed.*discard_after"):
        cp.save(4, model=model, optimizer=opt)
    with pytest.raises(ckpt.ConflictError, match=r"step 3 is already committed"):
        cp.save(3, model=model, optimizer=opt)
    report = cp.discard_after(3)
    assert sorted(s for s, _ in report.retired) == [4, 5]
    assert cp.steps() == [3]
    assert len(list((root / "manifests").iterdir())) == 1
    new = {}
    for step in (4, 5):
        train(model, opt, step, shift=100)
        new[step] = snapshot(model, opt)
        cp.save(step, model=model, optimizer=opt)
    cp.close()
    assert not same(new[5], saved[5])  # the new run differs from the old

    model, opt = job()
    restart = ckpt.Checkpointer(url, keep_last=3, rng=False)
    assert restart.load_latest(model=model, optimizer=opt) == 5
    assert same(snapshot(model, opt), new[5])
    assert restart.steps() == [3, 4, 5]


def test_discard_after_checks_its_step_and_discards_nothing_when_nothing_is_later(url: str) -> None:
    model, opt = job()
    cp = ckpt.Checkpointer(url, rng=False)
    cp.save(1, model=model)
    cp.save(2, model=model).wait()
    for bad in (-1, 1.5, "2", None):
        with pytest.raises(ckpt.InvalidInputError, match="step must be a non-negative int"):
            cp.discard_after(bad)  # type: ignore[arg-type]
    assert cp.discard_after(2).retired == []
    with pytest.raises(ckpt.InvalidInputError, match=r"no committed checkpoint of step 0 .*\[1, 2\]"):
        cp.discard_after(0)  # a mistyped step discards nothing
    assert cp.steps() == [1, 2]
    reader = ckpt.Checkpointer(url, read_only=True)
    with pytest.raises(ckpt.InvalidInputError, match="read-only"):
        reader.discard_after(0)
    assert cp.steps() == [1, 2]
    cp.close()


def test_an_older_incarnation_cannot_discard(url: str) -> None:
    """A job restarted while its old incarnation still runs: the old one's
    discard is fenced, and the new one's checkpoints stay as they are."""
    model, _ = job()
    old = ckpt.Checkpointer(url, rng=False)
    for step in (1, 2, 3):
        old.save(step, model=model).wait()
    new = ckpt.Checkpointer(url, rng=False)
    assert new.load_latest(model=model) == 3
    with pytest.raises(ckpt.FencedError):
        old.discard_after(1)
    assert new.steps() == [1, 2, 3]
    new.close()


def test_the_memory_tier_discards_in_memory_and_on_the_durable_tier(tmp_path: Path, shm: Path) -> None:
    durable = (tmp_path / "durable").as_uri()
    model, opt = job()

    cp = memory_tier(durable, shm, keep_in_memory=3, durable_every=1)
    for step in (1, 2, 3):
        train(model, opt, step)
        cp.save(step, model=model, optimizer=opt)
    cp.wait()
    back = snapshot(model, opt)
    cp.close()

    model, opt = job()
    cp = memory_tier(durable, shm, keep_in_memory=3, durable_every=1)
    assert cp.durable.load(1, model=model, optimizer=opt) == 1
    with pytest.raises(ckpt.InvalidInputError, match=r"no checkpoint of step 7"):
        cp.discard_after(7)
    assert cp.durable.steps() == [1, 2, 3] and sorted(cp.own.committed()) == [1, 2, 3]
    cp.discard_after(1)
    assert cp.durable.steps() == [1]
    assert sorted(cp.own.committed()) == [1]
    train(model, opt, 2, shift=100)
    new = snapshot(model, opt)
    cp.save(2, model=model, optimizer=opt)
    cp.wait()
    cp.close()
    assert not same(new, back)

    model, opt = job()
    cp = memory_tier(durable, shm, keep_in_memory=3, durable_every=1)
    assert cp.load_latest(model=model, optimizer=opt) == 2
    assert cp.last_source == "memory"
    assert same(snapshot(model, opt), new)
    cp.close()


def test_the_memory_tier_rolls_back_to_a_step_held_only_in_memory(tmp_path: Path, shm: Path) -> None:
    """``load(step)`` reads a step the durable tier never got from memory;
    ``discard_after`` then takes the durable tier back to its newest step
    before it, and a restart resumes the new run from memory."""
    durable = (tmp_path / "durable").as_uri()
    model, opt = job()

    cp = memory_tier(durable, shm)
    kept: Dict[int, Dict[str, torch.Tensor]] = {}
    for step in (1, 2, 3, 4):
        train(model, opt, step)
        cp.save(step, model=model, optimizer=opt)
        kept[step] = snapshot(model, opt)
    cp.wait()
    cp.close()
    assert ckpt.Checkpointer(durable, coordinate="none").steps() == [1, 3]

    model, opt = job()
    cp = memory_tier(durable, shm)
    assert cp.load(2, model=model, optimizer=opt) == 2
    assert cp.last_source == "memory" and cp.last_restore is not None
    assert same(snapshot(model, opt), kept[2])
    assert cp.load(3, model=model, optimizer=opt) == 3
    assert cp.last_source == "memory" and same(snapshot(model, opt), kept[3])
    with pytest.raises(ckpt.NotFoundError, match=r"step 9"):
        cp.load(9, model=model, optimizer=opt)
    assert cp.load(2, model=model, optimizer=opt) == 2
    with pytest.raises(ckpt.ConflictError, match="discard_after"):
        cp.save(3, model=model, optimizer=opt)
        cp.wait()
    cp.discard_after(2)
    assert cp.durable.steps() == [1]
    assert sorted(cp.own.committed()) == [1, 2]
    train(model, opt, 3, shift=100)
    new = snapshot(model, opt)
    cp.save(3, model=model, optimizer=opt)
    cp.wait()
    cp.close()
    assert not same(new, kept[3])

    model, opt = job()
    cp = memory_tier(durable, shm)
    assert cp.load_latest(model=model, optimizer=opt) == 3
    assert cp.last_source == "memory"
    assert same(snapshot(model, opt), new)
    cp.close()


def test_a_damaged_memory_copy_loads_the_step_from_the_durable_tier(tmp_path: Path, shm: Path) -> None:
    durable = (tmp_path / "durable").as_uri()
    model, opt = job()

    cp = memory_tier(durable, shm)
    kept: Dict[int, Dict[str, torch.Tensor]] = {}
    for step in (1, 2, 3):
        train(model, opt, step)
        cp.save(step, model=model, optimizer=opt)
        kept[step] = snapshot(model, opt)
    cp.wait()
    chunks = sorted((cp.own.path / "chunks").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    cp.close()
    for c in chunks:  # every chunk of the memory root: no step of it is intact
        if c.is_file():
            c.write_bytes(b"\0" * c.stat().st_size)

    model, opt = job()
    cp = memory_tier(durable, shm)
    with pytest.warns(UserWarning, match="damaged"):
        assert cp.load(1, model=model, optimizer=opt) == 1
    assert cp.last_source == "durable" and same(snapshot(model, opt), kept[1])
    with pytest.warns(UserWarning, match="damaged"), pytest.raises(ckpt.CorruptError, match="durable tier holds none"):
        cp.load(2, model=model, optimizer=opt)
    cp.close()


def test_a_step_the_memory_tier_refuses_is_saved_by_neither_tier(tmp_path: Path, shm: Path) -> None:
    """Back at step 3 with step 4 still in memory but not durable: a save of
    4 would leave two runs' checkpoints of step 4 (memory's old one, the
    durable tier's new one), and a restart would take memory's. It is
    refused at once, by both tiers, and said once."""
    durable = (tmp_path / "durable").as_uri()
    model, opt = job()
    cp = memory_tier(durable, shm)
    for step in (1, 2, 3, 4):
        train(model, opt, step)
        cp.save(step, model=model, optimizer=opt)
    cp.wait()
    assert cp.load(3, model=model, optimizer=opt) == 3
    train(model, opt, 4, shift=100)
    with pytest.raises(ckpt.ConflictError, match="discard_after"):
        cp.save(4, model=model, optimizer=opt)
    cp.wait()  # (the refusal is not raised again)
    assert cp.durable.steps() == [1, 3]
    cp.discard_after(3)
    cp.save(4, model=model, optimizer=opt)  # the durable tier's turn (every second save): both tiers
    cp.wait()
    assert cp.durable.steps() == [1, 3, 4] and sorted(cp.own.committed()) == [1, 2, 3, 4]
    cp.close()
