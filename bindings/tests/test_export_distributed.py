"""`ckpt.export` of a checkpoint two DDP ranks saved: one copy of each
replicated tensor, no rank's internal state."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

import ckpt
from dist_worker import model_and_opt
from test_distributed import launch, ok


def test_export_of_a_two_rank_checkpoint(tmp_path: Path) -> None:
    root, rows = tmp_path / "ckpts", tmp_path / "out"
    rows.mkdir()
    ok(launch(2, ["train", root.as_uri(), str(rows), "--steps", "3", "--save-at", "2"]))
    back = ckpt.Checkpointer(root.as_uri()).read_latest()
    assert back is not None and back.step == 2
    out = tmp_path / "model.safetensors"
    report = ckpt.export(root.as_uri(), out, "model")
    tensors = load_file(out)
    model, _ = model_and_opt()
    assert set(tensors) == set(model.state_dict()) and report["tensors"] == len(tensors)
    for k, v in back.state["model"].items():
        assert torch.equal(tensors[k], v), k
    model.load_state_dict(tensors)
