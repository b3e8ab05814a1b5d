"""Round trips of real PyTorch training state: bitwise, with the same Python types."""

from __future__ import annotations

import math
import random
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

import ckpt


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor(0.5, dtype=torch.float64))
        self.low = nn.Parameter(torch.randn(5, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.conv(x)).mean((2, 3))
        return self.fc(x) * self.scale.float() + self.low.float().sum()


def trained(seed: int = 0, steps: int = 3) -> tuple[Net, torch.optim.AdamW]:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.8, 0.95))
    for _ in range(steps):
        loss = net(torch.randn(6, 2, 5, 5)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net, opt


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a, b, path="$"):
    """Equal with the same types all the way down; tensors compared bit for bit."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert bits(a) == bits(b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def test_module_optimizer_and_rng_round_trip_bitwise(url: str) -> None:
    net, opt = trained(seed=1)
    assert opt.state_dict()["state"], "the optimizer has state after steps"
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    cp = ckpt.Checkpointer(url)
    cp.save(10, model=net, optimizer=opt, extra={"epoch": 2, "note": "x"}).wait()
    want_rng = (random.random(), np.random.rand(), torch.rand(3))

    # Fresh objects with different values; the RNGs move on.
    net2, opt2 = trained(seed=2, steps=1)
    torch.rand(100)
    random.random()
    np.random.rand(5)
    extra: dict = {"epoch": 0}
    assert ckpt.Checkpointer(url).load_latest(model=net2, optimizer=opt2, extra=extra) == 10

    assert_same(net.state_dict(), net2.state_dict())
    assert_same(opt.state_dict(), opt2.state_dict())
    assert extra == {"epoch": 2, "note": "x"}
    got_rng = (random.random(), np.random.rand(), torch.rand(3))
    assert got_rng[0] == want_rng[0] and got_rng[1] == want_rng[1]
    assert bits(got_rng[2]) == bits(want_rng[2])

    # Training continues identically from the restored state.
    x = torch.randn(6, 2, 5, 5, generator=torch.Generator().manual_seed(3))
    for n, o in ((net, opt), (net2, opt2)):
        o.zero_grad()
        n(x).square().mean().backward()
        o.step()
    assert_same(net.state_dict(), net2.state_dict())


def test_read_keeps_types_exactly(url: str) -> None:
    odict = OrderedDict(a=torch.arange(3))
    odict._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    state = {
        "tuple": (1, 2.5, "s", None, True, b"\x00\xff"),
        "list": [1, [2, (3,)]],
        "int_keys": {0: "zero", "0": "string zero", -5: {}},
        "floats": [float("inf"), -0.0, 1e-308, 0.1],
        "nan": float("nan"),
        "big": 2**63 - 1,
        "odict": odict,
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_scalar": np.float32(1.5),
        "bf16": torch.randn(4, 4).to(torch.bfloat16),
        "f8": torch.randn(8).to(torch.float8_e4m3fn),
        "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(3, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "strided": torch.arange(12.0).reshape(3, 4).t(),
        "u64": np.array([2**64 - 1], dtype=np.uint64),
        # Tensors the export's fast path (numpy's view) must hand to the slow
        # one, or take only the viewed bytes of.
        "grad_leaf": torch.ones(3, requires_grad=True),
        "offset_view": torch.arange(10.0)[3:7],
        "expanded": torch.arange(3.0).expand(4, 3),
        "conj": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj(),
        "neg": torch._neg_view(torch.arange(3.0)),
        "f64_scalar": torch.tensor(0.25, dtype=torch.float64),
    }
    cp = ckpt.Checkpointer(url, rng=False)
    cp.save(1, state).wait()
    back = cp.read_latest()
    assert back is not None and back.step == 1
    want = dict(state)
    want["strided"] = state["strided"].contiguous()
    want["grad_leaf"] = torch.ones(3)
    want["expanded"] = torch.tensor([[0.0, 1.0, 2.0]] * 4)
    want["conj"] = torch.tensor([1 - 2j, 3 + 1j], dtype=torch.complex64)
    want["neg"] = torch.tensor([-0.0, -1.0, -2.0])
    assert_same(want, back.state)
    assert math.copysign(1.0, back.state["floats"][1]) == -1.0
    assert back.state["np_scalar"].dtype == np.float32 and isinstance(back.state["np_scalar"], np.float32)

    # Tensors come back writable and independent of the checkpoint.
    back.state["bf16"].add_(1)
    assert_same(cp.read(1).state["bf16"], state["bf16"])

    # Framework override: everything as numpy (where numpy has the dtype), or as torch.
    as_np = cp.read(1, framework="pt").state
    assert isinstance(as_np["np"], torch.Tensor) and as_np["np"].dtype == torch.int16
    with pytest.raises(ckpt.UnsupportedError):
        cp.read(1, framework="np")  # bf16 has no numpy dtype


def test_fresh_start_and_steps(url: str) -> None:
    cp = ckpt.Checkpointer(url, keep_last=2)
    net = nn.Linear(2, 2)
    assert cp.load_latest(model=net) is None
    assert cp.read_latest() is None
    for step in (1, 2, 3):
        cp.save(step, model=net)
    cp.wait()
    assert cp.steps() == [2, 3]
    assert cp.read(3).state["model"]["weight"].shape == (2, 2)


def test_load_into_state_dict_replaces_plain_values(url: str) -> None:
    cp = ckpt.Checkpointer(url, rng=False)
    w = torch.ones(3)
    cp.save(5, {"w": w * 2, "epoch": 4, "hist": [1, 2]}).wait()
    target = {"w": w, "epoch": 0, "hist": [9]}
    assert cp.load(5, target) == 5
    assert torch.equal(w, torch.full((3,), 2.0)), "tensors are restored in place"
    assert target["epoch"] == 4 and target["hist"] == [1, 2]
    with pytest.raises(ckpt.InvalidInputError, match="no entry 'missing'"):  # (the call's mistake: see test_match.py)
        cp.load(5, missing=torch.zeros(1))
    with pytest.raises(ckpt.InvalidInputError):
        cp.load(5, w=torch.zeros(4))  # shape mismatch


class Tied(nn.Module):
    """An embedding and an output layer sharing one weight (as GPT-2's do)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(x)))


@pytest.mark.parametrize("lazy", [False, True])
def test_a_tied_weight_is_staged_once_and_comes_back_tied(url: str, lazy: bool) -> None:
    torch.manual_seed(3)
    m = Tied()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.arange(10)).square().mean().backward()
    opt.step()
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False)
    report = cp.save(1, model=m, optimizer=opt).wait()
    sd = m.state_dict()
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in sd.values()}
    for s in opt.state_dict()["state"].values():
        for v in s.values():
            unique[v.data_ptr()] = v.numel() * v.element_size()
    assert report["copied_bytes"] == sum(unique.values())
    want = {k: v.clone() for k, v in sd.items()}

    torch.manual_seed(4)
    fresh = Tied()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert ckpt.Checkpointer(url, rng=False).load_latest(model=fresh, optimizer=fopt) == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert fresh.head.weight is fresh.emb.weight
