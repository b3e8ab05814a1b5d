"""One rank of the DCP tests (test_dcp.py runs it under torchrun).

    dcp_worker.py save URL OUT --step S [--async thread|process]
    dcp_worker.py load URL OUT --step S
    dcp_worker.py failures URL OUT --step S
    dcp_worker.py train URL OUT --steps N --every K [--slow-after S]

``save`` builds a small MLP whose dimensions do not divide by the rank count,
shards it with FSDP2 (``fully_shard``) over all ranks, trains it two steps
with AdamW and saves model, optimizer and some plain data through
``torch.distributed.checkpoint`` (``dcp.save``, or ``dcp.async_save`` in a
thread or a process) into ckpt (:mod:`ckpt.dcp`), step ``S``. ``load`` builds
the same model on the current ranks (any count), loads step ``S`` with
``dcp.load`` and hands it to the model and optimizer. Each rank writes
``OUT/<mode>-rank<r>.json``: digests of the full state (as PyTorch gathers
it itself) and the plain data. ``failures`` makes saves of step ``S`` fail
on one rank (a write item it cannot resolve, metadata ckpt cannot store, a
dtype it cannot store), then saves it, then saves it again (a conflict),
and records how each went on each rank: every failure must reach every rank
at once, with no engine save left waiting for a rank that will not come.
``train`` is a training loop of N steps that saves model and optimizer
with ``dcp.save`` every K steps, and at its start resumes with ``dcp.load``
from the root's newest committed step (killed.py's crash pattern: rank 0
marks each committed save, and writes the final full state at the end).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import ckpt
import killed
from ckpt.dcp import StorageReader, StorageWriter

DIMS = (64, 97, 31, 5)  # 97, 31 and 5 shard unevenly over 2 and 3 ranks


def build() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIMS[0], DIMS[1]), nn.ReLU(), nn.Linear(DIMS[1], DIMS[2]), nn.ReLU(),
                          nn.Linear(DIMS[2], DIMS[3]))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for i in range(0, len(model), 2):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    """One step on the batch of (``step``, this rank)."""
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x, y = torch.randn(8, DIMS[0], generator=g), torch.randn(8, DIMS[3], generator=g)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        train_step(model, opt, step)


def digests(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    flat = {f"model.{k}": v for k, v in msd.items()}
    for name, s in osd["state"].items():
        for k, v in s.items():
            flat[f"optim.{name}.{k}"] = v
    out = {}
    for k, t in sorted(flat.items()):
        t = t.detach().contiguous().cpu()
        out[k] = [str(t.dtype), list(t.shape), hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "load", "failures", "train"])
    ap.add_argument("url")
    ap.add_argument("out")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--steps", type=int, default=0)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--slow-after", type=int)
    ap.add_argument("--async", dest="async_", choices=["thread", "process"])
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    row: dict = {"world": dist.get_world_size()}
    if a.mode == "train":
        loop(a.url, Path(a.out), model, opt, a.steps, a.every, a.slow_after)
        dist.barrier()
        dist.destroy_process_group()
        return
    if a.mode == "failures":
        train(model, opt, 1)
        row["cases"] = failures(a.url, a.step, {"model": get_state_dict(model, opt)[0]})
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"failures-rank{rank}.json").write_text(json.dumps(row))
        dist.barrier()
        dist.destroy_process_group()
        return
    if a.mode == "save":
        train(model, opt, 2)
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "extra": {"epoch": 3, "note": f"saved by {dist.get_world_size()}"}}
        writer = StorageWriter(a.url)
        cid = f"step-{a.step}"
        if a.async_ is None:
            dcp.save(state, checkpoint_id=cid, storage_writer=writer)
        else:
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

            kind = AsyncCheckpointerType.PROCESS if a.async_ == "process" else AsyncCheckpointerType.THREAD
            fut = dcp.async_save(state, checkpoint_id=cid, storage_writer=writer, async_checkpointer_type=kind)
            fut = getattr(fut, "upload_completion", fut)
            fut.result()
        writer.close()
        row["extra"] = state["extra"]
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "extra": {"epoch": 0, "note": ""}}
        dcp.load(state, checkpoint_id=f"step-{a.step}", storage_reader=StorageReader(a.url))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        row["extra"] = state["extra"]
    row["digests"] = digests(model, opt)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.mode}-rank{rank}.json").write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()


def loop(url: str, out: Path, model: nn.Module, opt: torch.optim.Optimizer, steps: int, every: int,
         slow_after: "int | None") -> None:
    """Train ``steps`` steps from the newest committed step, saving every ``every``."""
    rank = dist.get_rank()
    committed = ckpt.Checkpointer(url, read_only=True).steps()
    start = committed[-1] if committed else 0
    if committed:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=start, storage_reader=StorageReader(url))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed from {start}", flush=True)
    writer = StorageWriter(url)
    for step in range(start, steps):
        if step != start and step % every == 0:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=step, storage_writer=writer)
            if rank == 0:  # dcp.save returns on every rank once the coordinator's finish committed it
                killed.mark(out, step)
        killed.slow(out, slow_after)
        train_step(model, opt, step)
    writer.close()
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        tensors = {f"model.{k}": v for k, v in msd.items()}
        tensors.update(killed.optimizer_tensors("optim", osd["state"]))
        killed.write_final(out, tensors, {"steps": steps, "world": dist.get_world_size()})


def failures(url: str, step: int, state: dict) -> dict:
    """Each case: the failure's type on this rank (``None``: saved) and the seconds it took."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    rank = dist.get_rank()

    class FailsOnRank1(DefaultSavePlanner):
        def resolve_data(self, write_item):  # type: ignore[no-untyped-def]
            if rank == 1:
                raise RuntimeError("rank 1 cannot resolve its items")
            return super().resolve_data(write_item)

    class UnstorableMetadata(DefaultSavePlanner):
        def create_global_plan(self, all_plans):  # type: ignore[no-untyped-def]
            plans, md = super().create_global_plan(all_plans)
            md.planner_data = {"not plain": object()}
            return plans, md

    writer = StorageWriter(url, collective_timeout=120.0)
    cases = {}

    def attempt(name: str, s: dict, planner: object = None) -> None:
        t0 = time.perf_counter()
        outcome = None
        try:
            dcp.save(s, checkpoint_id=step, storage_writer=writer, planner=planner)
        except CheckpointException as e:
            (exc, _), *_ = e.failures.values()
            outcome = type(exc).__name__
        cases[name] = [outcome, time.perf_counter() - t0]

    attempt("resolve", state, FailsOnRank1())
    attempt("metadata", state, UnstorableMetadata())
    attempt("dtype", {**state, "odd": torch.zeros(3, dtype=torch.complex128)})
    attempt("ok", state)
    attempt("again", state)
    writer.close()
    return cases


if __name__ == "__main__":
    main()
