"""One rank of the distributed tests (test_distributed.py launches several).

    dist_worker.py train URL OUT --steps 5 --save-at 2,4 [--die-rank R --die-at S] [--mpi]
    dist_worker.py load URL OUT [--mpi]
    dist_worker.py rollback URL OUT --back 2 --steps 5 --save-at 3,4 --shift 50

Under torch.distributed the rendezvous comes from the environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT: what torchrun sets; the tests set them
themselves); with ``--mpi`` the process runs under mpirun and ckpt coordinates
through mpi4py. Each rank writes ``OUT/rank<r>.json`` with what it saw.

``train`` trains a small MLP with dropout, data parallel (DDP with gloo; under
MPI every rank computes the same steps, so the replicas stay identical), and
saves at the given steps. ``rollback`` goes back to the checkpoint of
``--back`` (``load``), discards the later ones, and trains on from it on other
batches (``--shift``), saving as ``train`` does. Each rank's random generators are seeded per rank,
so their states differ. ``--die-rank`` makes that rank ``os._exit`` right after
``save`` of ``--die-at`` returned, while the save is still in flight.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import struct
import sys
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import ckpt


def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.3), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def state_digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for pid, s in sorted(opt.state_dict()["state"].items()):
        for k, t in sorted(s.items()):
            h.update(f"{pid}.{k}".encode())
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for s in opt.state_dict()["state"].values():
        n += sum(t.numel() * t.element_size() for t in s.values() if isinstance(t, torch.Tensor))
    return n


def draws() -> list:
    """The next values of every global generator (bit-exact, JSON-friendly)."""
    return [
        struct.pack("<d", random.random()).hex(),
        struct.pack("<d", float(np.random.rand())).hex(),
        torch.rand(3).view(torch.int32).tolist(),
    ]


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(args: argparse.Namespace) -> tuple[int, int]:
    torch.set_num_threads(1)
    if args.mpi:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def report(out: str, rank: int, row: dict) -> None:
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(row, f)
    os.replace(path + ".tmp", path)


def train(args: argparse.Namespace) -> None:
    rank, world = setup(args)
    torch.manual_seed(0)  # the same initial weights everywhere (DDP would broadcast them anyway)
    model, opt = model_and_opt()
    net: nn.Module = model
    if world > 1 and not args.mpi:
        net = nn.parallel.DistributedDataParallel(model)
    if args.mpi:
        # No gradient all-reduce here: every rank computes the same step (the same
        # batches, dropout off), so the replicas stay identical bit for bit.
        model.eval()
    seed_all(100 + rank)  # each rank's own dropout masks
    cp = ckpt.Checkpointer(args.url, collective_timeout=args.timeout)
    assert (cp.rank, cp.world_size) == (rank, world), (cp.rank, cp.world_size, rank, world)
    save_at = [int(s) for s in args.save_at.split(",")]
    row: dict = {"rank": rank, "world": world, "saves": {}}
    handles = {}
    for step in range(args.steps):
        if step in save_at and step == args.busy_at and rank == args.busy_rank:
            # Busy elsewhere past the collective timeout: never comes to this save.
            time.sleep(args.busy_s)
            report(args.out, rank, {"rank": rank, "busy": True})
            sys.stdout.flush()
            os._exit(0)
        if step in save_at:
            if step in (args.die_at, args.busy_at):
                for h in handles.values():
                    h.wait()  # the earlier checkpoints are durable: only this one is in flight
            row["saves"][step] = {"digest": state_digest(model, opt), "state_bytes": state_bytes(model, opt)}
            handles[step] = cp.save(step, model=model, optimizer=opt, extra={"step": step, "world": world})
            if step in (args.die_at, args.busy_at):
                if step == args.die_at and rank == args.die_rank:
                    os._exit(3)  # in the middle of the save: its persist is still running
                # The others go on to wait for the save (a training step would now
                # fail in DDP's own all-reduce, which is not what is tested here).
                break
            if step == save_at[-1]:
                # What a rank that loads this checkpoint must draw next.
                row["draws"] = draws()
        x, y = batch(step, 0 if args.mpi else rank)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    t0 = time.monotonic()
    try:
        for step, h in handles.items():
            rep = h.wait()
            row["saves"][step]["raw_bytes"] = rep["raw_bytes"]
        row["error"] = None
    except ckpt.CheckpointError as e:
        row["error"] = type(e).__name__
        row["message"] = str(e)
        row["ranks"] = getattr(e, "ranks", None)
    row["wait_s"] = time.monotonic() - t0
    if row["error"] is not None:
        # What a restarted job would find: read without coordination.
        row["latest_after_failure"] = ckpt.Checkpointer(args.url, coordinate="none").steps()[-1]
    report(args.out, rank, row)
    if row["error"] is None:
        cp.close()
        if world > 1 and not args.mpi:
            torch.distributed.destroy_process_group()
        return
    # A peer died: the training's own process group is dead too, and tearing it
    # down could block. Leave as a job would after reporting the failure.
    sys.stdout.flush()
    os._exit(0)


def rollback(args: argparse.Namespace) -> None:
    rank, world = setup(args)
    torch.manual_seed(12345)  # weights unlike the saved ones
    model, opt = model_and_opt()
    net = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    seed_all(1000 + rank)
    cp = ckpt.Checkpointer(args.url, collective_timeout=args.timeout)
    save_at = [int(s) for s in args.save_at.split(",")]
    row: dict = {"rank": rank, "world": world, "saves": {}}
    assert cp.load(args.back, model=model, optimizer=opt) == args.back
    row["loaded"] = state_digest(model, opt)
    try:
        cp.save(save_at[0], model=model, optimizer=opt, extra={"step": save_at[0], "world": world})
        row["refused"] = None
    except ckpt.ConflictError as e:
        row["refused"] = str(e)
    report_ = cp.discard_after(args.back)
    row["discarded"] = sorted(s for s, _ in report_.retired)
    for step in range(args.back, args.steps):
        if step in save_at:
            row["saves"][step] = {"digest": state_digest(model, opt)}
            cp.save(step, model=model, optimizer=opt, extra={"step": step, "world": world}).wait()
        x, y = batch(step + args.shift, rank)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    row["steps"] = cp.steps()
    report(args.out, rank, row)
    cp.close()
    if world > 1:
        torch.distributed.destroy_process_group()


def load(args: argparse.Namespace) -> None:
    rank, world = setup(args)
    torch.manual_seed(12345)  # weights unlike the saved ones
    model, opt = model_and_opt()
    seed_all(1000 + rank)
    cp = ckpt.Checkpointer(args.url, collective_timeout=args.timeout)
    if rank == args.busy_rank:
        time.sleep(args.busy_s)  # busy elsewhere: never comes to the load
        report(args.out, rank, {"rank": rank, "busy": True})
        sys.stdout.flush()
        os._exit(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.monotonic()
        try:
            step = cp.load_latest(model=model, optimizer=opt)
        except ckpt.CheckpointError as e:
            failed = {"rank": rank, "error": type(e).__name__, "message": str(e)}
            failed.update(ranks=getattr(e, "ranks", None), wait_s=time.monotonic() - t0)
            report(args.out, rank, failed)
            sys.stdout.flush()
            os._exit(0)  # the job's process group is out of step: leave as a job would
    row = {
        "rank": rank,
        "world": world,
        "cp_world": cp.world_size,
        "step": step,
        "digest": state_digest(model, opt),
        "draws": draws(),
        "warnings": [str(w.message) for w in caught],
        "extra": cp.read_latest().state["extra"],
    }
    report(args.out, rank, row)
    cp.close()
    if world > 1 and not args.mpi:
        torch.distributed.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["train", "load", "rollback"])
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save-at", default="2,4")
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-at", type=int, default=-1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--busy-rank", type=int, default=-1)
    p.add_argument("--busy-at", type=int, default=-1)
    p.add_argument("--busy-s", type=float, default=0.0)
    p.add_argument("--back", type=int, default=2)
    p.add_argument("--shift", type=int, default=0)
    p.add_argument("--mpi", action="store_true")
    args = p.parse_args()
    {"train": train, "load": load, "rollback": rollback}[args.what](args)


if __name__ == "__main__":
    main()
