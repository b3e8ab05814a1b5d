"""One rank of the memory-tier tests (test_memory_tier.py launches several).

    memtier_worker.py DURABLE_URL MEMORY_DIR OUT --steps 6 [--stop-at S] [--kill]
                      [--ranks-per-node 2] [--durable-every 3] [--mpi] [--stuck-rank R] [--timeout T]
                      [--load-step S]

Resumes from ``MemoryCheckpointer.load_latest`` (a fresh start when there is
nothing), then trains a small DDP MLP with dropout (each rank its own dropout
masks, so each rank's RNG state matters), saving at every step before the
step's update, and records the state's digest and the next draws of every
random generator at each save. ``--stop-at S`` ends the job right after the save of step S is
committed and replicated everywhere: with ``--kill`` the ranks of the last
node die by SIGKILL (a node failure; the test then wipes that node's memory
directory), the others exit. Each rank writes ``OUT/rank<r>.json``: the step
it resumed from, where its state came from, what it restored (digest and
draws) and what it saved. ``--stuck-rank R``: that rank's replication never
answers (its peers must give up after ``--timeout`` seconds). ``--load-step S``:
resume from step S with ``MemoryCheckpointer.load``, not the newest, and
discard the later checkpoints (``discard_after``) before training on.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import ckpt
from ckpt.memory import MemoryCheckpointer

sys.path.insert(0, os.path.dirname(__file__))
from dist_worker import batch, draws, model_and_opt, report, seed_all, setup, state_digest  # noqa: E402


#: Elements of the frozen tensor (4 MiB: a chunk of its own; below 2 MiB it would be packed).
FROZEN = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("memory_dir")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stop-at", type=int, default=-1)
    p.add_argument("--kill", action="store_true")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--durable-every", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--mpi", action="store_true")
    p.add_argument("--stuck-rank", type=int, default=-1)
    p.add_argument("--load-step", type=int, default=-1)
    args = p.parse_args()

    rank, world = setup(args)
    torch.manual_seed(0)
    model, opt = model_and_opt()
    net: nn.Module = model
    if world > 1 and not args.mpi:
        net = nn.parallel.DistributedDataParallel(model)
    if args.mpi:
        model.eval()  # every rank computes the same steps (no gradient all-reduce)
    seed_all(100 + rank)
    cp = MemoryCheckpointer(
        args.url,
        memory_dir=args.memory_dir,
        ranks_per_node=args.ranks_per_node,
        durable_every=args.durable_every,
        collective_timeout=args.timeout,
    )
    if rank == args.stuck_rank:
        # A peer that stops answering: its replication thread never sends nor receives.
        cp._link.sendrecv = cp._link.sendrecv_into = lambda *_: time.sleep(3600)
    held = cp.memory_steps()  # what this node's memory held before the restore
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # A tensor that never changes: its chunk is the same at every save.
        frozen = torch.zeros(FROZEN)
        if args.load_step >= 0:
            start = cp.load(args.load_step, model=model, optimizer=opt, frozen=frozen)
            cp.discard_after(start)
        else:
            start = cp.load_latest(model=model, optimizer=opt, frozen=frozen)
    row: dict = {
        "rank": rank,
        "node": cp.topology.node(),
        "start": start,
        "source": cp.last_source,
        "held": held,
        "warnings": [str(w.message) for w in caught],
        # What was restored: the state, and the next values of every generator.
        "loaded": {"digest": state_digest(model, opt), "draws": draws()},
        "frozen": start is None or bool(torch.equal(frozen, torch.arange(FROZEN, dtype=torch.float32))),
        "saved": {},
    }
    for step in range(0 if start is None else start, args.steps):
        if step != start:
            digest = state_digest(model, opt)
            cp.save(step, model=model, optimizer=opt, extra={"step": step},
                    frozen=torch.arange(FROZEN, dtype=torch.float32))
            # What a rank that resumes from this step must have and draw next.
            row["saved"][step] = {"digest": digest, "draws": draws()}
        if step == args.stop_at:
            cp.wait()
            row["stopped"] = step
            report(args.out, rank, row)
            sys.stdout.flush()
            if args.kill and cp.topology.node() == cp.topology.nodes - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(0)  # the job is gone; nothing is torn down
        x, y = batch(step, 0 if args.mpi else rank)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if rank == args.stuck_rank:
        cp.durable.wait()
        report(args.out, rank, row)
        sys.stdout.flush()
        os._exit(0)  # its replication thread is stuck for good
    try:
        cp.wait()
    except ckpt.CheckpointError as e:
        # A memory-tier failure (every rank learns of it); the durable saves went on.
        row["wait_error"] = {"cls": type(e).__name__, "errno": getattr(e, "errno", None), "msg": str(e)}
    cp.close()
    row["replication_s"] = cp.replication_seconds
    report(args.out, rank, row)
    if world > 1 and not args.mpi:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except ckpt.CheckpointError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        raise
