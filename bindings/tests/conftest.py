"""Shared fixtures of the ckpt Python tests (real PyTorch, real files, no mocks)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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


def python_env() -> dict:
    """Environment for child Python processes (the same interpreter and ckpt)."""
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    env["OMP_NUM_THREADS"] = "1"
    return env


PYTHON = sys.executable
