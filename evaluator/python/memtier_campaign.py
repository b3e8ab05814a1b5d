"""Fault campaign of the memory tier: node failures and rank kills at random
moments of a real multi-rank job, every restart checked bitwise.

    python memtier_campaign.py --dir D [--episodes 6] [--ranks 4] [--ranks-per-node 2] [--steps 80] [--save-every 4] [--seed 1] [--json OUT]

Each episode starts a job of ``--ranks`` processes (torch.distributed over
gloo, nodes of ``--ranks-per-node`` ranks simulated on this machine, each
node with its own memory-tier directory under /dev/shm) training a small DDP
MLP with dropout through ``MemoryCheckpointer``: a save every ``--save-every``
steps, the durable tier (local disk) every 4th save. Each rank appends what it
saved (step, digest of model and Adam state, next draws of every random
generator) to a log, flushed as it goes. Once rank 0 has logged a random number of saves,
the fault strikes, alternately:

- **node**: the ranks of a random node are killed (SIGKILL) and its memory
  directory is wiped; the other ranks are killed too, as a launcher tears a
  job down;
- **rank**: one random rank is killed, then the others; memory survives.

Saves and replications are in flight at that moment. The job is started
again; each rank resumes with ``load_latest`` and reports what it restored
and from where. The oracle: the resumed step is one every rank logged, and
every rank's restored state and generators equal what it logged for that
step (bitwise: a mismatch would be an undetected corruption or a torn
checkpoint); the steps lost are the newest step any rank logged minus the
resumed one. A node failure resumes from peer replicas when every rank of the
lost node restored a peer's replica; when it did not, the episode says what
each rank held in memory (its own steps and the replicas it kept) at the
restart, so a replica that lagged behind shows as such. Restart time is from
the kill to the first step after the restore, reported beside its parts (the
slowest rank's): until the new
processes run, until they are ready to load (imports, rendezvous, the
checkpointer's groups), and the restore.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import struct
import sys
import time
import uuid
from pathlib import Path

KINDS = ("node", "rank")
STARTED = time.time()  # this process's start, before torch is imported

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch import finish_ranks, kill_ranks, start_ranks  # noqa: E402


# ------------------------------------------------------------------ worker


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from ckpt.memory import MemoryCheckpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.3), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    net = nn.parallel.DistributedDataParallel(model)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)

    def digest() -> str:
        h = hashlib.sha256()
        for name, t in model.state_dict().items():
            h.update(name.encode())
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        for pid, s in sorted(opt.state_dict()["state"].items()):
            for k, t in sorted(s.items()):
                h.update(f"{pid}.{k}".encode())
                h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def draws() -> list:
        return [struct.pack("<d", random.random()).hex(), struct.pack("<d", float(np.random.rand())).hex(),
                torch.rand(3).view(torch.int32).tolist()]

    cp = MemoryCheckpointer(args.url, memory_dir=args.memory_dir, ranks_per_node=args.ranks_per_node,
                            durable_every=4, collective_timeout=30.0)
    t0 = time.time()
    ready_s = t0 - STARTED  # imports, rendezvous, the checkpointer's groups
    held = cp.memory_steps() if args.resume else None  # before the restore prunes anything
    start = cp.load_latest(model=model, optimizer=opt)
    restore_s = time.time() - t0
    out = Path(args.out)
    if args.resume:
        row = {"rank": rank, "start": start, "source": cp.last_source, "digest": digest(), "draws": draws(),
               "restore_s": restore_s, "started_at": STARTED, "ready_s": ready_s, "held": held}
        # The first training step after the restart.
        g = torch.Generator().manual_seed(10**6 + rank)
        F.cross_entropy(net(torch.randn(16, 32, generator=g)), torch.randint(0, 4, (16,), generator=g)).backward()
        opt.step()
        row["first_step_at"] = time.time()
        (out / f"resume-rank{rank}.json").write_text(json.dumps(row))
        cp.close()
        dist.destroy_process_group()
        return
    log = open(out / f"log-rank{rank}.jsonl", "a")
    for step in range(args.steps):
        if step % args.save_every == 0:
            d = digest()
            cp.save(step, model=model, optimizer=opt)
            log.write(json.dumps({"step": step, "digest": d, "draws": draws()}) + "\n")
            log.flush()
        g = torch.Generator().manual_seed(step * 1000 + rank)
        loss = F.cross_entropy(net(torch.randn(16, 32, generator=g)), torch.randint(0, 4, (16,), generator=g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        time.sleep(args.step_ms / 1000)
    cp.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver


def start_job(args: argparse.Namespace, durable: Path, shm: Path, out: Path, resume: bool) -> list:
    return start_ranks(__file__, ["--worker", "--url", durable.as_uri(), "--memory-dir", str(shm / "node{node}"),
                                  "--out", str(out), "--ranks-per-node", str(args.ranks_per_node),
                                  "--steps", str(args.steps), "--step-ms", str(args.step_ms),
                                  "--save-every", str(args.save_every)]
                       + (["--resume"] if resume else []), args.ranks, args.ranks_per_node)


def logged(out: Path, rank: int) -> dict:
    f = out / f"log-rank{rank}.jsonl"
    rows = {}
    if f.exists():
        for line in f.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # the last line, cut by the kill
            rows[row["step"]] = row
    return rows


def episode(args: argparse.Namespace, i: int, rng: random.Random) -> dict:
    kind = KINDS[i % len(KINDS)]
    base = Path(args.dir) / f"episode{i}"
    shutil.rmtree(base, ignore_errors=True)
    out = base / "out"
    out.mkdir(parents=True)
    durable = base / "durable"
    shm = Path(args.shm) / f"ckpt-campaign-{uuid.uuid4().hex[:12]}"
    try:
        procs = start_job(args, durable, shm, out, resume=False)
        saves = len(range(0, args.steps, args.save_every))
        after = rng.randint(3, max(3, saves - 2))  # saves logged by rank 0
        deadline = time.monotonic() + 180
        while len(logged(out, 0)) < after:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                kill_ranks(procs)
                raise RuntimeError(f"episode {i}: the job ended before step {after}: "
                                   + "".join(p.stderr.read() or "" for p in procs)[-3000:])
            time.sleep(0.01)
        nodes = args.ranks // args.ranks_per_node
        if kind == "node":
            node = rng.randrange(nodes)
            victims = [r for r in range(args.ranks) if r // args.ranks_per_node == node]
        else:
            node, victims = None, [rng.randrange(args.ranks)]
        killed_at = time.time()
        kill_ranks(procs, first=victims)  # the launcher tears the rest of the job down at once
        if node is not None:
            shutil.rmtree(shm / f"node{node}", ignore_errors=True)
        logs = [logged(out, r) for r in range(args.ranks)]
        finish_ranks(start_job(args, durable, shm, out, resume=True), 180, f"episode {i}: the restart")
        rows = [json.loads((out / f"resume-rank{r}.json").read_text()) for r in range(args.ranks)]
        start = rows[0]["start"]
        bitwise = all(row["start"] == start for row in rows) and start is not None and all(
            start in logs[r] and rows[r]["digest"] == logs[r][start]["digest"] and rows[r]["draws"] == logs[r][start]["draws"]
            for r in range(args.ranks)
        )
        newest = max(max(lg, default=-1) for lg in logs)
        from_peer = node is not None and all(rows[r]["source"] == "peer" for r in victims)
        return {
            "episode": i,
            "fault": kind,
            "node": node,
            "killed_ranks": victims,
            "killed_after_step": after,
            "newest_logged_step": newest,
            "resumed_step": start,
            "steps_lost": None if start is None else newest - start,
            "sources": [row["source"] for row in rows],
            "from_peer": from_peer,
            "held": [row["held"] for row in rows],
            "bitwise": bitwise,
            "restore_s": max(row["restore_s"] for row in rows),
            "start_s": max(row["started_at"] for row in rows) - killed_at,
            "ready_s": max(row["ready_s"] for row in rows),
            "restart_to_first_step_s": max(row["first_step_at"] for row in rows) - killed_at,
        }
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir")
    p.add_argument("--episodes", type=int, default=6)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--url")
    p.add_argument("--memory-dir")
    p.add_argument("--out")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.ranks // args.ranks_per_node < 2:
        p.error("a node failure needs two nodes or more")
    rng = random.Random(args.seed)
    episodes = [episode(args, i, rng) for i in range(args.episodes)]
    for e in episodes:
        print(json.dumps(e), flush=True)
    summary = {
        "episodes": len(episodes),
        "node_failures": sum(e["fault"] == "node" for e in episodes),
        "rank_kills": sum(e["fault"] == "rank" for e in episodes),
        "resumed_bitwise": sum(e["bitwise"] for e in episodes),
        "torn_or_undetected": sum(not e["bitwise"] for e in episodes),
        "from_peer_replicas": sum("peer" in e["sources"] for e in episodes),
        "node_failures_from_peer": sum(e["from_peer"] for e in episodes),
        "save_every": args.save_every,
        "episodes_detail": episodes,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "episodes_detail"}))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    if summary["torn_or_undetected"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
