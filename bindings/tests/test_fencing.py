"""A restarted job fences its old incarnation: the old one's saves raise
``ckpt.FencedError`` and what it commits is never restored; a read-only
checkpointer beside a running job fences nobody."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import ckpt


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(16, 8)


def test_fenced_error_is_a_checkpoint_error() -> None:
    assert issubclass(ckpt.FencedError, ckpt.CheckpointError)


def test_the_old_incarnation_is_fenced(tmp_path) -> None:
    url = (tmp_path / "run").as_uri()
    old_model = _model(1)
    old = ckpt.Checkpointer(url, keep_last=1)
    for step in (1, 2):
        old.save(step, model=old_model).wait()

    # The restart: it resumes from 2 and saves 3 and 4.
    new_model = _model(2)
    new = ckpt.Checkpointer(url, keep_last=1)
    assert new.load_latest(model=new_model) == 2
    assert torch.equal(new_model.weight, old_model.weight)
    with torch.no_grad():
        new_model.weight.add_(1.0)
    for step in (3, 4):
        new.save(step, model=new_model).wait()

    # The old one wakes up: its save and its gc are refused, and it stays fenced.
    with pytest.raises(ckpt.FencedError) as e:
        old.save(100, model=old_model).wait()
    assert e.value.epoch < e.value.current
    with pytest.raises(ckpt.FencedError):
        old.gc()
    with pytest.raises(ckpt.FencedError):
        old.save(101, model=old_model)

    # The job's work is there, and a fresh restart gets it bitwise.
    assert new.steps() == [4]
    fresh = _model(3)
    assert ckpt.Checkpointer(url).load_latest(model=fresh) == 4
    assert torch.equal(fresh.weight, new_model.weight)


def test_a_read_only_reader_fences_nobody(tmp_path) -> None:
    url = (tmp_path / "run").as_uri()
    writer = ckpt.Checkpointer(url)
    model = _model(1)
    writer.save(1, model=model).wait()
    reader = ckpt.Checkpointer(url, read_only=True)
    got = _model(2)
    assert reader.load_latest(model=got) == 1
    assert torch.equal(got.weight, model.weight)
    with pytest.raises(ckpt.InvalidInputError, match="read-only"):
        reader.save(2, model=got)
    # The writer goes on.
    writer.save(2, model=model).wait()
    assert writer.steps() == [1, 2]


def test_ckpt_list_shows_epochs(tmp_path) -> None:
    url = (tmp_path / "run").as_uri()
    cp = ckpt.Checkpointer(url)
    cp.save(1, model=_model(1)).wait()
    out = subprocess.run(
        [sys.executable, "-m", "ckpt", "list", url, "--json"], check=True, capture_output=True, text=True
    )
    rows = json.loads(out.stdout)
    assert [(r["step"], r["epoch"], r["status"]) for r in rows] == [(1, 1, "committed")]
