"""What a process that exits without waiting leaves (ckpt._runtime.exit): the saves it
started are committed, a failed one is said on stderr, and no ckpt thread is
still running when the interpreter finalizes."""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

import ckpt
from conftest import PYTHON, python_env

# A save that takes about a second and a half here (8 MiB of noise through
# zstd at level 19), far longer than the interpreter's finalization: without
# the wait at exit, the process ends in the middle of it.
SLOW_SAVE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import ckpt

    url, lazy, scope = sys.argv[1], sys.argv[2] == "lazy", sys.argv[3]
    noise = np.random.default_rng(7).integers(0, 256, size=8 << 20, dtype=np.uint8)

    def save():
        cp = ckpt.Checkpointer(url, compression="zstd", level=19, lazy=lazy, rng=False)
        cp.save(3, noise=noise, extra={"why": "exit"})
        return cp

    if scope == "function":
        save()  # the checkpointer is collected before the interpreter exits
    else:
        kept = save()
    print("leaving", flush=True)
    """
)


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", *args], capture_output=True, text=True, env=python_env(), timeout=timeout)


@pytest.mark.parametrize("lazy", ["eager", "lazy"])
@pytest.mark.parametrize("scope", ["function", "module"])
def test_a_save_not_waited_for_is_committed_at_exit(url: str, lazy: str, scope: str) -> None:
    r = _run(SLOW_SAVE, url, lazy, scope)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "leaving"
    cp = ckpt.Checkpointer(url, rng=False)
    assert cp.steps() == [3], r.stderr
    got = cp.read_latest()
    want = np.random.default_rng(7).integers(0, 256, size=8 << 20, dtype=np.uint8)
    assert np.array_equal(np.asarray(got.state["noise"]), want)
    assert got.state["extra"] == {"why": "exit"}


def test_a_save_that_fails_after_the_script_ends_is_said_on_stderr(full_disk: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import ckpt

        cp = ckpt.Checkpointer(sys.argv[1], rng=False)
        cp.save(1, w=np.ones(1024, dtype=np.float32)).wait()
        cp.save(2, w=np.random.default_rng(0).random(4 << 20, dtype=np.float32))  # 16 MiB onto 4 MiB
        """
    )
    r = _run(script, full_disk.as_uri())
    assert r.returncode == 0, r.stderr
    assert "ckpt: the save of step 2 failed: StorageError" in r.stderr, r.stderr
    assert ckpt.Checkpointer(full_disk.as_uri(), rng=False).steps() == [1]


def test_no_ckpt_thread_runs_after_exit_after_a_restore(url: str) -> None:
    """A restore readies the first save's staging memory on a thread of its
    own, which holds the state's tensors; a process that exits at once used
    to finalize with it running, and aborted when it let go of a tensor
    (about once in 20 runs). The script's own exit hook, registered before
    ckpt's and so run after it, looks for it."""
    script = textwrap.dedent(
        """
        import atexit, sys, threading

        def after_ckpt():
            alive = [t.name for t in threading.enumerate() if t.name.startswith("ckpt-") and t.is_alive()]
            print("alive:", ",".join(alive) or "none", flush=True)

        atexit.register(after_ckpt)

        import torch
        import ckpt

        state = {f"t{i}": torch.randn(8 << 20) for i in range(8)}  # 256 MiB to ready
        cp = ckpt.Checkpointer(sys.argv[1], rng=False)
        if sys.argv[2] == "save":
            cp.save(1, state).wait()
        else:
            assert cp.load_latest(state) == 1
            assert cp._readying is not None and cp._readying.is_alive(), "(the exit has something to wait for)"
        """
    )
    assert _run(script, url, "save").returncode == 0
    r = _run(script, url, "load")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "alive: none", r.stdout


def test_the_memory_tier_finishes_at_exit(tmp_path: Path, shm: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import ckpt

        cp = ckpt.MemoryCheckpointer(sys.argv[1], memory_dir=sys.argv[2], durable_every=1, coordinate="none")
        cp.save(5, w=np.arange(1 << 20, dtype=np.float32))
        """
    )
    durable = (tmp_path / "durable").as_uri()
    r = _run(script, durable, str(shm / "node{node}"))
    assert r.returncode == 0, r.stderr
    assert ckpt.Checkpointer(durable, rng=False).steps() == [5]
    again = ckpt.MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none")
    w = np.zeros(1 << 20, dtype=np.float32)
    assert again.load_latest(w=w) == 5
    assert again.last_source == "memory"
    assert np.array_equal(w, np.arange(1 << 20, dtype=np.float32))
    again.close()


def test_a_process_group_destroyed_under_a_save_is_a_typed_error_said_at_exit(tmp_path: Path) -> None:
    """A script that destroys torch.distributed's process group while its save
    is still being coordinated (no wait before ``destroy_process_group``):
    the save fails with a typed error that says what to do, said at exit on
    every rank, and the job ends (no hang, no dead-peer timeout)."""
    from test_distributed import free_port

    script = textwrap.dedent(
        """
        import sys
        import torch
        import torch.distributed as dist
        import ckpt

        dist.init_process_group("gloo")
        m = torch.nn.Linear(1024, 1024)
        cp = ckpt.Checkpointer(sys.argv[1], compression="zstd", level=19, rng=False)
        cp.save(1, model=m)  # (about a second of compression: still in flight below)
        dist.destroy_process_group()
        """
    )
    port = str(free_port())
    procs = []
    for r in range(2):
        env = python_env()
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([PYTHON, "-c", script, (tmp_path / "root").as_uri()], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        # A rank that finds its own group gone says what to do. A rank whose
        # peer destroyed its group while a collective between them was in
        # flight (a race of the two ranks' timing) sees that peer leave, and
        # says so as the typed timeout of a peer that stopped taking part.
        if "ckpt: the save of step 1 failed: InvalidInputError" in err:
            assert "before destroy_process_group()" in err, err
        else:
            # Named (StragglerError) when the roll call found the peer gone.
            assert re.search(r"ckpt: the save of step 1 failed: (CheckpointTimeoutError|StragglerError)", err), err
            assert "taking part" in err, err


# A job stopped by its scheduler (SIGTERM, then SIGKILL after a grace period)
# in the middle of a lazy save.
PREEMPTED = textwrap.dedent(
    """
    import signal, sys, time
    import numpy as np
    import ckpt

    url, handled = sys.argv[1], sys.argv[2] == "handled"
    if handled:  # the recipe of bindings/README.md, "At exit"
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    noise = np.random.default_rng(7).integers(0, 256, size=8 << 20, dtype=np.uint8)
    cp = ckpt.Checkpointer(url, compression="zstd", level=19, lazy=True, rng=False)
    cp.save(5, noise=noise)
    print("saving", flush=True)
    while True:
        time.sleep(0.01)  # training
    """
)


@pytest.mark.parametrize("handled", ["handled", "default"])
def test_a_preempted_job_keeps_its_save_when_sigterm_is_made_an_exit(url: str, handled: str) -> None:
    """By default SIGTERM ends the process at once, with the save half
    written (the last committed checkpoint stays whole); turned into
    ``SystemExit`` by a handler, the exit finishes the save first."""
    p = subprocess.Popen([PYTHON, "-c", PREEMPTED, url, handled], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=python_env())
    assert p.stdout is not None and p.stdout.readline().strip() == "saving"
    p.terminate()
    _, err = p.communicate(timeout=120)
    cp = ckpt.Checkpointer(url, rng=False)
    if handled == "default":
        assert p.returncode == -15, err
        assert cp.steps() == []
        return
    assert p.returncode == 143, err
    assert cp.steps() == [5], err
    want = np.random.default_rng(7).integers(0, 256, size=8 << 20, dtype=np.uint8)
    assert np.array_equal(np.asarray(cp.read_latest().state["noise"]), want)
