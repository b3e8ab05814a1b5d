"""Restart of a job after a failure, by the source it restores from: the time
from the failure to the first training step of the restarted job.

Imported by ``memtier_bench.py`` (its restore mode), which calls
:func:`restarts`; run as a script, it is one rank of the jobs that
function starts (``--role save`` or ``--role restart``).

The job is data parallel: ``ranks`` processes (2 by default), one per node
(nodes simulated on this machine, each with its own memory-tier directory),
each holding the same ``mib`` MiB of float32 tensors (16 MiB each), as the
replicas of a DDP model do. One job saves step 1 everywhere at once: through
``MemoryCheckpointer`` (every rank's copy in its node's memory, replicated to
the next node, and the durable tier on local disk, where ckpt stores the
replicated tensors once), with ``torch.save`` + fsync of one file by rank 0
(every rank loads it) and, given an S3 URL, through ``ckpt.Checkpointer``
on S3. Then, per repeat and
source, the failure: the page cache is dropped for the sources on disk, the
last node's memory directory is wiped for ``peer`` (a replacement node),
and a fresh job is started at once. Each rank imports torch and ckpt, joins
the gloo group, builds its live state (tensors allocated and written, as a
model's initialisation writes its parameters), restores step 1 from its
source and takes a first step (an update of every tensor); the time to the
slowest rank's first step is the restart, the slowest restore within it
(from ``load_latest``, or ``torch.load``, until the state is in place; the
checkpointer is opened before) reported beside it. Sources:

- ``memory``: ``MemoryCheckpointer.load_latest``, every rank from its own copy;
- ``peer``: the same after the last node was lost: its rank fetches the
  replica its peer node keeps;
- ``memory, fewer ranks``: a job of one rank fewer (one node fewer) restarts
  from the memory tier: the saved ranks' memory checkpoints merged
  (``ckpt._memtier.reshape``), what its nodes lack fetched; the memory tier is put
  back as saved afterwards (untimed), since the merged restart removes the
  old job's roots;
- ``disk cold``: ``ckpt.Checkpointer(<local disk>).load_latest``, page cache dropped;
- ``s3``: ``ckpt.Checkpointer(<S3 URL>).load_latest``;
- ``torch.load cold``: ``torch.load(weights_only=True)`` of that file,
  page cache dropped, copied into the live tensors.

Every restarted rank checks its tensors after the step against the digest
the saving job took of the same step on the saved state (bitwise).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any
from pathlib import Path

STARTED = time.time()  # this process's start, before torch is imported

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import finish_ranks, start_ranks  # noqa: E402
from peers import drop_cache  # noqa: E402

PIECE = 16 << 20
#: Every source, in the table's order; ``s3`` only with an S3 URL.
SOURCES = ("memory", "peer", "memory, fewer ranks", "disk cold", "s3", "torch.load cold")
#: The source restarted by one rank fewer than saved (a job of another shape).
FEWER = "memory, fewer ranks"


def make_state(nbytes: int) -> dict:
    """The job's state: data parallel, the same tensors on every rank (as a
    DDP model and its optimizer), so the durable tier stores them once."""
    import torch

    g = torch.Generator().manual_seed(0)
    n = max(1, nbytes // PIECE)
    return {f"t{i:04}": torch.randn(PIECE // 4, generator=g) for i in range(n)}


def first_step(state: dict) -> None:
    """The first training step after the restore: an update of every tensor."""
    for t in state.values():
        t.add_(1.0)


def digest(state: dict) -> str:
    import torch

    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------ ranks


def memory_checkpointer(a: argparse.Namespace):
    from ckpt.memory import MemoryCheckpointer

    return MemoryCheckpointer(Path(a.disk).as_uri(), memory_dir=str(Path(a.shm) / "node{node}"), ranks_per_node=1,
                              durable_every=1, collective_timeout=120.0)


def save_rank(a: argparse.Namespace) -> None:
    """The job that saves step 1 to every source, then the expected digest."""
    import torch
    import torch.distributed as dist

    import ckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = make_state(a.mib << 20)
    cp = memory_checkpointer(a)
    cp.save(1, state)
    cp.wait()
    cp.close()
    if rank == 0:  # one file, as a DDP job's rank 0 writes it
        pt = Path(a.out) / "state.pt"
        torch.save(state, pt)
        with open(pt, "rb+") as f:
            os.fsync(f.fileno())
    if a.s3_url:
        s3 = ckpt.Checkpointer(a.s3_url)
        s3.save(1, state).wait()
        s3.close()
    first_step(state)
    (Path(a.out) / f"expected-rank{rank}.json").write_text(json.dumps(
        {"digest": digest(state), "shapes": {k: t.numel() for k, t in state.items()}}))
    dist.barrier()
    dist.destroy_process_group()


def restart_rank(a: argparse.Namespace) -> None:
    """A rank of the restarted job: join, restore from ``a.source``, take the first step."""
    import torch
    import torch.distributed as dist

    import ckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(a.out)
    expected = json.loads((out / f"expected-rank{rank}.json").read_text())
    # The live state as a restarted job has it before loading: allocated and
    # initialised (its pages written), so the restore writes into memory that
    # exists, whatever the source.
    state = {k: torch.empty(n).fill_(0.0) for k, n in expected["shapes"].items()}
    ready = time.time()
    cp: Any = None
    if a.source in ("memory", "peer", FEWER):
        cp = memory_checkpointer(a)
    elif a.source != "torch.load cold":
        cp = ckpt.Checkpointer(a.s3_url if a.source == "s3" else Path(a.disk).as_uri())
    t0 = time.perf_counter()
    if a.source == "torch.load cold":
        loaded = torch.load(out / "state.pt", weights_only=True)
        for k, t in loaded.items():
            state[k].copy_(t)
        del loaded
        step, source = 1, "torch.load"
    else:
        step = cp.load_latest(state)
        source = cp.last_source if a.source in ("memory", "peer", FEWER) else a.source
    restore_s = time.perf_counter() - t0
    first_step(state)
    at = time.time()
    if cp is not None:
        cp.close()
    row = {"rank": rank, "step": step, "source": source, "restore_s": restore_s, "ready_s": ready - STARTED,
           "first_step_at": at, "bitwise": step == 1 and digest(state) == expected["digest"]}
    (out / f"restart-rank{rank}.json").write_text(json.dumps(row))
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def rank_args(a: argparse.Namespace, role: str, out: Path, source: str = "") -> list:
    return ["--role", role, "--out", str(out), "--disk", str(a.disk), "--shm", str(a.shm), "--mib", str(a.mib),
            "--source", source, "--s3-url", a.s3_url or ""]


def restarts(work: Path, shm_root: str, mib: int, ranks: int, repeats: int, s3_url: str | None,
             timeout: float = 300.0) -> dict:
    """Save once, then ``repeats`` restarts from every source (interleaved);
    what the restore mode of ``memtier_bench.py`` reports under ``"restart"``."""
    if ranks < 2:
        raise ValueError("a restart from a peer's replica needs two ranks (nodes) or more")
    import uuid

    out = work / "restart"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    a = argparse.Namespace(disk=out / "durable", shm=Path(shm_root) / f"ckpt-restart-{uuid.uuid4().hex[:12]}",
                           mib=mib, s3_url=s3_url)
    kept = Path(str(a.shm) + "-kept")
    sources = [s for s in SOURCES if s != "s3" or s3_url]
    me = os.path.abspath(__file__)
    rows: dict = {s: [] for s in sources}
    cache = "none"
    try:
        finish_ranks(start_ranks(me, rank_args(a, "save", out), ranks, 1), timeout, "the saving job")
        for _ in range(repeats):
            for source in sources:
                if source == "peer":
                    shutil.rmtree(a.shm / f"node{ranks - 1}", ignore_errors=True)  # the node is replaced
                elif source == "disk cold":
                    cache = drop_cache(str(a.disk))
                elif source == "torch.load cold":
                    cache = drop_cache(str(out))
                elif source == FEWER:
                    shutil.rmtree(kept, ignore_errors=True)
                    shutil.copytree(a.shm, kept)  # put back below: the merge removes the old roots
                for f in out.glob("restart-rank*.json"):
                    f.unlink()
                n = ranks - 1 if source == FEWER else ranks
                failed_at = time.time()
                finish_ranks(start_ranks(me, rank_args(a, "restart", out, source), n, 1), timeout,
                             f"the restart from {source}")
                got = [json.loads((out / f"restart-rank{r}.json").read_text()) for r in range(n)]
                if source == FEWER:
                    shutil.rmtree(a.shm, ignore_errors=True)
                    shutil.copytree(kept, a.shm)
                if source in ("memory", "peer", FEWER):
                    want = ["memory, merged"] * n if source == FEWER else ["memory"] * (n - 1) + [source]
                    if [g["source"] for g in got] != want:
                        raise RuntimeError(f"the restart from {source} restored from {[g['source'] for g in got]}")
                rows[source].append({
                    "to_first_step_s": max(g["first_step_at"] for g in got) - failed_at,
                    "restore_s": max(g["restore_s"] for g in got),
                    "ready_s": max(g["ready_s"] for g in got),
                    "sources": [g["source"] for g in got],
                    "bitwise": all(g["bitwise"] for g in got),
                })
    finally:
        shutil.rmtree(a.shm, ignore_errors=True)
        shutil.rmtree(kept, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    med = {s: statistics.median(r["to_first_step_s"] for r in v) for s, v in rows.items()}
    return {
        "ranks": ranks,
        "mib_per_rank": mib,
        "repeats": repeats,
        "page_cache": cache,
        "sources": sources,
        "runs": rows,
        "median_to_first_step_s": med,
        "median_restore_s": {s: statistics.median(r["restore_s"] for r in v) for s, v in rows.items()},
        "ratio_to_disk_cold": {s: m / med["disk cold"] for s, m in med.items()},
        "all_bitwise": all(r["bitwise"] for v in rows.values() for r in v),
    }


def main() -> None:
    p = argparse.ArgumentParser(description="one rank of memtier_bench.py's restart jobs")
    p.add_argument("--role", choices=("save", "restart"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--disk", required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--mib", type=int, required=True)
    p.add_argument("--source", default="")
    p.add_argument("--s3-url", default="")
    a = p.parse_args()
    save_rank(a) if a.role == "save" else restart_rank(a)


if __name__ == "__main__":
    main()
