"""Ctrl-C interrupts a long wait (the GIL is released, signals are polled)."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time

from conftest import PYTHON, python_env

SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    import numpy as np
    import ckpt

    # A runner that starts the suite in the background (no job control) leaves
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    cp = ckpt.Checkpointer(sys.argv[1], compression="zstd", level=22, rng=False)
    noise = np.random.default_rng(0).integers(0, 256, size=96 << 20, dtype=np.uint8)
    h = cp.save(1, noise=noise)
    print("waiting", flush=True)
    t = time.monotonic()
    try:
        h.wait()
        print("finished", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted done={h.done()} after {time.monotonic() - t:.2f}", flush=True)
    """
)


def test_ctrl_c_interrupts_wait(url: str) -> None:
    proc = subprocess.Popen(
        [PYTHON, "-c", SCRIPT, url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=python_env()
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "waiting"
    time.sleep(1.0)  # let it enter wait()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.startswith("interrupted done=False"), out
