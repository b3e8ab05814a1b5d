"""A loop's repeated saves of the same CPU tensors, taken in bulk (ckpt._save.repeat_host)."""

from __future__ import annotations

import gc
import weakref
from typing import Any, Dict, List

import pytest
import torch
from torch import nn

import ckpt


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_bits(model: nn.Module, opt: torch.optim.Optimizer) -> Dict[str, bytes]:
    out = {f"model.{k}": bits(v) for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": bits(v) for k, v in s.items()})
    return out


def saved_bits(cp: ckpt.Checkpointer, step: int) -> Dict[str, bytes]:
    saved = cp.read(step).state
    out = {f"model.{k}": bits(v) for k, v in saved["model"].items()}
    for i, s in saved["optimizer"]["state"].items():
        out.update({f"opt.{i}.{k}": bits(v) for k, v in s.items()})
    return out


def net() -> nn.Module:
    # Buffers (batch norm's, a 0-d count among them) change in forward and are
    # copied at once; parameters and Adam state (its 0-d steps too) are left
    # to the background copy.
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 4))


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("lazy", [True, False])
def test_later_cpu_saves_take_the_state_in_bulk_and_store_the_values_of_the_save(
    url: str, lazy: bool, host_bulk: List[bool]
) -> None:
    torch.manual_seed(0)
    model, x = net(), torch.randn(8, 16)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt, x)
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False)
    expected = {}
    for step in range(4):
        expected[step] = state_bits(model, opt)
        cp.save(step, model=model, optimizer=opt)
        # Forward changes the buffers before the step; the step the rest.
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    cp.wait()
    # The first save walks and records the plans; the later three take the
    # model's state dict and the optimizer's state from them.
    assert host_bulk == [True] * 6
    for step, want in expected.items():
        assert saved_bits(cp, step) == want, f"step {step}"
    got = cp.read(3).state
    assert got["optimizer"]["state"][0]["step"].shape == ()  # (0-d, as saved)
    assert got["model"]["1.num_batches_tracked"].shape == ()
    cp.close()


def test_a_changed_mapping_is_walked_again_and_stored_whole(url: str, host_bulk: List[bool]) -> None:
    torch.manual_seed(0)
    model, x = net(), torch.randn(8, 16)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt, x)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    cp.save(0, model=model, optimizer=opt)
    cp.save(1, model=model, optimizer=opt)
    assert host_bulk == [True, True]
    host_bulk.clear()
    # A parameter in new memory, and one of a new shape: the model's plan
    # fails, the walk takes it; the optimizer's state is unchanged.
    with torch.no_grad():
        model[0].weight = nn.Parameter(model[0].weight.clone() + 1)
        model[4].bias = nn.Parameter(torch.arange(5.0))
    want = state_bits(model, opt)
    cp.save(2, model=model, optimizer=opt)
    assert host_bulk == [True]  # (the optimizer's)
    cp.save(3, model=model, optimizer=opt)
    assert host_bulk == [True, True, True]  # the model's new plan holds
    cp.wait()
    assert saved_bits(cp, 2) == want
    assert saved_bits(cp, 3) == want
    assert cp.read(3).state["model"]["4.bias"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    cp.close()


def test_tensors_numpy_cannot_view_are_taken_in_bulk_too(url: str, host_bulk: List[bool]) -> None:
    # bf16 (no numpy dtype) and a tensor that requires grad: the walk views
    # them as bytes; later saves take them by their storages as any other.
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(3, 5).to(torch.bfloat16) for i in range(6)}
    state["g"] = torch.randn(4, requires_grad=True)
    state["s"] = torch.tensor(7.0)
    state["i"] = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    for step in range(3):
        with torch.no_grad():
            for t in state.values():
                t.add_(1)
        cp.save(step, state=state).wait()
        got = cp.read(step).state["state"]
        assert set(got) == set(state)
        for k, v in state.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert bits(got[k]) == bits(v), k
    assert host_bulk == [True, True]
    cp.close()


def test_a_plan_keeps_no_tensor_memory_alive(url: str, host_bulk: List[bool]) -> None:
    import numpy as np

    # Tensors over numpy arrays: an array dies only once no tensor, view or
    # storage of its memory is left.
    arrays = [np.full(64, float(i), dtype=np.float32) for i in range(10)]
    refs = [weakref.ref(a) for a in arrays]
    state = {f"t{i}": torch.from_numpy(a) for i, a in enumerate(arrays)}
    del arrays
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    cp.save(0, state=state).wait()
    cp.save(1, state=state).wait()
    assert host_bulk == [True]
    # (Nor does the plan hold a tensor or an array itself.)
    plan = cp._host_plans["state."]
    held = [getattr(plan, k) for k in type(plan).__slots__]
    seen, kinds = set(), set()
    while held:
        o = held.pop()
        if id(o) not in seen:
            seen.add(id(o))
            kinds.add(type(o))
            if isinstance(o, (list, tuple, dict, set, frozenset)):
                held.extend(gc.get_referents(o))
            elif type(o).__module__ == "ckpt._save.repeat_host":  # (the plan's parts)
                held.extend(getattr(o, k) for k in type(o).__slots__)
    assert not kinds & {np.ndarray, torch.Tensor, torch.UntypedStorage}, kinds
    del state
    gc.collect()
    assert all(r() is None for r in refs)
    # A new mapping under the same name, which may sit at the freed
    # addresses, is stored with its own values.
    state = {f"t{i}": torch.full((64,), float(100 + i)) for i in range(10)}
    cp.save(2, state=state).wait()
    got = cp.read(2).state["state"]
    assert all(torch.equal(got[k], v) for k, v in state.items())
    cp.close()


def test_names_already_taken_in_the_save_send_the_mapping_through_the_walk(url: str, host_bulk: List[bool]) -> None:
    # A plan's names are free in the save it was made in; in a later save, an
    # entry saved first may take one of them: the walk then makes it unique.
    a = {f"t{i}": torch.full((4,), float(i)) for i in range(8)}
    cp = ckpt.Checkpointer(url, lazy=False, rng=False)
    cp.save(0, {"m": a}).wait()
    cp.save(1, {"m": a}).wait()
    assert host_bulk == [True]
    clash = torch.full((2,), -1.0)
    cp.save(2, {"m.t3": clash, "m": a}).wait()
    assert host_bulk == [True]  # (not tried: a name is taken)
    # Saved after the mapping taken in bulk, a tensor under one of its names
    # is given another.
    cp.save(3, {"m": a, "m.t3": clash}).wait()
    assert host_bulk == [True, True]
    for step in (2, 3):
        got = cp.read(step).state
        assert torch.equal(got["m.t3"], clash)
        assert all(torch.equal(got["m"][k], v) for k, v in a.items())
    cp.close()


class AppState:
    """DCP's AppState pattern: its state dict's lazy-safe tensors are those
    of the module and optimizer it holds, looked up by address each save."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, opt

    def state_dict(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optim"])


def test_an_app_states_tensors_copied_at_once_are_decided_at_every_save(url: str, host_bulk: List[bool]) -> None:
    torch.manual_seed(0)
    model, x = net(), torch.randn(8, 16)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt, x)
    app = AppState(model, opt)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    expected = {}
    for step in range(3):
        sd = app.state_dict()
        expected[step] = {k: bits(v) for k, v in sd["model"].items()}
        cp.save(step, app=app)
        model(x).square().mean().backward()  # buffers change now, parameters at the step
        opt.step()
        opt.zero_grad()
    cp.wait()
    assert True in host_bulk
    for step, want in expected.items():
        got = cp.read(step).state["app"]["model"]
        assert {k: bits(v) for k, v in got.items()} == want, f"step {step}"
    cp.close()


def test_the_plans_need_no_numpy_where_none_is_installed() -> None:
    # numpy is optional: CUDA state is saved through host slabs without it, so
    # the modules of repeated saves must import and plan without it too.
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import torch, ckpt, ckpt._state.tensors, ckpt._save.repeat, ckpt._save.repeat_host\n"
        "assert ckpt._save.repeat_host.ndarray() is None\n"
        "print('imported')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "imported" in r.stdout, r.stderr[-2000:]
