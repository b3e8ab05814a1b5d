"""GPU training with checkpoints: ckpt's Python API beside the checkpointing a
PyTorch user would otherwise pick, in one process on one CUDA device.
``ckpt-eval gpu`` runs it:

    python gpu_bench.py --dir D --json OUT [--layers 24] [--width 1024] [--seq 1024]
                        [--batch 8] [--every 40] [--rounds 3] [--methods a,b,...]

The model is GPT-style in plain PyTorch (token and position embeddings, pre-norm
blocks with causal attention through ``scaled_dot_product_attention``, dropout,
a head tied to the token embedding), trained with fused AdamW under bf16
autocast on a fixed batch of random tokens. The default (24 x 1024, 355 M
parameters, 4.2 GB of parameters and optimizer state, batch 8 x 1024) takes
about 70 ms a step on an H100, 62.5 ms on an H200; every method takes about
6.5 minutes on an H200 (each ckpt method about 45 s, loop and restores; each
peer about a minute), the ckpt methods alone about 4.

Per method, in this order: ``none`` (no checkpoint), ckpt eager and lazy,
``torch.save`` + fsync, ``dcp.save``, ``dcp.async_save`` with DCP's pinned
``DefaultStager`` and torch-checkpointing's async save (when installed): the
peers of ``peers.py``, as every benchmark of ckpt-eval measures them (any
name of its ``MAKERS`` can be given to ``--methods``), ckpt keeping its last
two checkpoints. ``ckpt lazy (device staging)`` is lazy with
``device_staging`` the size of the state: the save's copy goes to device
memory first, the optimizer step waits only for that, and the copy to the
host follows from there; ``ckpt lazy (half staged)`` has room on the device
for half the state, the rest copied straight to the host from ``save`` on,
while forward and backward run. ``ckpt lazy (memory tier)`` saves through
``ckpt.memory.MemoryCheckpointer`` (host memory under ``/dev/shm`` and local
disk, every save to both from one snapshot) and restores from memory, as a
restarted process does; its cold restore has the disk's page cache dropped.

- **Loop.** ``--rounds`` rounds of ``--every`` training steps without a
  checkpoint, then a save and ``--every`` steps; the slowdown is the second
  parts' time over the first parts' (each part ends with a device sync), over
  the rounds after the first: a long run's steady state. The first round's
  save is the method's first in the process; what it costs the loop beyond a
  later one is reported apart (``first_save_extra_s``). The
  next optimizer step waits where a method needs it: ckpt lazy's own step
  pre-hook (timed: ``step_wait``), DCP async's staging future, torch-
  checkpointing's staging future.
- **First step**: one step before the rounds, with what it left in the
  background (``first_step_s``): after a fresh start's ``load_latest``, ckpt
  readies its first save there (``ckpt._save.ahead``), once per job.
- **Stall**: how long ``save`` blocked the loop, the first of the method in this
  process (pools and stagers start cold) and the median of the later ones;
  **durable**: median time from ``save`` to its data being on disk (fsync),
  taken by a waiter thread.
- **Restore** into the live CUDA model and optimizer (their values scrambled
  first) by a new reader, as a restarted process restores, timed until the
  values are on the device, less the close of ckpt's reader (a restarted
  job keeps its checkpointer open; the close is recorded as
  ``restore_*_close_s``, and the figures of earlier runs included it). Plain
  ckpt lazy also restores cold as a restarted job's writer does
  (``restore_cold_writer_s``: it readies its first save, and keeps its slab
  locked for it), then trains one step (``restore_cold_writer_step_s``,
  against ``step_s``: what that lock costs the job). Restores run warm
  (every file read once before, untimed, so that it is in the page cache: a
  writer that bypasses the cache leaves none of it there) and with the page
  cache dropped (``/proc/sys/vm/drop_caches`` where allowed, else
  ``posix_fadvise``), each checked ``torch.equal`` against a copy taken at
  the save. ckpt's restores page-lock their new host slab as
  ``HostStage.lock`` says by default (``"during"`` the read); with
  ``--restore-ways during,later,after``, plain ckpt lazy also restores with
  the slab locked in the background once the copies are done
  (``restore_warm_lock_later_s``...) and after the read
  (``restore_cold_lock_after_s``...): every way, timed in the same run. ``--restore-repeats N`` restores each
  way N times, the ways interleaved: the figure is the median run, every run
  is in ``restore_*_runs_s``. ckpt's restores also record where
  their time went (``restore_warm_phases``...: ``Checkpointer.last_restore``,
  the plan, the read, the slab's lock, the copies to the device, the apply). ``--no-restore`` leaves the
  restores out (a larger model's run, where they cost the most time and the
  default size has measured them).
- **Memory**: host memory page-locked by ckpt (the most at once) and the growth
  of the process's resident set over the loop (sampled every 20 ms).

Floors, same run, same bytes: the device-to-host copy of the whole state into
page-locked memory, the host-to-device copy back, write + fsync of those bytes
to one file, and its read with the page cache dropped (``peers.write_read_floor``).

Without a CUDA device it writes ``{"skipped": reason}`` and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import (  # noqa: E402
    MAKERS, Ckpt, DcpAsync, Method, TorchCheckpointing, done, drop_cache, warm_cache, write_read_floor,
)

ALL = ["none", "ckpt eager", "ckpt eager (locked ahead)", "ckpt lazy", "ckpt lazy (device staging)",
       "ckpt lazy (half staged)", "ckpt lazy (memory tier)", "torch.save", "dcp.save", "dcp.async_save", "torch-checkpointing"]


# ---------------------------------------------------------------- the model


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, seq: int, vocab: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(width, width // 64, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device)))
        for b in self.h:
            h = b(h)
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


class Trainer:
    def __init__(self, a: argparse.Namespace, device: str) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = GPT(a.layers, a.width, a.seq, a.vocab).to(device)
        #: "fused" (the benchmark's: each step count a tensor on the GPU) or
        #: "foreach" (PyTorch's default on CUDA: each step count a CPU tensor
        #: beside the moments on the GPU, which ckpt takes in bulk with them).
        self.optimizer = getattr(a, "optimizer", "fused")
        fused = device == "cuda" and self.optimizer == "fused"
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused,
                                     foreach=None if fused else True)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(device)
        self.step()

    def step(self) -> None:
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.device == "cuda"):
            loss = self.model(self.x)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def mark(self) -> Any:
        """A point in the device's timeline, read by :meth:`between` after a ``sync``."""
        if self.device == "cuda":
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    @staticmethod
    def between(marks: List[Any]) -> List[float]:
        """Seconds between consecutive marks (once the device has passed them)."""
        if marks and isinstance(marks[0], float):
            return [b - a for a, b in zip(marks, marks[1:])]
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]

    def tensors(self) -> Dict[str, torch.Tensor]:
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        names = {id(p): n for n, p in self.model.named_parameters()}
        for p, s in self.opt.state.items():
            for k, v in s.items():
                if torch.is_tensor(v):
                    out[f"optim.{names[id(p)]}.{k}"] = v
        return out

    def nbytes(self) -> int:
        seen, n = set(), 0
        for t in self.tensors().values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                n += t.numel() * t.element_size()
        return n

    def reference(self) -> Dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.tensors().items()}

    def scramble(self) -> None:
        with torch.no_grad():
            seen = set()
            for t in self.tensors().values():
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    t.add_(1)

    def check(self, ref: Dict[str, torch.Tensor], name: str) -> None:
        got = self.tensors()
        bad = [k for k, v in ref.items() if k not in got or not torch.equal(got[k], v)]
        if bad:
            raise RuntimeError(f"{name}: {len(bad)} of {len(ref)} tensors differ after the restore, e.g. {bad[:3]}")


# ---------------------------------------------------------------- floors


def floors(tr: Trainer, work: str) -> Dict[str, float]:
    """Device-to-host into locked memory, host-to-device, and ``peers``'
    write + fsync and cold read of those bytes."""
    ts = [t for t in tr.tensors().values()]
    total = sum(t.numel() * t.element_size() for t in ts)
    pin = torch.empty(total, dtype=torch.uint8, pin_memory=tr.device == "cuda")
    views, off = [], 0
    for t in ts:
        n = t.numel() * t.element_size()
        views.append(pin[off : off + n].view(t.dtype).view(t.shape))
        off += n
    d2h = h2d = math.inf
    for _ in range(3):
        tr.sync()
        t0 = time.perf_counter()
        for v, t in zip(views, ts):
            v.copy_(t, non_blocking=True)
        tr.sync()
        d2h = min(d2h, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for v, t in zip(views, ts):
            t.copy_(v, non_blocking=True)
        tr.sync()
        h2d = min(h2d, time.perf_counter() - t0)
    write, read, _ = write_read_floor(memoryview(pin.numpy()), os.path.join(work, "floor.bin"))
    del pin, views
    return {"d2h_s": d2h, "h2d_s": h2d, "write_fsync_s": write, "cold_read_s": read}


# ---------------------------------------------------------------- methods
#
# The peers are ``peers.py``'s, as in every other benchmark; what differs on
# a GPU is said here: ckpt keeps its last two checkpoints, its lazy step
# pre-hook is timed, and its page-locked peak is reported.


class NoCheckpoint(Method):
    """The control: the same loop, never saving (``run_method`` calls neither)."""

    name = "none"

    def start(self, step: int) -> Callable[[], None]:
        return done

    def load(self, step: int) -> None:
        pass


class GpuCkpt(Ckpt):
    """ckpt on the device: lazy, the optimizer step pre-hook that orders the
    step after the copies (on the device, no host wait) is timed; eager,
    ``save`` returns once the copies have landed. Bound to the model, it calls
    ``load_latest`` as a job's start does (nothing to restore here).

    ``ahead_bytes`` (the state's): with ``staging_budget`` set to twice that,
    which makes that ``load_latest`` lock the first save's memory in the
    background. ``staged_bytes``: lazy with ``device_staging`` of that many
    bytes (the state's: the step waits only for a copy on the device)."""

    AHEAD = "ckpt eager (locked ahead)"
    STAGED = "ckpt lazy (device staging)"
    HALF = "ckpt lazy (half staged)"

    def __init__(self, work: str, lazy: bool, ahead_bytes: Optional[int] = None,
                 staged_bytes: Optional[int] = None, name: Optional[str] = None) -> None:
        super().__init__(work, lazy=lazy, keep_last=2)
        if ahead_bytes is not None:
            self.name = GpuCkpt.AHEAD
            self.dir = os.path.join(work, "ckpt_eager_ahead")
            self.options["staging_budget"] = 2 * ahead_bytes
        if staged_bytes is not None:
            self.name = name or GpuCkpt.STAGED
            self.dir = os.path.join(work, "ckpt_lazy_staged" if self.name == GpuCkpt.STAGED else "ckpt_lazy_half")
            self.options["device_staging"] = staged_bytes
        self.step_wait: List[float] = []
        #: How the last restore's host slab was page-locked (see ``loaded_by``).
        self.restore_lock: Optional[str] = None
        #: Where the last restore's time went (``Checkpointer.last_restore``), in seconds.
        self.restore_phases: Optional[Dict[str, Any]] = None
        #: Each save's ``SaveHandle.phases``: where its stall went.
        self.phases: List[Any] = []

    def start(self, step: int) -> Callable[[], None]:
        wait = super().start(step)
        self.phases.append(self.h.phases)
        return wait

    def bind(self, model: Any, opt: Any) -> "GpuCkpt":
        super().bind(model, opt)
        self.cp.load_latest(**self.state())
        return self

    def open(self) -> None:
        super().open()
        if self.lazy:
            self._time_step_hook()

    def _time_step_hook(self) -> None:
        """Time the optimizer step pre-hook of ``self.cp`` into ``step_wait``."""
        inner = self.cp._before_step

        def timed() -> None:
            t0 = time.perf_counter()
            inner()
            self.step_wait.append(time.perf_counter() - t0)

        self.cp._before_step = timed

    def snapshot_wait(self) -> None:
        pass  # the lazy pre-hook above; eager is done at return

    def settle(self) -> None:
        """Wait for what ckpt does in the background (locking, plans)."""
        pool = self.cp._pool(False)
        if pool is not None:
            pool.drain()

    def pinned(self) -> Optional[int]:
        slabs = self.cp._pool(False)  # its own slabs, or those it shares
        return None if slabs is None else slabs.peak_locked

    def loaded_by(self, cp: Any) -> None:
        # How the restore's host slab was page-locked: in the background once
        # copied (ckpt's way), after the read or during it (--restore-ways),
        # or not at all; and where the restore's time went.
        pool = cp._pool(False)
        self.restore_lock = ",".join(pool.restore_locks) if pool is not None else None
        self.restore_phases = restore_phases(cp.last_restore)


def restore_phases(p: Any) -> Optional[Dict[str, Any]]:
    """A ``ckpt.RestorePhases`` as JSON: its fields and ``other``, in seconds."""
    return None if p is None else {**dataclasses.asdict(p), "other": p.other}


class GpuMemoryTier(GpuCkpt):
    """ckpt lazy through the memory tier (``ckpt.memory.MemoryCheckpointer``):
    every save to host memory (``/dev/shm``) and to local disk, the one
    snapshot serving both; restores read the memory tier (what a restarted
    process does), "cold" with the disk's page cache dropped."""

    name = "ckpt lazy (memory tier)"

    def __init__(self, work: str) -> None:
        super().__init__(work, lazy=True)
        self.name = GpuMemoryTier.name
        self.dir = os.path.join(work, "ckpt_memory_tier")
        base = "/dev/shm" if os.path.isdir("/dev/shm") else work
        self.shm = os.path.join(base, f"ckpt-gpu-bench-{os.getpid()}")
        self.mc: Any = None

    def _open_tier(self) -> Any:
        from ckpt.memory import MemoryCheckpointer

        url = "file://" + os.path.abspath(self.dir)
        return MemoryCheckpointer(url, memory_dir=os.path.join(self.shm, "node{node}"), coordinate="none", lazy=True,
                                  rng=False, keep_last=2, keep_in_memory=2)

    def open(self) -> None:
        Method.open(self)
        shutil.rmtree(self.shm, ignore_errors=True)
        self.mc = self._open_tier()
        self.cp = self.mc.memory  # its step pre-hook fences both tiers' saves; its pool is the durable one's
        self._time_step_hook()

    def bind(self, model: Any, opt: Any) -> "GpuCkpt":
        Method.bind(self, model, opt)  # its own restores are timed in ``load``
        return self

    def start(self, step: int) -> Callable[[], None]:
        h = self.mc.save(step, **self.state())
        if h is not None:
            self.phases.append(h.phases)
        return self.mc.wait

    def prune(self, step: int) -> None:
        pass  # both tiers keep two

    def load(self, step: int) -> None:
        mc = self._open_tier()  # as a restarted process would
        try:
            got = mc.load_latest(**self.state())
            if (got, mc.last_source) != (step, "memory"):
                raise RuntimeError(f"the memory tier restored step {got} from {mc.last_source}, not {step} from memory")
        finally:
            t = time.perf_counter()
            mc.close()
            self.close_s = time.perf_counter() - t

    def close(self) -> None:
        try:
            if self.mc is not None:
                self.mc.close()
        finally:
            shutil.rmtree(self.shm, ignore_errors=True)


def make(name: str, work: str, state_bytes: int) -> Method:
    """The method ``name``: the control, ckpt (``GpuCkpt``, ``GpuMemoryTier``) or a peer of ``peers.MAKERS``."""
    if name == "none":
        return NoCheckpoint(work)
    if name in ("ckpt eager", "ckpt lazy"):
        return GpuCkpt(work, lazy=name == "ckpt lazy")
    if name == GpuCkpt.AHEAD:
        return GpuCkpt(work, lazy=False, ahead_bytes=state_bytes)
    if name == GpuCkpt.STAGED:
        # Room for the slots' 256-byte alignment.
        return GpuCkpt(work, lazy=True, staged_bytes=state_bytes + (64 << 20))
    if name == GpuCkpt.HALF:
        return GpuCkpt(work, lazy=True, staged_bytes=state_bytes // 2, name=GpuCkpt.HALF)
    if name == GpuMemoryTier.name:
        return GpuMemoryTier(work)
    return MAKERS[name](work)


#: Methods whose next optimizer step waits for their staging (``snapshot_wait``), timed.
STAGED = (DcpAsync, TorchCheckpointing)


# ---------------------------------------------------------------- measurement


class Rss:
    """Peak growth of this process's resident set, sampled every 20 ms."""

    def __init__(self) -> None:
        self.base = self._rss()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss() - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def _phases(phases: List[Any]) -> Optional[Dict[str, float]]:
    """Medians of the later saves' ``SaveHandle.phases``, in seconds: where
    ckpt's stall went, timed inside ``save`` (the stall above is timed by the
    loop, around the call)."""
    if not phases:
        return None
    keys = ("before", "walk", "device", "engine", "after", "other", "total")
    return {f"{k}_s": statistics.median(getattr(p, k) for p in phases) for k in keys}


def run_method(m: Method, tr: Trainer, a: argparse.Namespace, step0: int) -> dict:
    """The loop, then the restores; figures in seconds."""
    plain: List[float] = []
    with_ckpt: List[float] = []
    stalls: List[float] = []
    durable: List[float] = []
    waiters: List[threading.Thread] = []
    step = step0
    # Waits of the first optimizer step after a save (ckpt lazy: its pre-hook's, every step).
    waits: List[float] = m.step_wait if isinstance(m, GpuCkpt) else []
    rss = Rss()

    def wait_durable(fn: Callable[[], None], t0: float) -> None:
        fn()
        durable.append(time.perf_counter() - t0)

    # Each step's time in the device's timeline, per round: without a save,
    # and after one (the first of those includes the save's stall).
    plain_steps: List[List[float]] = []
    ckpt_steps: List[List[float]] = []
    # One step before the windows: after a fresh start's load_latest, ckpt
    # readies its first save at the first optimizer step (memory locked in the
    # background, the state walked once: ckpt._save.ahead), once per job; timed
    # with what it left in the background, against the control's.
    tr.sync()
    t0 = time.perf_counter()
    tr.step()
    tr.sync()
    if isinstance(m, GpuCkpt):
        m.settle()
    first_step = time.perf_counter() - t0
    for r in range(a.rounds):
        tr.sync()
        t0 = time.perf_counter()
        marks = [tr.mark()]
        for _ in range(a.every):
            tr.step()
            marks.append(tr.mark())
        tr.sync()
        plain.append(time.perf_counter() - t0)
        plain_steps.append(tr.between(marks))
        t0 = time.perf_counter()
        marks = [tr.mark()]
        if not isinstance(m, NoCheckpoint):
            step += 1
            durable_wait = m.start(step)
            stalls.append(time.perf_counter() - t0)
            w = threading.Thread(target=wait_durable, args=(durable_wait, t0), daemon=True)
            w.start()
            waiters.append(w)
        for i in range(a.every):
            _step(tr, m, i == 0, waits)
            marks.append(tr.mark())
        tr.sync()
        with_ckpt.append(time.perf_counter() - t0)
        ckpt_steps.append(tr.between(marks))
    for w in waiters:
        w.join()
    host_peak = rss.stop()
    out: Dict[str, Any] = {
        "method": m.name,
        "stall_first_s": stalls[0] if stalls else None,
        "stall_later_s": statistics.median(stalls[1:]) if len(stalls) > 1 else None,
        "step_wait_s": statistics.median(waits) if waits else None,
        # Steady state: the rounds after the first (whose save is the process's
        # first, with its one-time costs, reported apart as first_save_extra_s).
        "slowdown": _slowdown(plain[1:], with_ckpt[1:]) if a.rounds > 1 else _slowdown(plain, with_ckpt),
        "slowdown_all": _slowdown(plain, with_ckpt),
        "first_save_extra_s": (with_ckpt[0] - plain[0]) - (
            statistics.median(w - p for p, w in zip(plain[1:], with_ckpt[1:])) if a.rounds > 1 else 0.0),
        "rounds_s": [[p, w] for p, w in zip(plain, with_ckpt)],
        "step_waits_s": list(waits),
        "durable_s": statistics.median(durable) if durable else None,
        "restore_warm_s": None,
        "restore_cold_s": None,
        "pinned_peak_bytes": m.pinned() if isinstance(m, GpuCkpt) else None,
        "host_peak_bytes": host_peak,
        "error": None,
        "stalls_s": stalls,
        "stall_phases": _phases(m.phases[1:len(stalls)]) if isinstance(m, GpuCkpt) else None,
        "step_excess": _excess(plain_steps[1:] or plain_steps, ckpt_steps[1:] or ckpt_steps),
        "first_step_s": first_step,
    }
    if isinstance(m, NoCheckpoint) or a.no_restore:
        return out
    # Restores: one more save with nothing after it, then scramble and restore.
    step += 1
    tr.sync()
    ref = tr.reference()
    m.start(step)()
    m.prune(step)
    # Plain lazy restores again with the restore's new slab locked another
    # way (after the read, during it): every way asked for, in one run.
    # Then cold as a restarted job's writer (which readies its first save and
    # locks its slab in the background), and the training step after it.
    restores = [("warm", ""), ("cold", "")]
    if m.name == "ckpt lazy" and a.device == "cuda":
        for way in [w.strip() for w in a.restore_ways.split(",")]:
            if way and way != default_lock():
                restores += [("warm", f"_lock_{way}"), ("cold", f"_lock_{way}")]
        restores.append(("cold", "_writer"))
    # ``--restore-repeats`` rounds, each restoring every way once (the ways
    # interleaved, so that neither is always first); the median is the figure.
    runs: Dict[str, List[Tuple[float, Any]]] = {}
    for _ in range(max(1, a.restore_repeats)):
        for kind, key in restores:
            tr.scramble()
            if kind == "cold":
                drop_cache(m.dir)
            else:
                warm_cache(m.dir)
            tr.sync()
            with _restore_lock(key[len("_lock_"):] if key.startswith("_lock_") else default_lock()):
                m.close_s = 0.0
                t0 = time.perf_counter()
                if key == "_writer":
                    m.load(step, writer=True)
                else:
                    m.load(step)
                tr.sync()
                # A restarted job's checkpointer stays open: the reader's close
                # (slabs unlocked, its threads joined) is noted apart.
                took = time.perf_counter() - t0 - m.close_s
            tr.check(ref, f"{m.name} ({kind}{key.replace('_', ' ')})")
            got: Optional[Dict[str, Any]] = None
            if isinstance(m, GpuCkpt):
                got = {"lock": m.restore_lock, "phases": m.restore_phases, "close_s": m.close_s}
            if key == "_writer":  # the job's first step: it may wait for the slab's lock
                t1 = time.perf_counter()
                tr.step()
                tr.sync()
                got = {**(got or {}), "step_s": time.perf_counter() - t1}
            runs.setdefault(f"restore_{kind}{key}", []).append((took, got))
    for name, taken in runs.items():
        ordered = sorted(taken, key=lambda r: r[0])
        took, got = ordered[(len(ordered) - 1) // 2]  # the median run (the lower one of an even count)
        out[f"{name}_s"] = took
        out[f"{name}_runs_s"] = [t for t, _ in taken]
        for k, v in (got or {}).items():
            out[f"{name}_{k}"] = v
    del ref
    return out


def default_lock() -> str:
    """How ckpt's restores page-lock a new host slab by default."""
    from ckpt._device.cuda import HostStage

    return str(HostStage.lock)


@contextlib.contextmanager
def _restore_lock(way: str) -> Iterator[None]:
    """A restore's new host slab page-locked ``way`` (``ckpt._device.cuda.HostStage.lock``)."""
    from ckpt._device.cuda import HostStage

    was, HostStage.lock = HostStage.lock, way
    try:
        yield
    finally:
        HostStage.lock = was


def _excess(plain: List[List[float]], after: List[List[float]]) -> Dict[str, Any]:
    """Where a loop's slowdown went, in seconds per save (the rounds after the
    first): each step after a save against the median step without one, by
    the step's place after the save (medians over rounds), summed as the
    first step (the save's stall, and ckpt lazy's wait for its copies), the
    next three, and the rest (work in the background)."""
    base = statistics.median(t for r in plain for t in r)
    by_place = [statistics.median(r[k] for r in after) - base for k in range(len(after[0]))] if after else []
    return {
        "step_s": base,
        "by_place_s": by_place,
        "first_s": sum(by_place[:1]),
        "next3_s": sum(by_place[1:4]),
        "rest_s": sum(by_place[4:]),
    }


def _slowdown(plain: List[float], with_ckpt: List[float]) -> float:
    return (sum(with_ckpt) - sum(plain)) / sum(plain)


def _step(tr: Trainer, m: Method, first: bool, waits: List[float]) -> None:
    """One training step; before the first optimizer step after a save, what the
    method needs waited for, timed into ``waits`` (ckpt lazy's own hook does its
    part inside ``step``)."""
    with torch.autocast(tr.device, dtype=torch.bfloat16, enabled=tr.device == "cuda"):
        loss = tr.model(tr.x)
    loss.backward()
    if first and isinstance(m, STAGED):
        t0 = time.perf_counter()
        m.snapshot_wait()
        waits.append(time.perf_counter() - t0)
    tr.opt.step()
    tr.opt.zero_grad(set_to_none=True)


def targets(res: dict) -> List[dict]:
    fl = res["floors"]
    by = {m["method"]: m for m in res["methods"] if not m.get("error")}
    out = []

    def add(what: str, value: Optional[float], bound: float) -> None:
        if value is not None:
            out.append({"target": what, "value": value, "bound": bound, "met": value <= bound})

    lazy, eager = by.get("ckpt lazy"), by.get("ckpt eager")
    gib = res["state_bytes"] / 2**30
    if lazy:
        add(f"lazy stall, s ({gib:.1f} GiB)", lazy["stall_later_s"], 0.010)
        if lazy["stall_first_s"] is not None and lazy["stall_later_s"]:
            add("lazy first stall / later stall", lazy["stall_first_s"] / lazy["stall_later_s"], 2.0)
        add(f"lazy loop slowdown, every {res['every']} steps", lazy["slowdown"], 0.01)
        if lazy["durable_s"] is not None:
            add("lazy durable / write + fsync", lazy["durable_s"] / fl["write_fsync_s"], 1.1)
        if lazy["restore_cold_s"] is not None:
            add("cold restore / (cold read + host-to-device)", lazy["restore_cold_s"] / (fl["cold_read_s"] + fl["h2d_s"]), 1.1)
        ways = {"during": "during the read", "later": "in the background once copied", "after": "after the read"}
        for way, how in ways.items():  # the other ways of locking a restore's slab (--restore-ways)
            other = lazy.get(f"restore_cold_lock_{way}_s")
            if other is not None:
                add(f"cold restore, slab locked {how} / (cold read + host-to-device)",
                    other / (fl["cold_read_s"] + fl["h2d_s"]), 1.1)
        if lazy["pinned_peak_bytes"] is not None:
            add("page-locked bytes / state (budget 2x by default)", lazy["pinned_peak_bytes"] / res["state_bytes"], 2.1)
    if eager and eager["stall_later_s"] is not None:
        add("eager stall / device-to-host floor", eager["stall_later_s"] / fl["d2h_s"], 1.1)
    staged = by.get(GpuCkpt.STAGED)
    if staged:
        add(f"lazy stall with device staging, s ({gib:.1f} GiB)", staged["stall_later_s"], 0.010)
        add(f"lazy loop slowdown with device staging, every {res['every']} steps", staged["slowdown"], 0.01)
    ahead = by.get(GpuCkpt.AHEAD)
    if ahead and ahead["stall_first_s"] is not None and ahead["stall_later_s"]:
        # staging_budget set: load_latest at the start locked the first save's memory.
        add("eager first stall / later stall (memory locked ahead)", ahead["stall_first_s"] / ahead["stall_later_s"], 2.0)
    tier = by.get(GpuMemoryTier.name)
    if tier and lazy:
        if tier["stall_later_s"] and lazy["stall_later_s"]:
            # One snapshot for both tiers: the stall of a plain lazy save, not two.
            add("memory tier stall / lazy stall", tier["stall_later_s"] / lazy["stall_later_s"], 1.25)
        if tier["restore_cold_s"] is not None and lazy["restore_cold_s"]:
            add("memory tier restore / lazy cold restore", tier["restore_cold_s"] / lazy["restore_cold_s"], 0.3)
    return out


def model_args(ap: argparse.ArgumentParser) -> None:
    """The model's size and batch (``Trainer``'s), flags of every script on it."""
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--optimizer", choices=["fused", "foreach"], default="fused",
                    help="AdamW's implementation: foreach keeps each parameter's step count on the CPU")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--json", required=True)
    model_args(ap)
    ap.add_argument("--every", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default=",".join(ALL))
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to smoke-test this script")
    ap.add_argument("--restore-ways", default="",
                    help="other ways plain ckpt lazy's restores may page-lock their new host slab, each "
                         "timed beside the default (HostStage.lock): later, after, during (comma-separated)")
    ap.add_argument("--no-restore", action="store_true", help="measure no restores (nor the save before them)")
    ap.add_argument("--restore-repeats", type=int, default=1,
                    help="restore each way this many times, interleaved; the median is the figure")
    a = ap.parse_args()

    def write(obj: dict) -> None:
        with open(a.json, "w") as f:
            json.dump(obj, f, indent=1)

    if a.device == "cuda" and not torch.cuda.is_available():
        write({"skipped": "no CUDA device (torch.cuda.is_available() is false)"})
        return
    os.makedirs(a.dir, exist_ok=True)
    import torch.distributed as dist

    # An absolute path: a relative one makes a URL whose first part is read as
    # a host, and the group waits for it forever.
    store = os.path.abspath(os.path.join(a.dir, "store"))
    if os.path.exists(store):
        os.remove(store)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    tr = Trainer(a, a.device)
    for _ in range(3):
        tr.step()
    tr.sync()
    t0 = time.perf_counter()
    for _ in range(10):
        tr.step()
    tr.sync()
    step_s = (time.perf_counter() - t0) / 10
    params = sum(p.numel() for p in tr.model.parameters())
    res: Dict[str, Any] = {
        "skipped": None,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__.split("+")[0],
        "model": f"GPT {a.layers} x {a.width}, {params / 1e6:.0f} M parameters, {tr.optimizer} AdamW, bf16 autocast, "
                 f"batch {a.batch} x {a.seq}",
        "state_bytes": tr.nbytes(),
        "step_s": step_s,
        "every": a.every,
        "floors": floors(tr, a.dir),
        "methods": [],
    }
    print(f"[gpu] {res['model']}: {res['state_bytes'] / 2**30:.2f} GiB, step {step_s * 1e3:.1f} ms; "
          f"floors {res['floors']}", file=sys.stderr, flush=True)
    step = 0
    for name in a.methods.split(","):
        name = name.strip()
        t0 = time.perf_counter()
        m = None
        try:
            m = make(name, os.path.join(a.dir, "runs"), res["state_bytes"])
            m.prepare()
            m.open()
            r = run_method(m.bind(tr.model, tr.opt), tr, a, step)
        except Exception as e:  # noqa: BLE001 - report and go on with the next method
            traceback.print_exc()
            r = {"method": name, "error": f"{type(e).__name__}: {e}"}
        finally:
            if m is not None:
                try:
                    m.close()
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                shutil.rmtree(m.dir, ignore_errors=True)
        step += 1000
        res["methods"].append(r)
        print(f"[gpu] {name}: {time.perf_counter() - t0:.1f} s: {json.dumps(r)}", file=sys.stderr, flush=True)
        write(res)
    res["targets"] = targets(res)
    write(res)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
