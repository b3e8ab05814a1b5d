"""Lightning training with ckpt as its ``CheckpointIO`` (``ckpt.lightning``), on CPU.

A tiny model trains two epochs with a checkpoint at each epoch's end; a
second run resumes from the first epoch's checkpoint with ``ckpt_path=`` and
must end with the same weights and optimizer state, bit for bit. And a
``Trainer.fit`` job (lightning_worker.py) saving at each epoch's end is
killed with SIGKILL in the middle of the next, rerun with ``ckpt_path="last"``,
and must end where a job never killed does, bit for bit.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")

import ckpt  # noqa: E402
import ckpt.cli  # noqa: E402
from ckpt.lightning import CheckpointIO  # noqa: E402
from conftest import PYTHON, python_env  # noqa: E402
from killed import assert_same_end, run, run_killed  # noqa: E402

WORKER = str(Path(__file__).with_name("lightning_worker.py"))


class Tiny(L.LightningModule):  # type: ignore[misc, name-defined]
    def __init__(self, width: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 1))

    def training_step(self, batch, _i):  # type: ignore[no-untyped-def]
        x, y = batch
        return ((self.net(x) - y) ** 2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True) ** 2), batch_size=16, shuffle=False)


def trainer(tmp: Path, url: str, epochs: int) -> "L.Trainer":
    every = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp / "points", save_top_k=-1, save_last=True)
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, plugins=[CheckpointIO(url)],
                     callbacks=[every], logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(tmp), deterministic=True)


def weights(model: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, bytes]:
    out = {k: v.detach().contiguous().numpy().tobytes() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            out[f"opt.{i}.{k}"] = v.detach().contiguous().reshape(-1).numpy().tobytes()
    return out


def test_resume_from_a_ckpt_checkpoint_is_bitwise(tmp_path: Path, url: str) -> None:
    torch.manual_seed(0)
    model = Tiny()
    t = trainer(tmp_path / "a", url, 2)
    t.fit(model, data())
    ended = weights(model, t.optimizers[0])

    points = sorted((tmp_path / "a" / "points").iterdir())
    names: List[str] = [p.name for p in points]
    assert "last.ckpt" in names and "epoch=0-step=4.ckpt" in names, names
    pointer = json.loads((tmp_path / "a" / "points" / "epoch=0-step=4.ckpt").read_text())
    assert pointer["format"] == "ckpt.lightning" and pointer["url"] == url

    # Every checkpoint Lightning saved is an ordinary ckpt checkpoint of the root.
    cp = ckpt.Checkpointer(url, read_only=True)
    assert len(cp.steps()) == 4  # each epoch, and last.ckpt after each
    first = cp.read(pointer["step"]).state
    assert first["global_step"] == 4 and first["epoch"] == 0
    assert ckpt.cli.main(["verify", url]) == 0

    torch.manual_seed(123)  # another initialisation: everything must come from the checkpoint
    resumed = Tiny()
    t2 = trainer(tmp_path / "b", url, 2)
    t2.fit(resumed, data(), ckpt_path=str(tmp_path / "a" / "points" / "epoch=0-step=4.ckpt"))
    assert t2.global_step == 8
    assert weights(resumed, t2.optimizers[0]) == ended
    # The resumed run's own checkpoints went to the same root, after the first run's.
    assert len(ckpt.Checkpointer(url, read_only=True).steps()) == 6


def test_load_and_remove(tmp_path: Path, url: str) -> None:
    torch.manual_seed(0)
    model = Tiny()
    t = trainer(tmp_path, url, 1)
    t.fit(model, data())
    io = CheckpointIO(url)
    last = tmp_path / "points" / "last.ckpt"
    loaded = io.load_checkpoint(last)
    assert loaded["hyper_parameters"]["width"] == 8
    for k, v in model.state_dict().items():
        assert torch.equal(loaded["state_dict"][k], v), k
    io.remove_checkpoint(last)
    assert not last.exists()
    (tmp_path / "other.ckpt").write_text("{}")
    with pytest.raises(ckpt.UnsupportedError):
        io.load_checkpoint(tmp_path / "other.ckpt")


@pytest.mark.parametrize("asynchronous", [None, "ckpt", "lightning"])
def test_a_killed_fit_resumes_from_last_bitwise(tmp_path: Path, asynchronous: Optional[str]) -> None:
    """Synchronous, ckpt's asynchronous mode, and Lightning's AsyncCheckpointIO
    around the plugin: each killed with SIGKILL in the second epoch resumes
    from the last committed ``last.ckpt`` bitwise."""
    mode = ["--asynchronous", asynchronous] if asynchronous else []

    def job(url: str, out: Path, *extra: str) -> List[str]:
        return [PYTHON, WORKER, url, str(out), "--steps", "16", "--every", "1", *mode, *extra]  # 8 steps an epoch

    run(job((tmp_path / "ref").as_uri(), tmp_path / "ref-out"), python_env())
    url, out = (tmp_path / "ck").as_uri(), tmp_path / "out"
    run_killed(job(url, out, "--slow-after", "8"), python_env(), out, 8)  # in the second epoch
    pointer = json.loads((out / "points" / "last.ckpt").read_text())
    saved = ckpt.Checkpointer(url, read_only=True).read(pointer["step"]).state["global_step"]
    # Synchronous, the kill lands right after step 8's commit; asynchronous,
    # while the steps after it run (a later epoch's commit may be in too).
    assert saved == 8 if asynchronous is None else 8 <= saved < 16, saved
    assert "ended at 16" in run(job(url, out), python_env())
    assert_same_end(tmp_path / "ref-out", out)
    assert ckpt.cli.main(["verify", url]) == 0


def test_asynchronous_saves_return_before_the_commit_and_publish_in_order(tmp_path: Path) -> None:
    """``asynchronous=True``: the pointers appear once committed (all of them
    after ``teardown``), each naming the checkpoint of its own save."""
    url = (tmp_path / "root").as_uri()
    io = CheckpointIO(url, asynchronous=True)
    for i in range(3):
        io.save_checkpoint({"global_step": i, "w": torch.full((1000,), float(i))}, tmp_path / f"p{i}.ckpt")
    io.remove_checkpoint(tmp_path / "p1.ckpt")  # after its pointer is written, not before
    io.teardown()
    assert not (tmp_path / "p1.ckpt").exists()
    for i in (0, 2):
        got = CheckpointIO(url).load_checkpoint(tmp_path / f"p{i}.ckpt")
        assert got["global_step"] == i and torch.equal(got["w"], torch.full((1000,), float(i)))


def test_an_asynchronous_failure_raises_at_teardown_and_publishes_nothing(tmp_path: Path) -> None:
    """A save that fails in the background (another writer has claimed the
    root since: this one is fenced) writes no pointer, and raises at
    ``teardown``; nothing of the other writer's is touched."""
    url = (tmp_path / "root").as_uri()
    io = CheckpointIO(url, asynchronous=True)
    io.save_checkpoint({"global_step": 0}, tmp_path / "p0.ckpt")
    deadline = time.monotonic() + 60
    while not (tmp_path / "p0.ckpt").exists():  # committed, and its pointer written
        assert time.monotonic() < deadline
        time.sleep(0.01)
    other = ckpt.Checkpointer(url, coordinate="none")
    other.save(7, {"global_step": 7}).wait()
    io.save_checkpoint({"global_step": 1}, tmp_path / "p1.ckpt")  # returns: the fence is found at the commit
    with pytest.raises(ckpt.FencedError):
        io.teardown()
    assert (tmp_path / "p0.ckpt").exists() and not (tmp_path / "p1.ckpt").exists()
    assert ckpt.Checkpointer(url, read_only=True).steps() == [0, 7]
    other.close()
