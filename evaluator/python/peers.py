"""The peers every Python benchmark of ckpt-eval measures, and how: one
``Method`` per way to checkpoint a model and its optimizer (ckpt eager and
lazy, ckpt given DCP's ``AppState``, ``torch.save``, ``safetensors.torch``,
``dcp.save``, ``dcp.async_save`` with its stager, torch-checkpointing's
``CheckpointManager``), the floors (copy, write + fsync, cold read), dropping
the page cache ("cold" is the same in every table), fsync of what a peer wrote,
and host memory (Pss of the process tree, sampled over windows: "peak").

Works in one process and under torchrun (collectives only where a process
group of several ranks exists). Written next to each benchmark script by
ckpt-eval, which imports it from there.
"""

from __future__ import annotations

import abc
import gc
import json
import os
import shutil
import threading
import time
from typing import Any

__all__ = [
    "tree_pss", "settle", "Peak", "drop_cache", "drop_cache_ranks", "fsync_path", "fsync_tree",
    "fsync_written", "tree_bytes", "rank", "world", "barrier", "broadcast", "floors", "write_read_floor",
    "Method", "timed_save", "Ckpt", "CkptAppState", "AppState", "TorchSave", "Safetensors",
    "DcpSave", "DcpAsync", "DcpCkpt", "DcpAsyncCkpt", "TorchCheckpointing", "dcp_state", "dcp_apply", "MAKERS",
]


# ---------------------------------------------------------------- host memory

def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def tree_pss() -> int:
    """Pss of this process and its descendants, bytes."""
    todo, seen, total = [os.getpid()], set(), 0
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += _pss(p)
        todo += _children(p)
    return total


def settle() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc ``malloc_trim``),
    so memory that an earlier phase freed (a model built for a load, a load's
    buffers) but the allocator kept is not counted against the next save."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Peak:
    """Samples tree_pss() on a thread while a window opened with ``active()`` is
    open. ``extra``: the peak over the windows, minus the value at entry and
    minus ``own``, the bytes of reference copies the benchmark itself holds.

    One reading takes tens of milliseconds, so a reading counts only if its
    window was open from its start to its end: one still in flight when the
    window closed would else take in what the benchmark does next (a training
    step's activations, a reference copy not yet in ``own``)."""

    def __enter__(self) -> "Peak":
        settle()
        self.base = tree_pss()
        self.own = 0
        self.extra = 0
        #: Bumped as each window opens and closes (odd: open): a reading
        #: counts only if it is the same, and odd, after the reading as before.
        self._window = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        window, own = self._window, self.own
        if window % 2 == 0:
            return
        value = tree_pss() - self.base - own
        if self._window == window:
            self.extra = max(self.extra, value)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self._sample()

    def active(self):
        peak = self

        class _On:
            def __enter__(self):
                settle()
                peak._window += 1
                peak._sample()

            def __exit__(self, *exc):
                peak._sample()
                peak._window += 1

        return _On()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


# ---------------------------------------------------------------- files

def drop_cache(path: str) -> str:
    """Drop the page cache: globally if allowed, else per file; says which."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    ok = True
    walk = os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]
    for root, _, files in walk:
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
            except (OSError, AttributeError):
                ok = False
    return "fadvise" if ok else "none"


def warm_cache(path: str) -> int:
    """Read every file under ``path`` once (untimed), so that a "warm" restore
    finds it in the page cache whatever way it was written: a writer that
    bypasses the cache (``O_DIRECT``, as ckpt's native format does) leaves
    none of it there. Returns the bytes read."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                with open(os.path.join(root, name), "rb", buffering=0) as f:
                    while True:
                        b = f.read(16 << 20)
                        if not b:
                            break
                        total += len(b)
            except OSError:
                pass
    return total


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    for root, dirs, files in os.walk(path):
        for name in files + dirs:
            fsync_path(os.path.join(root, name))
    fsync_path(path)


def fsync_written(args) -> None:
    """torch-checkpointing's pre-finalize callback: fsync what was written."""
    fsync_tree(str(args.path))


def tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


# ---------------------------------------------------------------- ranks

def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def world() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def barrier() -> None:
    if world() > 1:
        _dist().barrier()


def broadcast(obj):
    """Rank 0's ``obj`` on every rank."""
    if world() == 1:
        return obj
    box = [obj]
    _dist().broadcast_object_list(box, src=0)
    return box[0]


def drop_cache_ranks(path: str) -> str:
    """``drop_cache`` on every rank together: rank 0 drops the whole page cache
    where allowed (once, for every rank), else every rank its own files."""
    if world() == 1:
        return drop_cache(path)
    barrier()
    how = broadcast(drop_cache(path) if rank() == 0 else None)
    if how != "drop_caches":
        how = drop_cache(path)
    barrier()
    return how


# ---------------------------------------------------------------- floors

def floors(tensors: dict, work: str, repeats: int = 1) -> dict:
    """Copy into preallocated (touched) buffers, write + fsync to one file and
    the cold read of that file, of the bytes of ``tensors`` (each storage
    once); the fastest of the repeats (at least three copies). Under several
    ranks each rank measures its own bytes, the ranks in step."""
    import torch

    uniq, seen = [], set()
    for t in tensors.values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            uniq.append(t)
    dsts = [torch.empty_like(t) for t in uniq]
    for d in dsts:
        d.zero_()  # touch the pages first
    copy = []
    for _ in range(max(3, repeats)):
        barrier()
        t = time.perf_counter()
        for d, s in zip(dsts, uniq):
            d.copy_(s)
        copy.append(time.perf_counter() - t)
    del dsts
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in uniq])
    path = os.path.join(work, f"floor-rank{rank()}.bin")
    write, read, how = [], [], "none"
    back = torch.empty_like(flat)
    for _ in range(max(1, repeats)):
        w, r, how = write_read_floor(memoryview(flat.numpy()), path, into=memoryview(back.numpy()))
        write.append(w)
        read.append(r)
        assert torch.equal(back, flat)
    return {"memcpy_s": min(copy), "write_fsync_s": min(write), "read_cold_s": min(read), "cache_drop": how}


#: The pieces the floors write and read in (one call moves at most 2 GiB on Linux).
FLOOR_PIECE = 64 << 20


def write_read_floor(buf: memoryview, path: str, into: memoryview | None = None) -> tuple:
    """Write + fsync of ``buf`` to one new file at ``path``, then the read of
    that file with the page cache dropped (every rank together) into
    ``into`` (``buf`` itself if not given), both in pieces of ``FLOOR_PIECE``;
    the file is removed. Returns (write s, read s, how the cache was dropped)."""
    buf = buf.cast("B")
    into = buf if into is None else into.cast("B")
    total = len(buf)
    barrier()
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        at = 0
        while at < total:
            at += f.write(buf[at : at + FLOOR_PIECE])
        os.fsync(f.fileno())
    write = time.perf_counter() - t
    how = drop_cache_ranks(path)
    t = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        at = 0
        while at < total:
            n = f.readinto(into[at : at + FLOOR_PIECE])
            if not n:
                raise OSError(f"{path}: {at} of {total} bytes read back")
            at += n
    read = time.perf_counter() - t
    os.remove(path)
    return write, read, how


# ---------------------------------------------------------------- methods

def done() -> None:
    """The waiter of a save that was durable when it returned."""


class Method(abc.ABC):
    """One way to checkpoint a model and its optimizer (``bind``): a saver kept
    across saves (as in training) and its directory. ``start`` returns once the
    training loop may go on (the stall) with a function that blocks until the
    save is durable; ``snapshot_wait`` blocks until the state may change again."""

    name = "?"
    #: Whether this method's load is timed (one method per file format).
    loads = True
    #: Seconds the last load spent closing its reader (ckpt's), within it.
    close_s = 0.0

    def __init__(self, work: str) -> None:
        self.dir = os.path.join(work, self.name.replace(" ", "_").replace(".", "_"))
        self.model = self.opt = None
        self.written = 0

    def bind(self, model, opt) -> "Method":
        """The model and optimizer that ``start`` saves and ``load`` loads into."""
        self.model, self.opt = model, opt
        return self

    def prepare(self) -> None:
        """Import what the method needs (an exception skips the method)."""

    def begin(self) -> None:
        """What a job does at its start with this method, after ``open`` and
        before it trains (ckpt: ``load_latest``, which finds nothing)."""

    def open(self) -> None:
        """A fresh directory (rank 0 makes it) and saver."""
        if rank() == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
            os.makedirs(self.dir, exist_ok=True)
        barrier()

    def step_dir(self, step: int) -> str:
        return os.path.join(self.dir, f"step_{step}")

    @abc.abstractmethod
    def start(self, step: int):
        """Start saving ``step``; returns a function that blocks until durable."""

    def snapshot_wait(self) -> None:
        """Block until the state may be mutated again (before the optimizer step)."""

    @abc.abstractmethod
    def load(self, step: int) -> None:
        """Load ``step`` into the bound model and optimizer."""

    def measure_written(self, step: int) -> None:
        """Bytes this rank wrote for ``step``: the method's files over the ranks."""
        self.written = tree_bytes(self.step_dir(step)) // world()

    def prune(self, step: int) -> None:
        """Remove every checkpoint but ``step``'s (bounds the disk used)."""
        if rank() != 0:
            return
        for name in os.listdir(self.dir):
            if name.startswith("step_") and name != f"step_{step}":
                shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)

    def close(self) -> None:
        pass


def timed_save(m: Method, step: int):
    """(stall, snapshot, durable) of one save, seconds from the call."""
    t = time.perf_counter()
    wait = m.start(step)
    stall = time.perf_counter() - t
    m.snapshot_wait()
    snap = time.perf_counter() - t
    wait()
    return stall, snap, time.perf_counter() - t


class Ckpt(Method):
    """ckpt's Python API: ``save(step, model=, optimizer=)``, ``load_latest`` in place."""

    def __init__(self, work: str, lazy: bool, keep_last: int | None = None) -> None:
        self.lazy = lazy
        self.name = "ckpt lazy" if lazy else "ckpt eager"
        self.loads = not lazy  # the same files and load path as eager
        #: Options of the checkpointer (``keep_last``, ``staging_budget``, ...).
        self.options: dict = {} if keep_last is None else {"keep_last": keep_last}
        self.cp = None
        self.h = None
        super().__init__(work)

    def prepare(self) -> None:
        import ckpt  # noqa: F401

    def open(self) -> None:
        import ckpt

        super().open()
        self.cp = ckpt.Checkpointer("file://" + os.path.abspath(self.dir), lazy=self.lazy, rng=False, **self.options)

    def state(self) -> dict:
        """What ``save`` and ``load_latest`` are given."""
        return {"model": self.model, "optimizer": self.opt}

    def begin(self) -> None:
        # As the README asks of a job: on a fresh start too, with the names it
        # saves under (it readies the first save after the next optimizer step).
        if self.cp.load_latest(**self.state()) is not None:
            raise RuntimeError(f"{self.name}: a fresh directory held a checkpoint")

    def start(self, step: int):
        before = self.cp.io_counts()["written_bytes"]
        h = self.h = self.cp.save(step, **self.state())

        def wait():
            h.wait()
            self.written = self.cp.io_counts()["written_bytes"] - before

        return wait

    def snapshot_wait(self) -> None:
        if self.h is not None:
            self.h.wait_snapshot()

    def measure_written(self, step: int) -> None:
        pass  # counted by the waiter (ckpt's own counter, this rank's bytes)

    def prune(self, step: int) -> None:
        if "keep_last" not in self.options:
            super().prune(step)

    def load(self, step: int, writer: bool = False) -> None:
        """Restore ``step`` with a new reader. ``writer``: one that may save,
        as a restarted job's (it readies its first save and keeps its slab),
        claiming no epoch; else a read-only one."""
        import ckpt

        url = "file://" + os.path.abspath(self.dir)
        try:
            # A reader beside the saver, which saves again after: it must not
            # claim the root's writer epoch (that would fence the saver).
            if writer:
                cp = ckpt.Checkpointer(url, lazy=self.lazy, rng=False, fencing=False)
            else:
                cp = ckpt.Checkpointer(url, lazy=self.lazy, rng=False, read_only=True)
        except TypeError:  # a ckpt without writer epochs
            cp = ckpt.Checkpointer(url, lazy=self.lazy, rng=False)
        try:
            got = cp.load_latest(**self.state())
            if got != step:
                raise RuntimeError(f"ckpt loaded step {got}, not {step}")
            self.loaded_by(cp)
        finally:
            t = time.perf_counter()
            cp.close()
            #: Seconds the reader's close took, within the load (a job's stays open).
            self.close_s = time.perf_counter() - t

    def loaded_by(self, cp: Any) -> None:
        """What a benchmark notes of the reader that restored (before it closes)."""

    def close(self) -> None:
        if self.cp is not None:
            self.cp.close()
            self.cp = None


class CkptAppState(Ckpt):
    """ckpt lazy, given DCP's tutorial ``AppState`` (a ``Stateful`` over
    ``get_state_dict``/``set_state_dict``) instead of the model and optimizer."""

    name = "ckpt lazy (AppState)"

    def __init__(self, work: str, keep_last: int | None = None) -> None:
        super().__init__(work, lazy=True, keep_last=keep_last)
        self.name = CkptAppState.name
        self.dir = os.path.join(work, "ckpt_lazy_appstate")
        self.loads = True

    def state(self) -> dict:
        return {"app": AppState(self.model, self.opt)}


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


class TorchSave(Method):
    """``torch.save`` of both state dicts to one file, fsynced; ``torch.load(weights_only=True)``."""

    name = "torch.save"

    def path(self, step: int) -> str:
        return os.path.join(self.step_dir(step), "state.pt")

    def start(self, step: int):
        import torch

        os.makedirs(self.step_dir(step), exist_ok=True)
        with open(self.path(step), "wb") as f:
            torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        return done

    def load(self, step: int) -> None:
        import torch

        s = torch.load(self.path(step), weights_only=True)
        self.model.load_state_dict(s["model"])
        self.opt.load_state_dict(s["optimizer"])


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
        for k, v in self.model.state_dict().items():
            key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
            if key in seen:
                aliases[k] = seen[key]
            else:
                seen[key] = k
                flat[f"model.{k}"] = v.contiguous()
        osd = self.opt.state_dict()
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
        self.model.load_state_dict(msd)
        self.opt.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})


class DcpSave(Method):
    """``dcp.save`` with ``FileSystemWriter(sync_files=True)``; ``dcp.load`` + ``set_state_dict``."""

    name = "dcp.save"

    def prepare(self) -> None:
        import torch.distributed.checkpoint  # noqa: F401

    def start(self, step: int):
        import torch.distributed.checkpoint as dcp

        dcp.save(dcp_state(self.model, self.opt),
                 storage_writer=dcp.FileSystemWriter(self.step_dir(step), sync_files=True))
        return done

    def load(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        sd = dcp_state(self.model, self.opt)
        dcp.load(sd, checkpoint_id=self.step_dir(step))
        dcp_apply(self.model, self.opt, sd)


class DcpAsync(DcpSave):
    """``dcp.async_save`` with its ``DefaultStager`` (pinned memory where CUDA
    is), in a gloo group of its own for the background collectives; one
    upload at a time (a save first waits for the previous one's)."""

    name = "dcp.async_save"

    def __init__(self, work: str, loads: bool = True) -> None:
        super().__init__(work)
        self.loads = loads

    def prepare(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401

        # Pinned host memory needs CUDA; without it the same stager stages to plain memory.
        self.pinned = torch.cuda.is_available()
        self.pg = dist.new_group(backend="gloo")  # its own group for the background collectives
        self.stager = None
        self.resp = None
        self.upload = None

    def open(self) -> None:
        super().open()
        self.open_stager()

    def open_stager(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self.stager is not None:
            self.stager.close()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=self.pinned, use_shared_memory=False,
                                                   use_async_staging=True, use_non_blocking_copy=self.pinned))

    def _stager_closed(self) -> bool:
        """True when a save closed the stager: its executor shut down, or its
        state-dict stager's copy dispatch cleared (what ``close`` does)."""
        ex = getattr(self.stager, "_staging_executor", None)
        if ex is not None and getattr(ex, "_shutdown", False):
            return True
        inner = getattr(self.stager, "_state_dict_stager", None)
        return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)

    def start(self, step: int):
        import torch.distributed.checkpoint as dcp

        if self.upload is not None:  # one upload at a time, as torchtitan does
            self.upload()
        if self._stager_closed():
            # Some torch versions (2.11) close a given stager with the save
            # that used it: a fresh one for the next.
            self.open_stager()
        resp = self.resp = dcp.async_save(
            dcp_state(self.model, self.opt),
            storage_writer=dcp.FileSystemWriter(self.step_dir(step), sync_files=True),
            process_group=self.pg, async_stager=self.stager)
        fut = resp.upload_completion if hasattr(resp, "upload_completion") else resp
        self.upload = lambda: fut.result()
        return self.upload

    def snapshot_wait(self) -> None:
        if self.resp is not None and hasattr(self.resp, "staging_completion"):
            self.resp.staging_completion.result()

    def close(self) -> None:
        if self.upload is not None:
            self.upload()
            self.upload = None
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class _IntoCkpt:
    """What ``dcp.save`` and ``dcp.async_save`` into ckpt's storage share: one
    ``ckpt.dcp.StorageWriter`` per job, kept across saves (as its docs say),
    ``dcp.load`` through ``ckpt.dcp.StorageReader``, and bytes written by
    ckpt's own counter (this rank's)."""

    dir: str
    writer = None

    def prepare_writer(self) -> None:
        import ckpt.dcp  # noqa: F401

    def open_writer(self) -> None:
        import ckpt.dcp

        self.writer = ckpt.dcp.StorageWriter(self.dir)

    def counted(self) -> int:
        native = self.writer._native if self.writer is not None else None
        return native.io_counts()["written_bytes"] if native is not None else 0

    def measure_written(self, step: int) -> None:
        pass  # counted by the save (ckpt's counter)

    def load(self, step: int) -> None:
        import ckpt.dcp
        import torch.distributed.checkpoint as dcp

        sd = dcp_state(self.model, self.opt)
        dcp.load(sd, checkpoint_id=f"step-{step}", storage_reader=ckpt.dcp.StorageReader(self.dir))
        dcp_apply(self.model, self.opt, sd)

    def close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()  # waits for this rank's part
            self.writer = None


class DcpCkpt(_IntoCkpt, DcpSave):
    """``dcp.save`` into ``ckpt.dcp.StorageWriter``: ckpt's commit, chunks and fsync."""

    name = "dcp.save -> ckpt"

    def prepare(self) -> None:
        self.prepare_writer()
        super().prepare()

    def open(self) -> None:
        super().open()
        self.open_writer()

    def start(self, step: int):
        import torch.distributed.checkpoint as dcp

        before = self.counted()
        dcp.save(dcp_state(self.model, self.opt), checkpoint_id=f"step-{step}", storage_writer=self.writer)
        # Rank 0 returns once committed, the others once their part is handed
        # to the engine: durable once it is written (the commit waited for it).
        self.writer.settle()
        self.written = self.counted() - before
        return done

    def close(self) -> None:
        self.close_writer()


class DcpAsyncCkpt(_IntoCkpt, DcpAsync):
    """``dcp.async_save`` (its ``DefaultStager``, one upload at a time) into ``ckpt.dcp.StorageWriter``."""

    name = "dcp.async_save -> ckpt"

    def prepare(self) -> None:
        self.prepare_writer()
        super().prepare()

    def open(self) -> None:
        super().open()
        self.open_writer()

    def start(self, step: int):
        import torch.distributed.checkpoint as dcp

        if self.upload is not None:
            self.upload()
        if self._stager_closed():
            self.open_stager()
        before = self.counted()
        resp = self.resp = dcp.async_save(dcp_state(self.model, self.opt), checkpoint_id=f"step-{step}",
                                          storage_writer=self.writer, process_group=self.pg, async_stager=self.stager)
        fut = resp.upload_completion if hasattr(resp, "upload_completion") else resp
        writer = self.writer

        def upload() -> None:
            fut.result()
            writer.settle()
            self.written = self.counted() - before

        self.upload = upload
        return upload

    def close(self) -> None:
        super().close()
        self.close_writer()


class TorchCheckpointing(Method):
    """torch-checkpointing's ``CheckpointManager``, asynchronous saver."""

    name = "torch-checkpointing"
    #: The manager once opened (``close`` runs also after a failed ``prepare``).
    m = None

    def prepare(self) -> None:
        import torch_checkpointing  # noqa: F401

    def _manager(self, for_load: bool = False):
        from torch_checkpointing import CheckpointManager, ItemSpec
        from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        # No resharder: 0.1.1 gathers resharding metadata through a CUDA tensor
        # (metadata_manager._all_gather_pickled_data), which fails without a GPU.
        # Without one it saves each rank's DTensor shards as they are
        # (``<item>_<rank>.pt``) and loads them back on the same layout.
        # O_DIRECT (its default) fails on the first unaligned write (EINVAL),
        # so buffered writes, made durable by the pre-finalize fsync.
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

    def start(self, step: int):
        fut = self.m.save(self.step_dir(step), dcp_state(self.model, self.opt))
        return (lambda: fut.result()) if fut is not None else done

    def snapshot_wait(self) -> None:
        # The manager's staging future: when the state may be mutated again.
        if self.m is not None and self.m._staging_future is not None:
            self.m._staging_future.result()

    def load(self, step: int) -> None:
        sd = dcp_state(self.model, self.opt)
        m = self._manager(for_load=True)
        try:
            m.load(self.step_dir(step), into=sd)
        finally:
            m.close()
        dcp_apply(self.model, self.opt, sd)

    def close(self) -> None:
        if self.m is not None:
            self.m.close()
            self.m = None


#: Every peer by name: ``MAKERS[name](work)`` makes it (bind a model and optimizer next).
MAKERS = {
    "ckpt eager": lambda work: Ckpt(work, lazy=False),
    "ckpt lazy": lambda work: Ckpt(work, lazy=True),
    CkptAppState.name: CkptAppState,
    "torch.save": TorchSave,
    "safetensors": Safetensors,
    "dcp.save": DcpSave,
    "dcp.async_save": DcpAsync,
    DcpCkpt.name: DcpCkpt,
    DcpAsyncCkpt.name: DcpAsyncCkpt,
    "torch-checkpointing": TorchCheckpointing,
}
