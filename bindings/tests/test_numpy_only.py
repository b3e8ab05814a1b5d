"""ckpt works with numpy arrays alone, without importing torch."""

from __future__ import annotations

import subprocess
import textwrap

from conftest import PYTHON, python_env

SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    import ckpt

    url = sys.argv[1]
    cp = ckpt.Checkpointer(url, keep_last=2)
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = {"w": w, "ids": np.array([1, 2, 3], dtype=np.int64), "cfg": {"lr": 0.1, "dims": (3, 4)}}
    np.random.seed(3)
    cp.save(7, state).wait()
    want_draw = np.random.rand()

    w[:] = 0
    np.random.rand(10)
    assert cp.load_latest(state) == 7
    assert (w == np.arange(12, dtype=np.float32).reshape(3, 4)).all(), "restored in place"
    assert np.random.rand() == want_draw, "numpy RNG restored"
    back = ckpt.Checkpointer(url).read_latest()
    assert isinstance(back.state["ids"], np.ndarray) and back.state["ids"].dtype == np.int64
    assert back.state["cfg"] == {"lr": 0.1, "dims": (3, 4)}
    assert "torch" not in sys.modules, "torch was imported"
    print("ok")
    """
)


def test_numpy_without_torch(url: str) -> None:
    out = subprocess.run(
        [PYTHON, "-c", SCRIPT, url], capture_output=True, text=True, env=python_env(), timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
