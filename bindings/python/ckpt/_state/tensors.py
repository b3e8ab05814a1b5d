"""PyTorch glue: tensors to byte buffers (CPU and CUDA), and back.

Tensors cross into the engine as CPU byte buffers, so the native module never
links libtorch: a CPU tensor is viewed as ``uint8`` and exported through numpy's
buffer protocol (no copy); a CUDA tensor is copied into a slot of a host slab
by a device-to-host copy on a side stream (:mod:`ckpt._device.cuda`), and the engine
takes the slot as the tensor's bytes once the copy has landed.

Loading wraps the engine's bytes with ``torch.frombuffer`` (no copy).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set, Sized, Tuple, cast

import torch

if TYPE_CHECKING:
    import numpy
    from typing_extensions import Buffer

    from ckpt._device.slabs import SlabPool
    from ckpt._device.cuda import DeviceCopy

from ckpt._device.device import CudaDevice, current
from ckpt._sharded.dtensor import _dtensor_type, local_of, local_tensor
from ckpt.errors import InvalidInputError, UnsupportedError

__all__ = ["dtype_name", "torch_dtype", "Exporter", "from_buffer", "lazy_safe_pointers"]

_NAMES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "complex64": "C64",
    "float64": "F64",
    "int64": "I64",
    "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
_TO_NAME: Dict[torch.dtype, str] = {
    getattr(torch, k): v for k, v in _NAMES.items() if isinstance(getattr(torch, k, None), torch.dtype)
}
_FROM_NAME: Dict[str, torch.dtype] = {v: k for k, v in _TO_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The checkpoint dtype name (safetensors style) of a torch dtype."""
    try:
        return _TO_NAME[dtype]
    except KeyError:
        raise InvalidInputError(f"torch dtype {dtype} cannot be stored") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a checkpoint dtype name."""
    try:
        return _FROM_NAME[name]
    except KeyError:
        raise UnsupportedError(f"dtype {name} has no equivalent in this PyTorch") from None


#: dtypes numpy has: their byte view is taken on the numpy side, where a
#: reshape and a view cost a fraction of torch's (a save walks every tensor).
_NUMPY_DTYPES = frozenset(
    {
        torch.float64, torch.float32, torch.float16, torch.complex64, torch.complex128,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    }
)


_STRIDED = torch.strided

#: Names of the dtypes the export fast path takes.
_FAST_NAMES: Dict[torch.dtype, str] = {d: _TO_NAME[d] for d in _NUMPY_DTYPES if d in _TO_NAME}


def _byte_view(t: torch.Tensor) -> numpy.ndarray[Tuple[int], numpy.dtype[numpy.uint8]]:
    """A numpy ``uint8`` view of a contiguous, detached CPU tensor's bytes (no copy)."""
    if t.dtype in _NUMPY_DTYPES:
        return t.numpy().reshape(-1).view("u1")
    return t.reshape(-1).view(torch.uint8).numpy()


class Exporter:
    """Turns the tensors of one save into ``(dtype, shape, buffer, copy_now)``.

    CPU tensors are viewed as bytes without a copy. CUDA tensors are queued
    for a device-to-host copy (:class:`ckpt._device.cuda.DeviceCopy`): their buffer is
    a slot of a host slab, or a :class:`ckpt._device.cuda.Pending` until the save
    starts the copies and puts the slab's slots in their place. It walks
    every tensor one by one; a checkpointer's saves walk mappings in bulk by
    the last save's plans (:class:`ckpt._save.repeat.PlannedExporter`).
    """

    def __init__(self, slabs: Optional[SlabPool] = None, lazy: bool = True) -> None:
        self._slabs = slabs
        self._lazy = lazy
        #: The save's device-to-host copies, once a CUDA tensor was met.
        self.device: Optional[DeviceCopy] = None
        #: Which tensors take the device path: CUDA ones (``is_cuda``, the
        #: fast check) unless another device is in use (a test's).
        dev = current()
        self._takes: Optional[Callable[[torch.Tensor], bool]] = None if isinstance(dev, CudaDevice) else dev.takes

    def export(self, t: torch.Tensor, path: object, copy_now: bool) -> Tuple[str, Tuple[int, ...], object, bool]:
        """Export one tensor. ``copy_now`` asks for a copy before ``save`` returns."""
        if t.is_cuda if self._takes is None else self._takes(t):
            # A GPU's state dict: one check each for what a CUDA tensor may be
            # (this runs for every tensor in the stall of a lazy save).
            if t.layout is _STRIDED and not (t.is_quantized or t.is_conj() or t.is_neg()):
                name = _TO_NAME.get(t.dtype)
                if name is not None:
                    device = self.device
                    if device is None:
                        device = self._device()
                    return name, t.shape, device.add(t, copy_now), False
            return self._export(t, path, copy_now)
        # Most of a state dict: dense, contiguous CPU tensors of a dtype numpy
        # has. ``numpy()`` views them without a copy and refuses everything the
        # checks below sort out (other devices and layouts, meta, quantized,
        # conjugate or negative bits, bf16 and fp8), so one call replaces a
        # dozen; the engine takes any C-contiguous buffer as bytes.
        name = _FAST_NAMES.get(t.dtype)
        if name is not None and not t.requires_grad:
            try:
                arr = t.numpy()
            except (RuntimeError, TypeError):
                pass
            else:
                if arr.flags.c_contiguous:
                    # A 0-d array exports no shape through the buffer protocol.
                    return name, arr.shape, arr if arr.ndim else arr.reshape(1), copy_now
        return self._export(t, path, copy_now)

    def _export(self, t: torch.Tensor, path: object, copy_now: bool) -> Tuple[str, Tuple[int, ...], object, bool]:
        if t.layout != torch.strided:
            raise InvalidInputError(f"{path}: {t.layout} tensors cannot be stored (convert to dense first)")
        if t.is_quantized or t.is_meta or getattr(t, "is_nested", False):
            raise InvalidInputError(f"{path}: quantized, meta and nested tensors cannot be stored")
        name = dtype_name(t.dtype)
        shape = tuple(t.shape)
        t = t.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
            copy_now = False  # a private copy: nobody else mutates it
        if t.device.type == "cpu":
            if not t.is_contiguous():
                t = t.contiguous()
                copy_now = False
            return name, shape, _byte_view(t), copy_now
        if t.device.type == "cuda":
            # Copied by the save's device-to-host copies, into memory private to it.
            return name, shape, self._device().add(t, copy_now), False
        raise InvalidInputError(f"{path}: tensors on {t.device.type} are not supported (CPU or CUDA)")

    def _device(self) -> DeviceCopy:
        if self.device is None:
            from ckpt._device.cuda import DeviceCopy, SlabPool

            if self._slabs is None:
                self._slabs = SlabPool()
            self.device = DeviceCopy(self._slabs, self._lazy)
        return self.device


def from_buffer(dtype: str, shape: Tuple[int, ...], buf: Buffer) -> torch.Tensor:
    """A CPU tensor over loaded bytes (no copy; the tensor keeps ``buf`` alive)."""
    td = torch_dtype(dtype)
    if len(cast(Sized, buf)) == 0:  # (a TensorBuffer or bytearray: bytes have a length)
        return torch.empty(shape, dtype=td)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # older torch warns even for writable buffers
        return torch.frombuffer(buf, dtype=td).reshape(shape)


def lazy_safe_pointers(obj: object) -> Tuple[Optional[Set[int]], List[torch.optim.Optimizer]]:
    """Which tensors of ``obj.state_dict()`` may be snapshotted lazily, and the
    optimizers ``obj`` holds, whose step must wait for the snapshot too (an
    optimizer met itself is guarded as such).

    All of them (``None``) for an optimizer: its state changes only in
    ``step()``, which the lazy-mode hook guards. The data pointers of the
    parameters for an ``nn.Module``: buffers such as batch-norm statistics
    change in ``forward`` and are copied at once. For any other object, what
    the modules and optimizers it holds as attributes would allow (DCP's
    ``AppState`` pattern: an object with ``model`` and ``optimizer`` whose
    ``state_dict()`` returns ``get_state_dict(model, optimizer)``): their
    parameters and optimizer state, with those optimizers guarded. Tensors the
    state dict made itself (gathered or offloaded copies) are not among them
    and are copied at once; so is everything of an object holding neither.
    """
    if isinstance(obj, torch.optim.Optimizer):
        return None, []
    if isinstance(obj, torch.nn.Module):
        return _param_pointers(obj), []
    modules, optimizers = _held(obj)
    ptrs: Set[int] = set()
    for m in modules:
        ptrs |= _param_pointers(m)
    for o in optimizers:
        ptrs |= _state_pointers(o)
    return ptrs, optimizers


def _param_pointers(module: torch.nn.Module) -> Set[int]:
    dt = _dtensor_type()
    if dt is None:
        return {p.data_ptr() for p in module.parameters()}
    return {(local_of(p) if isinstance(p, dt) else p).data_ptr() for p in module.parameters()}


def _state_pointers(opt: torch.optim.Optimizer) -> Set[int]:
    out: Set[int] = set()
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                out.add(local_tensor(v).data_ptr())
    return out


#: Longest list, tuple or dict attribute :func:`_held` looks into.
_HELD_ITEMS = 64


def _held(obj: object) -> Tuple[List[torch.nn.Module], List[torch.optim.Optimizer]]:
    """The modules and optimizers among ``obj``'s attributes, and among the
    items of attributes that are lists, tuples or dicts of at most
    ``_HELD_ITEMS`` (one level)."""
    modules: List[torch.nn.Module] = []
    optimizers: List[torch.optim.Optimizer] = []
    try:
        values = list(vars(obj).values())
    except TypeError:  # no __dict__ (slots, builtins)
        return modules, optimizers
    for v in values:
        if isinstance(v, (dict, list, tuple)):
            if len(v) > _HELD_ITEMS:  # data, not a handful of models and optimizers
                continue
            items = list(v.values()) if isinstance(v, dict) else list(v)
        else:
            items = [v]
        for x in items:
            if isinstance(x, torch.nn.Module):
                modules.append(x)
            elif isinstance(x, torch.optim.Optimizer):
                optimizers.append(x)
    return modules, optimizers
