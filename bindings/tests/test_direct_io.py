"""``direct_io``: large objects of a local directory are written past the page
cache unless ``direct_io=False``. Checked where it shows: which pages of the
written chunk files the kernel keeps cached (``mincore``), on a file system
that takes ``O_DIRECT``."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Optional

import pytest
import torch

import ckpt

DIRECT_FS = {"ext4", "xfs"}


def fs_type(path: Path) -> str:
    """The file system of ``path``, by the longest mount point above it."""
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                best, kind = parts[1], parts[2]
    return kind


def resident_fraction(files: list) -> float:
    """The fraction of these files' pages in the page cache."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for p in files:
        size = os.path.getsize(p)
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
            try:
                pages = (size + page - 1) // page
                vec = ctypes.create_string_buffer(pages)
                assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
                resident += sum(b & 1 for b in vec.raw)
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total


def saved_chunks(root: Path, direct: Optional[bool]) -> list:
    """The large chunk files of a second save (the first put of a new root makes
    its directory, and goes through the page cache for it)."""
    g = torch.Generator().manual_seed(7)
    cp = ckpt.Checkpointer(str(root), direct_io=direct, rng=False)
    cp.save(1, w=torch.randn(1 << 18, generator=g))
    cp.wait()
    before = set((root / "chunks").iterdir())
    cp.save(2, w=torch.randn(4 << 20, generator=g))  # 16 MiB of incompressible bytes: chunks of 8 MiB
    cp.close()
    files = [p for p in set((root / "chunks").iterdir()) - before if p.stat().st_size >= 1 << 20]
    assert files, "no large chunk files"
    return files


def test_direct_io_keeps_written_chunks_out_of_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kind = fs_type(tmp_path)
    if kind not in DIRECT_FS:
        pytest.skip(f"the temporary directory is on {kind}, which may refuse O_DIRECT or cache anyway")
    monkeypatch.delenv("CKPT_DIRECT_IO", raising=False)
    buffered = resident_fraction(saved_chunks(tmp_path / "buffered", False))
    direct = resident_fraction(saved_chunks(tmp_path / "direct", None))
    assert buffered > 0.9, buffered
    assert direct < 0.1, direct
    # Both load back the same bytes.
    a = ckpt.Checkpointer(str(tmp_path / "buffered"), read_only=True).read(2).state["w"]
    b = ckpt.Checkpointer(str(tmp_path / "direct"), read_only=True).read(2).state["w"]
    assert torch.equal(a, b)


def test_direct_io_must_be_a_bool_or_none(tmp_path: Path) -> None:
    with pytest.raises(ckpt.InvalidInputError, match="direct_io"):
        ckpt.Checkpointer(str(tmp_path), direct_io="yes")  # type: ignore[arg-type]
