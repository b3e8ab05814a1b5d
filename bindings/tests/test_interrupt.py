"""Ctrl-C interrupts a long wait (the GIL is released, signals are polled),
and the wait for saves in progress at exit."""

from __future__ import annotations

import signal
import subprocess
import textwrap
import time

import ckpt
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
        [PYTHON, "-c", SCRIPT, url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=python_env()
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "waiting"
    time.sleep(1.0)  # let it enter wait()
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().startswith("interrupted done=False")
    # The script ends; at exit ckpt finishes the save still in progress
    # (ckpt._runtime.exit), says so once it takes a while, and a second Ctrl-C abandons it.
    note = proc.stdout.readline()
    assert note.startswith("ckpt: finishing 1 save still in progress before exiting (Ctrl-C abandons)"), note
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "ckpt: exit: abandoned 1 save in progress; the last committed checkpoint is intact" in out, out
    assert ckpt.Checkpointer(url, rng=False).steps() == []
