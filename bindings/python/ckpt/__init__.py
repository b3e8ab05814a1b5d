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

from ckpt import _ckpt, distributed
from ckpt._ckpt import cpu_threads, set_cpu_threads
from ckpt.handles import Checkpoint, RestorePhases, SaveHandle, SavePhases
from ckpt.checkpointer import Checkpointer
from ckpt.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointTimeoutError,
    StragglerError,
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
from ckpt.export import export
from ckpt.memory import MemoryCheckpointer
from ckpt.rng import RNGState

__version__: str = _ckpt.__version__

__all__ = [
    "Checkpointer",
    "MemoryCheckpointer",
    "SaveHandle",
    "SavePhases",
    "RestorePhases",
    "Checkpoint",
    "RNGState",
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
    "StragglerError",
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
