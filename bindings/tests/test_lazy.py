"""Lazy snapshots: the copy overlaps forward/backward, never the optimizer step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ckpt


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("compiled", [False, True])
def test_hook_never_lets_a_post_step_value_in(url: str, compiled: bool) -> None:
    torch.manual_seed(0)
    # Big enough (about 100 MB of parameters and Adam state) that the background
    # copy is still running when opt.step() is called right after save().
    model = nn.Sequential(nn.Linear(1024, 4096), nn.BatchNorm1d(4096), nn.Linear(4096, 1024))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(8, 1024)
    step_fn = opt.step
    if compiled:
        # The optimizer step compiled (PyTorch's recipe for a faster step), and
        # compiled before the first save registered the pre-hook: the hook
        # must run at every compiled step all the same. (Dynamo alone decides
        # that; the "eager" backend spares the test Inductor's compile time.)
        step_fn = torch.compile(opt.step, backend="eager")
        model(x).square().mean().backward()
        step_fn()
        opt.zero_grad()
    # The first save has no Adam state yet: size the staging budget for the later ones.
    cp = ckpt.Checkpointer(url, lazy=True, rng=False, staging_budget=512 << 20)
    expected = {}
    for step in range(3):
        expected[step] = (
            {k: bits(v) for k, v in model.state_dict().items()},
            {(i, k): bits(v) for i, s in opt.state_dict()["state"].items() for k, v in s.items()},
        )
        handle = cp.save(step, model=model, optimizer=opt)
        loss = model(x).square().mean()  # forward mutates batch-norm buffers
        opt.zero_grad()
        loss.backward()
        step_fn()  # the pre-hook blocks until the snapshot is complete
        assert handle.snapshot_done(), "optimizer.step ran before the snapshot finished"
    cp.wait()

    for step, (params, opt_state) in expected.items():
        saved = cp.read(step).state
        got_params = {k: bits(v) for k, v in saved["model"].items()}
        assert got_params == params, f"step {step}: a parameter or buffer has a post-save value"
        got_opt = {(i, k): bits(v) for i, s in saved["optimizer"]["state"].items() for k, v in s.items()}
        assert got_opt == opt_state, f"step {step}: optimizer state has a post-save value"


def test_close_removes_the_hook(url: str) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    cp.save(0, model=model, optimizer=opt)
    assert len(opt._optimizer_step_pre_hooks) == 1
    cp.save(1, model=model, optimizer=opt)
    assert len(opt._optimizer_step_pre_hooks) == 1, "one hook per optimizer"
    cp.close()
    assert len(opt._optimizer_step_pre_hooks) == 0
    assert cp.steps() == [0, 1]


def test_eager_mode_snapshot_is_done_on_return(url: str) -> None:
    w = torch.ones(1000)
    cp = ckpt.Checkpointer(url, rng=False)
    h = cp.save(1, w=w)
    assert h.snapshot_done()
    w.add_(1)  # allowed at once in eager mode
    report = h.wait()
    assert report["copied_bytes"] == 4000 and report["stall"] >= 0
    assert torch.equal(cp.read(1).state["w"], torch.ones(1000))
