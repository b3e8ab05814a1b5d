"""A restore asked for what the checkpoint does not hold is refused with
``InvalidInputError`` before anything is written, and no checkpoint is taken
for damaged because of it (``ckpt/_state/match.py``).

Before, a misnamed entry made ``load_latest`` skip every checkpoint as
damaged and start afresh: the job's next saves took the old steps and
retention removed the old checkpoints. A module or optimizer that did not
fit got torch's own error after the other tensors were written.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch import nn

import ckpt
from ckpt.memory import MemoryCheckpointer


def _net(*widths: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:])))


def _trained(seed: int = 0, widths: Tuple[int, ...] = (4, 4, 2)) -> Tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = _net(*widths)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, widths[0])).square().sum().backward()
    opt.step()
    return m, opt


def _copy(m: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _same(m: nn.Module, values: Dict[str, torch.Tensor]) -> bool:
    now = m.state_dict()
    return now.keys() == values.keys() and all(torch.equal(now[k], v) for k, v in values.items())


def _saved(url: str, steps: List[int]) -> Tuple[nn.Module, torch.optim.Optimizer]:
    m, opt = _trained()
    with ckpt.Checkpointer(url, keep_last=2) as cp:
        for s in steps:
            cp.save(s, model=m, optimizer=opt)
    return m, opt


def test_a_misnamed_entry_is_refused_and_no_checkpoint_is_passed_over(url: str, root: Path) -> None:
    saved, _ = _saved(url, [1, 2])
    manifests = sorted((root / "manifests").iterdir())
    m, opt = _trained(seed=1)
    before = _copy(m)
    cp = ckpt.Checkpointer(url, keep_last=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a skipped checkpoint is a warning)
        with pytest.raises(ckpt.InvalidInputError, match=r"step 2 has no entry 'optimizr' \(it has 'model', 'optimizer'\)"):
            cp.load_latest(model=m, optimizr=opt)
    assert _same(m, before)
    # Both checkpoints still count: the job cannot save over step 2, and the
    # right names restore it.
    with pytest.raises(ckpt.ConflictError):
        cp.save(2, model=m, optimizer=opt).wait()
    assert cp.load_latest(model=m, optimizer=opt) == 2
    assert _same(m, _copy(saved))
    cp.close()
    assert sorted((root / "manifests").iterdir()) == manifests


def test_every_missing_entry_is_named_by_load_too(url: str) -> None:
    _saved(url, [1])
    m, opt = _trained(seed=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    with pytest.raises(ckpt.InvalidInputError, match=r"no entry 'data', 'scheduler'"):
        ckpt.Checkpointer(url).load(1, {"data": {"epoch": 0}}, model=m, scheduler=sched)


@pytest.mark.parametrize(
    "widths, said",
    [
        ((4, 4), r"2 keys this module does not have \('1.weight', '1.bias'\)"),
        ((4, 4, 2, 2), r"missing 2 of this module's keys \('2.weight', '2.bias'\)"),
        ((4, 4, 3), None),  # same keys, another shape: the tensor's own check
    ],
)
def test_a_module_whose_keys_differ_is_refused_before_anything_is_written(url: str, widths: Tuple[int, ...], said: Any) -> None:
    _saved(url, [1])
    torch.manual_seed(1)
    m = _net(*widths)
    before = _copy(m)
    with pytest.raises(ckpt.InvalidInputError, match=said or "has shape"):
        ckpt.Checkpointer(url).load_latest(model=m)
    assert _same(m, before)


def test_an_optimizer_over_other_parameters_is_refused_before_anything_is_written(url: str) -> None:
    _saved(url, [1])
    m, _ = _trained(seed=1)
    before = _copy(m)
    params = list(m.parameters())
    for groups, said in (
        ([{"params": params[:2]}], r"1 parameter group of 4 parameters, this AdamW 1 parameter group of 2"),
        ([{"params": params[:2]}, {"params": params[2:]}], r"this AdamW 2 parameter groups of 2, 2 parameters"),
    ):
        opt = torch.optim.AdamW(groups, lr=0.1)
        with pytest.raises(ckpt.InvalidInputError, match=said):
            ckpt.Checkpointer(url).load_latest(model=m, optimizer=opt)
        assert _same(m, before) and not opt.state


class Renamed(nn.Module):
    """A module that loads an older layout of its state its own way: its
    weight was saved as ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        if prefix + "w" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "w")
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_a_module_that_loads_its_own_way_still_decides(url: str) -> None:
    with ckpt.Checkpointer(url) as cp:
        cp.save(1, model={"w": torch.arange(3.0)})
    m = Renamed()
    assert ckpt.Checkpointer(url).load_latest(model=m) == 1
    assert torch.equal(m.weight.detach(), torch.arange(3.0))
    # And a load hook outside torch that forgives a missing key.
    torch.manual_seed(1)
    grown = _net(4, 4, 2)
    grown.register_load_state_dict_post_hook(lambda _m, keys: keys.missing_keys.clear())
    with ckpt.Checkpointer(url + "-2") as cp:
        cp.save(1, model=_net(4, 4))
    assert ckpt.Checkpointer(url + "-2").load_latest(model=grown) == 1


def test_the_memory_tier_refuses_a_misnamed_entry_from_either_tier(url: str, shm: Path) -> None:
    m, opt = _trained()
    memory = str(shm / "node{node}")
    with MemoryCheckpointer(url, memory_dir=memory, coordinate="none", durable_every=1) as cp:
        cp.save(1, model=m, optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for where in (memory, str(shm / "elsewhere{node}")):  # (the second root holds nothing: from disk)
            fresh, fopt = _trained(seed=1)
            before = _copy(fresh)
            cp = MemoryCheckpointer(url, memory_dir=where, coordinate="none", durable_every=1)
            with pytest.raises(ckpt.InvalidInputError, match="no entry 'optim'"):
                cp.load_latest(model=fresh, optim=fopt)
            assert _same(fresh, before)
            assert cp.load_latest(model=fresh, optimizer=fopt) == 1
            assert _same(fresh, _copy(m))
            cp.close()


def test_a_model_on_the_meta_device_is_refused_until_it_has_memory(url: str) -> None:
    m, opt = _trained()
    _saved_to = ckpt.Checkpointer(url)
    _saved_to.save(1, model=m, optimizer=opt).wait()
    with torch.device("meta"):
        deferred = _net(4, 4, 2)
    cp = ckpt.Checkpointer(url)
    with pytest.raises(ckpt.InvalidInputError, match=r"'model.0.weight' is on the meta device"):
        cp.load_latest(model=deferred)  # (it returned 1 with nothing restored)
    deferred.to_empty(device="cpu")
    fopt = torch.optim.AdamW(deferred.parameters(), lr=0.1)
    assert cp.load_latest(model=deferred, optimizer=fopt) == 1
    assert _same(deferred, _copy(m))
