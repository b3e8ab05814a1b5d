"""Many small FSDP2 tensors: how ckpt's and DCP's coordination and metadata grow with ranks.

Run under torchrun (gloo on CPU); ``ckpt-eval fsdp-scale`` does it for each rank count:

    python -m torch.distributed.run --standalone --nproc-per-node N fsdp_scale.py --dir D \
        [--blocks 400] [--width 16] [--repeats 1]

Every rank builds the same deep MLP: ``--blocks`` blocks of one ``Linear(width,
width)`` (no bias) and a ReLU, each block ``fully_shard``ed and then the root,
and takes one AdamW step. FSDP2 shards each weight's ``width`` rows over the
ranks: with fewer rows than ranks the last ranks hold empty shards, so
``ckpt-eval`` passes a width of at least the rank count. With the default 400 blocks a rank holds 1,600
tensors (400 weight shards, and AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``
of each), of a few bytes each: the times are coordination and metadata, not
bytes.

Per repetition (each into fresh directories):

- ckpt: ``Checkpointer(url, coordinate="torch", rng=False)`` (the "open" time),
  ``save(step, model=, optimizer=)`` then ``wait()`` (the "save" time, a root's
  first save), a training step, a second save + wait (the "later save", what a
  job does every interval); then every local tensor is perturbed and
  ``load_latest(model=, optimizer=)`` of the same checkpointer restores the
  second save in place (the "load" time), checked bitwise on every rank against
  a copy taken after the save.
- DCP, the way its docs do FSDP2: ``dcp.save({"model": msd, "optim": osd},
  checkpoint_id=dir)`` with ``msd, osd = get_state_dict(model, opt)`` (the
  default ``FileSystemWriter``, which fsyncs); then the tensors are perturbed
  and ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` restore it (both
  times include the state-dict helpers), checked bitwise the same way.

Odd repetitions run DCP first. Every time is taken after a barrier on every
rank, and the figure is the slowest rank's (all_reduce MAX), the median over
repetitions. Sizes: ckpt's manifest of one checkpoint (the newest file under
``manifests/``) and of all of them, any object under ``data/`` whose name ends
in a metadata suffix, and DCP's ``.metadata``. Rank 0 prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

#: Names of objects that hold metadata rather than tensor bytes.
META_SUFFIXES = (".json", ".meta", ".metadata", ".index", ".manifest")


def build(blocks: int, width: int, seed: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width, bias=False), nn.ReLU()) for _ in range(blocks)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, width: int, step: int) -> None:
    g = torch.Generator().manual_seed(7919 * step + dist.get_rank())
    model(torch.randn(4, width, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's shard of every parameter and optimizer state tensor, by name (views, not copies)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"model.{name}"] = local(p.data)
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{name}.{k}"] = local(v)
    return out


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {k: v.detach().clone() for k, v in local_tensors(model, opt).items()}


@torch.no_grad()
def perturb(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Change every local value, so that a load that restores nothing is caught."""
    for v in local_tensors(model, opt).values():
        v.add_(1.0)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def check(what: str, ref: dict, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Every local tensor bitwise equal to ``ref`` on this rank, else raise."""
    got = local_tensors(model, opt)
    bad = [k for k, v in ref.items() if k not in got or got[k].shape != v.shape or not torch.equal(bits(got[k]), bits(v))]
    if bad or len(got) != len(ref):
        raise RuntimeError(f"{what}: rank {dist.get_rank()}: {len(bad)} of {len(ref)} tensors differ, e.g. {bad[:3]}")


def max_over_ranks(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn) -> float:
    """``fn()`` after a barrier; the slowest rank's seconds."""
    dist.barrier()
    t = time.perf_counter()
    fn()
    return max_over_ranks(time.perf_counter() - t)


def file_bytes(path: str) -> int:
    return os.path.getsize(path) if os.path.isfile(path) else 0


def ckpt_sizes(root: str) -> dict:
    """The newest manifest's bytes, all manifests' bytes, metadata-named objects under ``data/``, and
    the bytes under each top-level name of the root."""
    mdir = os.path.join(root, "manifests")
    names = sorted(os.listdir(mdir)) if os.path.isdir(mdir) else []
    meta = {}
    for dirpath, _, files in os.walk(os.path.join(root, "data")):
        for f in files:
            if f.endswith(META_SUFFIXES):
                p = os.path.join(dirpath, f)
                meta[os.path.relpath(p, root)] = file_bytes(p)
    tops = {}
    for top in sorted(os.listdir(root)):
        p = os.path.join(root, top)
        tops[top] = sum(file_bytes(os.path.join(d, f)) for d, _, fs in os.walk(p) for f in fs) if os.path.isdir(p) else file_bytes(p)
    return {
        "root_bytes": tops,
        "manifest_bytes": file_bytes(os.path.join(mdir, names[-1])) if names else 0,
        "manifests_total_bytes": sum(file_bytes(os.path.join(mdir, n)) for n in names),
        "manifests": len(names),
        "data_metadata_bytes": sum(meta.values()),
        "data_metadata_objects": meta,
    }


def run_ckpt(a, work: str, rep: int, model, opt) -> dict:
    import ckpt

    root = os.path.join(work, f"ckpt-{rep}")
    step = 10 * (rep + 1)
    box: dict = {}

    def open_() -> None:
        box["cp"] = ckpt.Checkpointer("file://" + root, coordinate="torch", rng=False)

    open_s = timed(open_)
    cp = box["cp"]
    save_s = timed(lambda: cp.save(step, model=model, optimizer=opt).wait())
    train_step(model, opt, a.width, 1000 + rep)
    later_s = timed(lambda: cp.save(step + 1, model=model, optimizer=opt).wait())
    ref = snapshot(model, opt)
    perturb(model, opt)

    def load() -> None:
        box["got"] = cp.load_latest(model=model, optimizer=opt)

    load_s = timed(load)
    if box["got"] != step + 1:
        raise RuntimeError(f"ckpt load_latest restored step {box['got']}, not {step + 1}")
    check("ckpt load_latest", ref, model, opt)
    t = time.perf_counter()
    cp.close()
    close_s = max_over_ranks(time.perf_counter() - t)
    dist.barrier()
    sizes = ckpt_sizes(root) if dist.get_rank() == 0 else {}
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"open_s": open_s, "save_s": save_s, "later_save_s": later_s, "load_s": load_s, "close_s": close_s,
            "verified_tensors": len(ref), **sizes}


def run_dcp(work: str, rep: int, model, opt) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = os.path.join(work, f"dcp-{rep}")

    def save() -> None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    save_s = timed(save)
    ref = snapshot(model, opt)
    perturb(model, opt)

    def load() -> None:
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    load_s = timed(load)
    check("dcp.load", ref, model, opt)
    dist.barrier()
    meta = file_bytes(os.path.join(path, ".metadata")) if dist.get_rank() == 0 else 0
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    return {"save_s": save_s, "load_s": load_s, "metadata_bytes": meta}


def progress(what: str, since: float) -> None:
    """Rank 0 says where the job is, on stderr (a job that runs past its
    limit then shows which phase it was in)."""
    if dist.get_rank() == 0:
        print(f"fsdp_scale: {what} after {time.perf_counter() - since:.1f} s", file=sys.stderr, flush=True)


def median_of(rows: list, key: str) -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--blocks", type=int, default=400)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = os.path.abspath(a.dir)
    os.makedirs(work, exist_ok=True)
    model = build(a.blocks, a.width, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    train_step(model, opt, a.width, 0)
    tensors = len(local_tensors(model, opt))
    setup_s = max_over_ranks(time.perf_counter() - t0)
    progress(f"set up {world} ranks", t0)
    ck, dc = [], []
    for rep in range(max(1, a.repeats)):
        train_step(model, opt, a.width, 1 + rep)
        for method in ("dcp", "ckpt") if rep % 2 else ("ckpt", "dcp"):
            if method == "ckpt":
                ck.append(run_ckpt(a, work, rep, model, opt))
            else:
                dc.append(run_dcp(work, rep, model, opt))
            progress(f"repeat {rep}: {method} done", t0)
    if rank == 0:
        last = ck[-1]
        out = {
            "ranks": world,
            "blocks": a.blocks,
            "width": a.width,
            "tensors_per_rank": tensors,
            "repeats": len(ck),
            "torch": torch.__version__,
            "setup_s": setup_s,
            "ckpt": {
                **{k: median_of(ck, k) for k in ("open_s", "save_s", "later_save_s", "load_s", "close_s")},
                **{k: last[k] for k in ("manifest_bytes", "manifests_total_bytes", "manifests",
                                        "data_metadata_bytes", "data_metadata_objects", "root_bytes",
                                        "verified_tensors")},
                "runs": [{k: r[k] for k in ("open_s", "save_s", "later_save_s", "load_s")} for r in ck],
            },
            "dcp": {
                "save_s": median_of(dc, "save_s"),
                "load_s": median_of(dc, "load_s"),
                "metadata_bytes": dc[-1]["metadata_bytes"],
                "runs": [{k: r[k] for k in ("save_s", "load_s")} for r in dc],
            },
        }
        print(json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
