"""A module's state dict made in bulk while its tree is as before
(ckpt._state.modstate): always what ``module.state_dict()`` returns, whatever
changed in between, and the saves that use it store the live tensors."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import pytest
import torch
from torch import nn

import ckpt
from ckpt._state import modstate as _modstate


def net() -> nn.Module:
    torch.manual_seed(0)
    shared = nn.Linear(3, 3)
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Sequential(shared, nn.ReLU(), shared), nn.Linear(3, 2, bias=False))
    m[1].register_buffer("scratch", torch.zeros(2), persistent=False)
    m[2].register_module("gone", None)
    return m


def assert_same(m: nn.Module) -> None:
    """The bulk state dict is torch's: keys, order, values (the same memory,
    detached, plain tensors) and ``_metadata``."""
    got, want = _modstate.state_dict(m), m.state_dict()
    assert type(got) is OrderedDict
    assert list(got) == list(want)
    for k in want:
        assert type(got[k]) is type(want[k]) and not got[k].requires_grad, k
        assert got[k].data_ptr() == want[k].data_ptr() and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k
    assert list(got._metadata.items()) == list(want._metadata.items())


def made_in_bulk(m: nn.Module) -> bool:
    tree = _modstate._trees.get(m)
    return tree is not None and tree.make() is not None


def test_a_repeated_state_dict_is_made_in_bulk_and_equals_torchs() -> None:
    m = net()
    assert_same(m)  # the first: torch's own, and the tree recorded
    assert made_in_bulk(m)
    for _ in range(2):
        assert_same(m)
    # (tied modules come twice, under both names, as torch has them)
    assert "2.0.weight" in _modstate.state_dict(m) and "2.2.weight" in _modstate.state_dict(m)


CHANGES: "list[tuple[str, Callable[[nn.Module], Any]]]" = [
    ("a parameter replaced", lambda m: setattr(m[0], "weight", nn.Parameter(torch.ones(3, 4)))),
    ("a parameter's data replaced", lambda m: setattr(m[0].weight, "data", torch.full((3, 4), 2.0))),
    ("a parameter resized in place", lambda m: m[3].weight.data.resize_(2, 2)),
    ("a bias that was None given", lambda m: setattr(m[3], "bias", nn.Parameter(torch.ones(2)))),
    ("a bias set to None", lambda m: setattr(m[0], "bias", None)),
    ("a submodule replaced", lambda m: m.__setitem__(3, nn.Linear(3, 2))),
    ("a submodule added", lambda m: m.add_module("head", nn.Linear(2, 2))),
    ("a None child given", lambda m: setattr(m[2], "gone", nn.Linear(1, 1))),
    ("a buffer made persistent", lambda m: m[1]._non_persistent_buffers_set.discard("scratch")),
    ("a buffer registered", lambda m: m[3].register_buffer("extra", torch.arange(3.0))),
    ("a buffer reassigned", lambda m: setattr(m[1], "running_mean", torch.full((3,), 7.0))),
    ("a version changed", lambda m: setattr(m[1], "_version", 1)),
    ("a parameter renamed", lambda m: m[0]._parameters.__setitem__("w", m[0]._parameters.pop("weight"))),
]


@pytest.mark.parametrize("what,change", CHANGES, ids=[c[0] for c in CHANGES])
def test_whatever_changes_between_calls_the_state_dict_is_torchs(what: str, change: Callable[[nn.Module], Any]) -> None:
    m = net()
    assert_same(m)
    assert made_in_bulk(m)
    change(m)
    assert_same(m)
    assert_same(m)  # (recorded again, then in bulk)
    assert made_in_bulk(m)


def _hook(module: nn.Module, sd: Any, prefix: str, meta: Any) -> None:
    sd[prefix + "hooked"] = torch.ones(1)


class Extra(nn.Linear):
    def get_extra_state(self) -> Any:
        return {"calls": 1}

    def set_extra_state(self, state: Any) -> None:
        pass


class Own(nn.Linear):
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "mine"] = torch.zeros(1)


RUNS_ITS_OWN_CODE: "list[tuple[str, Callable[[nn.Module], Any]]]" = [
    ("a state dict post-hook", lambda m: m[3].register_state_dict_post_hook(lambda *a: None)),
    ("an old-style hook", lambda m: m[3]._register_state_dict_hook(_hook)),
    ("a pre-hook", lambda m: m[0].register_state_dict_pre_hook(lambda *a: None)),
    ("extra state", lambda m: m.add_module("extra", Extra(1, 1))),
    ("its own _save_to_state_dict", lambda m: m.add_module("own", Own(1, 1))),
    ("a state_dict on the instance", lambda m: setattr(m[0], "state_dict", lambda *a, **k: OrderedDict())),
]


@pytest.mark.parametrize("what,change", RUNS_ITS_OWN_CODE, ids=[c[0] for c in RUNS_ITS_OWN_CODE])
def test_a_module_that_runs_code_in_its_state_dict_gets_its_own(what: str, change: Callable[[nn.Module], Any]) -> None:
    m = net()
    assert_same(m)
    change(m)
    for _ in range(2):
        got = _modstate.state_dict(m)
        want = m.state_dict()
        assert list(got) == list(want)
        assert not made_in_bulk(m)


def test_saves_store_the_live_tensors_after_a_change(tmp_path: Any) -> None:
    """A loop whose model changes between saves (a layer swapped, a parameter's
    data replaced): every save stores the tensors live at its call, lazy or eager."""
    for lazy in (False, True):
        m = net()
        cp = ckpt.Checkpointer((tmp_path / f"lazy{lazy}").as_uri(), lazy=lazy, coordinate="none", rng=False)
        want = {}
        for step, change in enumerate([lambda m: None, lambda m: None] + [c for _, c in CHANGES[:7]]):
            change(m)
            cp.save(step, model=m).wait()
            want[step] = {k: v.clone() for k, v in m.state_dict().items()}
        for step, sd in want.items():
            got = cp.read(step).state["model"]
            assert list(got) == list(sd), step
            assert all(torch.equal(got[k], sd[k]) for k in sd), step
        cp.close()


def _restore(tmp_path: Any, m: nn.Module, monkeypatch: Any) -> "list[str]":
    """Save ``m``, scramble it, restore it; returns the classes whose
    ``load_state_dict`` was called (counted on ``nn.Module``'s own)."""
    cp = ckpt.Checkpointer(tmp_path.as_uri(), coordinate="none", rng=False)
    cp.save(1, model=m).wait()
    want = {k: v.clone() for k, v in m.state_dict().items()}
    with torch.no_grad():
        for v in m.state_dict().values():
            v.fill_(3)
    calls: "list[str]" = []
    load = nn.Module.load_state_dict

    def counted(self: nn.Module, *a: Any, **k: Any) -> Any:
        calls.append(type(self).__name__)
        return load(self, *a, **k)

    monkeypatch.setattr(nn.Module, "load_state_dict", counted)
    assert cp.load_latest(model=m) == 1
    got = m.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    cp.close()
    return calls


def test_a_restore_filled_in_place_skips_load_state_dict_only_where_nothing_runs(tmp_path: Any, monkeypatch: Any) -> None:
    plain = nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.Linear(3, 3), nn.ReLU()), nn.Linear(3, 2, bias=False))
    assert _restore(tmp_path / "plain", plain, monkeypatch) == []

    # Batch norm loads its own way (_load_from_state_dict): torch's call runs.
    monkeypatch.undo()
    assert _restore(tmp_path / "bn", net(), monkeypatch) == ["Sequential"]

    monkeypatch.undo()
    hooked = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    seen: "list[Any]" = []
    hooked[1].register_load_state_dict_post_hook(lambda module, keys: seen.append(module))
    assert _restore(tmp_path / "hooked", hooked, monkeypatch) == ["Sequential"]
    assert seen == [hooked[1]]


def test_a_recorded_tree_keeps_no_module_alive() -> None:
    import gc
    import weakref

    m = net()
    _modstate.state_dict(m)
    assert made_in_bulk(m)
    old = m[3]
    m[3] = nn.Linear(3, 2)
    gone = weakref.ref(old)
    del old
    gc.collect()
    assert gone() is None  # a replaced layer (and its parameters) is freed at once
    assert_same(m)
    root = weakref.ref(m)
    del m
    gc.collect()
    assert root() is None
