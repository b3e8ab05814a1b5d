"""Resume after SIGKILL at random instants gives bitwise the same final weights.

The training process is the example script (a small CNN, seeded, deterministic
CPU kernels). It is killed at seeded random instants, some of them right after
it announced a save (so the kill lands while the save is snapshotting or
persisting), restarted each time, and finally allowed to finish. Its final
model and optimizer state must hash the same as an uninterrupted run's.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

from conftest import PYTHON, REPO, python_env

SCRIPT = REPO / "examples" / "python" / "train_cnn.py"
ARGS = ["--steps", "80", "--every", "8", "--batch", "16", "--keep-last", "2"]


def run(url: str, digest: Path, extra: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, str(SCRIPT), "--ckpt", url, "--digest", str(digest), *ARGS, *extra],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=300,
    )


def kill_at_random(
    url: str, digest: Path, extra: list[str], rng: random.Random, during_save: bool
) -> tuple[bool, str]:
    """Start a run and SIGKILL it; returns (finished before the kill, first line)."""
    proc = subprocess.Popen(
        [PYTHON, str(SCRIPT), "--ckpt", url, "--digest", str(digest), *ARGS, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=python_env(),
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    try:
        if during_save:
            # Kill shortly after the n-th save of this run started.
            n = rng.randint(1, 3)
            seen = 0
            for line in proc.stdout:
                if line.startswith("save "):
                    seen += 1
                    if seen == n:
                        time.sleep(rng.uniform(0.0, 0.02))
                        break
        else:
            # Kill at a random instant after training started.
            time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is not None:
            return proc.returncode == 0, first
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        return False, first
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_resume_after_sigkill_is_bitwise_identical(tmp_path: Path) -> None:
    # The uninterrupted reference runs alongside the crashing runs.
    ref_digest = tmp_path / "ref.txt"
    ref = subprocess.Popen(
        [PYTHON, str(SCRIPT), "--ckpt", (tmp_path / "ref").as_uri(), "--digest", str(ref_digest), *ARGS],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(),
    )

    rng = random.Random(1234)
    url = (tmp_path / "crashy").as_uri()
    digest = tmp_path / "crashy.txt"
    # Eager and lazy snapshots alternate between restarts: both must resume exactly,
    # and a checkpoint written in one mode restores in the other.
    plan = [([], False), (["--lazy"], True), ([], True), (["--lazy"], False)]
    kills, starts = 0, []
    for extra, during_save in plan:
        finished, first = kill_at_random(url, digest, extra, rng, during_save)
        starts.append(first.strip())
        if finished:
            break
        kills += 1
    final = run(url, digest, ["--lazy"])
    assert final.returncode == 0, final.stderr
    starts.append(final.stdout.splitlines()[0])
    assert kills >= 1, "the run was never killed: the test proves nothing"
    assert any(s.startswith("resumed at step") for s in starts), f"no run resumed from a checkpoint: {starts}"

    _, ref_err = ref.communicate(timeout=300)
    assert ref.returncode == 0, ref_err
    assert digest.read_text() == ref_digest.read_text(), f"final state differs after {kills} kills ({starts})"
