"""Restoring a checkpoint straight into the live objects of a training job.

For each entry to restore (a module, an optimizer, a state dict, a tensor, a
dict), the stored tree is walked beside the live object's own state, and every
stored tensor gets a destination:

* a live CPU tensor of the same shape and dtype is filled in place (its memory
  is handed to the engine through the buffer protocol: no intermediate copy);
* a live DTensor asks for the boxes of the global tensor its local shard
  covers, whatever the mesh was at save; only the stored pieces that overlap
  them are read;
* a CUDA, non-contiguous or aliased tensor is filled through a host buffer and
  copied once the load is complete;
* where the live object has no tensor yet (an optimizer that has not stepped),
  one is made with the layout of its parameter (a DTensor for a sharded
  parameter), so optimizer state comes back keyed and placed as the optimizer
  expects it.

Shapes and dtypes are checked against the checkpoint's table before anything
is read, so a mismatch raises :class:`~ckpt.InvalidInputError` naming the
tensor and leaves every live tensor as it was. The objects themselves are only
updated (``load_state_dict``, RNG) by :meth:`RestorePlan.apply`, which the
checkpointer calls once every rank has read its part intact.
"""

from __future__ import annotations

import bisect
import sys
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set, Tuple, TypeVar, Union, cast

from ckpt._ckpt import HostSpan, LoadTarget, Shard, TensorInfo, TensorRef
from ckpt._sharded.dtensor import is_dtensor, local_of, local_pieces
from ckpt.errors import CorruptError, InvalidInputError, UnsupportedError
from ckpt._state.tree import NP_SCALAR, ODICT, TAG, Tree, is_stateful

if TYPE_CHECKING:
    import torch
    from torch import Tensor
    from typing_extensions import Buffer

    from ckpt._device.hoststage import HostStage
    from ckpt._state.arrays import NDArray

#: Where a value sits in the stored tree: its keys and indices from the entry's root.
Path = List[Union[str, int]]
#: The live tensor whose layout a tensor missing from the live state takes (see :func:`live_state`).
Hint = Callable[[Path], Optional["Tensor"]]

__all__ = ["RestorePlan", "live_state", "restore_into"]


class _Deferred:
    """A value known only once the tensors are loaded (a numpy scalar)."""

    def __init__(self, make: Callable[[], object]) -> None:
        self.make = make


def _torch() -> Optional[ModuleType]:
    return sys.modules.get("torch")


def _loaded_torch() -> ModuleType:
    """torch, where a live tensor shows it is imported."""
    return sys.modules["torch"]


def _no_hint(path: Path) -> None:
    """No parameter gives a missing tensor its layout."""
    return None


class _At:
    """A place in the stored tree (``model.layers.0.weight``), formatted only
    when an error names it."""

    __slots__ = ("parent", "key")

    def __init__(self, parent: object, key: object) -> None:
        self.parent = parent
        self.key = key

    def __str__(self) -> str:
        return f"{self.parent}.{self.key}"


_V = TypeVar("_V")

#: A stored mapping's items.
_Items = Mapping[Union[str, int], Tree]
#: Where the load writes a tensor's bytes: a writable buffer (a numpy array's among them).
_Dest = Union["Buffer", "NDArray"]


class RestorePlan:
    """Destinations for the tensors of one checkpoint (see the module docs).

    Args:
        table: the checkpoint's tensors (``Checkpointer.contents`` of the native module).
        numpy_names: tensors saved as numpy arrays.
        stage: CUDA destinations go through this host slab (:class:`ckpt._device.cuda.HostStage`), if given.
    """

    def __init__(self, table: Dict[str, TensorInfo], numpy_names: Set[str], stage: Optional[HostStage] = None) -> None:
        self.table = table
        self._stage = stage
        #: Boxes read through the stage: the target without its buffer, and its slot in the stage.
        self._staged: List[Tuple[str, str, Tuple[int, ...], Optional[Shard], int]] = []
        self.numpy_names = numpy_names
        #: What the load reads, and where to (``load_into`` of the native module).
        self.requests: List[LoadTarget] = []
        self._after: List[Callable[[], None]] = []
        self._memory: Dict[Tuple[int, int], str] = {}
        #: The memory taken as destinations in place, none overlapping another.
        self._spans = Spans()
        self._cuda = False
        #: Whether a value is known only once the tensors are loaded (:class:`_Deferred`).
        self._deferred = False

    # ------------------------------------------------------------ the walk

    def value(self, saved: Tree, live: object, where: str, hint: Hint = _no_hint) -> object:
        """The value of stored tree ``saved`` with tensors placed in or beside ``live``."""
        return self._walk(saved, live, where, [], hint)

    def _walk(self, saved: Tree, live: object, where: object, path: Path, hint: Hint) -> object:
        if isinstance(saved, TensorRef):
            return self._tensor(saved.name, live, where, hint(path))
        if type(saved) is dict:
            tag = saved.get(TAG)
            if tag == ODICT:
                out = OrderedDict(self._items(cast(_Items, saved["items"]), live, where, path, hint))
                if saved.get("metadata") is not None:
                    setattr(out, "_metadata", self._walk(saved["metadata"], None, where, path + ["_metadata"], hint))
                return out
            if tag == NP_SCALAR:
                arr = cast("NDArray", self._walk(saved["value"], None, where, path, hint))
                self._deferred = True
                return _Deferred(lambda: arr[()])
            if tag is not None:
                raise UnsupportedError(f"unknown encoded type {tag!r} in checkpoint (written by a newer ckpt?)")
            return self._items(saved, live, where, path, hint)
        if type(saved) in (list, tuple):
            seq = cast(Sequence[Tree], saved)
            same = isinstance(live, Sequence) and not isinstance(live, (str, bytes)) and len(live) == len(seq)
            items = [
                self._walk(v, cast(Sequence[object], live)[i] if same else None, f"{where}[{i}]", path + [i], hint)
                for i, v in enumerate(seq)
            ]
            return items if type(saved) is list else tuple(items)
        return saved

    def _items(self, saved: _Items, live: object, where: object, path: Path, hint: Hint) -> Dict[Union[str, int], object]:
        """The items of a stored mapping, each walked beside ``live``'s value
        of its key. (A state dict's thousands of tensors are taken here, each
        without a walk of its own; the place named in an error is formatted
        only by the error.)"""
        get = live.get if isinstance(live, Mapping) else None
        out: Dict[Union[str, int], object] = {}
        for k, v in saved.items():
            at = _At(where, k)
            lv = get(k) if get is not None else None
            if type(v) is TensorRef:
                out[k] = self._tensor(v.name, lv, at, hint(path + [k]) if hint is not _no_hint else None)
            else:
                out[k] = self._walk(v, lv, at, path + [k], hint)
        return out

    # ---------------------------------------------------------- one tensor

    def _info(self, name: str, where: object) -> Tuple[str, Tuple[int, ...]]:
        info = self.table.get(name)
        if info is None:
            raise CorruptError(f"{where}: the checkpoint's metadata names tensor {name!r}, which it does not hold")
        return info.dtype, tuple(info.global_shape)

    def _tensor(self, name: str, live: object, where: object, hint: Optional[Tensor]) -> object:
        dtype, shape = self._info(name, where)
        torch = _torch()
        np = sys.modules.get("numpy")
        if torch is not None and isinstance(live, torch.Tensor):
            self._check(where, name, dtype, shape, _torch_dtype_name(live), tuple(live.shape))
            self._fill_torch(name, dtype, shape, live)
            return live
        if np is not None and isinstance(live, np.ndarray):
            from ckpt._state import arrays as npg

            self._check(where, name, dtype, shape, npg.dtype_name(live.dtype), tuple(live.shape))
            self._fill_numpy(name, dtype, shape, live)
            return live
        # Nothing live to fill: make the tensor (with its parameter's layout, if any).
        if name in self.numpy_names or torch is None:
            from ckpt._state import arrays as npg

            arr = npg.empty(dtype, shape)
            self._fill_numpy(name, dtype, shape, arr)
            return arr
        from ckpt._state.tensors import torch_dtype

        td = torch_dtype(dtype)
        if hint is not None and isinstance(hint, torch.Tensor) and tuple(hint.shape) == shape:
            with torch.no_grad():
                t = torch.empty_like(hint.detach(), dtype=td)
        else:
            t = torch.empty(shape, dtype=td)
        self._fill_torch(name, dtype, shape, t)
        return t

    @staticmethod
    def _check(where: object, name: str, dtype: str, shape: Tuple[int, ...], have_dtype: str, have: Tuple[int, ...]) -> None:
        if shape != have:
            raise InvalidInputError(f"{where}: tensor {name!r} has shape {shape} in the checkpoint, {have} here")
        if dtype != have_dtype:
            raise InvalidInputError(f"{where}: tensor {name!r} is {dtype} in the checkpoint, {have_dtype} here")

    def _fill_torch(self, name: str, dtype: str, shape: Tuple[int, ...], t: Tensor) -> None:
        if is_dtensor(t):
            _, pieces = local_pieces(t, name)
            local = local_of(t)
            whole = len(pieces) == 1 and pieces[0].shape == shape
            for p in pieces:
                self._into_torch(name, dtype, p.shape, None if whole else Shard(shape, p.offsets), p.view(local))
        else:
            self._into_torch(name, dtype, shape, None, t)

    def _into_torch(self, name: str, dtype: str, shape: Tuple[int, ...], shard: Optional[Shard], t: Tensor) -> None:
        if t.is_meta:
            # (Its copy from the checkpoint would be a no-op: the restore would
            # return its step with nothing restored.)
            raise InvalidInputError(
                f"tensor {name!r} is on the meta device here, which holds no data to restore into: allocate "
                "the model first (model.to_empty(device=...)), then restore"
            )
        nbytes = t.numel() * t.element_size()
        if nbytes == 0:
            return
        pin = _on_device(t)
        if not pin and t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg():
            ptr = t.data_ptr()
            if self._claim(ptr, nbytes, name) == "same":
                return  # tied to a tensor already being filled (the same memory)
            if self._free_span(ptr, nbytes):
                self._read(name, dtype, shape, shard, _bytes_of(t, ptr, nbytes))
                return
        torch = _loaded_torch()
        t = t.detach()
        self._cuda = self._cuda or pin
        if pin and self._stage is not None:
            if self._claim(t.data_ptr(), nbytes, name) == "same":
                return  # tied to a tensor already staged (the same device memory)
            self._memory[(t.data_ptr(), nbytes)] = name
            # Its buffer is a slot of the stage's slab, chosen once all are known (place()).
            self._staged.append((name, dtype, shape, shard, self._stage.add(t)))
            return
        host = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=pin)
        self._read(name, dtype, shape, shard, host.reshape(-1).view(torch.uint8).numpy())

        def copy_back(dst: Tensor = t, src: Tensor = host) -> None:
            with torch.no_grad():
                dst.copy_(src, non_blocking=dst.device.type == "cuda")

        self._after.append(copy_back)

    def _fill_numpy(self, name: str, dtype: str, shape: Tuple[int, ...], arr: NDArray) -> None:
        np = sys.modules["numpy"]
        if arr.nbytes == 0:
            return
        from ckpt._state import arrays as npg

        direct = arr.flags.c_contiguous and arr.flags.writeable and arr.dtype.byteorder != ">"
        ptr = arr.__array_interface__["data"][0]
        if direct and self._claim(ptr, arr.nbytes, name) == "same":
            return
        if direct and self._free_span(ptr, arr.nbytes):
            self._read(name, dtype, shape, None, arr.reshape(-1).view(np.uint8))
            return
        host = npg.empty(dtype, shape)
        self._read(name, dtype, shape, None, host.reshape(-1).view(np.uint8))
        self._after.append(lambda: np.copyto(arr, host))

    def _read(self, name: str, dtype: str, shape: Tuple[int, ...], shard: Optional[Shard], dest: _Dest) -> None:
        """Have the load read the box ``shape`` (at ``shard``; None: the whole tensor) into ``dest``."""
        # (numpy's stubs give an array a buffer only on Python 3.12 and later)
        self.requests.append(LoadTarget(name=name, dtype=dtype, shape=shape, dest=cast("Buffer", dest), shard=shard))

    def read_whole(self, name: str, dest: Buffer) -> None:
        """Have the load read all of tensor ``name`` into ``dest`` (a writable buffer of its bytes)."""
        dtype, shape = self._info(name, name)
        self._read(name, dtype, shape, None, dest)

    def _claim(self, ptr: int, nbytes: int, name: str) -> str:
        """``"same"`` when exactly this memory is already a destination."""
        if (ptr, nbytes) in self._memory:
            return "same"
        return "new"

    def _free_span(self, ptr: int, nbytes: int) -> bool:
        """Take ``[ptr, ptr + nbytes)`` as a destination unless it overlaps one already taken."""
        if not self._spans.take(ptr, ptr + nbytes):
            return False
        self._memory[(ptr, nbytes)] = ""
        return True

    def load(self, read: Callable[[List[LoadTarget]], None]) -> None:
        """Run the load with ``read`` (the engine's load of a list of
        requests). With CUDA destinations, the stage reads their slots group
        by group and starts each group's copies to the device once it is read
        (:meth:`ckpt._device.cuda.HostStage.fill`)."""
        if not self._staged:
            read(self.requests)
            return
        assert self._stage is not None  # (staged through it)
        n = len(self._staged)
        head, slots = self.requests[: len(self.requests) - n], self.requests[len(self.requests) - n :]
        self._stage.fill(read, head, slots)

    def abandon(self) -> None:
        """After a failed load or a damaged checkpoint on any rank: wait for
        the copies to the device already started (the stage's slab is reused
        by the next attempt)."""
        if self._staged:
            assert self._stage is not None  # (staged through it)
            self._stage.abandon()

    def place(self) -> None:
        """Give the CUDA destinations their slots in the stage's slab (after the walk)."""
        if not self._staged:
            return
        assert self._stage is not None  # (staged through it)
        bufs = self._stage.buffers()
        for name, dtype, shape, shard, i in self._staged:
            self._read(name, dtype, shape, shard, bufs[i])

    # --------------------------------------------------------------- after

    def finish(self, value: _V) -> _V:
        """Copy host buffers into their live tensors; resolve deferred values."""
        if self._staged:
            assert self._stage is not None  # (staged through it)
            self._stage.copy_back()
            self._staged = []
        for f in self._after:
            f()
        if self._cuda:
            from ckpt._device.device import current  # (torch is imported: a CUDA tensor was met)

            current().synchronize()
        self._after.clear()
        return cast(_V, _resolve(value)) if self._deferred else value


class Spans:
    """Disjoint byte ranges ``[start, end)``, kept sorted: a restore's plan asks
    of each of its thousands of tensors whether its memory overlaps one taken
    before, in logarithmic time (a scan of every earlier range made the plan
    quadratic)."""

    def __init__(self) -> None:
        self._starts: List[int] = []
        self._ends: List[int] = []

    def take(self, start: int, end: int) -> bool:
        """Add ``[start, end)`` unless it overlaps a range already taken;
        whether it was added (an empty range overlaps nothing, and is not kept)."""
        if start >= end:
            return True
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._ends[i - 1] > start:
            return False  # the range before it reaches into it
        if i < len(self._starts) and self._starts[i] < end:
            return False  # the range after it begins inside it
        self._starts.insert(i, start)
        self._ends.insert(i, end)
        return True

    def __len__(self) -> int:
        return len(self._starts)


def restore_into(target: object, value: object, where: str, live: object = None) -> bool:
    """Restore ``value`` into ``target`` in place; False when that is impossible.

    Objects with ``load_state_dict`` get their state dict (``live``: the
    target's live state the restore walked, see :func:`live_state`; a
    module whose every tensor was filled in place needs no more, see
    :func:`ckpt._state.modstate.loaded_already`), tensors and arrays are copied
    into, dicts and lists are updated in place (their items replaced where
    they cannot be restored in place)."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if value is target and not is_stateful(target):
        return True  # filled in place by the load
    if is_stateful(target):
        if live is not None and torch is not None and isinstance(target, torch.nn.Module):
            from ckpt._state.modstate import loaded_already

            if loaded_already(target, value, live):
                return True
        if torch is not None and type(target).load_state_dict is torch.optim.Optimizer.load_state_dict:
            value = _indexed_groups(value)
        target.load_state_dict(value)
        return True
    if torch is not None and isinstance(target, torch.Tensor):
        tensor: Tensor = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
        if tuple(target.shape) != tuple(tensor.shape):
            raise InvalidInputError(f"{where}: shape {tuple(tensor.shape)} in checkpoint, {tuple(target.shape)} here")
        with torch.no_grad():
            target.copy_(tensor)
        return True
    if np is not None and isinstance(target, np.ndarray):
        arr: NDArray = np.asarray(value)
        if target.shape != arr.shape:
            raise InvalidInputError(f"{where}: shape {arr.shape} in checkpoint, {target.shape} here")
        np.copyto(target, arr, casting="no" if target.dtype == arr.dtype else "same_kind")
        return True
    if isinstance(target, MutableMapping) and isinstance(value, Mapping):
        for k, v in value.items():
            if k not in target or not restore_into(target[k], v, f"{where}.{k}"):
                target[k] = v
        return True
    if isinstance(target, MutableSequence) and isinstance(value, list) and len(target) == len(value):
        for i, v in enumerate(value):
            if not restore_into(target[i], v, f"{where}[{i}]"):
                target[i] = v
        return True
    if isinstance(target, MutableSequence) and isinstance(value, list):
        target[:] = value
        return True
    return False


class _Ids(list):  # type: ignore[type-arg]
    """A parameter group's parameter ids whose ``in`` is a set lookup.

    torch's ``Optimizer.load_state_dict`` asks, for every state tensor, which
    group holds its parameter by scanning each group's list of ids: the load
    is quadratic in the parameters (docs/perf.md, "Restore"; a mixture of
    experts with a module per expert has thousands). Everything else it
    does with the list (its length, iterating, a deep copy, then replacing
    it by the live group's) is a list's; the optimizer keeps none of it."""

    def __init__(self, ids: List[object]) -> None:
        super().__init__(ids)
        self._set = frozenset(ids)

    def __contains__(self, x: object) -> bool:
        try:
            return x in self._set
        except TypeError:  # (unhashable: the list's own scan)
            return list.__contains__(self, x)


def _indexed_groups(value: object) -> object:
    """An optimizer's stored state dict with each group's ``params`` an
    :class:`_Ids` (a shallow copy; ``value`` as it is unless it has the
    layout torch's optimizers write)."""
    if not isinstance(value, Mapping) or not isinstance(value.get("param_groups"), list):
        return value
    groups = value["param_groups"]
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return value
    try:
        indexed = [dict(g, params=_Ids(g["params"])) for g in groups]
    except TypeError:  # (unhashable ids: torch's own scan)
        return value
    return dict(value, param_groups=indexed)


def _on_device(t: Tensor) -> bool:
    """Whether a live tensor is filled through the host (a CUDA tensor)."""
    return bool(t.is_cuda)


def _bytes_of(t: Tensor, ptr: int, nbytes: int) -> _Dest:
    """A writable buffer of the ``nbytes`` bytes at ``ptr`` of a contiguous
    CPU tensor (no copy): a span of its storage, else (a tensor whose storage
    cannot be had) a numpy byte view."""
    try:
        return HostSpan.writable(t.untyped_storage(), ptr, nbytes)
    except (RuntimeError, TypeError, NotImplementedError, InvalidInputError):
        return t.detach().reshape(-1).view(_loaded_torch().uint8).numpy()


def _resolve(v: object) -> object:
    if isinstance(v, _Deferred):
        return v.make()
    if type(v) is OrderedDict:
        meta = getattr(v, "_metadata", None)
        out = OrderedDict((k, _resolve(x)) for k, x in v.items())
        if meta is not None:
            setattr(out, "_metadata", _resolve(meta))
        return out
    if type(v) is dict:
        return {k: _resolve(x) for k, x in v.items()}
    if type(v) is list:
        return [_resolve(x) for x in v]
    if type(v) is tuple:
        return tuple(_resolve(x) for x in v)
    return v


def _torch_dtype_name(t: Tensor) -> str:
    global _DTYPE_NAME
    if _DTYPE_NAME is None:  # (imported once, not by an import statement per tensor)
        from ckpt._state.tensors import dtype_name

        _DTYPE_NAME = dtype_name
    return _DTYPE_NAME(t.dtype)


_DTYPE_NAME: Optional[Callable[[torch.dtype], str]] = None


def live_state(target: object) -> Tuple[object, Hint]:
    """The live state of a restore target and, for an optimizer, where to find
    the parameter whose layout a missing state tensor takes."""
    if not is_stateful(target):
        return target, _no_hint
    torch = _torch()
    if torch is not None and isinstance(target, torch.nn.Module):
        from ckpt._state.modstate import state_dict

        return state_dict(target), _no_hint
    live = target.state_dict()
    if torch is not None and isinstance(target, torch.optim.Optimizer):
        params: List[Tensor] = [p for g in target.param_groups for p in g["params"]]

        def hint(path: Path) -> Optional[Tensor]:
            if len(path) == 3 and path[0] == "state" and isinstance(path[1], int) and 0 <= path[1] < len(params):
                return params[path[1]]
            return None

        return live, hint
    return live, _no_hint
