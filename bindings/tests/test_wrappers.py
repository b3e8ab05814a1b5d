"""A module saved through wrappers (torch.compile of the whole or of each
block, DataParallel, both) and restored without them, or through others
(ckpt._state.wrappers): the keys differ by the wrappers' parts, and the values
come back all the same."""

from __future__ import annotations

from typing import Callable, Dict

import pytest
import torch
from torch import nn

import ckpt
from ckpt._state import wrappers as _wrappers


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))


def compiled(m: nn.Module) -> nn.Module:
    return torch.compile(m, backend="eager")


def regional(m: nn.Module) -> nn.Module:
    """Each block compiled on its own (its keys: ``0._orig_mod.weight``, ...)."""
    for i in (0, 1, 3):
        m[i] = compiled(m[i])  # type: ignore[index]
    return m


WRAPS: Dict[str, Callable[[nn.Module], nn.Module]] = {
    "plain": lambda m: m,
    "compiled": compiled,
    "data-parallel": nn.DataParallel,  # (on CPU, a pass-through that prefixes "module.")
    "compiled-data-parallel": lambda m: compiled(nn.DataParallel(m)),
    "regional": regional,
    "data-parallel-regional": lambda m: nn.DataParallel(regional(m)),
}


def bits(m: nn.Module) -> Dict[str, bytes]:
    """The values by the module's own names (compiled blocks' segments left out)."""
    return {k.replace("_orig_mod.", ""): v.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
            for k, v in m.state_dict().items()}


@pytest.mark.parametrize("saved", list(WRAPS))
@pytest.mark.parametrize("restored", list(WRAPS))
def test_a_module_comes_back_through_any_wrapper(tmp_path, saved: str, restored: str) -> None:
    torch.manual_seed(0)
    inner = net()
    model = WRAPS[saved](inner)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with ckpt.Checkpointer(tmp_path.as_uri(), rng=False) as cp:
        cp.save(3, model=model, optimizer=opt).wait()
    want, want_opt = bits(inner), opt.state_dict()

    torch.manual_seed(1)
    fresh = net()
    live = WRAPS[restored](fresh)
    lopt = torch.optim.AdamW(live.parameters(), lr=1e-2)
    assert bits(fresh) != want
    with ckpt.Checkpointer(tmp_path.as_uri(), rng=False) as cp:
        assert cp.load_latest(model=live, optimizer=lopt) == 3
    assert bits(fresh) == want  # BatchNorm's running stats and counter too
    got = lopt.state_dict()["state"]
    for i, s in want_opt["state"].items():
        assert torch.equal(got[i]["exp_avg"], s["exp_avg"]) and torch.equal(got[i]["step"], s["step"])


def test_keys_that_differ_otherwise_are_still_refused(tmp_path) -> None:
    model = net()
    with ckpt.Checkpointer(tmp_path.as_uri(), rng=False) as cp:
        cp.save(1, model=model).wait()
    other = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))  # no BatchNorm: keys off by more
    with ckpt.Checkpointer(tmp_path.as_uri(), rng=False) as cp:
        # (Before anything is written: see test_match.py.)
        with pytest.raises(ckpt.InvalidInputError, match="keys this module does not have \\('1.weight', '1.bias'"):
            cp.load_latest(model=other)


def test_fit_renames_keys_and_module_versions_and_leaves_the_rest() -> None:
    tag = ckpt._state.tree.TAG
    inner = net()
    stored = {
        tag: "odict",
        "items": {f"_orig_mod.{k}": f"ref {k}" for k in inner.state_dict()},
        "metadata": {tag: "odict", "items": {"": {"version": 1}, "_orig_mod": {"v": 0}, "_orig_mod.1": {"version": 2}},
                     "metadata": None},
    }
    got = _wrappers.fit(stored, inner, inner.state_dict())
    assert list(got["items"]) == list(inner.state_dict())
    assert got["items"]["1.running_mean"] == "ref 1.running_mean"
    assert got["metadata"]["items"] == {"": {"v": 0}, "1": {"version": 2}}
    assert stored["items"]["_orig_mod.0.weight"] == "ref 0.weight"  # (the stored tree is not changed)
    # Same keys, other objects, and other keys: left as they are.
    plain = {tag: "odict", "items": {k: 0 for k in inner.state_dict()}, "metadata": None}
    assert _wrappers.fit(plain, inner, inner.state_dict()) is plain
    assert _wrappers.fit(stored, {"w": torch.zeros(1)}, {"w": torch.zeros(1)}) is stored
    off = {tag: "odict", "items": {"_orig_mod.x": 0}, "metadata": None}
    assert _wrappers.fit(off, inner, inner.state_dict()) is off
