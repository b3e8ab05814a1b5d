"""HDF5 checkpoints from Python, browsed with h5py (groups mirror the nesting)."""

from __future__ import annotations

from pathlib import Path

import h5py
import torch

import ckpt

from test_roundtrip import trained


def test_hdf5_checkpoint_round_trips_and_h5py_browses_it(url: str, root: Path) -> None:
    net, opt = trained()
    cp = ckpt.Checkpointer(url, format="hdf5")
    cp.save(3, model=net, optimizer=opt, extra={"epoch": 1})
    cp.wait()
    fresh, fresh_opt = trained(seed=1, steps=1)
    assert ckpt.Checkpointer(url).load_latest(model=fresh, optimizer=fresh_opt) == 3
    for k, v in net.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k

    (f,) = root.glob("data/*/model-rank00000.h5")
    with h5py.File(f, "r") as h5:
        # Groups mirror the state: one per entry, the state-dict keys as datasets.
        assert set(h5["model"]) == set(net.state_dict())
        w = h5["model"]["fc.weight"][()]
        assert torch.equal(torch.from_numpy(w), net.fc.weight.detach())
        assert h5["model/low"].attrs["ckpt_dtype"] == "BF16"
        assert "state.0.exp_avg" in h5["optimizer"]
