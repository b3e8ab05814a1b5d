"""What the evaluator's Python benchmarks share: host memory (Pss of the process
tree, sampled over windows), the page cache, fsync of what a peer wrote.

Written next to each benchmark script by ckpt-eval, which imports it from there.
"""

import gc
import os
import threading

__all__ = [
    "tree_pss", "settle", "Peak", "drop_cache", "fsync_path", "fsync_tree",
    "fsync_written", "tree_bytes",
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
    minus ``own``, the bytes of reference copies the benchmark itself holds."""

    def __enter__(self) -> "Peak":
        settle()
        self.base = tree_pss()
        self.own = 0
        self.extra = 0
        self._on = False
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _sample(self) -> None:
        if self._on:
            self.extra = max(self.extra, tree_pss() - self.base - self.own)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self._sample()

    def active(self):
        peak = self

        class _On:
            def __enter__(self):
                settle()
                peak._on = True
                peak._sample()

            def __exit__(self, *exc):
                peak._sample()
                peak._on = False

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
