"""The memory tier (``ckpt.memory``): real multi-process jobs on simulated nodes.

Four ranks (``memtier_worker.py``, torch.distributed over gloo; one test under
mpirun with mpi4py) form two nodes of two ranks (an FSDP2 test under torchrun:
two nodes of one rank, ``memtier_fsdp_worker.py``), each node with its own
memory-tier directory under ``/dev/shm``. A node failure kills the job (the
last node's ranks by SIGKILL) and wipes that node's directory; the restarted
job must resume bitwise from memory and the peer's replica, or fall back to
the durable tier when the replicas are bad. Every test removes its directories.
"""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List

import pytest

import ckpt
from ckpt.memory import MemoryCheckpointer, Topology
from conftest import PYTHON, python_env
from test_distributed import free_port, have_mpi4py

WORKER = str(Path(__file__).with_name("memtier_worker.py"))
FSDP_WORKER = str(Path(__file__).with_name("memtier_fsdp_worker.py"))
LIMIT = 180
WORLD, PER_NODE = 4, 2



def test_each_ranks_replica_lives_on_the_next_node() -> None:
    # Three nodes of two ranks: rank r's replica is kept by the same local rank one node on.
    holders = [Topology(r, 6, 2).holder() for r in range(6)]
    assert holders == [2, 3, 4, 5, 0, 1]
    assert [Topology(r, 6, 2).source() for r in range(6)] == [4, 5, 0, 1, 2, 3]
    for r in range(6):
        t = Topology(r, 6, 2)
        assert t.node(t.holder()) != t.node()  # never on its own node
    assert Topology.from_env(0, 4, 4).nodes == 1
    with pytest.raises(ckpt.InvalidInputError):
        Topology.from_env(0, 4, 3)


def test_a_node_keeps_only_the_roots_of_its_own_ranks(tmp_path: Path, shm: Path) -> None:
    node = shm / "node0"
    for stale in ("rank5", "replica7"):
        (node / stale / "chunks").mkdir(parents=True)
    (node / "notes").mkdir()
    cp = MemoryCheckpointer((tmp_path / "d").as_uri(), memory_dir=str(shm / "node{node}"), coordinate="none")
    # Kept until load_latest has looked for checkpoints of another job shape in them.
    assert sorted(p.name for p in node.iterdir()) == ["notes", "rank0", "rank5", "replica7"]
    assert cp.load_latest() is None
    cp.close()
    assert sorted(p.name for p in node.iterdir()) == ["notes", "rank0"]


def test_manifests_that_cannot_be_merged_are_typed_errors(tmp_path: Path) -> None:
    import torch

    from ckpt import _ckpt

    def manifest(name: str, w: "torch.Tensor") -> bytes:
        cp = ckpt.Checkpointer((tmp_path / name).as_uri(), coordinate="none")
        cp.save(7, model={"w": w}).wait()
        return next((tmp_path / name / "manifests").iterdir()).read_bytes()

    a, b = manifest("a", torch.ones(4)), manifest("b", torch.ones(5))
    merged = _ckpt.merge_manifests([a, a])
    assert merged.startswith(b"ckpt-manifest 1 ")
    with pytest.raises(ckpt.InvalidInputError, match="different dtypes, shapes or placements"):
        _ckpt.merge_manifests([a, b])
    with pytest.raises(ckpt.CorruptError):
        _ckpt.merge_manifests([a, a[:-1]])
    with pytest.raises(ckpt.InvalidInputError):
        _ckpt.merge_manifests([])


def test_one_process_saves_to_memory_and_durable_and_restores_from_memory(tmp_path: Path, shm: Path) -> None:
    import torch

    durable = (tmp_path / "durable").as_uri()
    state = {"w": torch.arange(10.0), "extra": {"epoch": 1}}
    cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none", durable_every=2)
    for step in range(4):
        state["w"] += 1
        cp.save(step, state)
    cp.close()
    # Memory keeps the newest two; durable got every second save.
    assert sorted(cp.own.committed()) == [2, 3]
    assert ckpt.Checkpointer(durable, coordinate="none").steps() == [0, 2]
    back = {"w": torch.zeros(10), "extra": {}}
    cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none", durable_every=2)
    assert cp.last_restore is None
    assert cp.load_latest(back) == 3 and cp.last_source == "memory"
    assert torch.equal(back["w"], torch.arange(10.0) + 4) and back["extra"] == {"epoch": 1}
    from_memory = cp.last_restore  # where the memory root's restore went
    assert from_memory is not None and from_memory.read > 0 and from_memory is cp.memory.last_restore
    # Memory lost (the node rebooted): the durable tier's newest.
    shutil.rmtree(shm / "node0")
    cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none", durable_every=2)
    assert cp.load_latest(back) == 2 and cp.last_source == "durable"
    assert torch.equal(back["w"], torch.arange(10.0) + 3)
    assert cp.last_restore is not None and cp.last_restore is cp.durable.last_restore
    cp.close()


def test_lazy_snapshots_go_to_both_tiers_before_the_optimizer_steps(
    tmp_path: Path, shm: Path, walks: List[int]
) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    durable = (tmp_path / "durable").as_uri()
    cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none", lazy=True)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    cp.save(1, model=model, optimizer=opt)
    assert len(walks) == 1  # one snapshot for both tiers
    to_memory, to_durable = cp.memory._unwaited[-1], cp.durable._unwaited[-1]
    model(torch.randn(4, 64)).sum().backward()
    opt.step()  # the step pre-hook waits for the snapshot
    # Copied once: the durable save took the memory save's copies.
    state_bytes = sum(t.nbytes for t in want.values())
    assert to_memory.wait()["copied_bytes"] >= state_bytes
    assert to_durable.wait()["copied_bytes"] == 0
    cp.close()
    for source in ("memory", "durable"):
        if source == "durable":
            shutil.rmtree(shm / "node0")
        fresh = torch.nn.Linear(64, 64)
        cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none")
        assert cp.load_latest(model=fresh) == 1 and cp.last_source == source
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in want.items())
        cp.close()


def launch(durable: Path, memory: Path, out: Path, extra: List[str], mpi: bool = False, world: int = WORLD,
           per_node: int = PER_NODE) -> List[Dict]:
    """Run one job of ``world`` ranks to its end; return each rank's report."""
    WORLD, PER_NODE = world, per_node  # noqa: N806 - the job's shape, as below
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    args = [WORKER, durable.as_uri(), str(memory / "node{node}"), str(out), "--ranks-per-node", str(PER_NODE)]
    args += extra
    env = python_env()
    if mpi:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
        cmd = ["mpirun", "--oversubscribe", "-np", str(WORLD), "--mca", "btl", "self,vader"]
        cmd += ["--mca", "btl_vader_single_copy_mechanism", "none", PYTHON, *args, "--mpi"]
        p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=LIMIT)
        outs = [p.stdout]
    else:
        port = str(free_port())
        procs = []
        for r in range(WORLD):
            e = dict(env, RANK=str(r), LOCAL_RANK=str(r % PER_NODE), WORLD_SIZE=str(WORLD))
            e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_WORLD_SIZE=str(PER_NODE))
            procs.append(subprocess.Popen([PYTHON, *args], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = []
        try:
            for q in procs:
                outs.append(q.communicate(timeout=LIMIT)[0])
        finally:
            for q in procs:
                q.kill()
    rows = []
    for r in range(WORLD):
        f = out / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote no report:\n" + "\n".join(outs)
        rows.append(json.loads(f.read_text()))
    return rows


def node_failure(memory: Path, node: int) -> None:
    """What a lost node leaves: nothing of its memory tier."""
    shutil.rmtree(memory / f"node{node}")


def resumed_bitwise(first: List[Dict], rows: List[Dict], step: int) -> None:
    """Each rank restored exactly what it saved at ``step``: model, Adam state,
    and the state of every random generator (its own dropout masks)."""
    for r, (a, b) in enumerate(zip(first, rows)):
        assert b["loaded"] == a["saved"][str(step)], f"rank {r}"
        assert b["frozen"], f"rank {r}"


def test_a_lost_node_resumes_bitwise_from_memory_and_the_peers_replica(
    tmp_path: Path, shm: Path
) -> None:
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"])
    assert all(r["stopped"] == 4 for r in first)
    # Durable every third save: steps 0 and 3 only. Step 4 lives in memory.
    assert ckpt.Checkpointer(durable.as_uri(), coordinate="none").steps() == [0, 3]
    # Node 0 keeps the replicas of node 1's ranks and the other way round.
    assert sorted(p.name for p in (shm / "node0").iterdir() if not p.name.startswith(".")) == [
        "rank0", "rank1", "replica2", "replica3"
    ]
    node_failure(shm, 1)
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6"])
    assert [r["start"] for r in rows] == [4] * WORLD
    assert [r["source"] for r in rows] == ["memory", "memory", "peer", "peer"]
    # Before the restore, node 0 held its ranks' steps and node 1's replicas; node 1 nothing.
    assert [4 in r["held"]["own"] and 4 in r["held"]["replica"] for r in rows[:2]] == [True, True]
    assert [r["held"] for r in rows[2:]] == [{"own": [], "replica": []}] * 2
    resumed_bitwise(first, rows, 4)
    assert all(r["warnings"] == [] for r in rows)
    # The replacement node's memory tier holds its ranks' state again, and the
    # retention kept at most two checkpoints per rank in memory.
    for r in (2, 3):
        assert len(list((shm / "node1" / f"rank{r}" / "manifests").iterdir())) <= 2


def test_a_lost_node_rolls_back_to_an_older_step_from_memory_and_the_peers_replica(
    tmp_path: Path, shm: Path
) -> None:
    """``load(step)`` of a step before the newest, after a node failure: each
    rank of the lost node fetches its replica from the peer; the later
    checkpoints are discarded, and a restart resumes the new run's."""
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"])
    node_failure(shm, 1)
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6", "--load-step", "3"])
    assert [r["start"] for r in rows] == [3] * WORLD
    assert [r["source"] for r in rows] == ["memory", "memory", "peer", "peer"]
    resumed_bitwise(first, rows, 3)
    assert all(r["warnings"] == [] for r in rows)
    # The new run saved 4 and 5 (4 durable: its first save); the old run's 4
    # is gone from memory (every rank's copy and replica), so a restart
    # resumes the new run's 5. (The new 4 is not compared with the old one:
    # a fresh DDP's first step lays its gradients out in another order, so
    # gloo's ring sums four ranks' gradients in another order, off in the
    # last bit. With two ranks the sums commute and the runs are bitwise.)
    assert ckpt.Checkpointer(durable.as_uri(), coordinate="none").steps() == [0, 3, 4]
    again = launch(durable, shm, tmp_path / "c", ["--steps", "6"])
    assert [r["start"] for r in again] == [5] * WORLD
    assert [r["source"] for r in again] == ["memory"] * WORLD
    resumed_bitwise(rows, again, 5)


def test_fewer_ranks_resume_from_the_old_jobs_merged_memory_checkpoints(tmp_path: Path, shm: Path) -> None:
    """Four ranks on two nodes save; node 1 is lost; two ranks (one per node)
    resume from memory: the old ranks' checkpoints merged, what node 1 lacks
    fetched from node 0."""
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"])
    node_failure(shm, 1)
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6"], world=2, per_node=1)
    assert [(r["start"], r["source"]) for r in rows] == [(4, "memory, merged")] * 2
    # The model and Adam state (the same on every rank: DDP), and old ranks 0
    # and 1's random generators for new ranks 0 and 1.
    resumed_bitwise(first[:2], rows, 4)
    assert all(r["warnings"] == [] for r in rows)
    # The old job's roots are gone; the new job's ranks saved and replicated.
    assert sorted(p.name for p in (shm / "node0").iterdir() if not p.name.startswith(".")) == ["rank0", "replica1"]
    assert sorted(p.name for p in (shm / "node1").iterdir() if not p.name.startswith(".")) == ["rank1", "replica0"]


def test_a_damaged_copy_of_another_shape_is_skipped_for_an_older_merged_step(tmp_path: Path, shm: Path) -> None:
    """After node 1 is lost, node 0 keeps the only copy of old rank 2's step 4;
    its manifest fails verification, so the two-rank job merges step 3."""
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"])
    node_failure(shm, 1)
    (manifest,) = (shm / "node0" / "replica2" / "manifests").glob(f"{4:020}-*.manifest")
    raw = manifest.read_bytes()
    at = raw.index(b'"hash":"') + len(b'"hash":"')
    manifest.write_bytes(raw[:at] + (b"0" if raw[at:at + 1] != b"0" else b"1") + raw[at + 1 :])
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6"], world=2, per_node=1)
    assert [(r["start"], r["source"]) for r in rows] == [(3, "memory, merged")] * 2
    resumed_bitwise(first[:2], rows, 3)
    for r in rows:
        assert [w for w in r["warnings"] if "step 4 cannot be merged" in w and "hash mismatch" in w], r["warnings"]


def test_more_ranks_resume_from_the_old_jobs_merged_memory_checkpoints(tmp_path: Path, shm: Path) -> None:
    """Two ranks (one per node) save; four (two per node) resume from memory.
    Ranks that the old job did not have keep their generators, and say so."""
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"], world=2, per_node=1)
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6"])
    assert [(r["start"], r["source"]) for r in rows] == [(4, "memory, merged")] * WORLD
    resumed_bitwise(first, rows[:2], 4)
    for r in rows[2:]:
        assert r["loaded"]["digest"] == first[0]["saved"]["4"]["digest"]
        assert len(r["warnings"]) == 1 and "no RNG state for rank" in r["warnings"][0], r["warnings"]
    # Resumed again, same shape: each rank's own copy, as saved by this job.
    again = launch(durable, shm, tmp_path / "c", ["--steps", "6"])
    assert [(r["start"], r["source"]) for r in again] == [(5, "memory")] * WORLD
    for r, (a, b) in enumerate(zip(rows, again)):
        assert b["loaded"] == a["saved"]["5"], f"rank {r}"
        assert b["frozen"] and b["warnings"] == [], f"rank {r}"


def test_a_damaged_memory_copy_is_skipped_for_the_peers_replica(tmp_path: Path, shm: Path) -> None:
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"])
    # No node is lost, but rank 3's own copy in memory fails verification.
    for c in (shm / "node1" / "rank3" / "chunks").iterdir():
        b = bytearray(c.read_bytes())
        b[-1] ^= 0xFF
        c.write_bytes(bytes(b))
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6"])
    assert [r["start"] for r in rows] == [4] * WORLD
    assert [r["source"] for r in rows] == ["memory", "memory", "memory", "peer"]
    assert any("damaged" in w for w in rows[3]["warnings"])
    resumed_bitwise(first, rows, 4)


def test_bad_replicas_fall_back_to_the_durable_tier(tmp_path: Path, shm: Path) -> None:
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"])
    node_failure(shm, 1)
    # Every chunk of the replicas of node 1's ranks is damaged: they fail verification.
    damaged = 0
    for rep in ("replica2", "replica3"):
        for c in (shm / "node0" / rep / "chunks").iterdir():
            b = bytearray(c.read_bytes())
            b[-1] ^= 0xFF
            c.write_bytes(bytes(b))
            damaged += 1
    assert damaged
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6"])
    assert [r["start"] for r in rows] == [3] * WORLD  # the durable tier's newest
    assert [r["source"] for r in rows] == ["durable"] * WORLD
    resumed_bitwise(first, rows, 3)
    # The ranks whose replicas were read warned of the damage.
    assert all(any("damaged" in w for w in r["warnings"]) for r in rows[2:])


def test_both_nodes_lost_resumes_from_the_durable_tier(tmp_path: Path, shm: Path) -> None:
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"])
    node_failure(shm, 0)
    node_failure(shm, 1)
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6"])
    assert [(r["start"], r["source"]) for r in rows] == [(3, "durable")] * WORLD
    resumed_bitwise(first, rows, 3)


def test_a_full_memory_tier_is_a_storage_error_on_every_rank_and_the_durable_tier_goes_on(
    tmp_path: Path, shm: Path
) -> None:
    # Node 1's memory tier is a tmpfs far too small for one checkpoint (mounting needs root).
    small = shm / "node1"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs (needs root)")
    try:
        durable = tmp_path / "durable"
        rows = launch(durable, shm, tmp_path / "a", ["--steps", "4"])
    finally:
        subprocess.run(["umount", str(small)], check=True)
    for r in rows:
        assert r["wait_error"]["cls"] == "StorageError", r
        assert r["wait_error"]["errno"] == errno.ENOSPC, r
    # Every save reached the durable tier all the same.
    assert ckpt.Checkpointer(durable.as_uri(), coordinate="none").steps() == [0, 3]


def test_a_peer_that_does_not_answer_is_given_up_and_the_durable_tier_goes_on(tmp_path: Path, shm: Path) -> None:
    durable = tmp_path / "durable"
    t0 = time.monotonic()
    rows = launch(durable, shm, tmp_path / "a", ["--steps", "4", "--stuck-rank", "2", "--timeout", "5"])
    assert time.monotonic() - t0 < LIMIT
    # Rank 0 gives up on rank 2 (it keeps rank 0's replica) after the timeout,
    # and replication stops; the others then give up on rank 0 in the next
    # exchange. Every rank but the stuck one says so from wait().
    for r in (0, 1, 3):
        assert rows[r]["wait_error"]["cls"] in ("CheckpointTimeoutError", "StragglerError"), rows[r]
    assert ckpt.Checkpointer(durable.as_uri(), coordinate="none").steps() == [0, 3]
    # No replica was committed from the stuck exchange; nothing of it is loadable.
    assert not (shm / "node1" / "replica0" / "manifests").exists() or not any(
        (shm / "node1" / "replica0" / "manifests").iterdir()
    )


def fsdp_job(tmp_path: Path, shm: Path, out: Path, nproc: int, *extra: str) -> List[Dict]:
    """One job of ``nproc`` FSDP2 ranks, one per node, under real torchrun."""
    out.mkdir(parents=True)
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), FSDP_WORKER, (tmp_path / "durable").as_uri(),
           str(shm / "node{node}"), str(out), "--ranks-per-node", "1", *extra]
    p = subprocess.run(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=LIMIT)
    assert p.returncode == 0, p.stdout[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_fsdp2_shards_resume_from_memory_and_the_peers_replica_under_torchrun(tmp_path: Path, shm: Path) -> None:
    """Two nodes of one rank each, FSDP2 shards of uneven sizes, real torchrun."""
    first = fsdp_job(tmp_path, shm, tmp_path / "a", 2, "--steps", "5", "--stop-at", "3")
    node_failure(shm, 1)
    rows = fsdp_job(tmp_path, shm, tmp_path / "b", 2, "--steps", "5")
    assert [(r["start"], r["source"]) for r in rows] == [(3, "memory"), (3, "peer")]
    for r in rows:
        assert r["loaded"] == first[0]["saved"]["3"]  # the full state, as PyTorch gathers it


def test_fsdp2_shards_reshard_from_memory_onto_more_ranks(tmp_path: Path, shm: Path) -> None:
    """Saved by two FSDP2 ranks, resumed by three from the memory tier: each
    new shard is cut from pieces of both old ranks."""
    first = fsdp_job(tmp_path, shm, tmp_path / "a", 2, "--steps", "5", "--stop-at", "3")
    rows = fsdp_job(tmp_path, shm, tmp_path / "b", 3, "--steps", "5")
    assert [(r["start"], r["source"]) for r in rows] == [(3, "memory, merged")] * 3
    for r in rows:
        assert r["loaded"] == first[0]["saved"]["3"]


@pytest.mark.skipif(not have_mpi4py(), reason="needs mpi4py and mpirun")
def test_under_mpirun_a_lost_node_resumes_from_the_peers_replica(tmp_path: Path, shm: Path) -> None:
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"], mpi=True)
    node_failure(shm, 1)
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6"], mpi=True)
    assert [r["start"] for r in rows] == [4] * WORLD
    assert [r["source"] for r in rows] == ["memory", "memory", "peer", "peer"]
    resumed_bitwise(first, rows, 4)


@pytest.mark.skipif(not have_mpi4py(), reason="needs mpi4py and mpirun")
def test_under_mpirun_fewer_ranks_resume_from_the_merged_memory_checkpoints(tmp_path: Path, shm: Path) -> None:
    durable = tmp_path / "durable"
    first = launch(durable, shm, tmp_path / "a", ["--steps", "6", "--stop-at", "4", "--kill"], mpi=True)
    node_failure(shm, 1)
    rows = launch(durable, shm, tmp_path / "b", ["--steps", "6"], mpi=True, world=2, per_node=1)
    assert [(r["start"], r["source"]) for r in rows] == [(4, "memory, merged")] * 2
    resumed_bitwise(first, rows, 4)


def test_a_state_that_does_not_fit_the_checkpoint_is_an_error_not_a_fallback(tmp_path: Path, shm: Path) -> None:
    import torch

    durable = (tmp_path / "durable").as_uri()
    cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none")
    cp.save(1, model=torch.nn.Linear(4, 4))
    cp.close()
    cp = MemoryCheckpointer(durable, memory_dir=str(shm / "node{node}"), coordinate="none")
    with pytest.raises(ckpt.CheckpointError, match="size mismatch|shape"):
        cp.load_latest(model=torch.nn.Linear(4, 5))
    cp.close()
