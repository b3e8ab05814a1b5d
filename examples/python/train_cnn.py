"""Train a small CNN on generated images, checkpointing with ckpt; resume after a crash.

A template for adding checkpoints to a PyTorch training loop:

    python examples/python/train_cnn.py --ckpt file:///tmp/run1 --steps 200 --every 20

Kill it at any moment (even with SIGKILL, even in the middle of a save) and
start it again with the same arguments: it resumes from the newest complete
checkpoint and ends with bitwise the same weights as a run that was never
interrupted. ``--digest FILE`` writes a SHA-256 of the final model and
optimizer state so runs can be compared.

The same script trains data parallel (DDP, gloo) under torchrun; every rank
checkpoints into one logical checkpoint, coordinated through torch.distributed:

    torchrun --standalone --nproc-per-node 2 examples/python/train_cnn.py --ckpt file:///tmp/run2

What makes resume exact:
  * the checkpoint is taken at the top of an iteration, so it holds the state
    *before* that step: model, optimizer, and the global RNGs (dropout);
  * batches depend only on the step number (and the rank: a generator seeded
    per step), so no data-loader position needs saving;
  * under torchrun each rank's RNG state (its own dropout masks) is saved and
    restored per rank;
  * deterministic CPU kernels and one thread.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import ckpt


class SmallCNN(nn.Module):
    """Two conv blocks with batch norm and dropout: parameters and buffers both matter."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.drop(x.flatten(1)))


def batch(step: int, size: int, seed: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 16x16 images whose class is which quadrant holds a bright blob."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + rank * 1_000_000_007)
    labels = torch.randint(0, 4, (size,), generator=g)
    images = torch.randn(size, 1, 16, 16, generator=g) * 0.3
    for i, c in enumerate(labels.tolist()):
        r, col = divmod(c, 2)
        images[i, 0, r * 8 + 2 : r * 8 + 6, col * 8 + 2 : col * 8 + 6] += 1.5
    return images, labels


def digest(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """SHA-256 over every tensor of the model and optimizer state, in order."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for pid, s in sorted(opt.state_dict()["state"].items()):
        for k, t in sorted(s.items()):
            h.update(f"{pid}.{k}".encode())
            h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# The DDP wrapper outlives main() so that it is never torn down (see the end).
_KEEP_ALIVE: list = []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint root URL (file:///dir)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lazy", action="store_true", help="lazy snapshots (copy overlaps forward/backward)")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--digest", help="write the final state's SHA-256 here")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (to watch it)")
    args = p.parse_args(argv)

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    # Under torchrun: data parallel over gloo. ckpt sees torch.distributed
    # initialised and coordinates every rank's save into one checkpoint.
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if distributed else 0

    torch.manual_seed(args.seed)
    model = SmallCNN()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    net = nn.parallel.DistributedDataParallel(model) if distributed else model
    _KEEP_ALIVE.append(net)  # see the end of the file
    torch.manual_seed(args.seed + rank)  # each rank its own dropout masks
    cp = ckpt.Checkpointer(args.ckpt, keep_last=args.keep_last, lazy=args.lazy)

    # Restores model, optimizer and RNG state in place; None on a fresh start.
    start = cp.load_latest(model=model, optimizer=opt)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"resumed at step {start}" if start is not None else "fresh start", flush=True)
    start = start or 0

    model.train()
    for step in range(start, args.steps):
        if step % args.every == 0 and step != start:
            # The state *before* this step. In lazy mode the copy overlaps the
            # forward and backward below; opt.step() waits for it (a hook).
            say(f"save {step}", flush=True)
            if distributed:
                # A tensor every rank holds is stored once, from one of them, so
                # replicas must agree. Batch-norm statistics drift apart per rank
                # until DDP broadcasts rank 0's at the next forward: do it now.
                for b in model.buffers():
                    torch.distributed.broadcast(b, 0)
            cp.save(step, model=model, optimizer=opt)
        x, y = batch(step, args.batch, args.seed, rank)
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.every == 0:
            say(f"step {step} loss {loss.item():.4f}", flush=True)
        if args.step_delay:
            time.sleep(args.step_delay)
    cp.close()  # every save durable, hooks removed (on every rank, before the group goes)
    if distributed:
        torch.distributed.destroy_process_group()

    if args.digest and rank == 0:
        tmp = args.digest + ".tmp"
        with open(tmp, "w") as f:
            f.write(digest(model, opt))
        os.replace(tmp, args.digest)
    say("done", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    if os.environ.get("WORLD_SIZE", "1") != "1":
        # Under torchrun, leave without tearing the DDP model down: PyTorch can
        # deadlock there (the Reducer's gloo group joins a worker thread that waits
        # for the GIL the dealloc holds), so the model is kept alive past main() and
        # the process exits directly. Every checkpoint is durable and the process
        # group is destroyed by now, so nothing is lost.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
