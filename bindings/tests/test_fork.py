"""Fork safety: a child (e.g. a DataLoader worker) gets its own runtime."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import ckpt


def _child(fn) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_child_after_fork_builds_its_own_runtime(url: str, tmp_path) -> None:
    parent = ckpt.Checkpointer(url, rng=False)
    parent.save(1, w=torch.ones(3)).wait()  # the runtime's threads exist now
    child_url = (tmp_path / "child").as_uri()

    def in_child() -> int:
        # The parent's checkpointer refuses to run in the child, with a clear error...
        try:
            parent.save(2, w=torch.ones(3))
            return 3
        except ckpt.InvalidInputError as e:
            if "before a fork" not in str(e):
                return 4
        # ...and a new one works (a fresh runtime).
        cp = ckpt.Checkpointer(child_url, rng=False)
        cp.save(5, w=torch.full((3,), 5.0)).wait()
        if not torch.equal(cp.read(5).state["w"], torch.full((3,), 5.0)):
            return 5
        if ckpt.Checkpointer(url, rng=False).read(1).state["w"].sum().item() != 3.0:
            return 6
        return 0

    assert _child(in_child) == 0
    # The parent is unaffected.
    parent.save(2, w=torch.zeros(3)).wait()
    assert parent.steps() == [1, 2]
    assert ckpt.Checkpointer(child_url).steps() == [5]


class Reads(Dataset):
    """Each item reads a checkpoint in the worker process."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return ckpt.Checkpointer(self.url, rng=False).read(1).state["w"] * i


def test_dataloader_workers_use_ckpt(url: str) -> None:
    cp = ckpt.Checkpointer(url, rng=False)
    cp.save(1, w=torch.arange(3.0)).wait()
    loader = DataLoader(Reads(url), batch_size=2, num_workers=2, multiprocessing_context="fork")
    batches = list(loader)
    assert torch.equal(torch.cat(batches), torch.stack([torch.arange(3.0) * i for i in range(4)]))
