"""ckpt: fault-tolerant checkpointing for training loops, without pickle.

>>> import ckpt
>>> cp = ckpt.Checkpointer("file:///scratch/run7", keep_last=3)     # doctest: +SKIP
>>> start = cp.load_latest(model=model, optimizer=opt) or 0         # doctest: +SKIP
>>> for step in range(start, steps):                                # doctest: +SKIP
...     if step % 100 == 0 and step != start:
...         cp.save(step, model=model, optimizer=opt, extra={"epoch": epoch})
...     ...                                                         # forward, backward, opt.step()
>>> cp.wait()                                                       # doctest: +SKIP

The engine is Rust (``ckpt._ckpt``); tensors cross as CPU buffers, so the same
wheel works with any PyTorch version and with numpy alone. See
:class:`Checkpointer` for the options (lazy snapshots, compression, retention).
The same script works under ``torchrun`` or ``mpirun``: every rank saves into
one logical checkpoint, coordinated through ``torch.distributed`` or mpi4py
(:mod:`ckpt.distributed`).
"""

from __future__ import annotations

import os as _os

# The native extension allocates with its own mimalloc (see bindings/src/lib.rs).
# Freed memory goes back to the OS at once instead of after a delay that only
# runs out when the freeing thread allocates again: the engine's threads sit
# idle after a load, so its read buffers would otherwise stay resident in the
# training process. Set before the extension loads; a value set by the user wins.
_os.environ.setdefault("MIMALLOC_PURGE_DELAY", "0")

from . import _ckpt, distributed  # noqa: E402
from ._ckpt import TensorRef, cpu_threads, set_cpu_threads
from .checkpointer import Checkpoint, Checkpointer, SaveHandle
from .errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointTimeoutError,
    ConflictError,
    FencedError,
    CorruptError,
    InternalError,
    InvalidInputError,
    NotFoundError,
    SkippedError,
    StorageError,
    UnsupportedError,
)
from .export import export
from .memory import MemoryCheckpointer
from .rng import RNGState

__version__: str = _ckpt.__version__

__all__ = [
    "Checkpointer",
    "MemoryCheckpointer",
    "SaveHandle",
    "Checkpoint",
    "RNGState",
    "TensorRef",
    "CheckpointError",
    "NotFoundError",
    "CorruptError",
    "ConflictError",
    "FencedError",
    "InvalidInputError",
    "UnsupportedError",
    "StorageError",
    "CheckpointIOError",
    "CheckpointTimeoutError",
    "SkippedError",
    "InternalError",
    "distributed",
    "export",
    "cpu_threads",
    "set_cpu_threads",
]

# A forked child (e.g. a DataLoader worker) must not use the parent's runtime
# threads, which do not exist in the child: it builds its own on first use.
if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_ckpt._after_fork_child)
