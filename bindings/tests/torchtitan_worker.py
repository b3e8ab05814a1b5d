"""A training loop driven as torchtitan's trainer drives its checkpointer (test_torchtitan.py runs it).

    torchtitan_worker.py URL OUT --steps N --every K [--slow-after J]

torchtitan's own components: its optimizer and scheduler containers
(``default_adamw``, ``LRSchedulersContainer``), its ``ParallelAwareDataloader``
(a shuffled ``StatefulDataLoader``), and the checkpoint manager built from its
config (``ckpt.torchtitan.CheckpointManager.Config(...).build(...)``) with the
arguments its ``Trainer`` passes. The loop calls the manager as the trainer
does: ``load`` first, ``maybe_wait_for_staging`` before each optimizer step,
``save(step, last_step=...)`` after each step, ``close`` at the end. Each
committed save is marked in OUT (killed.py); once done, the final state is
written there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

import ckpt.torchtitan
from killed import mark, slow, write_final


class Marked(ckpt.torchtitan.CheckpointManager):  # type: ignore[misc]
    """Marks each save once it is committed (the manager waits for it before the next)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ckpt.torchtitan.CheckpointManager.Config):  # type: ignore[misc]
        out: str = ""

    def _wait_for_saving(self) -> None:
        handle = self.save_future
        super()._wait_for_saving()
        if handle is not None:
            mark(Path(self.config.out), handle.step)


class TrainState:
    """The trainer's own state (torchtitan's ``Trainer.state_dict``)."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> Dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


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
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = default_adamw(lr=0.02).build(model_parts=[model])
    sched = LRSchedulersContainer.Config(warmup_steps=3).build(optimizers=opt, training_steps=a.steps)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4, generator=g)
    loader = ParallelAwareDataloader(TensorDataset(x, x.sum(1, keepdim=True) ** 2), dp_rank=0, dp_world_size=1,
                                     batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
    state = TrainState()
    config = Marked.Config(enable=True, url=a.url, out=str(out), interval=a.every, keep_latest_k=3,
                           last_save_model_only=False)
    manager = config.build(dataloader=loader, model_parts=[model], optimizers=opt, lr_schedulers=sched,
                           states={"train_state": state}, sd_adapter=None, base_folder=str(out))
    if manager.load(step=-1):
        print(f"resumed from {state.step}", flush=True)
    batches = iter(loader)  # after the load: from the restored position
    while state.step < a.steps:
        state.step += 1
        xb, yb = next(batches)
        ((model(xb) - yb) ** 2).mean().backward()
        manager.maybe_wait_for_staging()
        opt.step()
        sched.step()
        opt.zero_grad()
        state.ntokens_seen += xb.numel()
        manager.save(state.step, last_step=state.step == a.steps)
        slow(out, a.slow_after)
    manager.close()
    print(f"ended at {state.step}", flush=True)

    tensors: Dict[str, object] = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors.update({f"optim.{k}": v for k, v in opt.state_dict().items() if isinstance(v, torch.Tensor)})
    write_final(out, tensors, {"step": state.step, "ntokens": state.ntokens_seen, "lr": sched.schedulers[0].get_last_lr(),
                               "next_batch": next(batches)[0].tolist()})


if __name__ == "__main__":
    main()
