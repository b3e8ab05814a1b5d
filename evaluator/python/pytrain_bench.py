"""A real PyTorch training state checkpointed from Python: ckpt's public API beside
``torch.save``, ``safetensors.torch``, ``torch.distributed.checkpoint`` and
``torch-checkpointing``, in one process on CPU. ``ckpt-eval python`` runs it:

    python pytrain_bench.py --dir D [--layers 6] [--width 384] [--seq 128] [--repeats 2] [--rounds 3] [--every 4]

The model is GPT-2-shaped: ``transformers.GPT2LMHeadModel`` from a
``GPT2Config`` (GPT-2's vocabulary, tied embedding and head, fewer and narrower
layers than gpt2 by default so the run fits the time budget; random init, no
download), or, without transformers, a GPT-2-style module of the same shapes
defined here. AdamW, one real training step before anything is saved, so
optimizer state exists. The context is the sequence length, so every position
embedding is trained, and every saved tensor changes with each step (nothing is
deduplicated between saves).

Per method (a saver kept across saves, as in training): a cold save (pools,
stagers, writer processes start) and, after a training step, a warm one and a
load, all sampled for memory (below); then ``--repeats`` times, unsampled: a
training step, then

- save: ``stall`` is how long the call blocks the training loop; ``snapshot``
  until the state may be mutated again; ``durable`` until the data is on disk.
  ckpt and ``dcp`` (``FileSystemWriter(sync_files=True)``) fsync their files
  themselves; after ``torch.save`` and ``safetensors.torch.save_file`` the file
  is fsynced; ``torch-checkpointing`` 0.1.1 does not fsync, so its
  ``pre_finalize_callback`` does it in its writer process before it finalizes.
- disk: ckpt keeps the last two checkpoints (``keep_last=2``); the other
  methods' older checkpoints are removed after each save is durable, untimed
  here, and in the training loop (below) by the waiter thread, within the
  loop's time, as ckpt's retention deletes within the save.
- load, for one method per file format: the live model and optimizer are
  overwritten with other values, the page cache is dropped
  (``/proc/sys/vm/drop_caches``, else ``posix_fadvise(DONTNEED)`` on the files;
  reported), and the checkpoint is loaded back into the same live model and
  optimizer: ckpt ``load_latest`` (in place), ``torch.load(weights_only=True)``
  + ``load_state_dict``, ``safetensors.torch.load_file`` + ``load_state_dict``,
  ``dcp.load`` into the live state dict + ``set_state_dict``, and
  ``CheckpointManager.load``. Every tensor of model and optimizer is then
  checked equal (``torch.equal``) to the saved state.
- peak extra host memory: proportional set size (Pss, ``smaps_rollup``) of this
  process and its children, sampled every 10 ms during the two sampled saves
  (from before the cold one, so staging pools kept between saves count, minus
  the reference copy the benchmark holds) and during the sampled load, over the
  value before. Garbage is collected and freed heap handed back
  (``malloc_trim``) before each window. One Pss reading of this process takes
  tens of milliseconds of a core, so the timed saves and loads run without the
  sampler.

Training-loop interference, both ways, with real compute: ``--rounds`` rounds
per method of ``--every`` real training steps (forward, backward, AdamW step of
the model on CPU, on the same cores as any background work) without
checkpointing, then a save and training steps until at least ``--every`` are
done and the save is durable. Asynchronous methods are waited for only where
training needs it: the next optimizer step waits for the snapshot (ckpt lazy's
own step pre-hook; for ``dcp.async_save`` its staging future, for
torch-checkpointing its staging future). The time a checkpoint costs the loop
is the second part's time minus as many steps at the first part's pace; over
the first part's time it is the slowdown of a loop that checkpoints every
``--every`` steps. Alternating the two parts at this grain keeps a shared
machine's load out of the comparison. Each save's time until durable in the
loop is taken by a waiter thread, and compared to the same method's when idle
(the save figures above): checkpointing slowed by training.

Floors, same run, same bytes, the fastest of their repeats at the start and at
the end: copy of the state into preallocated (touched) buffers, write + fsync of
the bytes to one file, and the read of that file with the page cache dropped.
One JSON object is printed last.
"""

from __future__ import annotations

import abc
import argparse
import json
import os
import shutil
import sys
import threading
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

from benchlib import Peak, drop_cache, fsync_path, fsync_written, settle, tree_bytes

# ---------------------------------------------------------------- the model


class Block(nn.Module):
    """A GPT-2 block (pre-norm attention and MLP), used when transformers is absent."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class MiniGPT(nn.Module):
    """GPT-2's shapes without transformers: token and position embeddings, blocks,
    final norm, a head tied to the token embedding."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def loss(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for b in self.h:
            h = b(h)
        logits = self.lm_head(self.ln_f(h))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def build(a):
    """The model (GPT-2-shaped), its loss function and a description."""
    torch.manual_seed(0)
    heads = max(1, a.width // 64)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=heads, vocab_size=a.vocab,
                                      n_positions=a.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
        return model, (lambda x: model(x, labels=x).loss), f"transformers {transformers.__version__} GPT2LMHeadModel"
    except ImportError:
        model = MiniGPT(a.layers, a.width, heads, a.vocab, a.seq)
        return model, model.loss, "GPT-2-style module (transformers not installed)"


class Trainer:
    """The model, AdamW, and real training steps on a fixed stream of token batches."""

    def __init__(self, a) -> None:
        self.model, self.loss, self.desc = build(a)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.a = a
        self.n = 0
        self.step()  # optimizer state exists from here on

    def step(self) -> None:
        g = torch.Generator().manual_seed(1000 + self.n)
        self.n += 1
        x = torch.randint(0, self.a.vocab, (self.a.batch, self.a.seq), generator=g)
        self.loss(x).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def tensors(model, opt) -> dict:
    """Every tensor of model and optimizer state, by name (not copied)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            if torch.is_tensor(v):
                out[f"optim.{names[id(p)]}.{k}"] = v
    return out


def unique_bytes(ts: dict) -> int:
    seen, n = set(), 0
    for t in ts.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            n += t.numel() * t.element_size()
    return n


def reference(tr: Trainer) -> dict:
    return {k: v.detach().clone() for k, v in tensors(tr.model, tr.opt).items()}


def scramble(tr: Trainer) -> None:
    """Other values in every live tensor, so a load has to write them all."""
    with torch.no_grad():
        seen = set()
        for t in tensors(tr.model, tr.opt).values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                t.add_(1)


def check(tr: Trainer, ref: dict, name: str) -> None:
    got = tensors(tr.model, tr.opt)
    bad = [k for k, v in ref.items() if k not in got or not torch.equal(got[k], v)]
    if bad or len(got) != len(ref):
        raise RuntimeError(f"{name}: {len(bad)} of {len(ref)} tensors differ after load, e.g. {bad[:3]}")


# ---------------------------------------------------------------- floors

def floors(ref: dict, work: str, repeats: int) -> dict:
    """Copy, write + fsync and cold read of the state's bytes; the fastest of the repeats."""
    uniq, seen = [], set()
    for t in ref.values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            uniq.append(t)
    dsts = [torch.empty_like(t) for t in uniq]
    for d in dsts:
        d.zero_()  # touch the pages first
    copy = []
    for _ in range(max(3, repeats)):
        t = time.perf_counter()
        for d, s in zip(dsts, uniq):
            d.copy_(s)
        copy.append(time.perf_counter() - t)
    del dsts
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in uniq])
    path = os.path.join(work, "floor.bin")
    write, read, how = [], [], "none"
    back = torch.empty_like(flat)
    for _ in range(repeats):
        t = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            f.write(memoryview(flat.numpy()))
            os.fsync(f.fileno())
        write.append(time.perf_counter() - t)
        how = drop_cache(path)
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            f.readinto(memoryview(back.numpy()))
        read.append(time.perf_counter() - t)
        assert torch.equal(back, flat)
        os.remove(path)
    return {"memcpy_s": min(copy), "write_fsync_s": min(write), "read_cold_s": min(read), "cache_drop": how}


# ---------------------------------------------------------------- methods

def done() -> None:
    """The waiter of a save that was durable when it returned."""


class Method(abc.ABC):
    """One way to checkpoint: a saver kept across saves (as in training) and its
    directory. ``start`` returns once the training loop may go on (the stall)
    with a function that blocks until the save is durable."""

    name = "?"
    #: Whether this method's load is timed (one method per file format).
    loads = True

    def __init__(self, work: str, tr: Trainer) -> None:
        self.dir = os.path.join(work, self.name.replace(" ", "_").replace(".", "_"))
        self.tr = tr
        self.written = 0

    def prepare(self) -> None:
        """Import what the method needs (an exception skips the method)."""

    def open(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.dir, exist_ok=True)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.dir, f"step_{step}")

    @abc.abstractmethod
    def start(self, step: int):
        """Start saving ``step``; returns a function that blocks until durable."""

    def snapshot_wait(self) -> None:
        """Block until the state may be mutated again (before the optimizer step)."""

    @abc.abstractmethod
    def load(self, step: int) -> None:
        """Load ``step`` into the live model and optimizer."""

    def measure_written(self, step: int) -> None:
        self.written = tree_bytes(self.step_dir(step))

    def prune(self, step: int) -> None:
        """Remove every checkpoint but ``step``'s (bounds the disk used)."""
        for name in os.listdir(self.dir):
            if name.startswith("step_") and name != f"step_{step}":
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def close(self) -> None:
        pass


class Ckpt(Method):

    def __init__(self, work: str, tr: Trainer, lazy: bool) -> None:
        self.lazy = lazy
        self.name = "ckpt lazy" if lazy else "ckpt eager"
        self.loads = not lazy  # the same files and load path as eager
        self.cp = None
        self.h = None
        super().__init__(work, tr)

    def prepare(self) -> None:
        import ckpt  # noqa: F401

    def open(self) -> None:
        import ckpt

        super().open()
        # Retention as a training run sets it (the disk holds two checkpoints).
        self.cp = ckpt.Checkpointer("file://" + os.path.abspath(self.dir), lazy=self.lazy, rng=False, keep_last=2)

    def start(self, step: int):
        before = self.cp.io_counts()["written_bytes"]
        h = self.h = self.cp.save(step, model=self.tr.model, optimizer=self.tr.opt)

        def wait():
            h.wait()
            self.written = self.cp.io_counts()["written_bytes"] - before

        return wait

    def snapshot_wait(self) -> None:
        if self.h is not None:
            self.h.wait_snapshot()

    def measure_written(self, step: int) -> None:
        pass  # counted by the waiter

    def prune(self, step: int) -> None:
        pass  # keep_last

    def load(self, step: int) -> None:
        import ckpt

        cp = ckpt.Checkpointer("file://" + os.path.abspath(self.dir), rng=False)
        try:
            got = cp.load_latest(model=self.tr.model, optimizer=self.tr.opt)
            if got != step:
                raise RuntimeError(f"ckpt loaded step {got}, not {step}")
        finally:
            cp.close()

    def close(self) -> None:
        if self.cp is not None:
            self.cp.close()
            self.cp = None


class TorchSave(Method):
    name = "torch.save"

    def path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), "state.pt")

    def start(self, step: int):
        os.makedirs(self.step_dir(step), exist_ok=True)
        with open(self.path(step), "wb") as f:
            torch.save({"model": self.tr.model.state_dict(), "optimizer": self.tr.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        return done

    def load(self, step: int) -> None:
        s = torch.load(self.path(step), weights_only=True)
        self.tr.model.load_state_dict(s["model"])
        self.tr.opt.load_state_dict(s["optimizer"])


class Safetensors(Method):
    """One file of every tensor; tied weights stored once (safetensors refuses
    shared tensors), the optimizer's param groups as JSON in the metadata."""

    name = "safetensors"

    def prepare(self) -> None:
        import safetensors.torch  # noqa: F401

    def path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), "state.safetensors")

    def start(self, step: int):
        from safetensors.torch import save_file

        flat, aliases, seen = {}, {}, {}
        for k, v in self.tr.model.state_dict().items():
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
            if key in seen:
                aliases[k] = seen[key]
            else:
                seen[key] = k
                flat[f"model.{k}"] = v.contiguous()
        osd = self.tr.opt.state_dict()
        for pid, s in osd["state"].items():
            for k, v in s.items():
                flat[f"optim.{pid}.{k}"] = v
        meta = {"aliases": json.dumps(aliases), "param_groups": json.dumps(osd["param_groups"])}
        os.makedirs(self.step_dir(step), exist_ok=True)
        save_file(flat, self.path(step), metadata=meta)
        fsync_path(self.path(step))
        return done

    def load(self, step: int) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(self.path(step), framework="pt") as f:
            meta = f.metadata()
        flat = load_file(self.path(step))
        msd = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
        for k, src in json.loads(meta["aliases"]).items():
            msd[k] = msd[src]
        state: dict = {}
        for k, v in flat.items():
            if k.startswith("optim."):
                _, pid, name = k.split(".", 2)
                state.setdefault(int(pid), {})[name] = v
        self.tr.model.load_state_dict(msd)
        self.tr.opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})


def dcp_state(tr: Trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(tr.model, tr.opt)
    return {"model": msd, "optim": osd}


def dcp_apply(tr: Trainer, sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(tr.model, tr.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class DcpSave(Method):
    name = "dcp.save"

    def prepare(self) -> None:
        import torch.distributed.checkpoint  # noqa: F401

    def start(self, step: int):
        import torch.distributed.checkpoint as dcp

        dcp.save(dcp_state(self.tr), storage_writer=dcp.FileSystemWriter(self.step_dir(step), sync_files=True))
        return done

    def load(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        sd = dcp_state(self.tr)
        dcp.load(sd, checkpoint_id=self.step_dir(step))
        dcp_apply(self.tr, sd)


class DcpAsync(DcpSave):
    name = "dcp.async_save"
    loads = False  # dcp.save's files and load

    def prepare(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401

        import torch.distributed as dist

        # Pinned host memory needs CUDA; without it the same stager stages to plain memory.
        self.pinned = torch.cuda.is_available()
        self.pg = dist.new_group(backend="gloo")  # its own group for the background collectives
        self.stager = None
        self.resp = None

    def open(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().open()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=self.pinned, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=self.pinned))

    def start(self, step: int):
        import torch.distributed.checkpoint as dcp

        resp = self.resp = dcp.async_save(
            dcp_state(self.tr), storage_writer=dcp.FileSystemWriter(self.step_dir(step), sync_files=True),
            process_group=self.pg, async_stager=self.stager)
        if hasattr(resp, "upload_completion"):
            return lambda: resp.upload_completion.result()
        return lambda: resp.result()

    def snapshot_wait(self) -> None:
        if self.resp is not None and hasattr(self.resp, "staging_completion"):
            self.resp.staging_completion.result()

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

        # O_DIRECT (its default) fails on the first unaligned write (EINVAL), so
        # buffered writes, made durable by the pre-finalize fsync.
        spec = ItemSpec()
        return CheckpointManager(CheckpointManager.Config(
            items={"model": spec, "optim": spec},
            pre_finalize_callback=fsync_written,
            save=SyncCheckpointSaverConfig() if for_load else AsyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))

    def open(self) -> None:
        super().open()
        self.m = self._manager()

    def start(self, step: int):
        fut = self.m.save(self.step_dir(step), dcp_state(self.tr))
        return (lambda: fut.result()) if fut is not None else done

    def snapshot_wait(self) -> None:
        if self.m is not None and self.m._staging_future is not None:
            self.m._staging_future.result()

    def load(self, step: int) -> None:
        sd = dcp_state(self.tr)
        m = self._manager(for_load=True)
        try:
            m.load(self.step_dir(step), into=sd)
        finally:
            m.close()
        dcp_apply(self.tr, sd)

    def close(self) -> None:
        if self.m is not None:
            self.m.close()
            self.m = None


# ---------------------------------------------------------------- measurements

def timed_save(m: Method, step: int):
    """(stall, snapshot, durable) of one save, seconds from the call."""
    t = time.perf_counter()
    wait = m.start(step)
    stall = time.perf_counter() - t
    m.snapshot_wait()
    snap = time.perf_counter() - t
    wait()
    return stall, snap, time.perf_counter() - t


def checked_load(m: Method, tr: Trainer, ref: dict, step: int, peak: "Peak | None" = None):
    """Scramble the live state, drop the page cache, load ``step`` into it (in a
    window of ``peak`` if given), check it equals ``ref``; (seconds, cache drop)."""
    scramble(tr)
    how = drop_cache(m.dir)
    t = time.perf_counter()
    if peak is None:
        m.load(step)
    else:
        with peak.active():
            m.load(step)
    took = time.perf_counter() - t
    check(tr, ref, m.name)
    return took, how


def save_and_load(m: Method, tr: Trainer, a, state_bytes: int) -> dict:
    """Two saves (and a load) sampled for memory, then ``a.repeats`` timed ones.
    A Pss reading of this process takes tens of milliseconds, so the sampler
    would slow what it samples: timed saves and loads run without it."""
    rows = {"stall_s": [], "snapshot_s": [], "durable_s": [], "load_s": [], "written_bytes": []}
    with Peak() as p:  # from before the first save: staging pools and writer processes count
        with p.active():
            m.open()
            timed_save(m, 0)  # cold: pools, stagers, writer processes start
        tr.step()  # every value changes
        ref = reference(tr)
        p.own = state_bytes
        with p.active():
            timed_save(m, 1)  # warm
    if m.loads:
        with Peak() as lp:
            checked_load(m, tr, ref, 1, lp)
        rows["peak_load_extra_bytes"] = lp.extra
    rows["peak_save_extra_bytes"] = p.extra
    del ref
    m.prune(1)
    for rep in range(a.repeats):
        step = rep + 2
        tr.step()
        ref = reference(tr)
        settle()
        stall, snap, durable = timed_save(m, step)
        m.measure_written(step)
        for k, v in (("stall_s", stall), ("snapshot_s", snap), ("durable_s", durable),
                     ("written_bytes", m.written)):
            rows[k].append(v)
        if m.loads:
            took, rows["cache_drop"] = checked_load(m, tr, ref, step)
            rows["load_s"].append(took)
        del ref
        m.prune(step)
    return rows


def train_rounds(tr: Trainer, m: Method, a, first_step: int) -> dict:
    """``a.rounds`` rounds of: ``a.every`` training steps without checkpointing,
    then a save and training steps until at least ``a.every`` are done and the
    save is durable. Per round: both parts' times and steps, the save's stall
    and its time until durable (taken by a waiter thread)."""
    out: dict = {"plain_s": [], "plain_steps": [], "ckpt_s": [], "ckpt_steps": [], "stall_s": [], "durable_s": []}
    for r in range(a.rounds):
        t = time.perf_counter()
        for _ in range(a.every):
            tr.step()
        out["plain_s"].append(time.perf_counter() - t)
        out["plain_steps"].append(a.every)
        t = time.perf_counter()
        wait = m.start(first_step + r)
        out["stall_s"].append(time.perf_counter() - t)
        durable: list = []

        def waiter(wait=wait, t=t, step=first_step + r):
            wait()
            durable.append(time.perf_counter() - t)
            # Keeping the disk bounded is part of checkpointing in a loop: the
            # older checkpoint goes once this one is durable, in the loop's time
            # (ckpt's retention does the same inside the save).
            m.prune(step)

        w = threading.Thread(target=waiter, daemon=True)
        w.start()
        n = 0
        while n < a.every or w.is_alive():
            m.snapshot_wait()  # no-op once the snapshot is done (ckpt lazy has its own hook)
            tr.step()
            n += 1
        out["ckpt_s"].append(time.perf_counter() - t)
        out["ckpt_steps"].append(n)
        w.join()
        if not durable:
            raise RuntimeError(f"{m.name}: a save in the training loop failed")
        out["durable_s"].append(durable[0])
    return out


# ---------------------------------------------------------------- main

def init_dist(work: str) -> None:
    """A one-rank gloo group: ``dcp.async_save`` and torch-checkpointing need one."""
    import torch.distributed as dist

    store = os.path.join(work, "store")
    if os.path.exists(store):
        os.remove(store)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (also the context length)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--every", type=int, default=4, help="training steps between checkpoints in the loop")
    ap.add_argument("--rounds", type=int, default=3, help="checkpoints per method in the training loop")
    ap.add_argument("--methods",
                    default="ckpt eager,ckpt lazy,torch.save,safetensors,dcp.save,dcp.async_save,torch-checkpointing")
    ap.add_argument("--loop-methods", default="ckpt eager,ckpt lazy,torch.save,dcp.async_save")
    a = ap.parse_args()
    work = os.path.abspath(a.dir)
    os.makedirs(work, exist_ok=True)
    init_dist(work)
    t_all = time.perf_counter()
    tr = Trainer(a)
    live = tensors(tr.model, tr.opt)
    state_bytes = unique_bytes(live)
    params = sum(p.numel() for p in tr.model.parameters())
    fl = floors(reference(tr), work, a.repeats)
    del live
    out = {
        "torch": torch.__version__, "model": tr.desc, "layers": a.layers, "width": a.width, "vocab": a.vocab,
        "seq": a.seq, "batch": a.batch, "params": params, "state_bytes": state_bytes,
        "tensors": len(tensors(tr.model, tr.opt)), "repeats": a.repeats, "rounds": a.rounds, "every": a.every,
        "threads": torch.get_num_threads(), "cores": os.cpu_count(), "floors": fl, "methods": [], "loops": [],
    }
    makers = {
        "ckpt eager": lambda: Ckpt(work, tr, lazy=False),
        "ckpt lazy": lambda: Ckpt(work, tr, lazy=True),
        "torch.save": lambda: TorchSave(work, tr),
        "safetensors": lambda: Safetensors(work, tr),
        "dcp.save": lambda: DcpSave(work, tr),
        "dcp.async_save": lambda: DcpAsync(work, tr),
        "torch-checkpointing": lambda: TorchCheckpointing(work, tr),
    }
    loop_methods = [s.strip() for s in a.loop_methods.split(",") if s.strip()]
    for _ in range(2):
        tr.step()  # warm: the first steps of a process are slower
    for name in [s.strip() for s in a.methods.split(",") if s.strip()]:
        row: dict = {"name": name}
        m = makers[name]()
        try:
            m.prepare()
        except Exception as e:  # noqa: BLE001 - any import failure skips the method
            row["skipped"] = f"{type(e).__name__}: {e}"
            out["methods"].append(row)
            continue
        t = time.perf_counter()
        row.update(save_and_load(m, tr, a, state_bytes))
        out["methods"].append(row)
        t1 = time.perf_counter()
        if name in loop_methods:
            out["loops"].append({"name": name, **train_rounds(tr, m, a, 100)})
        print(f"{name}: saves and loads {t1 - t:.1f} s, loop {time.perf_counter() - t1:.1f} s",
              file=sys.stderr, flush=True)
        m.close()
        shutil.rmtree(m.dir, ignore_errors=True)
    # The floors again at the end, and the lower of the two (the machine is shared).
    fl2 = floors(reference(tr), work, a.repeats)
    for k in ("memcpy_s", "write_fsync_s", "read_cold_s"):
        fl[k] = min(fl[k], fl2[k])
    out["total_s"] = time.perf_counter() - t_all
    print(json.dumps(out), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
