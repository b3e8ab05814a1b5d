"""`ckpt.export(..., hf=True)` loads into `transformers` with no missing or
unexpected keys (a randomly initialised GPT-2: nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckpt

transformers = pytest.importorskip("transformers")


def gpt2() -> "transformers.GPT2LMHeadModel":
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=101)
    return transformers.GPT2LMHeadModel(config).eval()


def assert_loads_like(model: "transformers.GPT2LMHeadModel", out: Path) -> None:
    back, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert len(info[kind]) == 0, info
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(back.eval()(ids).logits, model(ids).logits)


@pytest.mark.parametrize("fmt", ["native", "torch"])
def test_hf_export_loads_with_from_pretrained(url: str, tmp_path: Path, fmt: str) -> None:
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters())
    cp = ckpt.Checkpointer(url, format=fmt)
    cp.save(3, model=model, optimizer=opt, extra={"tokens": 1000})
    cp.wait()
    out = tmp_path / "hf"
    report = ckpt.export(url, out, "model", hf=True, config=model.config)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert report["step"] == 3
    assert_loads_like(model, out)


def test_hf_export_in_shards_with_an_index(url: str, tmp_path: Path) -> None:
    model = gpt2()
    cp = ckpt.Checkpointer(url)
    cp.save(1, model=model)
    cp.wait()
    out = tmp_path / "hf"
    ckpt.export(url, out, "model", hf=True, config=model.config, max_shard_bytes=100_000)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert_loads_like(model, out)
