"""transformers' ``Trainer`` checkpointing into ckpt (``ckpt.hf.CkptTrainer``), on CPU.

A tiny GPT-2 trains 16 steps saving every 4 (hf_trainer_worker.py); one run
is killed with SIGKILL after a save, rerun with ``resume_from_checkpoint``,
and must end with the same weights, optimizer state, schedule, logged losses
and random generators as a run never killed, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="ckpt.hf needs transformers (scripts/requirements.txt)")

import ckpt  # noqa: E402
import ckpt.cli  # noqa: E402
from conftest import PYTHON, python_env  # noqa: E402
from killed import assert_same_end, run, run_killed  # noqa: E402

WORKER = str(Path(__file__).with_name("hf_trainer_worker.py"))
STEPS, EVERY = 16, 4


def job(url: str, out: Path, *extra: str) -> list:
    return [PYTHON, WORKER, url, str(out), "--steps", str(STEPS), "--every", str(EVERY), *extra]


def test_a_killed_trainer_resumes_bitwise(tmp_path: Path) -> None:
    ref_url, url = (tmp_path / "ref").as_uri(), (tmp_path / "ck").as_uri()
    run(job(ref_url, tmp_path / "ref-out"), python_env())

    out = tmp_path / "out"
    run_killed(job(url, out, "--slow-after", "8"), python_env(), out, 8)
    folders = sorted(p.name for p in (out / "run").iterdir())
    assert "checkpoint-8" in folders, folders
    # The folder the Trainer knows is a pointer and its JSON state: no weights, no pickles.
    assert sorted(p.name for p in (out / "run" / "checkpoint-8").iterdir()) == ["ckpt.json", "trainer_state.json"]
    assert json.loads((out / "run" / "checkpoint-8" / "ckpt.json").read_text()) == {"format": "ckpt.hf", "url": url, "step": 8}

    log = run(job(url, out), python_env())
    assert "resumed from checkpoint-8" in log, log[-3000:]
    assert_same_end(tmp_path / "ref-out", out)

    cp = ckpt.Checkpointer(url, read_only=True)
    assert cp.steps() == [12, 16]  # keep_last=2 (the Trainer saves at the end too)
    got = cp.read(16).state
    assert set(got) >= {"model", "optimizer", "scheduler", "trainer"}, sorted(got)
    assert json.loads(got["trainer"]["state"])["global_step"] == 16
    assert ckpt.cli.main(["verify", url]) == 0


def test_a_commit_without_its_folder_is_trained_again(tmp_path: Path) -> None:
    """Killed after step 8's commit but before its folder's rename: the
    rerun resumes from step 4's folder, and saves step 8 anew (the old
    commit is discarded, not a conflict)."""
    import shutil

    import torch
    from transformers import GPT2LMHeadModel, TrainingArguments

    from ckpt.hf import CkptTrainer
    from hf_trainer_worker import config, data

    url = (tmp_path / "ck").as_uri()

    def trainer(eval_dataset: object = None, **extra: object) -> CkptTrainer:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config())
        args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=8, save_steps=4, per_device_train_batch_size=8,
                                 report_to=[], use_cpu=True, disable_tqdm=True, **extra)
        return CkptTrainer(model=model, args=args, train_dataset=data(), eval_dataset=eval_dataset, ckpt_url=url)

    first = trainer()
    assert first.last_checkpoint() is None
    first.train()
    shutil.rmtree(tmp_path / "run" / "checkpoint-8")
    ended = {k: v.clone() for k, v in first.model.state_dict().items()}

    again = trainer()
    resume = again.last_checkpoint()
    assert resume is not None and resume.endswith("checkpoint-4")
    again.train(resume_from_checkpoint=resume)
    assert all(torch.equal(v, ended[k]) for k, v in again.model.state_dict().items())
    assert ckpt.Checkpointer(url, read_only=True).steps() == [4, 8]
    assert (tmp_path / "run" / "checkpoint-8" / "ckpt.json").exists()

    with pytest.raises(ckpt.UnsupportedError):
        trainer(data(), load_best_model_at_end=True, eval_strategy="steps", eval_steps=4)
