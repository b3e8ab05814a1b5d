"""A training loop under Hugging Face Accelerate, checkpointed with ckpt (test_accelerate.py runs it).

    accelerate_worker.py URL OUT --steps N --every K [--slow-after J]

Trains a small MLP with dropout on noise from the global generator (so a
resume that lost the RNG state ends elsewhere), AdamW with a step schedule,
gradient accumulation over 2 iterations (so the accelerator's ``step``
counter matters) and an EMA of the weights registered for checkpointing.
It resumes from the newest checkpoint of URL, if any, saves every K
iterations (``ckpt.accelerate.save_state``), marks each committed save in
OUT and, once done, writes its final state there (killed.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict

import torch
from accelerate import Accelerator
from torch import nn

import ckpt
import ckpt.accelerate
from killed import mark, optimizer_tensors, slow, write_final


class Ema:
    """An exponential moving average of the weights: an object with a state dict, not a module."""

    def __init__(self, model: nn.Module) -> None:
        self.avg = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.updates = 0

    def update(self, model: nn.Module) -> None:
        self.updates += 1
        for k, v in model.state_dict().items():
            self.avg[k].mul_(0.9).add_(v.detach(), alpha=0.1)

    def state_dict(self) -> Dict[str, object]:
        return {"avg": self.avg, "updates": self.updates}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        for k, v in state["avg"].items():  # type: ignore[attr-defined]
            self.avg[k].copy_(v)
        self.updates = int(state["updates"])  # type: ignore[call-overload]


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
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    ema = Ema(model)
    accelerator.register_for_checkpointing(ema)

    cp = ckpt.Checkpointer(a.url, keep_last=2)
    start = ckpt.accelerate.load_state(accelerator, cp) or 0
    print(f"resumed from {start}", flush=True)
    for it in range(start, a.steps):
        slow(out, a.slow_after)
        x = torch.randn(16, 8)
        y = x.sum(1, keepdim=True).sin() + 0.01 * torch.randn(16, 1)
        with accelerator.accumulate(model):
            loss = ((model(x) - y) ** 2).mean()
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            ema.update(model)
        done = it + 1
        if done % a.every == 0 and done < a.steps:
            ckpt.accelerate.save_state(accelerator, cp, done).wait()
            mark(out, done)
    cp.close()

    tensors = {f"model.{k}": v for k, v in accelerator.unwrap_model(model).state_dict().items()}
    tensors.update(optimizer_tensors("optim", opt.state_dict()["state"]))
    tensors.update({f"ema.{k}": v for k, v in ema.avg.items()})
    write_final(out, tensors, {"accelerator_step": accelerator.step, "lr": sched.get_last_lr(), "ema_updates": ema.updates,
                               "next_random": torch.rand(1).item()})


if __name__ == "__main__":
    main()
