"""An optimizer restored in place: its groups, hyperparameters and state as
torch's own load_state_dict would leave them (ckpt hands it the groups' ids
with a set lookup, so that the load is not quadratic in the parameters)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import torch
from torch import nn

import ckpt
from ckpt._restore.plan import _Ids, _indexed_groups


def job() -> "tuple[nn.Module, torch.optim.Optimizer]":
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if p.ndim != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-3)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 6, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def flat(opt: torch.optim.Optimizer) -> Dict[str, Any]:
    sd = opt.state_dict()
    out: Dict[str, Any] = {f"group{i}.{k}": v for i, g in enumerate(sd["param_groups"]) for k, v in g.items()}
    for pid, s in sd["state"].items():
        out.update({f"state{pid}.{k}": v.clone() for k, v in s.items()})
    return out


def same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def test_an_optimizer_comes_back_as_torchs_load_would_leave_it(tmp_path: Path) -> None:
    model, opt = job()
    for seed in range(3):
        train(model, opt, seed)
    opt.param_groups[1]["lr"] = 7e-4  # (a scheduler's doing)
    cp = ckpt.Checkpointer(tmp_path.as_uri(), coordinate="none", rng=False)
    cp.save(3, model=model, optimizer=opt).wait()
    saved = flat(opt)
    stored = cp.read(3).state

    # ckpt's restore, and torch's own load of the same state into a twin.
    model2, opt2 = job()
    train(model2, opt2, 99)
    assert not same(flat(opt2), saved)
    assert cp.load_latest(model=model2, optimizer=opt2) == 3
    model3, opt3 = job()
    train(model3, opt3, 99)
    model3.load_state_dict(stored["model"])
    opt3.load_state_dict(stored["optimizer"])
    assert same(flat(opt2), saved) and same(flat(opt3), saved)
    for g, live in zip(opt2.param_groups, [list(g["params"]) for g in job()[1].param_groups]):
        assert type(g["params"]) is list and len(g["params"]) == len(live)
    assert sorted(id(p) for g in opt2.param_groups for p in g["params"]) == sorted(map(id, model2.parameters()))
    assert all(p in opt2.state for p in model2.parameters())
    # It trains on as the twin does.
    train(model2, opt2, 5)
    train(model3, opt3, 5)
    assert same(flat(opt2), flat(opt3))
    cp.close()


def test_the_ids_answer_in_as_the_list_does() -> None:
    ids = _Ids([3, 1, 4, 1, 5])
    assert list(ids) == [3, 1, 4, 1, 5] and len(ids) == 5
    assert all(x in ids for x in (1, 3, 4, 5)) and 2 not in ids and "3" not in ids and [1] not in ids
    import copy

    deep = copy.deepcopy(ids)
    assert list(deep) == list(ids) and 4 in deep and 9 not in deep
    # Only torch's layout is touched, and unhashable ids are left as they are.
    assert _indexed_groups({"state": {}}) == {"state": {}}
    odd = {"param_groups": [{"params": [[1], [2]]}]}
    assert _indexed_groups(odd) is odd
    made = _indexed_groups({"state": {}, "param_groups": [{"params": [0, 1], "lr": 1.0}]})
    assert type(made["param_groups"][0]["params"]) is _Ids and made["param_groups"][0]["lr"] == 1.0
