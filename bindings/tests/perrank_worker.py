"""One rank of test_per_rank.py's resume test (launched like dist_worker.py).

    perrank_worker.py URL OUT --steps 14 --every 3 [--reference URL2 --kill-at 11]

Two DDP ranks (gloo) train a small MLP with dropout on batches of a shuffled
``torchdata`` ``StatefulDataLoader`` over data of their own (so the ranks'
loaders, batches and dropout masks differ). Each iteration saves first, at
its top (every ``--every`` steps): the model, the optimizer and, per rank,
the loader. A restart restores all three and goes on from the saved step.

With ``--reference``, the rank first trains the whole run uninterrupted
under that root and records its final model, then trains again from scratch
under URL and SIGKILLs itself at the top of step ``--kill-at``, after the
saves before it committed. Without it, the rank resumes from URL's newest
checkpoint and trains to the end. Each writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ckpt

warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata 0.11 on torch 2.13
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def job(rank: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, StatefulDataLoader]:
    """The same model everywhere, a loader of this rank's own data; every generator seeded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 4))
    net = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    data = torch.utils.data.TensorDataset(torch.randn(40, 16, generator=g), torch.randint(0, 4, (40,), generator=g))
    # Shuffled by the global generator, which ckpt saves and restores per
    # rank. (With a generator= of its own, torchdata 0.11's loader resumes the
    # epoch it was in but not the next one's order.)
    loader = StatefulDataLoader(data, batch_size=8, shuffle=True)
    torch.manual_seed(300 + rank)  # this rank's shuffles and dropout masks
    return model, net, opt, loader


def epoch(loader: StatefulDataLoader):  # type: ignore[no-untyped-def]
    """An iterator of the loader, made without drawing from the global generator.

    Making one draws seeds from it (torchdata 0.11), a resumed one too: a
    restart would draw where the uninterrupted run did not, and its dropout
    masks would differ from then on. A new epoch's order still comes from
    the global generator, as the fork starts from it."""
    with torch.random.fork_rng():
        return iter(loader)


def run(url: str, rank: int, steps: int, every: int, kill_at: int = -1) -> dict:
    model, net, opt, loader = job(rank)
    cp = ckpt.Checkpointer(url, collective_timeout=60)
    own: dict = {"loader": loader}
    start = cp.load_latest(model=model, optimizer=opt, per_rank=own)
    row: dict = {"resumed": start, "restored_per_rank": cp.last_per_rank is not None}
    start = 0 if start is None else start
    it = epoch(loader)
    seen = []
    for step in range(start, steps):
        # The one place to save: the top of the iteration, before its batch is
        # drawn, so a restart from step s draws and trains step s again.
        if step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % every == 0 and step != start:
            cp.save(step, model=model, optimizer=opt, per_rank={"loader": loader}).wait()
        try:
            x, y = next(it)
        except StopIteration:  # a new epoch, shuffled by the loader's own generator
            it = epoch(loader)
            x, y = next(it)
        seen.append(hashlib.sha256(x.numpy().tobytes()).hexdigest()[:12])
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    cp.close()
    row.update(digest=digest(model), seen=seen)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--reference", default=None)
    p.add_argument("--kill-at", type=int, default=-1)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    row: dict = {}
    if args.reference:
        row["reference"] = run(args.reference, rank, args.steps, args.every)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump(row, f)  # (this run dies below)
        run(args.url, rank, args.steps, args.every, kill_at=args.kill_at)
        raise AssertionError("not killed")
    row["resumed"] = run(args.url, rank, args.steps, args.every)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
