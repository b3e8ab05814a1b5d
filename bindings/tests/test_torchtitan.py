"""torchtitan (0.3, from PyPI) checkpointing through ``ckpt.torchtitan.CheckpointManager``, on CPU.

torchtitan_worker.py trains with torchtitan's optimizer and scheduler
containers and data loader, its checkpoint manager built from config as
torchtitan's ``Trainer`` builds it, and called as the trainer calls it. One
run is killed with SIGKILL after a committed save, rerun, and must end with
the same weights, optimizer state, schedule, token count and next batch as a
run never killed, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

pytest.importorskip("torchtitan", reason="ckpt.torchtitan needs torchtitan (scripts/requirements.txt)")

import ckpt  # noqa: E402
import ckpt.cli  # noqa: E402
import ckpt.torchtitan  # noqa: E402
from conftest import PYTHON, python_env  # noqa: E402
from killed import assert_same_end, run, run_killed  # noqa: E402

WORKER = str(Path(__file__).with_name("torchtitan_worker.py"))


def job(url: str, out: Path, *extra: str) -> List[str]:
    return [PYTHON, WORKER, url, str(out), "--steps", "20", "--every", "4", *extra]


def test_a_killed_loop_resumes_bitwise(tmp_path: Path) -> None:
    run(job((tmp_path / "ref").as_uri(), tmp_path / "ref-out"), python_env())
    url, out = (tmp_path / "ck").as_uri(), tmp_path / "out"
    run_killed(job(url, out, "--slow-after", "8"), python_env(), out, 8)
    committed = ckpt.Checkpointer(url, read_only=True).steps()
    assert committed and committed[-1] >= 8 and committed[-1] < 20, committed
    log = run(job(url, out), python_env())
    assert f"resumed from {committed[-1]}" in log and "ended at 20" in log, log
    assert_same_end(tmp_path / "ref-out", out)

    # An ordinary ckpt checkpoint: torchtitan's states by name, the data
    # loader in each rank's own part.
    newest = ckpt.Checkpointer(url, read_only=True).read_latest()
    assert newest is not None and newest.step == 20
    assert set(newest.state) >= {"model", "optimizer", "lr_scheduler", "train_state"}, sorted(newest.state)
    assert newest.state["train_state"]["step"] == 20
    assert ckpt.cli.main(["verify", url]) == 0


def test_what_it_does_not_do_is_refused_when_built(tmp_path: Path) -> None:
    from torch import nn
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    model = nn.Linear(2, 2)
    opt = default_adamw().build(model_parts=[model])
    sched = LRSchedulersContainer.Config().build(optimizers=opt, training_steps=4)
    config = ckpt.torchtitan.CheckpointManager.Config(enable=True, url=(tmp_path / "ck").as_uri(), last_save_in_hf=True)
    with pytest.raises(ckpt.UnsupportedError, match="last_save_in_hf"):
        config.build(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={},
                     sd_adapter=None, base_folder=str(tmp_path))
    # Disabled, it is torchtitan's no-op manager.
    off = ckpt.torchtitan.CheckpointManager.Config().build(
        dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sched, states={}, sd_adapter=None)
    assert off.save(4) is False and off.load() is False
