"""Files ckpt writes that PyTorch users load as they are: `.pt` state dicts,
and `ckpt.export` for inference (read back by torch and safetensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import ckpt

from test_roundtrip import Net, trained


def pt_file(root: Path) -> Path:
    (f,) = root.glob("data/*/model-rank00000.pt")
    return f


def test_pt_file_holds_plain_state_dicts(url: str, root: Path) -> None:
    net, opt = trained()
    extra = {"epoch": 3, "betas": (0.9, 0.99), 7: "int key"}
    torch.manual_seed(11)
    rng = torch.get_rng_state()
    cp = ckpt.Checkpointer(url, format="torch")
    cp.save(5, model=net, optimizer=opt, extra=extra)
    cp.wait()

    d = torch.load(pt_file(root), weights_only=True)
    assert list(d) == ["model", "optimizer", "extra", "__ckpt__"]
    fresh, fresh_opt = trained(seed=1, steps=1)
    fresh.load_state_dict(d["model"])  # strict: no missing or unexpected keys
    fresh_opt.load_state_dict(d["optimizer"])
    for k, v in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.95)
    assert d["extra"] == extra
    # ckpt's own state, under one key: its bookkeeping and this rank's RNG.
    assert torch.equal(d["__ckpt__"]["rank0"]["rng"]["torch"], rng)
    assert d["__ckpt__"]["ckpt"]["version"] == 1

    # ckpt itself still restores the exact types from the manifest.
    back = ckpt.Checkpointer(url).read_latest()
    assert back is not None
    assert back.state["extra"] == extra and isinstance(back.state["extra"]["betas"], tuple)
    assert hasattr(back.state["model"], "_metadata")


@pytest.mark.parametrize("source_format", ["native", "torch", "safetensors"])
def test_export_has_the_state_dict_keys_and_nothing_internal(url: str, tmp_path: Path, source_format: str) -> None:
    net, opt = trained()
    cp = ckpt.Checkpointer(url, format=source_format)
    cp.save(1, model=net, optimizer=opt)
    cp.wait()
    out = tmp_path / "model.safetensors"
    report = ckpt.export(url, out, "model")
    assert report["step"] == 1 and report["files"] == [str(out)]
    tensors = load_file(out)
    assert set(tensors) == set(net.state_dict())
    fresh = Net()
    fresh.load_state_dict(tensors)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in net.state_dict().items())

    pt = tmp_path / "model.pt"
    ckpt.export(url, pt, "model", format="pt", dtype="bf16")
    loaded = torch.load(pt, weights_only=True)
    assert loaded["fc.weight"].dtype == torch.bfloat16
    assert loaded["bn.num_batches_tracked"].dtype == torch.int64  # only floats are cast
    assert torch.equal(loaded["fc.weight"], net.fc.weight.detach().to(torch.bfloat16))


def test_export_of_a_missing_entry_lists_the_entries(url: str, tmp_path: Path) -> None:
    net, opt = trained()
    cp = ckpt.Checkpointer(url)
    cp.save(1, model=net, optimizer=opt, extra={"epoch": 1})
    cp.wait()
    with pytest.raises(ckpt.NotFoundError, match=r"`modl`.*model, optimizer") as e:
        ckpt.export(url, tmp_path / "x.safetensors", "modl")
    assert "__rank0__" not in str(e.value)
    assert not (tmp_path / "x.safetensors").exists()


def test_export_of_a_tiny_linear_casts_and_refuses_overwrites(url: str, tmp_path: Path) -> None:
    lin = nn.Linear(3, 2, dtype=torch.float64)
    cp = ckpt.Checkpointer(url)
    cp.save(2, model=lin)
    cp.wait()
    out = tmp_path / "lin.safetensors"
    ckpt.export(url, out, "model", dtype="f16")
    assert load_file(out)["weight"].dtype == torch.float16
    with pytest.raises(ckpt.ConflictError):
        ckpt.export(url, out, "model")
    with pytest.raises(ckpt.InvalidInputError, match="bf16, f16 or f32"):
        ckpt.export(url, tmp_path / "y.safetensors", "model", dtype="int8")
