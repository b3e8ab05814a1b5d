"""One rank of the memory tier's sharded test (test_memory_tier.py runs it under torchrun).

    memtier_fsdp_worker.py DURABLE_URL MEMORY_DIR OUT --steps 5 [--stop-at S] [--ranks-per-node 1]

The FSDP2 model of ``fsdp_worker.py`` (dimensions that shard unevenly),
trained with AdamW and saved through ``MemoryCheckpointer`` at every step
(the durable tier only at the first save). It first resumes with
``load_latest``. ``--stop-at S`` ends the job after the save of step S is
replicated. Each rank writes ``OUT/rank<r>.json``: where it resumed from, the
digests of the full state (as PyTorch gathers it) after the load and at
each save.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from fsdp_worker import build, digests, full_state, shard, train_step  # noqa: E402

from ckpt.memory import MemoryCheckpointer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("memory_dir")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--stop-at", type=int, default=-1)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    model = shard(build(), tp=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    cp = MemoryCheckpointer(a.url, memory_dir=a.memory_dir, ranks_per_node=a.ranks_per_node, durable_every=1000,
                            collective_timeout=120.0)
    start = cp.load_latest(model=model, optimizer=opt)
    row: dict = {"rank": rank, "start": start, "source": cp.last_source, "saved": {}}
    if start is not None:
        row["loaded"] = digests(full_state(model, opt))
    for step in range(0 if start is None else start, a.steps):
        if step != start:
            cp.save(step, model=model, optimizer=opt)
            row["saved"][step] = digests(full_state(model, opt))
        if step == a.stop_at:
            cp.wait()
            Path(a.out, f"rank{rank}.json").write_text(json.dumps(row))
            sys.stdout.flush()
            os._exit(0)
        train_step(model, opt, step, rank)
    cp.close()
    Path(a.out, f"rank{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
