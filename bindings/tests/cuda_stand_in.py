"""A test double for CUDA, used where this machine has no GPU: CPU tensors
take ckpt's CUDA path (``ckpt._device.slabs``' slabs, ``ckpt._device.cuda``'s device
copies, repeated-save plans), with ``torch.cuda``'s streams and events
replaced by stand-ins (streams that run each copy at once, events that are
always complete) and page-locking skipped. What it cannot show (the copies'
ordering on a real device) ``test_cuda.py`` checks on a GPU.

The tests install it with ``monkeypatch.setattr`` (the ``fake_cuda`` fixture
of ``test_device_copy.py``); a worker process under ``torchrun`` installs it
with plain ``setattr`` for its whole life.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List

import torch

import ckpt._save.ahead as ahead
import ckpt.checkpointer as cpm
import ckpt._device.slabs as slabs
import ckpt._device.cuda as cudam
from ckpt._state.tensors import Exporter, dtype_name


class Event:
    def __init__(self, blocking: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Stream:
    def __init__(self, device: Any = None) -> None:
        pass

    def wait_event(self, ev: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


def install(patch: Callable[[Any, str, Any], None], cpu_scalars: bool = False) -> Dict[str, List[int]]:
    """Route CPU tensors through the CUDA path with ``patch(obj, name, value)``;
    returns the counts of copy calls (``copies``: tensors per call) and of
    slots handed out after the walk (``into_slots``). With ``cpu_scalars``,
    0-d tensors stay CPU tensors, as an Adam optimizer's ``step`` is beside
    its CUDA moments (unless fused or capturable)."""
    calls: Dict[str, List[int]] = {"copies": [], "into_slots": []}
    patch(torch.cuda, "Event", Event)
    patch(torch.cuda, "Stream", Stream)
    patch(torch.cuda, "current_stream", lambda device=None: Stream())
    patch(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    patch(slabs._Locker, "lock", lambda self, address, n, quiet=False: True)
    patch(slabs._Locker, "unlock", lambda self, address: None)
    patch(slabs, "_on", lambda device: contextlib.nullcontext())
    patch(ahead, "cuda_ready", lambda: True)

    real_export = Exporter.export

    def export(self: Exporter, t: torch.Tensor, path: object, copy_now: bool) -> Any:
        if cpu_scalars and t.dim() == 0:
            return real_export(self, t, path, copy_now)
        return dtype_name(t.dtype), t.shape, self._device().add(t, copy_now), False

    patch(Exporter, "export", export)
    real_copy, real_into = cudam._copy_all, cpm._into_slots

    def copy_all(dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
        calls["copies"].append(len(dst))
        real_copy(dst, src)

    def into_slots(tensors: Any, slots: Any) -> Any:
        calls["into_slots"].append(len(slots))
        return real_into(tensors, slots)

    patch(cudam, "_copy_all", copy_all)
    patch(cpm, "_into_slots", into_slots)
    return calls
