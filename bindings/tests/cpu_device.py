"""A device of the tests' own (:class:`CpuDevice`, a
:class:`ckpt._device.device.Device`), used where this machine has no GPU:
CPU tensors take ckpt's device path (``ckpt._device.slabs``' slabs,
``ckpt._device.cuda``'s device copies, repeated-save plans), its streams
run each copy at once, its events are always complete, and page locking is
only recorded. What it cannot show (the copies' ordering on a real device)
``test_cuda.py`` checks on a GPU.

A test selects it with ``ckpt._device.device.using`` (the ``cpu_device``
fixture of ``test_device_copy.py``); a worker process under ``torchrun``
with ``ckpt._device.device.use`` for its whole life.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List, Optional, Tuple

import torch

from ckpt._device.device import Event, Stream


class CpuEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuStream:
    def synchronize(self) -> None:
        pass


class CpuDevice:
    """CPU tensors as device tensors (see the module docs). ``calls["copies"]``
    counts the tensors of each copy call; ``locked`` and ``unlocked`` record
    the page locking asked for, and ``lock_with`` (address, bytes, quiet),
    where a test sets it, answers for the runtime; ``before_copy``, where
    set, runs before each copy call (a test's gate). With ``cpu_scalars``, 0-d tensors stay CPU
    tensors, as an Adam optimizer's ``step`` is beside its CUDA moments
    (unless fused or capturable)."""

    def __init__(self, cpu_scalars: bool = False) -> None:
        self.cpu_scalars = cpu_scalars
        self.calls: Dict[str, List[int]] = {"copies": [], "into_slots": []}
        self.locked: List[Tuple[int, int]] = []
        self.unlocked: List[int] = []
        self.lock_with: Optional[Callable[[int, int, bool], bool]] = None
        self.before_copy: Optional[Callable[[], None]] = None

    def takes(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and not (self.cpu_scalars and t.dim() == 0)

    def ready(self) -> bool:
        return True

    def record(self, stream: Stream, blocking: bool = False) -> Event:
        return CpuEvent()

    def wait(self, stream: Stream, event: Event) -> None:
        pass

    def current_stream(self, device: torch.device) -> Stream:
        return CpuStream()

    def new_stream(self, device: torch.device) -> Stream:
        return CpuStream()

    def on_stream(self, stream: Stream) -> ContextManager[object]:
        return contextlib.nullcontext()

    def on(self, device: Optional[torch.device]) -> ContextManager[object]:
        return contextlib.nullcontext()

    def copy_all(self, dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
        self.calls["copies"].append(len(dst))
        if self.before_copy is not None:
            self.before_copy()
        for d, s in zip(dst, src):
            d.copy_(s)

    def lock(self, address: int, nbytes: int, quiet: bool = False) -> bool:
        self.locked.append((address, nbytes))
        return True if self.lock_with is None else self.lock_with(address, nbytes, quiet)

    def unlock(self, address: int) -> None:
        self.unlocked.append(address)

    def synchronize(self) -> None:
        pass
