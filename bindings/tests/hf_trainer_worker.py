"""A transformers ``Trainer`` run checkpointed with ckpt (test_hf_trainer.py runs it).

    hf_trainer_worker.py URL OUT --steps N --every K [--slow-after J]

Trains a 2-layer GPT-2 of a few thousand parameters (dropout on, so a resume
that lost the RNG state ends elsewhere) on random tokens with
``ckpt.hf.CkptTrainer``: AdamW, a linear schedule with warm-up, a save every K
steps. It resumes from the newest ``checkpoint-N`` folder of OUT/run, if any,
marks each committed save in OUT and, once done, writes its final state
there (killed.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any, Dict, List

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from ckpt.hf import CkptTrainer
from killed import mark, optimizer_tensors, slow, write_final


class Marks(TrainerCallback):  # type: ignore[misc]
    def __init__(self, out: Path, slow_after: Any) -> None:
        self.out, self.slow_after = out, slow_after

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        mark(self.out, state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        slow(self.out, self.slow_after)


def data(n: int = 64, length: int = 12) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (n, length), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def config() -> GPT2Config:
    return GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--slow-after", type=int)
    a = ap.parse_args()
    out = Path(a.out)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(config())
    args = TrainingArguments(
        output_dir=str(out / "run"), max_steps=a.steps, save_strategy="steps", save_steps=a.every,
        per_device_train_batch_size=8, learning_rate=5e-3, warmup_steps=3, lr_scheduler_type="linear",
        logging_steps=1, report_to=[], use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True, save_total_limit=2,
    )
    trainer = CkptTrainer(model=model, args=args, train_dataset=data(), callbacks=[Marks(out, a.slow_after)],
                          ckpt_url=a.url, ckpt_keep_last=2)
    resume = trainer.last_checkpoint()
    print(f"resumed from {None if resume is None else os.path.basename(resume)}", flush=True)
    trainer.train(resume_from_checkpoint=resume)

    tensors: Dict[str, object] = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors.update(optimizer_tensors("optim", trainer.optimizer.state_dict()["state"]))
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    write_final(out, tensors, {"global_step": trainer.state.global_step, "lr": trainer.lr_scheduler.get_last_lr(),
                               "losses": losses, "next_random": torch.rand(1).item()})


if __name__ == "__main__":
    main()
