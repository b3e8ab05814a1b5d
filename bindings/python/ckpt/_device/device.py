"""The device seam: what the package asks of the accelerator (:class:`Device`),
its one implementation over ``torch.cuda`` (:class:`CudaDevice`, the default),
and the device in use (:func:`current`, :func:`using`).

Every ``torch.cuda`` call of device staging (:mod:`ckpt._device.cuda`,
:mod:`ckpt._device.slabs`, :mod:`ckpt._device.hoststage`) goes through
:func:`current`; a test may put a device of its own in its place.
"""

from __future__ import annotations

import contextlib
import ctypes
import warnings
from typing import ContextManager, Iterator, List, Optional, Protocol

import torch

__all__ = ["Event", "Stream", "Device", "CudaDevice", "current", "using", "use"]


class Event(Protocol):
    """A point in a stream's work (``torch.cuda.Event``), made by :meth:`Device.record`."""

    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Stream(Protocol):
    """A queue of device work (``torch.cuda.Stream``)."""

    def synchronize(self) -> None: ...


class Device(Protocol):
    """What device staging asks of the accelerator."""

    def takes(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is saved through the device path (a device-to-host copy)."""
        ...

    def ready(self) -> bool:
        """Whether device tensors can occur (the runtime is initialised)."""
        ...

    def record(self, stream: Stream, blocking: bool = False) -> Event:
        """An event recorded on ``stream`` now; ``blocking``: a thread that
        waits for it sleeps instead of spinning."""
        ...

    def wait(self, stream: Stream, event: Event) -> None:
        """Work queued on ``stream`` from now on waits for ``event``."""
        ...

    def current_stream(self, device: torch.device) -> Stream: ...
    def new_stream(self, device: torch.device) -> Stream: ...

    def on_stream(self, stream: Stream) -> ContextManager[object]:
        """``stream`` current for the block."""
        ...

    def on(self, device: Optional[torch.device]) -> ContextManager[object]:
        """``device`` current in this thread for the block; nothing changes for None."""
        ...

    def copy_all(self, dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
        """``dst[i].copy_(src[i], non_blocking=True)`` for all ``i``, on the current stream."""
        ...

    def lock(self, address: int, nbytes: int, quiet: bool = False) -> bool:
        """Page-lock host memory; False where the runtime refuses."""
        ...

    def unlock(self, address: int) -> None: ...

    def synchronize(self) -> None:
        """Wait for all work queued on the current device."""
        ...


# ----------------------------------------------------------------- CUDA


def _loaded_cudart() -> Optional[ctypes.CDLL]:
    """The CUDA runtime library this process already loaded (PyTorch's), through
    ctypes, whose calls release the GIL; None when there is none."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostRegister.restype = ctypes.c_int
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            lib.cudaHostUnregister.restype = ctypes.c_int
            lib.cudaGetLastError.argtypes = []
            lib.cudaGetLastError.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


#: ``cudaHostRegisterPortable``: locked for every CUDA context of the process.
_PORTABLE = 1


class _Locker:
    """``cudaHostRegister`` / ``cudaHostUnregister`` of PyTorch's CUDA runtime."""

    def __init__(self) -> None:
        self._lib = _loaded_cudart()
        self._warned = False

    def lock(self, address: int, nbytes: int, quiet: bool = False) -> bool:
        """Page-lock ``[address, address + nbytes)``; False (with a warning,
        the first time, unless ``quiet``) where the runtime refuses."""
        if nbytes == 0:
            return False
        if self._lib is not None:
            rc = int(self._lib.cudaHostRegister(ctypes.c_void_p(address), nbytes, _PORTABLE))
        else:
            rc = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _PORTABLE))
        if rc != 0:
            self._clear_error()
        if rc != 0 and not self._warned and not quiet:
            self._warned = True
            warnings.warn(f"ckpt: could not page-lock {nbytes} bytes of snapshot memory (CUDA error {rc}); "
                          "device-to-host copies go through pageable memory", stacklevel=3)
        return rc == 0

    def unlock(self, address: int) -> None:
        try:
            if self._lib is not None:
                rc = int(self._lib.cudaHostUnregister(ctypes.c_void_p(address)))
            else:
                rc = int(torch.cuda.cudart().cudaHostUnregister(address))
            if rc != 0:
                self._clear_error()
        except Exception:  # noqa: BLE001 - at exit the runtime may be gone
            pass

    def _clear_error(self) -> None:
        """Take a failed call's error off the runtime: it would stay this
        thread's last error, which PyTorch checks after every kernel launch,
        and fail an unrelated kernel of the training."""
        lib = self._lib if self._lib is not None else torch.cuda.cudart()
        get = getattr(lib, "cudaGetLastError", None)
        if get is not None:
            get()


class CudaDevice:
    """:class:`Device` over ``torch.cuda`` (one CUDA runtime per process)."""

    def __init__(self) -> None:
        self._locker: Optional[_Locker] = None

    def takes(self, t: torch.Tensor) -> bool:
        return bool(t.is_cuda)

    def ready(self) -> bool:
        # ``is_initialized`` alone: it implies a device, and it is a flag, while
        # ``is_available`` asks the driver each time.
        return bool(torch.cuda.is_initialized())

    def record(self, stream: Stream, blocking: bool = False) -> torch.cuda.Event:
        assert isinstance(stream, torch.cuda.Stream)
        ev = torch.cuda.Event(blocking=blocking)
        ev.record(stream)
        return ev

    def wait(self, stream: Stream, event: Event) -> None:
        assert isinstance(stream, torch.cuda.Stream) and isinstance(event, torch.cuda.Event)
        stream.wait_event(event)

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)

    def on_stream(self, stream: Stream) -> ContextManager[object]:
        assert isinstance(stream, torch.cuda.Stream)
        return torch.cuda.stream(stream)

    def on(self, device: Optional[torch.device]) -> ContextManager[object]:
        return contextlib.nullcontext() if device is None else torch.cuda.device(device)

    def copy_all(self, dst: List[torch.Tensor], src: List[torch.Tensor]) -> None:
        # In one call where torch has it.
        foreach = getattr(torch, "_foreach_copy_", None)
        if foreach is not None:
            try:
                foreach(dst, src, non_blocking=True)
                return
            except (RuntimeError, TypeError):
                pass
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)

    def lock(self, address: int, nbytes: int, quiet: bool = False) -> bool:
        return self._lib().lock(address, nbytes, quiet)

    def unlock(self, address: int) -> None:
        self._lib().unlock(address)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def _lib(self) -> _Locker:
        if self._locker is None:
            self._locker = _Locker()
        return self._locker


# ----------------------------------------------------------------- in use

_CURRENT: Device = CudaDevice()


def current() -> Device:
    """The device in use (a :class:`CudaDevice` unless :func:`use` set another)."""
    return _CURRENT


def use(device: Device) -> Device:
    """Put ``device`` in use for the whole process; returns the one it replaces."""
    global _CURRENT
    before, _CURRENT = _CURRENT, device
    return before


@contextlib.contextmanager
def using(device: Device) -> Iterator[Device]:
    """``device`` in use for the block (a test's), then the one before it again."""
    before = use(device)
    try:
        yield device
    finally:
        use(before)
