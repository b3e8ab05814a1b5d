"""One rank of the sharded-state tests (test_sharded.py runs it under torchrun).

    fsdp_worker.py train URL OUT --steps 6 --save-at 3[,5] [--tp] [--lazy] [--die-rank R --die-at S] [--timeout T]
                   [--depth D] [--stand-in]
    fsdp_worker.py load URL OUT --steps 6 [--tp]
    fsdp_worker.py plain URL OUT --steps 6           (one process, no process group)

``train`` builds a small MLP whose dimensions do not divide by the rank count,
shards it with FSDP2 (``fully_shard``; with ``--tp`` a 2x2 mesh of tensor
parallel x FSDP), trains it with AdamW on per-rank batches and saves model and
optimizer through ckpt at ``--save-at``. ``load`` builds the same model on the
current ranks (any count, FSDP or FSDP x TP) and restores the newest
checkpoint; ``plain`` restores into an unsharded model in a single process.
Each rank writes ``OUT/<mode>-rank<r>.json``: digests of the full state (as
PyTorch gathers it itself) after the save/load and at the end, and its I/O.

``--compile`` (every mode) trains, saves and loads ``torch.compile``'s
wrapper of the model, whose keys are ``_orig_mod.*``; the digests are by the
model's own names (DCP's ``get_state_dict`` takes the wrapper off).

``--depth D`` (every mode) builds a narrower MLP of D hidden layers instead,
with enough tensors per mapping for repeated saves to be taken in bulk.
``--stand-in`` routes the CPU tensors through ckpt's device path (the tests'
own device, ``cpu_device.CpuDevice``, in use). Each save records how many mappings were
taken in bulk (``bulk``): by the CUDA path's plans with ``--stand-in``, else
by the plans of CPU tensors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import ckpt

DIMS = (1024, 1536, 1031, 5)  # 1031 and 5 shard unevenly over 2, 3 and 4 ranks; TP splits 1536
DEEP = 64  # the input width of ``--depth``'s model


def build(depth: int = 0) -> nn.Module:
    torch.manual_seed(0)
    if depth:
        dims = (DEEP,) + (97,) * depth + (DIMS[3],)  # 97 shards unevenly over 2 and 3 ranks
        layers: list = []
        for a, b in zip(dims, dims[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return nn.Sequential(*layers[:-1])
    return nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.ReLU(), nn.Linear(DIMS[1], DIMS[2]), nn.ReLU(), nn.Linear(DIMS[2], DIMS[3]))


def shard(model: nn.Module, tp: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if tp:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for i in range(0, len(model), 2):  # the Linear layers
        fully_shard(model[i], mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def batch(step: int, rank: int, width: int = DIMS[0]) -> tuple:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, width, generator=g), torch.randn(8, DIMS[3], generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    x, y = batch(step, rank, getattr(model, "_orig_mod", model)[0].in_features)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every parameter and optimizer tensor, unsharded, keyed by parameter name."""
    if dist.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    else:
        msd = model.state_dict()
        names = {id(p): n for n, p in model.named_parameters()}
        params = [p for g in opt.param_groups for p in g["params"]]
        osd = {"state": {names[id(params[i])]: s for i, s in opt.state_dict()["state"].items()}}
    out = {f"model.{k}": v for k, v in msd.items()}
    for name, s in osd["state"].items():
        for k, v in s.items():
            out[f"optim.{name}.{k}"] = v
    return out


def digests(state: dict) -> dict:
    out = {}
    for k, t in sorted(state.items()):
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        t = t.detach().contiguous().cpu()
        out[k] = [str(t.dtype), list(t.shape), hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
    return out


def local_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    def n(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(n(t) for t in model.state_dict().values())
    for s in opt.state_dict()["state"].values():
        total += sum(n(t) for t in s.values() if isinstance(t, torch.Tensor))
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["train", "load", "plain"])
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-at", default="3")
    ap.add_argument("--tp", action="store_true")
    ap.add_argument("--lazy", action="store_true")
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--die-at", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--stand-in", action="store_true")
    ap.add_argument("--ready", action="store_true", help="train: load_latest first, as a job's fresh start does")
    ap.add_argument("--compile", action="store_true", help="train and save or load torch.compile's wrapper of the model")
    a = ap.parse_args()
    bulk: list = []  # mappings taken in bulk since the last save

    def record(module: object, name: str) -> None:
        real = getattr(module, name)

        def emit(*args: object) -> bool:
            ok = real(*args)
            bulk.append(ok)
            return ok

        setattr(module, name, emit)

    if a.stand_in:
        import ckpt._save.repeat as rp
        from ckpt._device.device import use
        from cpu_device import CpuDevice

        use(CpuDevice())
        record(rp, "_emit")
        # Its state counts as CUDA state (a fresh start readies the first save for it).
        ckpt._save.ahead.cuda_device_in = lambda objs: torch.device("cpu")
    else:
        import ckpt._save.repeat_host as rh

        record(rh, "emit")
    save_at = {int(x) for x in a.save_at.split(",")}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sharded = a.mode != "plain"
    if sharded:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if sharded else 0
    model = build(a.depth)
    if sharded:
        model = shard(model, a.tp)
    if a.compile:
        model = torch.compile(model, backend="eager")  # (its state dict's keys: _orig_mod.*)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    cp = ckpt.Checkpointer(a.url, lazy=a.lazy, collective_timeout=a.timeout, coordinate="auto" if sharded else "none")
    row: dict = {"rank": rank, "world": dist.get_world_size() if sharded else 1}
    start = 0
    if a.mode == "train" and a.ready:
        assert cp.load_latest(model=model, optimizer=opt) is None
    if a.mode in ("load", "plain"):
        before = cp.io_counts()
        start = cp.load_latest(model=model, optimizer=opt)
        after = cp.io_counts()
        row["loaded"] = start
        row["read_bytes"] = after["read_bytes"] - before["read_bytes"]
        row["at_save"] = digests(full_state(model, opt))
    # Ranks of one tensor-parallel group see the same batch (one per data-parallel rank).
    data_rank = rank // 2 if a.tp else rank
    for step in range(start, a.steps):
        train_step(model, opt, step, data_rank)
        if a.mode == "train" and step + 1 in save_at:
            before = cp.io_counts()
            h = cp.save(step + 1, model=model, optimizer=opt)
            if rank == a.die_rank and step + 1 == a.die_at:
                os._exit(17)  # mid-save: the others must time out, the previous checkpoint stays
            try:
                report = h.wait()
            except ckpt.CheckpointError as e:
                row["error"] = type(e).__name__
                (out / f"{a.mode}-rank{rank}.json").write_text(json.dumps(row))
                sys.stdout.flush()
                os._exit(3)
            row["written_bytes"] = cp.io_counts()["written_bytes"] - before["written_bytes"]
            row["stored_bytes"] = report["stored_bytes"]
            row["local_bytes"] = local_bytes(model, opt)
            row["at_save"] = digests(full_state(model, opt))
            row.setdefault("bulk", []).append(sum(bulk))
            bulk.clear()
    cp.close()
    row["final"] = digests(full_state(model, opt))
    (out / f"{a.mode}-rank{rank}.json").write_text(json.dumps(row))
    if sharded:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
