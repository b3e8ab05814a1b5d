"""Distributed checkpoints from Python: real multi-process jobs, no mocks.

Ranks are separate processes (``dist_worker.py``) that rendezvous like torchrun
sets them up (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT) and train a
small DDP model over gloo; the MPI test runs the same worker under ``mpirun``
with mpi4py; the example runs under ``torchrun`` itself.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import pytest
import torch

import ckpt
from conftest import PYTHON, REPO, python_env

WORKER = str(Path(__file__).with_name("dist_worker.py"))
LIMIT = 120  # seconds for any one job (they take a few)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, args: List[str], timeout: float = LIMIT) -> List[subprocess.CompletedProcess]:
    """Start ``world`` ranks of dist_worker.py with a torchrun-style environment; wait for all."""
    port = str(free_port())
    procs = []
    for r in range(world):
        env = python_env()
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if world == 1:
            env.pop("WORLD_SIZE")
        procs.append(
            subprocess.Popen([PYTHON, WORKER, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    deadline = time.monotonic() + timeout
    done = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"a rank did not finish within {timeout} s (hang?)")
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    return done


def rows(out: Path, world: int) -> List[Dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def ok(procs: List[subprocess.CompletedProcess]) -> None:
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{p.stdout}"


def chunk_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in (root / "chunks").iterdir())


def fresh_draws(seed: int) -> list:
    """What dist_worker's draws() gives right after seed_all(seed)."""
    g = torch.Generator().manual_seed(seed)
    return [
        struct.pack("<d", random.Random(seed).random()).hex(),
        struct.pack("<d", float(np.random.RandomState(seed).rand())).hex(),
        torch.rand(3, generator=g).view(torch.int32).tolist(),
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Dict:
    """Two DDP ranks train 5 steps and checkpoint at steps 2 and 4."""
    base = tmp_path_factory.mktemp("ddp2")
    root, out = base / "ckpts", base / "out"
    out.mkdir()
    ok(launch(2, ["train", root.as_uri(), str(out), "--steps", "5", "--save-at", "2,4"]))
    return {"root": root, "url": root.as_uri(), "rows": rows(out, 2)}


def test_two_ranks_make_one_checkpoint_with_replicas_stored_once(trained: Dict) -> None:
    r0, r1 = trained["rows"]
    root = trained["root"]
    for step in ("2", "4"):
        # DDP kept the replicas identical, bit for bit.
        assert r0["saves"][step]["digest"] == r1["saves"][step]["digest"]
    # One logical checkpoint per step, not one per rank.
    cp = ckpt.Checkpointer(trained["url"], coordinate="none")
    assert cp.steps() == [2, 4]
    assert len(list((root / "manifests").iterdir())) == 2
    assert cp.read(4).state["extra"] == {"step": 4, "world": 2}

    state = r0["saves"]["4"]["state_bytes"]  # model + Adam state of one replica
    written = [r0["saves"]["4"]["raw_bytes"], r1["saves"]["4"]["raw_bytes"]]
    rng = sum(written) - state
    # The ranks together wrote one copy plus each rank's own RNG state
    # (a few KiB + the Python generator's 625 words).
    assert 0 < rng < 2 * 64 * 1024, (written, state)
    # ... and each wrote a fair share of it.
    assert min(written) > 0.3 * state, written
    # On disk: two checkpoints of one copy each, not two of world_size copies.
    # (Each chunk object carries a header of STAGING_LEAD bytes.)
    on_disk = chunk_bytes(root)
    headers = ckpt._ckpt.STAGING_LEAD * len(list((root / "chunks").iterdir()))
    assert 1.8 * state < on_disk <= 2 * state + 2 * rng + headers, (on_disk, state)
    print(f"\n2 ranks: state {state} B per replica; written per rank {written}; chunks/ {on_disk} B for 2 checkpoints")


def test_loads_bitwise_into_one_process(trained: Dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ok(launch(1, ["load", trained["url"], str(out)]))
    (row,) = rows(out, 1)
    r0 = trained["rows"][0]
    assert (row["step"], row["cp_world"]) == (4, 1)
    assert row["digest"] == r0["saves"]["4"]["digest"]
    assert row["draws"] == r0["draws"]  # rank 0's own generators, restored
    assert row["warnings"] == []


def test_loads_bitwise_into_three_processes(trained: Dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    ok(launch(3, ["load", trained["url"], str(out)]))
    got = rows(out, 3)
    saved = trained["rows"]
    for r, row in enumerate(got):
        assert (row["step"], row["cp_world"]) == (4, 3)
        assert row["digest"] == saved[0]["saves"]["4"]["digest"]
    # Ranks 0 and 1 continue their own random streams; rank 2 had none saved:
    # it keeps the generators it had (seeded 1000 + rank) and says so.
    assert got[0]["draws"] == saved[0]["draws"]
    assert got[1]["draws"] == saved[1]["draws"]
    assert got[0]["draws"] != got[1]["draws"]
    assert got[2]["draws"] == fresh_draws(1002)
    assert got[0]["warnings"] == got[1]["warnings"] == []
    assert len(got[2]["warnings"]) == 1 and "no RNG state for rank 2" in got[2]["warnings"][0]


def test_two_ranks_roll_back_and_a_restart_resumes_the_new_run(tmp_path: Path) -> None:
    """Two DDP ranks go back to step 2 after saving 2, 3 and 4 (a loss spike),
    discard 3 and 4, and train on other batches, saving 3 and 4 again. A save
    before the discard is refused on both ranks; a restart resumes from the
    new step 4, bitwise, not from the run left behind."""
    root, out = tmp_path / "ckpts", tmp_path / "out"
    for d in (out / "train", out / "back", out / "load"):
        d.mkdir(parents=True)
    url = root.as_uri()
    ok(launch(2, ["train", url, str(out / "train"), "--steps", "5", "--save-at", "2,3,4"]))
    old = rows(out / "train", 2)
    ok(launch(2, ["rollback", url, str(out / "back"), "--back", "2", "--steps", "5", "--save-at", "3,4", "--shift", "50"]))
    back = rows(out / "back", 2)
    for r in back:
        assert r["loaded"] == old[0]["saves"]["2"]["digest"]
        assert r["refused"] is not None and "discard_after" in r["refused"], r["refused"]
        assert r["steps"] == [2, 3, 4]
    assert back[0]["discarded"] == [3, 4] and back[1]["discarded"] == []
    assert back[0]["saves"]["4"] == back[1]["saves"]["4"]
    assert back[0]["saves"]["4"]["digest"] != old[0]["saves"]["4"]["digest"]  # other batches
    ok(launch(2, ["load", url, str(out / "load")]))
    for r in rows(out / "load", 2):
        assert (r["step"], r["digest"]) == (4, back[0]["saves"]["4"]["digest"])
        assert r["warnings"] == []


def test_a_rank_that_dies_mid_save_leaves_the_previous_checkpoint_and_nobody_hangs(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpts", tmp_path / "out"
    out.mkdir()
    timeout = 3.0
    t0 = time.monotonic()
    procs = launch(
        3,
        ["train", root.as_uri(), str(out), "--save-at", "2,4", "--die-rank", "1", "--die-at", "4"]
        + ["--timeout", str(timeout)],
    )
    elapsed = time.monotonic() - t0
    assert procs[1].returncode == 3, procs[1].stdout  # os._exit inside the save of step 4
    assert not (out / "rank1.json").exists()
    for r in (0, 2):
        assert procs[r].returncode == 0, procs[r].stdout
        row = json.loads((out / f"rank{r}.json").read_text())
        # The typed error naming the dead rank, within the deadline (a closed
        # connection may say so sooner).
        assert row["error"] == "StragglerError", row
        assert row["ranks"] == [1], row
        assert row["wait_s"] < timeout + 10, row
        assert row["latest_after_failure"] == 2, row
    assert ckpt.Checkpointer(root.as_uri(), coordinate="none").steps() == [2]
    assert elapsed < LIMIT


def test_a_rank_busy_elsewhere_at_a_save_is_named_on_every_other_rank_within_the_timeout(tmp_path: Path) -> None:
    root, out = tmp_path / "ckpts", tmp_path / "out"
    out.mkdir()
    timeout = 4.0
    args = ["train", root.as_uri(), str(out), "--save-at", "2,4", "--timeout", str(timeout)]
    procs = launch(3, args + ["--busy-rank", "2", "--busy-at", "4", "--busy-s", str(timeout + 6)])
    ok(procs)
    for r in (0, 1):
        row = json.loads((out / f"rank{r}.json").read_text())
        assert row["error"] == "StragglerError", row
        assert row["ranks"] == [2], row
        assert "save of step 4" in row["message"], row
        assert row["wait_s"] < timeout + 2, row
        assert row["latest_after_failure"] == 2, row


def test_a_rank_that_does_not_come_to_a_load_is_named_on_every_other_rank(trained: Dict, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    timeout = 4.0
    procs = launch(3, ["load", trained["url"], str(out), "--timeout", str(timeout), "--busy-rank", "0", "--busy-s", "10"])
    ok(procs)
    for r in (1, 2):
        row = json.loads((out / f"rank{r}.json").read_text())
        assert row["error"] == "StragglerError", row
        assert row["ranks"] == [0], row
        assert row["wait_s"] < timeout + 2, row


def have_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mpirun") is not None


@pytest.mark.skipif(not have_mpi4py(), reason="needs mpi4py and mpirun")
def test_mpi4py_under_mpirun(tmp_path: Path) -> None:
    root, out, out1 = tmp_path / "ckpts", tmp_path / "out", tmp_path / "out1"
    out.mkdir()
    out1.mkdir()
    env = python_env()
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = ["mpirun", "--oversubscribe", "-np", "2", "--mca", "btl", "self,vader"]
    cmd += ["--mca", "btl_vader_single_copy_mechanism", "none", PYTHON, WORKER]
    cmd += ["train", root.as_uri(), str(out), "--mpi", "--steps", "3", "--save-at", "2"]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=LIMIT)
    assert p.returncode == 0, p.stdout
    r0, r1 = rows(out, 2)
    assert (r0["world"], r1["world"]) == (2, 2)
    assert r0["saves"]["2"]["digest"] == r1["saves"]["2"]["digest"]
    state = r0["saves"]["2"]["state_bytes"]
    written = r0["saves"]["2"]["raw_bytes"] + r1["saves"]["2"]["raw_bytes"]
    assert state < written < state + 2 * 64 * 1024  # one copy of the replicas in all
    assert chunk_bytes(root) < state + 2 * 64 * 1024
    # A plain single process (no mpirun) loads it bitwise, with rank 0's generators.
    ok(launch(1, ["load", root.as_uri(), str(out1)]))
    (row,) = rows(out1, 1)
    assert row["step"] == 2 and row["digest"] == r0["saves"]["2"]["digest"]
    assert row["draws"] == r0["draws"] != r1["draws"]


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(PYTHON).parent)) is None, reason="needs torchrun")
def test_cnn_example_under_torchrun_resumes_bitwise(tmp_path: Path) -> None:
    """The example, unchanged, under torchrun: a run stopped after its step-4
    checkpoint and restarted ends bitwise where an uninterrupted run ends."""
    torchrun = str(Path(PYTHON).parent / "torchrun")
    script = str(REPO / "examples/python/train_cnn.py")

    def run(url: str, steps: int, digest: Optional[Path] = None) -> str:
        cmd = [torchrun, "--standalone", "--nproc-per-node", "2", script, "--ckpt", url]
        cmd += ["--steps", str(steps), "--every", "4", "--batch", "8"]
        if digest is not None:
            cmd += ["--digest", str(digest)]
        p = subprocess.run(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=LIMIT)
        assert p.returncode == 0, p.stdout
        return p.stdout

    straight, resumed = tmp_path / "straight.sha", tmp_path / "resumed.sha"
    run((tmp_path / "a").as_uri(), 10, straight)
    first = run((tmp_path / "b").as_uri(), 6)  # as if killed after the step-4 checkpoint
    assert "save 4" in first
    second = run((tmp_path / "b").as_uri(), 10, resumed)
    assert "resumed at step 4" in second
    assert resumed.read_text() == straight.read_text()


# ---------------------------------------------------------------------------
# Coordinator objects in one process: the engine's collectives through a Python
# object, called on ckpt's own thread, with the deadline.


class Loopback:
    """A job of one rank, recording what the engine asks of it and from which thread."""

    rank = 0
    world_size = 1

    def __init__(self, delay: float = 0.0, fail: Optional[str] = None, reply: Optional[list] = None) -> None:
        self.calls: list = []
        self.threads: set = set()
        self.delay, self.fail, self.reply = delay, fail, reply

    def all_gather(self, data: bytes) -> list:
        import threading

        self.calls.append("all_gather")
        self.threads.add(threading.get_ident())
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError(self.fail)
        return self.reply if self.reply is not None else [data]

    def broadcast(self, data: bytes, root: int) -> bytes:
        self.calls.append(f"broadcast({root})")
        return data


def test_a_coordinator_object_is_called_on_a_thread_of_its_own(url: str) -> None:
    import threading

    coord = Loopback()
    cp = ckpt.Checkpointer(url, coordinate=coord)
    assert coord.calls == ["broadcast(0)"]  # the job nonce, agreed at creation
    assert (cp.rank, cp.world_size) == (0, 1)
    cp.save(1, w=torch.arange(6.0))
    cp.wait()
    # The plan's offers and reply, the commit's shares, the outcome; an object
    # without gather() is all-gathered instead.
    assert coord.calls == ["broadcast(0)", "all_gather", "broadcast(0)", "all_gather", "broadcast(0)"]
    assert threading.get_ident() not in coord.threads and len(coord.threads) == 1
    assert torch.equal(ckpt.Checkpointer(url, coordinate="none").read(1).state["w"], torch.arange(6.0))


class Gathering(Loopback):
    def gather(self, data: bytes, root: int) -> list:
        self.calls.append(f"gather({root})")
        return [data]


def test_a_coordinator_with_gather_is_gathered_to_rank_0_not_all_gathered(url: str) -> None:
    coord = Gathering()
    cp = ckpt.Checkpointer(url, coordinate=coord)
    cp.save(1, w=torch.arange(6.0))
    cp.wait()
    assert coord.calls == ["broadcast(0)", "gather(0)", "broadcast(0)", "gather(0)", "broadcast(0)"]
    assert torch.equal(ckpt.Checkpointer(url, coordinate="none").read(1).state["w"], torch.arange(6.0))


def test_a_failed_or_late_collective_fails_the_save_typed_and_breaks_the_coordinator(url: str) -> None:
    w = torch.ones(4)
    for coord, timeout in [(Loopback(fail="Connection closed by peer"), 30.0), (Loopback(delay=2.0), 0.3)]:
        cp = ckpt.Checkpointer(url, coordinate=coord, collective_timeout=timeout, rng=False)
        t0 = time.monotonic()
        with pytest.raises(ckpt.CheckpointTimeoutError):
            cp.save(1, w=w).wait()
        assert time.monotonic() - t0 < 1.5
        # Broken from now on: the next save fails at once, without calling it again.
        n = len(coord.calls)
        with pytest.raises(ckpt.CheckpointTimeoutError, match="broken"):
            cp.save(2, w=w).wait()
        assert len(coord.calls) == n
        assert ckpt.Checkpointer(url, coordinate="none").steps() == []


class ThreadJob:
    """Ranks of one job as threads of this process: the coordinator protocol
    (``all_gather``, ``broadcast``) over a barrier, so two real checkpointers
    of one root save together as ranks 0 and 1."""

    def __init__(self, world: int) -> None:
        import threading

        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list = [None] * world

    def member(self, rank: int) -> "ThreadRank":
        return ThreadRank(self, rank)


class ThreadRank:
    def __init__(self, job: ThreadJob, rank: int) -> None:
        self.job, self.rank, self.world_size = job, rank, job.world

    def all_gather(self, data: bytes) -> list:
        self.job.slots[self.rank] = bytes(data)
        self.job.barrier.wait()
        out = list(self.job.slots)
        self.job.barrier.wait()
        return out

    def broadcast(self, data: bytes, root: int) -> bytes:
        if self.rank == root:
            self.job.slots[root] = bytes(data)
        self.job.barrier.wait()
        out = self.job.slots[root]
        self.job.barrier.wait()
        return out


def save_as_ranks(url: str, states: list, step: int = 1) -> list:
    """Each rank (a thread) saves its state at ``step``; each one's outcome: None or the exception."""
    from concurrent.futures import ThreadPoolExecutor

    job = ThreadJob(len(states))

    def rank(r: int) -> Optional[BaseException]:
        cp = ckpt.Checkpointer(url, coordinate=job.member(r), rng=False, collective_timeout=60)
        try:
            cp.save(step, **states[r]).wait()
            return None
        except Exception as e:  # noqa: BLE001 - returned to the test
            return e
        finally:
            try:
                cp.close()
            except Exception:  # noqa: BLE001 - the save's failure, already returned
                pass

    with ThreadPoolExecutor(len(states)) as pool:
        return list(pool.map(rank, range(len(states))))


def test_ranks_that_save_different_metadata_fail_the_save_on_every_rank(url: str) -> None:
    w = torch.arange(4.0)
    # A rank's own plain value: only rank 0's would be stored, and rank 1 would load it.
    got = save_as_ranks(url, [{"w": w, "extra": {"rank": 0}}, {"w": w, "extra": {"rank": 1}}])
    assert all(isinstance(e, ckpt.InvalidInputError) for e in got), got
    assert "rank(s) [1] differs from rank 0's" in str(got[0]) and str(got[0]) == str(got[1])
    # Another tree of tensor names on rank 1: refused the same way.
    got = save_as_ranks(url, [{"w": w}, {"v": w}], step=2)
    assert all(isinstance(e, ckpt.InvalidInputError) for e in got), got
    assert ckpt.Checkpointer(url, coordinate="none").steps() == []
    # The same tree and values on both ranks: one checkpoint, loadable as saved.
    assert save_as_ranks(url, [{"w": w, "extra": {"epoch": 3}}] * 2, step=3) == [None, None]
    back = ckpt.Checkpointer(url, coordinate="none").read(3).state
    assert torch.equal(back["w"], w) and back["extra"] == {"epoch": 3}


def test_bad_coordination_arguments_are_typed_errors(url: str) -> None:
    with pytest.raises(ckpt.InvalidInputError, match="coordinate must be"):
        ckpt.Checkpointer(url, coordinate="nccl")
    with pytest.raises(ckpt.InvalidInputError, match="has no all_gather"):
        ckpt.Checkpointer(url, coordinate=object())
    with pytest.raises(ckpt.InvalidInputError, match="not initialised"):
        ckpt.Checkpointer(url, coordinate="torch")
    with pytest.raises(ckpt.InvalidInputError, match="collective_timeout"):
        ckpt.Checkpointer(url, collective_timeout=0)
    bad_rank = Loopback()
    bad_rank.rank = 1  # of a world of 1
    with pytest.raises(ckpt.InvalidInputError, match="rank 1 of world size 1"):
        ckpt.Checkpointer(url, coordinate=bad_rank)
    cp = ckpt.Checkpointer(url, coordinate=Loopback(reply=[b"{}", b"{}"]), rng=False)
    with pytest.raises(ckpt.InvalidInputError, match="returned 2 items in a job of 1 ranks"):
        cp.save(1, w=torch.ones(1)).wait()


def test_ranks_that_meet_unsupported_data_and_damage_on_one_checkpoint_all_raise(url: str, monkeypatch) -> None:
    """One rank meets data it cannot read (UnsupportedError) where another meets
    damage (CorruptError), on the same checkpoint: every rank raises the
    Unsupported one. None falls back to the older checkpoint alone (it would
    wait there in collectives the others never join).

    The two failures are injected at the restore's planning step (each rank
    reading its part of step 2), since no stored checkpoint makes one rank of a
    job meet the one and another rank the other deterministically."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import ckpt._restore.load as load_mod

    w = torch.arange(4.0)
    assert save_as_ranks(url, [{"w": w}] * 2, step=1) == [None, None]
    assert save_as_ranks(url, [{"w": w + 1}] * 2, step=2) == [None, None]
    planned = load_mod.plan
    meets = {0: ckpt.UnsupportedError("checkpoint metadata version 9 (this ckpt reads 1)"),
             1: ckpt.CorruptError("hash mismatch", "chunks/ab", "w", "hash mismatch")}

    def plan(native, step, attempt, targets, rng, stage=None, rank=None):  # type: ignore[no-untyped-def]
        if step == 2:
            raise meets[rank]
        return planned(native, step, attempt, targets, rng, stage, rank)

    monkeypatch.setattr(load_mod, "plan", plan)
    job = ThreadJob(2)
    job.barrier = threading.Barrier(2, timeout=10)  # a rank left alone in a collective fails fast

    def rank(r: int) -> object:
        cp = ckpt.Checkpointer(url, coordinate=job.member(r), rng=False, collective_timeout=10)
        try:
            return cp.load_latest(w=torch.zeros(4))
        except Exception as e:  # noqa: BLE001 - returned to the test
            return e

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(rank, range(2)))
    assert all(isinstance(e, ckpt.UnsupportedError) for e in got), got
    assert "version 9" in str(got[0]) and "rank 0: " in str(got[1]) and "version 9" in str(got[1])
