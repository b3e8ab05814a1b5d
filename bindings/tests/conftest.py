"""Shared fixtures of the ckpt Python tests (real PyTorch, real files, no mocks)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator, List

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(tmp_path: Path) -> str:
    """A fresh checkpoint root on local disk."""
    return (tmp_path / "ckpts").as_uri()


@pytest.fixture
def root(url: str) -> Path:
    """The directory behind ``url``."""
    return Path(url[len("file://") :])


@pytest.fixture
def shm() -> Iterator[Path]:
    """A memory-tier root on /dev/shm for this test only, removed afterwards."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    d = base / f"ckpt-test-{uuid.uuid4().hex[:12]}"
    d.mkdir()
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def full_disk(tmp_path: Path):
    """A real 4 MiB tmpfs (needs mount privileges; skipped without them)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def walks(monkeypatch: pytest.MonkeyPatch) -> List[int]:
    """One entry per walk of a saved state (``Checkpointer`` flattening it)."""
    import ckpt.checkpointer as cpm

    out: List[int] = []
    real = cpm.flatten

    def flatten(*args: Any, **kwargs: Any) -> Any:
        out.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpm, "flatten", flatten)
    return out


@pytest.fixture
def cpu_device(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The tests' device in use (``cpu_device.CpuDevice``): CPU tensors take
    the device path, and its copy calls are counted (``calls["copies"]``).
    So are the slots handed out after the walk (``calls["into_slots"]``):
    no device sees those, so the checkpointer's ``_into_slots`` is wrapped."""
    import ckpt.checkpointer as cpm
    from ckpt._device.device import using
    from cpu_device import CpuDevice

    device = CpuDevice()
    real_into = cpm._into_slots

    def into_slots(tensors: Any, slots: List[Any]) -> Any:
        device.calls["into_slots"].append(len(slots))
        return real_into(tensors, slots)

    monkeypatch.setattr(cpm, "_into_slots", into_slots)
    with using(device):
        yield device


def record_results(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> List[Any]:
    """What each call of ``module.name`` returns, in order, from now on."""
    out: List[Any] = []
    real = getattr(module, name)

    def recorded(*args: Any) -> Any:
        r = real(*args)
        out.append(r)
        return r

    monkeypatch.setattr(module, name, recorded)
    return out


@pytest.fixture
def bulk(monkeypatch: pytest.MonkeyPatch) -> List[bool]:
    """One entry per mapping a save's walk tried to take in bulk from its plan
    (:mod:`ckpt._save.repeat`): whether it did."""
    import ckpt._save.repeat as rp

    return record_results(monkeypatch, rp, "_emit")


@pytest.fixture
def host_bulk(monkeypatch: pytest.MonkeyPatch) -> List[bool]:
    """The same for mappings of CPU tensors (:mod:`ckpt._save.repeat_host`)."""
    import ckpt._save.repeat_host as rh

    return record_results(monkeypatch, rh, "emit")


def python_env() -> dict:
    """Environment for child Python processes (the same interpreter and ckpt)."""
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    env["OMP_NUM_THREADS"] = "1"
    return env


PYTHON = sys.executable


@contextlib.contextmanager
def logged(match: str) -> Iterator[List[str]]:
    """The messages logger ``"ckpt"`` gives at ``WARNING`` and above inside
    the block; exactly one, matching ``match`` (a regular expression)."""
    got: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record.getMessage())

    log = logging.getLogger("ckpt")
    handler = Keep(logging.WARNING)
    log.addHandler(handler)
    try:
        yield got
    finally:
        log.removeHandler(handler)
    assert len(got) == 1 and re.search(match, got[0]), (match, got)
