"""Save and resume on S3 (a real Garage node started by scripts/test.sh)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

import ckpt

NEEDED = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT")


def s3_url(name: str) -> str:
    if not all(k in os.environ for k in NEEDED):
        if os.environ.get("CI") in ("true", "1"):
            pytest.fail("S3 tests need AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT")
        pytest.skip("no S3 server configured (run scripts/test.sh, or eval \"$(scripts/garage.sh start)\")")
    bucket = os.environ.get("CKPT_S3_BUCKET", "ckpt-test")
    return f"s3://{bucket}/py-{name}-{os.getpid()}-{time.time_ns()}"


def test_round_trip_on_s3() -> None:
    url = s3_url("roundtrip")
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    cp = ckpt.Checkpointer(url, keep_last=2, compression="zstd")
    for step in (1, 2, 3):
        cp.save(step, model=model, optimizer=opt)
    cp.wait()
    assert cp.steps() == [2, 3]

    model2 = nn.Linear(64, 32)
    opt2 = torch.optim.AdamW(model2.parameters())
    assert ckpt.Checkpointer(url).load_latest(model=model2, optimizer=opt2) == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
