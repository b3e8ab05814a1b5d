"""How a save names its tensors and says where a bad value sits: the names are
the stored format (a loader finds tensors by them), so a faster walk must give
exactly the same ones, for tensors in mappings (the common case, taken without
a recursive call) and everywhere else."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import ckpt
from ckpt._ckpt import TensorRef
from ckpt._state.tree import TAG, flatten


def names(state: dict, lazy: bool = False) -> list[str]:
    return [t.name for t in flatten(state, lazy).tensors]


def test_names_follow_the_path_in_every_kind_of_container() -> None:
    t = torch.zeros(2)
    state = {
        "a": {"b": t, 3: {"c": t}},
        "seq": [t, {"d": t}, (t,)],
        "od": OrderedDict(x=t),
        "top": t,
    }
    assert names(state) == ["a.b", "a.3.c", "seq.0", "seq.1.d", "seq.2.0", "od.x", "top"]


def test_colliding_names_get_a_counter_and_an_empty_path_is_called_tensor() -> None:
    t = torch.zeros(1)
    # "a.b" is both a nested path and a flat key; the second one met gets #1.
    assert names({"a": {"b": t}, "a.b": t, "a.b#1": t}) == ["a.b", "a.b#1", "a.b#1#1"]
    assert names({"": t, "x": {"": t}}) == ["tensor", "x."]
    # A nested empty key with an empty parent path: ".".join(["", ""]) == ".".
    assert names({"": {"": t}}) == ["."]


def test_module_and_optimizer_names_are_their_state_dict_keys() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    opt = torch.optim.AdamW(net.parameters())
    net(torch.randn(3, 2)).sum().backward()
    opt.step()
    got = names({"model": net, "optimizer": opt}, lazy=True)
    want = [f"model.{k}" for k in net.state_dict()]
    want += [f"optimizer.state.{i}.{k}" for i, s in opt.state_dict()["state"].items() for k in s]
    assert got == want


def test_a_parameter_or_subclass_in_a_mapping_is_still_a_tensor() -> None:
    p = nn.Parameter(torch.ones(3))
    flat = flatten({"p": {"w": p}}, False)
    assert [t.name for t in flat.tensors] == ["p.w"]
    assert flat.tree == {"p": {"w": TensorRef("p.w")}}


def test_lazy_mode_copies_loose_tensors_now_and_defers_optimizer_state() -> None:
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(1, 2)).sum().backward()
    opt.step()
    flat = flatten({"optimizer": opt, "loose": {"t": torch.ones(2)}}, True)
    now = {t.name: t.copy_now for t in flat.tensors}
    assert now["loose.t"] is True
    assert all(v is False for k, v in now.items() if k.startswith("optimizer.state."))


def test_a_bad_tensor_in_a_mapping_is_reported_with_its_path() -> None:
    sparse = torch.zeros(2, 2).to_sparse()
    with pytest.raises(ckpt.InvalidInputError, match=r"\$\['cfg'\]\['s'\]: torch.sparse_coo"):
        flatten({"cfg": {"s": sparse}}, False)
    with pytest.raises(ckpt.InvalidInputError, match=r"\$\['cfg'\]\['3'\]: torch.sparse_coo"):
        flatten({"cfg": {3: sparse}}, False)
    with pytest.raises(ckpt.InvalidInputError, match="reserved"):
        flatten({"cfg": {TAG: torch.zeros(1)}}, False)
