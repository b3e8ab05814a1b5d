"""Sharded training state (FSDP2) checkpointed side by side by ckpt and PyTorch's own.

Run under torchrun (gloo on CPU); ``ckpt-eval sharded`` does it for 2 and 4 ranks:

    python -m torch.distributed.run --nproc_per_node N sharded_bench.py --dir D [--mib 64] [--repeats 1]

Every rank builds the same MLP (``--mib`` MiB of f32 parameters, dimensions that
do not divide by the rank count), shards it with FSDP2 (``fully_shard``) and takes
one AdamW step, so model and optimizer state (about 3x the parameters) exist as
DTensors. Then, per method and repeat, after a barrier:

- save: ``stall`` is how long the call blocks the caller; ``snapshot`` until the
  state may be mutated again (staging done); ``durable`` until the data is on
  disk. ckpt and ``dcp`` (``FileSystemWriter(sync_files=True)``) fsync their
  files themselves; ``torch-checkpointing`` 0.1.1 does not, so its
  ``pre_finalize_callback`` fsyncs each rank's files in its writer process
  before its ranks' barrier, and its write future resolves after that.
- the page cache is dropped (``echo 1 > /proc/sys/vm/drop_caches``, else
  ``posix_fadvise(DONTNEED)`` on the method's files; reported), then a freshly
  built FSDP2 model and optimizer (other random values) load the checkpoint, and
  every local shard of model and optimizer state is checked equal
  (``torch.equal``) to what was saved.
- bytes written per rank: ckpt's own counter (``io_counts``), else the bytes
  under the method's directory / ranks.
- peak extra host memory: the proportional set size (Pss, from
  ``/proc/<pid>/smaps_rollup``, so pages shared with a writer subprocess are not
  counted twice) of the rank and its child processes, sampled every 10 ms on a
  thread from just before the save until durable, over two saves before the
  timed ones (the method's first, cold save and a warm one after a training
  step), minus the value before the first, so staging pools a method keeps
  between saves count. Before each sampled save, garbage is collected and freed
  heap handed back to the OS (``malloc_trim``). The sampler slows what it
  samples (it takes the lock on the rank's address space, and the GIL), so
  the timed saves run without it.

Floors, measured by the same ranks in the same run: write + fsync of a rank's
local bytes to one file, the cold read of that file, and a copy of the local
state into preallocated buffers. Every figure is the slowest (largest) rank's.
Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

from peers import MAKERS, Method, Peak, drop_cache_ranks, floors, timed_save

LAYERS = 8


def dims(mib: float, world: int) -> int:
    """Hidden size: LAYERS square layers of about ``mib`` MiB in all, not divisible by ``world``."""
    h = max(8, int((mib * (1 << 20) / 4 / LAYERS) ** 0.5))
    while any(h % d == 0 for d in range(2, max(world, 4) + 1)):
        h += 1
    return h


def build(h: int, seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(h, h), nn.ReLU()]
    model = nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_opt(model: nn.Module, seed: int, h: int) -> torch.optim.Optimizer:
    """AdamW after one step (so its state exists), on a batch that depends on ``seed``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    x = torch.randn(4, h, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def local_view(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Every local shard of model and optimizer state, keyed by FQN (not copied)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": local(v) for k, v in msd.items()}
    for name, s in osd["state"].items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{name}.{k}"] = local(v)
    return out


def nbytes(state: dict) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ---------------------------------------------------------------- main

def max_over_ranks(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def train_step(model, opt, h: int, step: int) -> None:
    g = torch.Generator().manual_seed(7919 * step + dist.get_rank())
    model(torch.randn(4, h, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def run_method(m: Method, a, h: int, model, opt) -> dict:
    """Two saves sampled for memory (a cold one, so savers, pools and writer
    subprocesses exist, then a warm one), then per repeat: a training step
    (every value changes), a timed save, a cold load checked shard by shard.

    Reading a process's Pss takes the kernel's lock on its address space (tens
    of milliseconds for a rank holding GiBs) and the sampler thread competes
    for the GIL, so the sampler would slow what it samples: the timed saves run
    without it."""
    rows = {"stall_s": [], "snapshot_s": [], "durable_s": [], "load_s": [],
            "written_bytes": [], "peak_extra_bytes": []}
    cache = None
    m.bind(model, opt)
    dist.barrier()
    with Peak() as p:  # from before the first save: staging pools and writer processes count
        with p.active():
            m.open()
            timed_save(m, 0)
        train_step(model, opt, h, 100)
        dist.barrier()
        with p.active():
            timed_save(m, 1)
    rows["peak_extra_bytes"].append(max_over_ranks(p.extra))
    for rep in range(a.repeats):
        step = rep + 2
        train_step(model, opt, h, 100 + step)
        ref = {k: v.detach().clone() for k, v in local_view(model, opt).items()}
        dist.barrier()
        stall, snap, durable = timed_save(m, step)
        m.measure_written(step)
        written = m.written
        fresh = build(h, seed=1000 + rep)
        fopt = make_opt(fresh, seed=1000 + rep, h=h)
        dist.barrier()
        cache = drop_cache_ranks(m.dir)
        t = time.perf_counter()
        m.bind(fresh, fopt).load(step)
        load = time.perf_counter() - t
        m.bind(model, opt)
        got = local_view(fresh, fopt)
        bad = [k for k, v in ref.items() if k not in got or not torch.equal(got[k], v)]
        if bad:
            raise RuntimeError(f"{m.name}: {len(bad)} local shards differ after load, e.g. {bad[:3]}")
        del fresh, fopt, got, ref
        for k, v in (("stall_s", stall), ("snapshot_s", snap), ("durable_s", durable),
                     ("load_s", load), ("written_bytes", written)):
            rows[k].append(max_over_ranks(v))
    m.close()
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(m.dir, ignore_errors=True)
    rows["cache_drop"] = cache
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mib", type=float, default=64.0, help="MiB of f32 parameters (AdamW adds twice that)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--methods", default="ckpt eager,ckpt lazy,ckpt lazy (AppState),dcp.save,dcp.async_save,"
                    "dcp.save -> ckpt,dcp.async_save -> ckpt,torch-checkpointing")
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = os.path.abspath(a.dir)
    os.makedirs(work, exist_ok=True)
    h = dims(a.mib, world)
    model = build(h, seed=0)
    opt = make_opt(model, seed=0, h=h)
    view = local_view(model, opt)
    ref = {k: v.detach().clone() for k, v in view.items()}
    del view
    local_bytes = nbytes(ref)
    fl = floors(ref, work)
    del ref
    out = {
        "ranks": world,
        "hidden": h,
        "layers": LAYERS,
        "param_bytes": LAYERS * (h * h + h) * 4,
        "local_bytes": int(max_over_ranks(local_bytes)),
        "torch": torch.__version__,
        "floors": {k: (max_over_ranks(v) if isinstance(v, float) else v) for k, v in fl.items()},
        "methods": [],
    }
    for name in [s.strip() for s in a.methods.split(",") if s.strip()]:
        row: dict = {"name": name}
        m = MAKERS[name](work)
        try:
            m.prepare()
        except Exception as e:  # noqa: BLE001 - any import failure skips the method
            row["skipped"] = f"{type(e).__name__}: {e}"
            out["methods"].append(row)
            continue
        if name == "dcp.async_save":
            row["pinned_stager"] = m.pinned
        row.update(run_method(m, a, h, model, opt))
        out["methods"].append(row)
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
