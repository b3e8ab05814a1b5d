"""``lightning.Trainer.fit`` checkpointed with ckpt (test_lightning.py runs it).

    lightning_worker.py URL OUT --steps N --every K [--slow-after J] [--asynchronous ckpt|lightning]

Fits a small model (AdamW, a per-step schedule) for N steps, 8 an epoch, with a
``ModelCheckpoint`` every K epochs and ``last.ckpt``, through
``ckpt.lightning.CkptCheckpointIO`` into URL (``--asynchronous ckpt``: its
own asynchronous mode; ``lightning``: wrapped in Lightning's
``AsyncCheckpointIO``), resuming with ``ckpt_path="last"``. Each committed ``last.ckpt`` is marked in OUT with its
global step; once done, the final state is written there (killed.py).

Checkpoints are at epoch ends: Lightning resumes a plain ``DataLoader``
mid-epoch from the epoch's start (it warns that the data loader is not
resumable), with its own checkpoint files as with ckpt's, so a mid-epoch
checkpoint cannot resume bitwise whatever stores it. The run is bounded by
epochs (N / 8): bounded by ``max_steps``, Lightning's own files did not resume
an epoch-end checkpoint bitwise either.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from collections import deque
from typing import Any, Deque, Dict, Optional

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt.lightning import CkptCheckpointIO
from killed import SLOW, mark, optimizer_tensors, slow, write_final


class Tiny(L.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.02)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 5, 0.5), "interval": "step"}}


class Marked(CkptCheckpointIO):
    """Marks each committed ``last.ckpt`` (the checkpoint ``ckpt_path="last"`` resumes from)."""

    def __init__(self, url: str, out: Path, asynchronous: bool) -> None:
        super().__init__(url, asynchronous=asynchronous)
        self.out = out
        self.global_steps: Deque[int] = deque()  # of the saves not yet published, in order

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.global_steps.append(int(checkpoint["global_step"]))
        super().save_checkpoint(checkpoint, path, storage_options)

    def _publish(self, path: str, step: int) -> None:
        super()._publish(path, step)
        global_step = self.global_steps.popleft()
        if Path(path).name == "last.ckpt":
            mark(self.out, global_step)


class Slow(L.Callback):  # type: ignore[misc]
    """Slows the steps after the marker of step ``after``; asynchronous, also
    every step past ``after`` (the marker follows the background commit, and
    a tiny model could otherwise finish before it appears)."""

    def __init__(self, out: Path, after: Optional[int], asynchronous: bool) -> None:
        self.out, self.after, self.asynchronous = out, after, asynchronous

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if self.asynchronous and self.after is not None and trainer.global_step > self.after:
            time.sleep(SLOW)
        else:
            slow(self.out, self.after)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True, help="epochs")
    ap.add_argument("--slow-after", type=int)
    ap.add_argument("--asynchronous", choices=["ckpt", "lightning"])
    a = ap.parse_args()
    out = Path(a.out)

    torch.manual_seed(0)
    model = Tiny()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True) ** 2), batch_size=8, shuffle=False)
    every = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "points", every_n_epochs=a.every, save_top_k=-1,
                                                save_last=True)
    io: Any = Marked(a.url, out, a.asynchronous == "ckpt")
    if a.asynchronous == "lightning":
        io = L.pytorch.plugins.AsyncCheckpointIO(io)
    trainer = L.Trainer(max_epochs=a.steps // 8, accelerator="cpu", devices=1, plugins=[io],
                        callbacks=[every, Slow(out, a.slow_after, a.asynchronous is not None)], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(out), deterministic=True)
    trainer.fit(model, data, ckpt_path="last")
    print(f"ended at {trainer.global_step}", flush=True)

    opt = trainer.optimizers[0]
    tensors: Dict[str, object] = {f"model.{k}": v for k, v in model.state_dict().items()}
    tensors.update(optimizer_tensors("optim", opt.state_dict()["state"]))
    write_final(out, tensors, {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                               "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()})


if __name__ == "__main__":
    main()
