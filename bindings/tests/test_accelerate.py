"""Hugging Face Accelerate with ckpt (``ckpt.accelerate``), on CPU.

A training loop under a real ``Accelerator`` (accelerate_worker.py) saves
every 3 iterations; one run is killed with SIGKILL after a save, rerun, and
must end with the same weights, optimizer state, EMA, scheduler, counter
and random generators as a run never killed, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="ckpt.accelerate needs Hugging Face Accelerate (scripts/requirements.txt)")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import ckpt  # noqa: E402
import ckpt.accelerate  # noqa: E402
import ckpt.cli  # noqa: E402
from conftest import PYTHON, python_env  # noqa: E402
from killed import assert_same_end, run, run_killed  # noqa: E402

WORKER = str(Path(__file__).with_name("accelerate_worker.py"))
STEPS, EVERY = 20, 4  # saves at optimizer steps: gradient accumulation over 2 (no partial gradient is saved)


def job(url: str, out: Path, *extra: str) -> list:
    return [PYTHON, WORKER, url, str(out), "--steps", str(STEPS), "--every", str(EVERY), *extra]


def test_a_killed_loop_resumes_bitwise(tmp_path: Path) -> None:
    ref_url, url = (tmp_path / "ref").as_uri(), (tmp_path / "ck").as_uri()
    run(job(ref_url, tmp_path / "ref-out"), python_env())

    out = tmp_path / "out"
    run_killed(job(url, out, "--slow-after", "8"), python_env(), out, 8)
    committed = ckpt.Checkpointer(url, read_only=True).steps()
    assert committed and committed[-1] >= 8, committed
    log = run(job(url, out), python_env())
    assert f"resumed from {committed[-1]}" in log, log
    assert_same_end(tmp_path / "ref-out", out)

    # An ordinary ckpt checkpoint, with no pickle in it.
    newest = ckpt.Checkpointer(url, read_only=True).read_latest()
    assert newest is not None and newest.step == 16  # the resumed run's last save (keep_last=2)
    got = newest.state
    assert set(got) >= {"model", "optimizer", "scheduler", "custom_0", "accelerate"}, sorted(got)
    assert got["accelerate"]["counts"]["custom"] == 1
    assert ckpt.cli.main(["verify", url]) == 0


def test_load_state_refuses_another_accelerator(tmp_path: Path) -> None:
    from accelerate import Accelerator

    url = (tmp_path / "ck").as_uri()
    acc = Accelerator(cpu=True)
    model = acc.prepare(nn.Linear(3, 2))
    cp = ckpt.Checkpointer(url)
    assert ckpt.accelerate.load_state(acc, cp) is None  # nothing saved yet: a fresh start
    ckpt.accelerate.save_state(acc, cp, 4).wait()
    with torch.no_grad():
        model.weight.zero_()
    assert ckpt.accelerate.load_state(acc, cp) == 4
    assert model.weight.abs().sum() > 0

    # An accelerator with one model more than was saved: refused before anything is restored.
    acc._models.append(nn.Linear(3, 2))
    with pytest.raises(ckpt.InvalidInputError):
        ckpt.accelerate.load_state(acc, cp)
    with pytest.raises(ckpt.InvalidInputError):
        ckpt.accelerate.save_state(acc, ckpt.Checkpointer(url, rng=False), 5)
