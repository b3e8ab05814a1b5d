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

import abc
import argparse
import json
import os
import shutil
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

from benchlib import Peak, drop_cache, fsync_written, tree_bytes

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


# ---------------------------------------------------------------- floors

def floors(state: dict, work: str) -> dict:
    """write + fsync, cold read and copy of this rank's local bytes."""
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()])
    path = os.path.join(work, f"floor-rank{dist.get_rank()}.bin")
    mv = memoryview(flat.numpy())
    dist.barrier()
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        f.write(mv)
        os.fsync(f.fileno())
    write = time.perf_counter() - t
    dist.barrier()
    how = drop_cache(path) if dist.get_rank() == 0 else None
    dist.barrier()
    how = broadcast(how)
    if how != "drop_caches":
        how = drop_cache(path)
    dist.barrier()
    back = torch.empty_like(flat)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        f.readinto(memoryview(back.numpy()))
    read = time.perf_counter() - t
    assert torch.equal(back, flat)
    os.remove(path)
    del back
    dsts = {k: torch.empty_like(v) for k, v in state.items()}
    for k, v in state.items():  # touch the pages first
        dsts[k].zero_()
    dist.barrier()
    t = time.perf_counter()
    for k, v in state.items():
        dsts[k].copy_(v)
    copy = time.perf_counter() - t
    return {"write_fsync_s": write, "read_cold_s": read, "memcpy_s": copy, "cache_drop": how}


def broadcast(obj):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------- methods

class Method(abc.ABC):
    """One way to checkpoint: a saver kept across saves (as in training), its
    directory. Each peer below implements ``save`` and ``load``."""

    name = "?"

    def __init__(self, work: str) -> None:
        self.dir = os.path.join(work, self.name.replace(" ", "_").replace(".", "_"))

    def prepare(self) -> None:
        """Import what the method needs (an exception skips the method)."""

    def open(self) -> None:
        """A fresh directory and saver."""
        if dist.get_rank() == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
            os.makedirs(self.dir, exist_ok=True)
        dist.barrier()

    def step_dir(self, step: int) -> str:
        return os.path.join(self.dir, f"step_{step}")

    @abc.abstractmethod
    def save(self, model, opt, step: int):
        """Returns (stall, snapshot, durable) in seconds from the call."""

    @abc.abstractmethod
    def load(self, model, opt, step: int) -> None:
        """Load step ``step`` into ``model`` and ``opt`` (fresh ones)."""

    def written(self, step: int, world: int) -> int:
        return tree_bytes(self.step_dir(step)) // world

    def close(self) -> None:
        pass


class Ckpt(Method):
    def __init__(self, work: str, lazy: bool) -> None:
        self.lazy = lazy
        self.name = "ckpt lazy" if lazy else "ckpt eager"
        self.cp = None
        super().__init__(work)

    def prepare(self) -> None:
        import ckpt  # noqa: F401

    def open(self) -> None:
        import ckpt

        super().open()
        self.cp = ckpt.Checkpointer("file://" + os.path.abspath(self.dir), lazy=self.lazy, rng=False)

    def save(self, model, opt, step: int):
        before = self.cp.io_counts()["written_bytes"]
        t = time.perf_counter()
        h = self.cp.save(step, **self.state(model, opt))
        stall = time.perf_counter() - t
        h.wait_snapshot()
        snap = time.perf_counter() - t
        h.wait()
        durable = time.perf_counter() - t
        self._written = self.cp.io_counts()["written_bytes"] - before
        return stall, snap, durable

    def state(self, model, opt) -> dict:
        """What ``save`` and ``load_latest`` are given."""
        return {"model": model, "optimizer": opt}

    def written(self, step: int, world: int) -> int:
        return self._written

    def load(self, model, opt, step: int) -> None:
        import ckpt

        cp = ckpt.Checkpointer("file://" + os.path.abspath(self.dir), lazy=self.lazy, rng=False)
        try:
            if cp.load_latest(**self.state(model, opt)) != step:
                raise RuntimeError(f"ckpt did not find step {step}")
        finally:
            cp.close()

    def close(self) -> None:
        if self.cp is not None:
            self.cp.close()
            self.cp = None


class CkptAppState(Ckpt):
    """ckpt lazy, given DCP's tutorial ``AppState`` (a ``Stateful`` over
    ``get_state_dict``/``set_state_dict``) instead of the model and optimizer."""

    name = "ckpt lazy (AppState)"

    def __init__(self, work: str) -> None:
        super().__init__(work, lazy=True)
        self.name = CkptAppState.name

    def state(self, model, opt) -> dict:
        return {"app": AppState(model, opt)}


class AppState:
    """The ``Stateful`` of PyTorch's DCP tutorial."""

    def __init__(self, model, opt) -> None:
        self.model, self.optimizer = model, opt

    def state_dict(self) -> dict:
        return dcp_state(self.model, self.optimizer)

    def load_state_dict(self, sd: dict) -> None:
        dcp_apply(self.model, self.optimizer, sd)


def dcp_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def dcp_apply(model, opt, sd) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class DcpSave(Method):
    name = "dcp.save"

    def prepare(self) -> None:
        import torch.distributed.checkpoint  # noqa: F401

    def save(self, model, opt, step: int):
        import torch.distributed.checkpoint as dcp

        t = time.perf_counter()
        dcp.save(dcp_state(model, opt), storage_writer=dcp.FileSystemWriter(self.step_dir(step), sync_files=True))
        d = time.perf_counter() - t
        return d, d, d

    def load(self, model, opt, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        sd = dcp_state(model, opt)
        dcp.load(sd, checkpoint_id=self.step_dir(step))
        dcp_apply(model, opt, sd)


class DcpAsync(DcpSave):
    name = "dcp.async_save"

    def prepare(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401

        # Pinned host memory needs CUDA; without it the same stager stages to plain memory.
        self.pinned = torch.cuda.is_available()
        self.pg = dist.new_group(backend="gloo")  # its own group for the background collectives
        self.stager = None

    def open(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().open()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=self.pinned, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=self.pinned))

    def save(self, model, opt, step: int):
        import torch.distributed.checkpoint as dcp

        t = time.perf_counter()
        resp = dcp.async_save(dcp_state(model, opt),
                              storage_writer=dcp.FileSystemWriter(self.step_dir(step), sync_files=True),
                              process_group=self.pg, async_stager=self.stager)
        stall = time.perf_counter() - t
        if hasattr(resp, "staging_completion"):
            resp.staging_completion.result()
            snap = time.perf_counter() - t
            resp.upload_completion.result()
        else:
            snap = stall
            resp.result()
        durable = time.perf_counter() - t
        return stall, snap, durable

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class TorchCheckpointing(Method):
    name = "torch-checkpointing"

    def prepare(self) -> None:
        import torch_checkpointing  # noqa: F401

        self.m = None

    def _manager(self, for_load: bool = False):
        from torch_checkpointing import CheckpointManager, ItemSpec
        from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        # No resharder: 0.1.1 gathers resharding metadata through a CUDA tensor
        # (metadata_manager._all_gather_pickled_data), which fails without a GPU.
        # Without one it saves each rank's DTensor shards as they are
        # (``<item>_<rank>.pt``) and loads them back on the same layout.
        # O_DIRECT (its default) fails here on the first unaligned write (EINVAL),
        # so buffered writes, made durable by the fsync in ``save`` below.
        spec = ItemSpec()
        return CheckpointManager(CheckpointManager.Config(
            items={"model": spec, "optim": spec},
            # It does not fsync: its pre-finalize hook (in its writer process, after
            # this rank's files are written, before the ranks' barrier) does.
            pre_finalize_callback=fsync_written,
            # Loading starts no writer subprocess.
            save=SyncCheckpointSaverConfig() if for_load else AsyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))

    def open(self) -> None:
        super().open()
        self.m = self._manager()

    def save(self, model, opt, step: int):
        t = time.perf_counter()
        fut = self.m.save(self.step_dir(step), dcp_state(model, opt))
        stall = time.perf_counter() - t
        # The manager's staging future: when the state may be mutated again.
        if self.m._staging_future is not None:
            self.m._staging_future.result()
        snap = time.perf_counter() - t
        if fut is not None:
            fut.result()
        durable = time.perf_counter() - t
        return stall, snap, durable

    def load(self, model, opt, step: int) -> None:
        sd = dcp_state(model, opt)
        m = self._manager(for_load=True)
        try:
            m.load(self.step_dir(step), into=sd)
        finally:
            m.close()
        dcp_apply(model, opt, sd)

    def close(self) -> None:
        if self.m is not None:
            self.m.close()
            self.m = None


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


def run_method(m: Method, a, h: int, model, opt, world: int) -> dict:
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
    dist.barrier()
    with Peak() as p:  # from before the first save: staging pools and writer processes count
        with p.active():
            m.open()
            m.save(model, opt, 0)
        train_step(model, opt, h, 100)
        dist.barrier()
        with p.active():
            m.save(model, opt, 1)
    rows["peak_extra_bytes"].append(max_over_ranks(p.extra))
    for rep in range(a.repeats):
        step = rep + 2
        train_step(model, opt, h, 100 + step)
        ref = {k: v.detach().clone() for k, v in local_view(model, opt).items()}
        dist.barrier()
        stall, snap, durable = m.save(model, opt, step)
        written = m.written(step, world)
        fresh = build(h, seed=1000 + rep)
        fopt = make_opt(fresh, seed=1000 + rep, h=h)
        dist.barrier()
        how = drop_cache(m.dir) if dist.get_rank() == 0 else None
        how = broadcast(how)
        if how != "drop_caches":
            how = drop_cache(m.dir)
        cache = how
        dist.barrier()
        t = time.perf_counter()
        m.load(fresh, fopt, step)
        load = time.perf_counter() - t
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
    ap.add_argument("--methods", default="ckpt eager,ckpt lazy,ckpt lazy (AppState),dcp.save,dcp.async_save,torch-checkpointing")
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
    makers = {
        "ckpt eager": lambda: Ckpt(work, lazy=False),
        "ckpt lazy": lambda: Ckpt(work, lazy=True),
        CkptAppState.name: lambda: CkptAppState(work),
        "dcp.save": lambda: DcpSave(work),
        "dcp.async_save": lambda: DcpAsync(work),
        "torch-checkpointing": lambda: TorchCheckpointing(work),
    }
    for name in [s.strip() for s in a.methods.split(",") if s.strip()]:
        row: dict = {"name": name}
        m = makers[name]()
        try:
            m.prepare()
        except Exception as e:  # noqa: BLE001 - any import failure skips the method
            row["skipped"] = f"{type(e).__name__}: {e}"
            out["methods"].append(row)
            continue
        if name == "dcp.async_save":
            row["pinned_stager"] = m.pinned
        row.update(run_method(m, a, h, model, opt, world))
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
