"""The `ckpt` command installed with the Python package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import ckpt
import ckpt.cli

from conftest import PYTHON, python_env


def saved(url: str) -> None:
    cp = ckpt.Checkpointer(url)
    cp.save(4, model=torch.nn.Linear(2, 2))
    cp.wait()


def test_console_script_is_on_path_next_to_python(url: str) -> None:
    saved(url)
    exe = shutil.which("ckpt", path=os.path.dirname(sys.executable))
    assert exe is not None, "pip install did not put a ckpt command next to python"
    env = python_env()
    env.pop("LD_LIBRARY_PATH", None)
    out = subprocess.run([exe, "list", url, "--json"], capture_output=True, text=True, env=env, check=True)
    rows = json.loads(out.stdout)
    assert [(r["step"], r["status"], r["format"]) for r in rows] == [(4, "committed", "native")]


def test_python_m_ckpt_runs_the_same_command(url: str, tmp_path: Path) -> None:
    saved(url)
    out = tmp_path / "m.safetensors"
    run = subprocess.run(
        [PYTHON, "-m", "ckpt", "export", url, str(out), "--entry", "model"],
        capture_output=True,
        text=True,
        env=python_env(),
    )
    assert run.returncode == 0, run.stderr
    assert out.exists() and "2 tensors of `model`" in run.stdout
    bad = subprocess.run([PYTHON, "-m", "ckpt", "list"], capture_output=True, text=True, env=python_env())
    assert bad.returncode == 2 and "URL" in bad.stderr


def test_main_returns_the_status_when_given_arguments(url: str, capfd) -> None:
    saved(url)
    assert ckpt.cli.main(["verify", url]) == 0
    assert "step 4" in capfd.readouterr().out
    assert ckpt.cli.main(["verify", url, "--step", "99"]) == 2
