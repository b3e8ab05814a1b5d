"""numpy arrays as checkpoint tensors: dtype names and byte buffers.

Imported only when numpy is already loaded (or a checkpoint holds numpy
arrays), so ``import ckpt`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Tuple, Type, cast

import numpy as np

from ckpt.errors import InvalidInputError, UnsupportedError

if TYPE_CHECKING:
    from typing_extensions import Buffer

#: A numpy array of any dtype and shape.
NDArray = np.ndarray[Tuple[int, ...], np.dtype[np.generic]]

_BY_NAME: Dict[str, Type[np.generic]] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "I16": np.int16,
    "U16": np.uint16,
    "F16": np.float16,
    "I32": np.int32,
    "U32": np.uint32,
    "F32": np.float32,
    "I64": np.int64,
    "U64": np.uint64,
    "F64": np.float64,
    "C64": np.complex64,
}
_BY_DTYPE = {np.dtype(v): k for k, v in _BY_NAME.items()}


def dtype_name(dtype: np.dtype[np.generic]) -> str:
    """The checkpoint dtype name (safetensors style) of a numpy dtype."""
    try:
        return _BY_DTYPE[np.dtype(dtype).newbyteorder("=")]
    except KeyError:
        raise InvalidInputError(f"numpy dtype {dtype} cannot be stored (supported: {sorted(_BY_NAME)})") from None


def export(array: NDArray, path: object) -> Tuple[str, Tuple[int, ...], NDArray]:
    """``(dtype name, shape, C-contiguous little-endian array)`` for saving.

    The array itself is returned when it is already contiguous and
    little-endian (no copy); otherwise a private copy.
    """
    if array.dtype.hasobject:
        raise InvalidInputError(f"{path}: numpy arrays of Python objects cannot be stored")
    name = dtype_name(array.dtype)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return name, tuple(int(d) for d in array.shape), np.ascontiguousarray(array)


def from_buffer(dtype: str, shape: Tuple[int, ...], buf: Buffer) -> NDArray:
    """A numpy array over loaded bytes (no copy)."""
    try:
        np_dtype = np.dtype(_BY_NAME[dtype])
    except KeyError:
        raise UnsupportedError(
            f"dtype {dtype} has no numpy equivalent; load with framework=\"pt\" (PyTorch)"
        ) from None
    # (numpy's stubs take no Buffer, which TensorBuffer is)
    return np.frombuffer(cast(bytes, buf), dtype=np_dtype).reshape(shape)


def empty(dtype: str, shape: Tuple[int, ...]) -> NDArray:
    """A new C-contiguous, little-endian array to load a tensor into."""
    try:
        np_dtype = np.dtype(_BY_NAME[dtype]).newbyteorder("<")
    except KeyError:
        raise UnsupportedError(
            f"dtype {dtype} has no numpy equivalent; load with framework=\"pt\" (PyTorch)"
        ) from None
    return np.empty(shape, dtype=np_dtype)
