"""Restart from the memory tier against restart from local disk, in one run.

    python memtier_bench.py --dir D [--gib 1.0] [--repeats 3] [--ranks 2] [--s3-url URL] [--no-restores]
                            [--shm /dev/shm] [--json OUT]
    python memtier_bench.py --dir D --loop [--ranks 2] [--steps 40] [--every 5] [--compute-ms 200] [--spin]
    torchrun --nproc-per-node 2 memtier_bench.py --dir D --peer [--gib 1.0] [--repeats 3]

**Restore** (one process): a state of ``--gib`` GiB of float32 tensors (16 MiB
each) is saved once through :class:`ckpt.memory.MemoryCheckpointer` (memory
tier under ``--shm``, durable tier on local disk under ``--dir``, both
written) and once with ``torch.save`` + fsync beside it. Then, ``--repeats``
times, the live tensors are overwritten and restored, each time by a fresh
checkpointer, as a restarted process would:

- ``memory``: ``MemoryCheckpointer.load_latest`` (it reads the memory tier);
- ``disk cold``: ``Checkpointer(<local disk>).load_latest`` after the page
  cache is dropped (``/proc/sys/vm/drop_caches``, else
  ``posix_fadvise(DONTNEED)``; reported);
- ``torch.load cold``: ``torch.load(weights_only=True)`` of the same state
  after the page cache is dropped, copied into the live tensors.

Every restore is checked ``torch.equal`` to the saved state. Then the
restart of a job of ``--ranks`` ranks (one per node; ``memtier_restart.py``)
from each source, ``--gib`` GiB per rank: the time from the failure to the
job's first training step, beside the restore within it, from the memory
tier, from a peer node's replica after the last node was lost, from local
disk cold, from S3 (given ``--s3-url``) and through ``torch.load`` cold,
every restarted rank checked bitwise. The figures are medians and the
ratios are of medians of this run (the target: memory ≤ 0.3× disk cold).
Before those, the stall of eager saves of the state (the first one cold)
to the memory tier alone, to both tiers (``durable_every=1``: one snapshot
serves both) and to local disk through a plain checkpointer.
With the stall of a save to memory (C) and each source's restart time (R;
the same C for every source, so only the restart differs), Young/Daly gives
the interval sqrt(2 C M) and the goodput 1 - C/T - (T/2 + R)/M for a mean
time between failures M (``--mtbf-s``, default 4 h). ``--no-restores``
leaves the in-process restores out (the restarts and the stall only).

**Peer** (``--peer``, under torchrun, one rank per node): the restore of
``--gib`` GiB per rank by a fresh checkpointer from memory on every rank,
against the same when the last rank's memory was wiped and it fetches its
replica from its peer over gloo (the slowest rank's time, medians).

**Loop** (``--loop``, under torchrun with two ranks or more, or started
alone: it then starts ``--ranks`` ranks itself): each rank runs
a loop of emulated compute (``--compute-ms`` per step with the host idle, as
in a GPU step where the host waits on the device; ``--spin`` busy-waits
instead, a CPU-bound step) with a 64 MiB state, saved every ``--every`` steps
through ``MemoryCheckpointer``: once with replication to the peer node (one
rank per node) and once without, alternating, the same number of steps; the
slowdown from replication is the ratio of the loops' wall times until the
last step (target: ≤ 1 %; the slowest rank's, medians over ``--rounds``);
the final wait for the last save and replication is reported apart. Durable saves are off in both (``durable_every=0``), so only the
replication differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memtier_restart import restarts  # noqa: E402
from peers import drop_cache, fsync_path  # noqa: E402

import ckpt  # noqa: E402
from ckpt.memory import MemoryCheckpointer  # noqa: E402

PIECE = 16 << 20


def make_state(nbytes: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // PIECE)
    return {f"t{i:04}": torch.randn(PIECE // 4, generator=g) for i in range(n)}


def scramble(state: dict) -> None:
    for t in state.values():
        t.fill_(0.5)


def check(state: dict, saved: dict, what: str) -> None:
    for k, t in saved.items():
        if not torch.equal(state[k], t):
            raise AssertionError(f"{what}: tensor {k} differs after the restore")


def restore(args: argparse.Namespace) -> dict:
    work = Path(args.dir)
    shm = Path(args.shm) / f"ckpt-bench-{uuid.uuid4().hex[:12]}"
    disk = work / "durable"
    shutil.rmtree(disk, ignore_errors=True)
    torch.set_num_threads(1)
    try:
        saved = make_state(int(args.gib * (1 << 30)), 0)
        state = {k: t.clone() for k, t in saved.items()}
        mem_dir = str(shm / "node{node}")
        # The stall of a memory-tier save (a save to memory alone), then the
        # saved state on both tiers.
        save_stalls = save_stall(disk, shm, state)
        stalls = save_stalls["memory"]
        times: dict = {"memory": [], "disk cold": [], "torch.load cold": []}
        dropped = "none"
        if not args.no_restores:
            cp = MemoryCheckpointer(disk.as_uri(), memory_dir=mem_dir, coordinate="none", durable_every=1)
            cp.save(1, state)
            cp.close()
            pt = work / "state.pt"
            torch.save(saved, pt)
            fsync_path(str(pt))
        for _ in range(0 if args.no_restores else args.repeats):
            scramble(state)
            t0 = time.perf_counter()
            cp = MemoryCheckpointer(disk.as_uri(), memory_dir=mem_dir, coordinate="none", durable_every=1)
            step = cp.load_latest(state)
            times["memory"].append(time.perf_counter() - t0)
            assert (step, cp.last_source) == (1, "memory"), (step, cp.last_source)
            cp.close()
            check(state, saved, "memory")

            scramble(state)
            dropped = drop_cache(str(disk))
            t0 = time.perf_counter()
            step = ckpt.Checkpointer(disk.as_uri()).load_latest(state)
            times["disk cold"].append(time.perf_counter() - t0)
            assert step == 1
            check(state, saved, "disk cold")

            scramble(state)
            drop_cache(str(pt))
            t0 = time.perf_counter()
            loaded = torch.load(pt, weights_only=True)
            for k, t in loaded.items():
                state[k].copy_(t)
            times["torch.load cold"].append(time.perf_counter() - t0)
            del loaded
            check(state, saved, "torch.load cold")
        restart = restarts(work, args.shm, int(args.gib * 1024), args.ranks, args.repeats, args.s3_url)
        to_step = restart["median_to_first_step_s"]
        med = {k: statistics.median(v) for k, v in times.items() if v}
        stall = statistics.median(stalls[1:])
        gib = sum(t.numel() * 4 for t in saved.values()) / (1 << 30)
        return {
            "experiment": "restore",
            "gib": gib,
            "repeats": args.repeats,
            "restart": restart,
            "memory_save_stall_s": stalls,
            "save_stalls_s": save_stalls,
            "mtbf_s": args.mtbf_s,
            "goodput_young_daly": {k: goodput(stall, r, args.mtbf_s) for k, r in to_step.items()},
            "page_cache": dropped,
            "seconds": times,
            "median_s": med,
            "ratio_memory_to_disk_cold": med["memory"] / med["disk cold"] if med else None,
            "ratio_memory_to_torch_load_cold": med["memory"] / med["torch.load cold"] if med else None,
        }
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def save_stall(disk: Path, shm: Path, state: dict, saves: int = 4, rounds: int = 3) -> dict:
    """Stalls of eager saves by where they go: the memory tier alone, both
    tiers (one snapshot for both), and local disk through a plain
    checkpointer; and of lazy saves to both tiers and to local disk of the
    same tensors as a module's parameters with their optimizer, until the
    snapshot is taken (``save`` + ``wait_snapshot``: the most a training
    loop's step waits for it). Interleaved rounds, each kind on a fresh root
    with a fresh checkpointer per round; the first save of the first round
    (cold) comes first in each list, the later saves of every round after it."""
    out: dict = {"memory": [], "memory and disk": [], "disk": [], "memory and disk, lazy": [], "disk, lazy": []}
    # Lazy saves copy in the background what the optimizer's step guards (its
    # parameters): the same tensors as parameters of a module and an optimizer.
    params = torch.nn.ParameterDict({k: torch.nn.Parameter(t, requires_grad=False) for k, t in state.items()})
    guarded = {"model": params, "optimizer": torch.optim.SGD(params.parameters(), lr=0.1)}
    for r in range(rounds):
        for where in out:
            shutil.rmtree(disk, ignore_errors=True)
            shutil.rmtree(shm / "stall0", ignore_errors=True)
            lazy = where.endswith(", lazy")
            if where.startswith("disk"):
                cp: object = ckpt.Checkpointer(disk.as_uri(), keep_last=1, gc_grace=0.0, lazy=lazy)
            else:
                cp = MemoryCheckpointer(disk.as_uri(), memory_dir=str(shm / "stall{node}"), coordinate="none",
                                        durable_every=0 if where == "memory" else 1, keep_last=1,
                                        gc_grace=0.0, lazy=lazy)
            for step in range(saves):
                t0 = time.perf_counter()
                cp.save(step, guarded if lazy else state)
                if lazy:
                    cp.wait_snapshot()
                dt = time.perf_counter() - t0
                if step > 0 or r == 0:
                    out[where].append(dt)
                cp.wait()
            cp.close()
    shutil.rmtree(disk, ignore_errors=True)
    shutil.rmtree(shm / "stall0", ignore_errors=True)
    return out


def goodput(stall_s: float, restart_s: float, mtbf_s: float) -> dict:
    """Young/Daly: the interval sqrt(2 C M) and the fraction of time left for
    training, 1 - C/T - (T/2 + R)/M, with C the save's stall and R the restart."""
    t = (2 * stall_s * mtbf_s) ** 0.5
    return {"interval_s": t, "goodput": 1 - stall_s / t - (t / 2 + restart_s) / mtbf_s}


def compute(ms: float, spin: bool) -> None:
    """A training step's host time: idle (a GPU step: the host waits on the
    device), or with ``spin`` a busy wait (a CPU-bound step)."""
    if not spin:
        time.sleep(ms / 1000)
        return
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


#: MiB of state per rank of the loop (``--loop``).
LOOP_MIB = 64


def loop(args: argparse.Namespace) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    base = Path(args.shm) / f"ckpt-bench-loop-{os.environ.get('MASTER_PORT', '0')}"
    state = make_state(LOOP_MIB << 20, rank)
    walls: dict = {"replicated": [], "memory only": []}
    tails: dict = {"replicated": [], "memory only": []}  # the final wait, after the last step
    try:
        for rnd in range(args.rounds):
            for replicate in ((True, False) if rnd % 2 == 0 else (False, True)):
                key = "replicated" if replicate else "memory only"
                d = base / f"{key.replace(' ', '-')}-{rnd}"
                cp = MemoryCheckpointer(
                    (Path(args.dir) / f"durable-{rnd}-{int(replicate)}").as_uri(),
                    memory_dir=str(d / "node{node}"),
                    ranks_per_node=1,
                    durable_every=0,
                    replicate=replicate,
                )
                dist.barrier()
                t0 = time.perf_counter()
                for step in range(args.steps):
                    if step % args.every == 0:
                        cp.save(step, state)
                    compute(args.compute_ms, args.spin)
                    next(iter(state.values())).add_(1.0)  # the optimizer step mutates the state
                loop_s = time.perf_counter() - t0
                cp.wait()
                walls[key].append(loop_s)
                tails[key].append(time.perf_counter() - t0 - loop_s)
                cp.close()
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(d, ignore_errors=True)
                dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, (walls, tails))
    dist.destroy_process_group()
    slowest = {k: [max(w[0][k][i] for w in gathered) for i in range(args.rounds)] for k in walls}
    tail = {k: [max(w[1][k][i] for w in gathered) for i in range(args.rounds)] for k in walls}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    return {
        "experiment": "loop",
        "ranks": world,
        "steps": args.steps,
        "every": args.every,
        "compute_ms": args.compute_ms,
        "compute": "busy wait" if args.spin else "idle host (sleep)",
        "state_mib": LOOP_MIB,
        "seconds": slowest,
        "median_s": med,
        "final_wait_s": tail,
        "slowdown_from_replication": med["replicated"] / med["memory only"] - 1,
        "rank": rank,
    }


def peer(args: argparse.Namespace) -> dict:
    """Under torchrun, one rank per node: every rank saves ``--gib`` GiB to
    the memory tier (replicated to the next rank), the last rank's memory
    is wiped (a replacement node), and a fresh checkpointer restores on every
    rank, the last one from its peer's replica over gloo; against the same
    restore from memory on every rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    base = Path(args.shm) / f"ckpt-bench-peer-{os.environ.get('MASTER_PORT', '0')}"
    mem_dir = str(base / "node{node}")
    durable = (Path(args.dir) / "peer-durable").as_uri()
    saved = make_state(int(args.gib * (1 << 30)), rank)
    state = {k: t.clone() for k, t in saved.items()}
    times: dict = {"memory": [], "peer": []}
    try:
        cp = MemoryCheckpointer(durable, memory_dir=mem_dir, ranks_per_node=1, durable_every=0)
        cp.save(1, state)
        cp.close()
        for _ in range(args.repeats):
            for what in ("memory", "peer"):
                scramble(state)
                dist.barrier()
                if what == "peer" and rank == world - 1:
                    shutil.rmtree(base / f"node{rank}" / f"rank{rank}")
                dist.barrier()
                t0 = time.perf_counter()
                cp = MemoryCheckpointer(durable, memory_dir=mem_dir, ranks_per_node=1, durable_every=0)
                step = cp.load_latest(state)
                times[what].append(time.perf_counter() - t0)
                want = "peer" if what == "peer" and rank == world - 1 else "memory"
                assert (step, cp.last_source) == (1, want), (step, cp.last_source)
                cp.close()
                check(state, saved, what)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, times)
    dist.destroy_process_group()
    slowest = {k: [max(t[k][i] for t in gathered) for i in range(args.repeats)] for k in times}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    return {
        "experiment": "peer restore",
        "ranks": world,
        "gib_per_rank": args.gib,
        "seconds": slowest,
        "median_s": med,
        "ratio_peer_to_memory": med["peer"] / med["memory"],
        "rank": rank,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    p.add_argument("--json")
    p.add_argument("--loop", action="store_true")
    p.add_argument("--peer", action="store_true")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--compute-ms", type=float, default=200.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--spin", action="store_true")
    p.add_argument("--mtbf-s", type=float, default=4 * 3600.0)
    p.add_argument("--ranks", type=int, default=2, help="ranks (one per node) of the restarted job")
    p.add_argument("--s3-url", help="also restart from S3 (credentials from the AWS_* variables)")
    p.add_argument("--no-restores", action="store_true", help="the restarts and the stall only")
    args = p.parse_args()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    if args.loop and "RANK" not in os.environ:
        # Not under a launcher: start the job itself, one rank per node (rank 0 writes the JSON).
        import launch

        procs = launch.start_ranks(os.path.abspath(__file__), sys.argv[1:], args.ranks, 1)
        launch.finish_ranks(procs, 600, "the replication loop")
        return
    out = loop(args) if args.loop else peer(args) if args.peer else restore(args)
    if out.get("rank", 0) != 0:
        return
    out.pop("rank", None)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
