"""Background work yields to training: the engine's threads run at a lower
priority than the caller, as batch work, and the CPU budget is a process-wide
setting."""

import os
import sys

import numpy as np
import pytest

import ckpt


def _nice(tid: int) -> int:
    # Field 19 of /proc/<pid>/task/<tid>/stat is the nice value.
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def _threads(name: str):
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip().startswith(name):
                yield int(tid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities are read from /proc")
def test_the_engine_threads_run_below_the_caller(tmp_path):
    cp = ckpt.Checkpointer(f"file://{tmp_path}")
    cp.save(1, {"w": np.arange(1 << 16, dtype=np.float32)}).wait()
    mine = _nice(_main_tid())
    engine = list(_threads("ckpt-io"))
    assert engine, "no engine thread found"
    lowered_by = int(os.environ.get("CKPT_BACKGROUND_NICE", "10"))
    expected = min(mine + lowered_by, 19)
    assert all(_nice(t) == expected for t in engine), [(_nice(t), t) for t in engine]
    # Batch work: waking one never preempts the thread that called save.
    policy = os.SCHED_BATCH if lowered_by > 0 else os.SCHED_OTHER
    assert all(os.sched_getscheduler(t) == policy for t in engine), [
        (os.sched_getscheduler(t), t) for t in engine
    ]
    # The caller itself was not touched.
    assert _nice(_main_tid()) == mine
    assert os.sched_getscheduler(_main_tid()) == os.SCHED_OTHER


def _main_tid() -> int:
    import threading

    return threading.get_native_id()


def test_the_cpu_budget_is_set_for_the_process(tmp_path):
    before = ckpt.cpu_threads()
    assert before >= 1
    try:
        assert ckpt.set_cpu_threads(1) == before
        assert ckpt.cpu_threads() == 1
        # Saves and loads still complete, one CPU job at a time.
        cp = ckpt.Checkpointer(f"file://{tmp_path}", compression="zstd")
        data = np.random.default_rng(0).standard_normal(1 << 14).astype(np.float32)
        cp.save(1, {"w": data}).wait()
        got = cp.read_latest()
        assert np.array_equal(got.state["w"], data)
        assert ckpt.set_cpu_threads(0) == 1  # 0 means at least one
        assert ckpt.cpu_threads() == 1
    finally:
        ckpt.set_cpu_threads(before)
