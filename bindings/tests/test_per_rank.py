"""State of one rank alone (``per_rank=``): saved beside its RNG state, given
back to the same rank, what a job of another size gets; replicas that differ
named in the error; what a restart passes over, said once. Real checkpointers
on real files; ranks as threads of one job (``ThreadJob``) or, for the resume
of a DDP job, processes over gloo killed with SIGKILL."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List

import pytest
import torch

import ckpt
from conftest import PYTHON, logged, python_env
from test_distributed import ThreadJob, free_port, save_as_ranks

WORKER = str(Path(__file__).with_name("perrank_worker.py"))


class Counter:
    """A stateful object (state_dict/load_state_dict), as a data loader is one."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict:
        return {"n": self.n, "order": torch.arange(4) * self.n}

    def load_state_dict(self, sd: dict) -> None:
        assert torch.equal(sd["order"], torch.arange(4) * sd["n"])
        self.n = sd["n"]


def as_ranks(url: str, world: int, f: Callable[[int, ckpt.Checkpointer], object]) -> List[object]:
    """Run ``f(rank, checkpointer of url)`` on ``world`` ranks (threads) of one job."""
    job = ThreadJob(world)

    def rank(r: int) -> object:
        cp = ckpt.Checkpointer(url, coordinate=job.member(r), rng=False, collective_timeout=60)
        try:
            return f(r, cp)
        finally:
            cp.close()

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank, range(world)))


def save_two_ranks(url: str) -> None:
    w = torch.arange(8.0)  # replicated: the same on both ranks

    def save(r: int, cp: ckpt.Checkpointer) -> None:
        batch = (torch.full((2, 3), float(r)), torch.tensor([r, r + 10]))
        cp.save(5, w=w, extra={"epoch": 1}, per_rank={"loader": Counter(10 + r), "batch": batch, "seen": r * 7}).wait()

    as_ranks(url, 2, save)


def restore(r: int, cp: ckpt.Checkpointer) -> tuple:
    own = {"loader": Counter(), "batch": None, "mine": "kept"}
    w = torch.zeros(8)
    step = cp.load_latest(w=w, per_rank=own)
    return step, torch.equal(w, torch.arange(8.0)), own, cp.last_per_rank


def test_each_rank_gets_its_own_state_back(url: str) -> None:
    save_two_ranks(url)
    for r, (step, w_ok, own, last) in enumerate(as_ranks(url, 2, restore)):
        assert step == 5 and w_ok
        assert own["loader"].n == 10 + r  # restored in place, through load_state_dict
        x, y = own["batch"]  # a tuple: replaced in the mapping
        assert torch.equal(x, torch.full((2, 3), float(r))) and torch.equal(y, torch.tensor([r, r + 10]))
        assert own["seen"] == r * 7 and own["mine"] == "kept"  # added; a key the save lacks stays
        assert last is not None and last["seen"] == r * 7
    # Not replicas: each rank's part is stored in its own fragment, both readable.
    data = ckpt.Checkpointer(url, coordinate="none").read(5).state
    assert data["per_rank"]["seen"] == 0 and data["extra"] == {"epoch": 1}


def test_more_ranks_than_saved_get_nothing_for_the_new_ones_and_say_so(url: str) -> None:
    save_two_ranks(url)
    with logged(r"step 5 was saved by 2 rank\(s\) and holds no per_rank state for rank 2; its per_rank dict stays"):
        got = as_ranks(url, 3, restore)
    for r in (0, 1):
        assert got[r][2]["loader"].n == 10 + r and got[r][3] is not None
    step, w_ok, own, last = got[2]
    assert step == 5 and w_ok  # the shared state is restored all the same
    assert own == {"loader": own["loader"], "batch": None, "mine": "kept"} and own["loader"].n == 0
    assert last is None


def test_fewer_ranks_than_saved_get_their_own(url: str) -> None:
    save_two_ranks(url)
    # One plain process is rank 0 of 1: rank 0's state; rank 1's is not read.
    cp = ckpt.Checkpointer(url, rng=False)
    own = {"loader": Counter()}
    assert cp.load_latest(w=torch.zeros(8), per_rank=own) == 5
    assert own["loader"].n == 10 and own["seen"] == 0
    with pytest.raises(ckpt.InvalidInputError, match="per_rank must be a dict"):
        cp.load_latest(w=torch.zeros(8), per_rank=[1])
    with pytest.raises(ckpt.InvalidInputError, match="per_rank must be a mapping"):
        cp.save(6, w=torch.zeros(8), per_rank=[1])


def test_one_process_saves_per_rank_beside_its_rng(url: str) -> None:
    cp = ckpt.Checkpointer(url)
    torch.manual_seed(3)
    cp.save(1, w=torch.ones(2), per_rank={"batch": torch.arange(3)}).wait()
    expected = torch.rand(2)
    torch.manual_seed(99)
    own: dict = {"batch": torch.zeros(3, dtype=torch.int64)}
    before = own["batch"]
    assert ckpt.Checkpointer(url).load_latest(w=torch.zeros(2), per_rank=own) == 1
    assert own["batch"] is before and torch.equal(before, torch.arange(3))  # copied into
    assert torch.equal(torch.rand(2), expected)  # the RNG too
    # A load without per_rank= leaves it, and warns of nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ckpt.Checkpointer(url).load_latest(w=torch.zeros(2)) == 1


def test_replicas_that_differ_are_named(url: str) -> None:
    w = torch.arange(4.0)
    states = [{"w": w, "batch": torch.full((64,), float(r)), "other": torch.ones(3)} for r in range(2)]
    got = save_as_ranks(url, states)
    assert all(isinstance(e, ckpt.InvalidInputError) for e in got), got
    msg = str(got[0])
    assert '("batch")' in msg and '"w"' not in msg and '"other"' not in msg, msg
    assert "per_rank=" in msg and str(got[1]).endswith(msg)
    assert ckpt.Checkpointer(url, coordinate="none").steps() == []


def records(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ckpt" and r.levelno >= logging.WARNING]


def test_a_restart_says_once_what_it_passed_over(url: str, root: Path, caplog: pytest.LogCaptureFixture) -> None:
    cp = ckpt.Checkpointer(url, format="safetensors", rng=False)
    for step in (40, 50, 60):
        cp.save(step, w=torch.full((4,), float(step))).wait()
    cp.close()
    manifests = sorted((root / "manifests").iterdir())
    manifests[2].unlink()  # step 60's save cut off before its commit: its data, no manifest
    manifests[1].write_bytes(manifests[1].read_bytes()[:40])  # step 50's manifest torn
    w = torch.zeros(4)
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert ckpt.Checkpointer(url, rng=False).load_latest(w=w) == 40
    assert torch.equal(w, torch.full((4,), 40.0))
    (said,) = records(caplog)
    assert "resumed from step 40" in said and "passing over 2 newer" in said
    assert "step 50" in said and "damaged" in said
    assert "step 60" in said and "never committed" in said
    # Nothing passed over: nothing said.
    caplog.clear()
    cp = ckpt.Checkpointer(url, rng=False)
    cp.save(70, w=w).wait()
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        assert ckpt.Checkpointer(url, rng=False).load_latest(w=w) == 70
    assert records(caplog) == []


def launch(args: List[str], timeout: float = 120) -> List[subprocess.CompletedProcess]:
    """Two ranks of perrank_worker.py with a torchrun-style environment; wait for both."""
    port = str(free_port())
    procs = []
    for r in range(2):
        env = python_env()
        env.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([PYTHON, WORKER, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
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


def test_ddp_with_stateful_dataloaders_resumes_bitwise_after_sigkill(tmp_path: Path) -> None:
    """Two DDP ranks, each with a shuffled StatefulDataLoader of its own data,
    save the loader per rank; SIGKILLed at step 11 (last commit: step 9) and
    restarted, they end with the model of the run that was never interrupted,
    bit for bit, having drawn the same batches."""
    pytest.importorskip("torchdata")
    root, ref, out1, out2 = tmp_path / "ckpts", tmp_path / "ref", tmp_path / "out1", tmp_path / "out2"
    out1.mkdir()
    out2.mkdir()
    killed = launch([root.as_uri(), str(out1), "--reference", ref.as_uri(), "--kill-at", "11"])
    assert any(p.returncode == -signal.SIGKILL for p in killed), [(p.returncode, p.stdout[-2000:]) for p in killed]
    assert ckpt.Checkpointer(root.as_uri(), coordinate="none").steps() == [3, 6, 9]
    resumed = launch([root.as_uri(), str(out2)])
    for r, p in enumerate(resumed):
        assert p.returncode == 0, f"rank {r}:\n{p.stdout}"
    for r in range(2):
        reference = json.loads((out1 / f"rank{r}.json").read_text())["reference"]
        again = json.loads((out2 / f"rank{r}.json").read_text())["resumed"]
        assert reference["resumed"] is None and again["resumed"] == 9 and again["restored_per_rank"]
        assert again["seen"] == reference["seen"][9:]  # the loader went on where it was
        assert again["digest"] == reference["digest"]
    ranks = [json.loads((out1 / f"rank{r}.json").read_text())["reference"]["seen"] for r in range(2)]
    assert ranks[0] != ranks[1]  # the ranks' batches (and loaders) differ
