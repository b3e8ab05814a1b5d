"""Nested state dicts to named tensors plus a plain-data tree, and back.

A state such as ``{"model": model, "optimizer": opt, "extra": {"epoch": 3}}``
is flattened into a list of tensors with unique names (``model.fc.weight``,
``optimizer.state.0.exp_avg``, ...) and a tree of plain data in which each
tensor is replaced by a :class:`TensorRef`. Types are kept exactly: tuples stay
tuples, ``int`` and ``str`` keys stay apart, ``OrderedDict`` (with the
``_metadata`` that ``nn.Module.state_dict()`` attaches) comes back as such.

Objects with ``state_dict()`` and ``load_state_dict()`` (modules, optimizers,
schedulers, :class:`ckpt.RNGState`) are stored as their state dict.

This module never imports torch: a value is a torch tensor only if torch is
already imported.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import (
    TYPE_CHECKING, AbstractSet, Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple, TypeGuard, Union, cast,
)

from ckpt import _ckpt
from ckpt._ckpt import Shard, TensorRef, TensorSpec
from ckpt._sharded.dtensor import _dtensor_type, local_of, local_pieces
from ckpt.errors import InvalidInputError

if TYPE_CHECKING:
    import torch
    from torch.distributed.tensor import DTensor
    from typing_extensions import Buffer

    from ckpt._state.arrays import NDArray
    from ckpt._device.cuda import DeviceCopy

__all__ = ["Flattened", "flatten", "unflatten", "is_stateful", "TAG", "ODICT", "NP_SCALAR"]

#: Key that marks a dict in the stored tree as an encoded Python type, and
#: its values (the schema is ckpt-core's: ``formats/src/pymeta.rs``).
TAG: str = _ckpt.TYPE_TAG
ODICT: str = _ckpt.ODICT_TAG
NP_SCALAR: str = _ckpt.NP_SCALAR_TAG

_PLAIN = (type(None), bool, int, float, str, bytes)

#: A stored tree: plain data, with a :class:`TensorRef` in place of each tensor
#: (and tagged dicts for ordered dicts and numpy scalars).
Tree = Union[
    None, bool, int, float, str, bytes, TensorRef, List["Tree"], Tuple["Tree", ...], Dict[Union[str, int], "Tree"]
]

#: Lazy-safe pointers as the walk carries them: a set, None (all of them) or
#: a module's, looked up when first needed.
LazyPtrs = Union[AbstractSet[int], None, "_Later"]


class Exporter(Protocol):
    """What :func:`flatten` needs of an exporter (:class:`ckpt._state.tensors.Exporter`)."""

    @property
    def device(self) -> Optional[DeviceCopy]: ...

    def export(self, t: torch.Tensor, path: object, copy_now: bool) -> Tuple[str, Tuple[int, ...], object, bool]: ...


class Probe(Protocol):
    """A mapping checked against the last save's plan (:class:`ckpt._save.repeat.Probe`)."""

    @property
    def tree(self) -> Tree: ...

    def record(self, fl: _Flattener, obj: Mapping[Union[str, int], object], n0: int, d0: int, tree: Tree) -> None: ...


class Stateful(Protocol):
    """An object that checkpoints through its state dict (a module, an optimizer, ...)."""

    def state_dict(self) -> object: ...

    def load_state_dict(self, state: object, /) -> object: ...


def is_stateful(obj: object) -> TypeGuard[Stateful]:
    """True for objects that checkpoint through ``state_dict``/``load_state_dict``."""
    return (
        not isinstance(obj, (Mapping, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def _torch() -> Optional[ModuleType]:
    return sys.modules.get("torch")


def _numpy() -> Optional[ModuleType]:
    return sys.modules.get("numpy")


@dataclass
class Flattened:
    """The result of :func:`flatten`."""

    #: The tensors of the save; a piece of a sharded tensor (a DTensor's local
    #: shard) has a :class:`~ckpt._ckpt.Shard`.
    tensors: List[TensorSpec] = field(default_factory=list)
    tree: Tree = None
    numpy_names: List[str] = field(default_factory=list)
    #: Objects with ``state_dict`` met on the way, and the optimizers they hold
    #: (the lazy-mode hook goes on optimizers).
    stateful: List[object] = field(default_factory=list)
    #: The device-to-host copies of the CUDA tensors (:class:`ckpt._device.cuda.DeviceCopy`),
    #: not yet started: their entries' buffers are :class:`ckpt._device.cuda.Pending`.
    device: Optional[DeviceCopy] = None
    #: The tree of the rank-local part (see :func:`flatten`), or None.
    local_tree: Tree = None
    #: Names of the rank-local part's numpy arrays.
    local_numpy_names: List[str] = field(default_factory=list)
    #: The name of every tensor in ``tensors`` (each is unique).
    names: Set[str] = field(default_factory=set)


class _Where:
    """Where a value sits in the saved tree (``$['model']['fc.weight']``), for
    error messages: formatted only when a message needs it, not at every node
    of every save (which showed in the stall of saves with many tensors).
    ``key``, if given, is one more step below ``path`` (so a mapping's tensors
    need no list of their own)."""

    __slots__ = ("path", "key")

    def __init__(self, path: List[str], key: Union[str, int, None] = None) -> None:
        self.path = path
        self.key = key

    def __str__(self) -> str:
        path = self.path if self.key is None else self.path + [str(self.key)]
        return "$" + "".join(f"[{p!r}]" for p in path)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class _Flattener:
    def __init__(self, lazy: bool, exporter: Exporter) -> None:
        self.lazy = lazy
        self.exporter = exporter
        self.export = exporter.export
        #: Mappings of CUDA tensors walked in bulk (:mod:`ckpt._save.repeat`), if the exporter can.
        self.probe: Optional[Callable[[_Flattener, Mapping[Union[str, int], object], str, LazyPtrs], Optional[Probe]]] = getattr(
            exporter, "probe", None
        )
        self.out = Flattened()
        self.names: Set[str] = set()
        self._classes()

    def _classes(self) -> None:
        """Look torch's tensor classes up once per save (and again after a
        ``state_dict()``, which may import torch), not at every node."""
        torch = _torch()
        self._tensor = torch.Tensor if torch is not None else None
        self._dtensor = _dtensor_type()

    def name_for(self, path: List[str]) -> str:
        return self.unique(".".join(path))

    def unique(self, base: str) -> str:
        """``base`` (``tensor`` if empty), or ``base#1``, ``base#2``, ... if taken."""
        base = base or "tensor"
        name, n = base, 1
        while name in self.names:
            name, n = f"{base}#{n}", n + 1
        self.names.add(name)
        return name

    def leaf(self, obj: torch.Tensor, base: str, where: object, lazy_ptrs: Optional[AbstractSet[int]]) -> TensorRef:
        """A tensor that is not a DTensor, named ``base`` (made unique)."""
        # (CPU and CUDA pointers share one address space: CUDA's unified addressing.)
        copy_now = self.lazy and lazy_ptrs is not None and obj.data_ptr() not in lazy_ptrs
        dtype, shape, buf, copy_now = self.export(obj, where, copy_now)
        names = self.names
        if base and base not in names:  # (``unique``'s common case, inline)
            name = base
            names.add(name)
        else:
            name = self.unique(base)
        self.out.tensors.append(TensorSpec(name=name, dtype=dtype, shape=shape, data=buf, copy_now=copy_now))
        return TensorRef(name)

    def walk(self, obj: object, path: List[str], lazy_ptrs: LazyPtrs, depth: int = 0) -> Tree:
        # The common kinds first, by exact type: a save walks every node of
        # every state dict, and its time is the stall of a lazy save.
        kind = type(obj)
        if kind in _PLAIN:
            return cast(Tree, obj)
        if depth > 200:
            raise InvalidInputError(f"{_Where(path)}: nested too deeply (a cycle?)")
        if kind is dict or kind is OrderedDict:
            # (a module's state dict: its pointers stay unlooked-up, see ``_Later``)
            return self.walk_mapping(cast(Mapping[Union[str, int], object], obj), path, lazy_ptrs, depth)
        if isinstance(lazy_ptrs, _Later):
            lazy_ptrs = lazy_ptrs.get()
        tensor = self._tensor
        if tensor is not None and isinstance(obj, tensor):
            if self._dtensor is not None and isinstance(obj, self._dtensor):
                return self.dleaf(obj, ".".join(path), _Where(path), lazy_ptrs)
            return self.leaf(obj, ".".join(path), _Where(path), lazy_ptrs)
        if isinstance(obj, Mapping):
            return self.walk_mapping(obj, path, lazy_ptrs, depth)
        if kind is list or kind is tuple:
            return self.walk_sequence(cast(Sequence[object], obj), path, lazy_ptrs, depth)
        np = _numpy()
        if np is not None and isinstance(obj, np.ndarray):
            from ckpt._state import arrays as npg

            dtype, shape, arr = npg.export(obj, _Where(path))
            name = self.name_for(path)
            self.out.tensors.append(TensorSpec(name=name, dtype=dtype, shape=shape, data=arr, copy_now=self.lazy))
            self.out.numpy_names.append(name)
            return TensorRef(name)
        if np is not None and isinstance(obj, np.generic):
            return {TAG: NP_SCALAR, "value": self.walk(np.asarray(obj), path, lazy_ptrs, depth + 1)}
        if is_stateful(obj):
            self.out.stateful.append(obj)
            ptrs, guarded = _stateful_lazy_ptrs(obj)
            self.out.stateful.extend(guarded)
            state = _state_of(obj)
            self._classes()
            return self.walk(state, path, ptrs, depth + 1)
        if isinstance(obj, (list, tuple)):
            return self.walk_sequence(obj, path, lazy_ptrs, depth)
        raise InvalidInputError(
            f"{_Where(path)}: cannot store a value of type {type(obj).__name__} "
            "(tensors, arrays, objects with state_dict(), and plain data: None, bool, int, float, str, "
            "bytes, list, tuple, dict)"
        )

    def walk_sequence(self, obj: Sequence[object], path: List[str], lazy_ptrs: LazyPtrs, depth: int) -> Tree:
        """A list or tuple (subclasses included) as a list or a tuple."""
        items = cast(List[Tree], [
            v if type(v) in _PLAIN else self.walk(v, path + [str(i)], lazy_ptrs, depth + 1)
            for i, v in enumerate(obj)
        ])
        return items if isinstance(obj, list) else tuple(items)

    def walk_mapping(self, obj: Mapping[Union[str, int], object], path: List[str], lazy_ptrs: LazyPtrs, depth: int) -> Tree:
        items: Dict[Union[str, int], Tree] = {}
        # Most values of a state dict are plain tensors (exactly torch.Tensor:
        # a module's detached parameters, an optimizer's state); they are taken
        # here, without a call of walk or a path of their own each.
        tensor = self._tensor
        prefix = ".".join(path) + "." if path else ""
        # One place for every tensor of the mapping, its key set per tensor:
        # it is formatted only by the error of the tensor being exported.
        here = _Where(path)
        probe = self.probe(self, obj, prefix, lazy_ptrs) if self.probe is not None else None
        if probe is not None and probe.tree is not None:
            return probe.tree
        if isinstance(lazy_ptrs, _Later):
            lazy_ptrs = lazy_ptrs.get()
        n0 = len(self.out.tensors)
        d0 = len(self.exporter.device) if self.exporter.device is not None else 0
        leaf = self.leaf
        dtensor = self._dtensor  # (FSDP2 and TP state dicts: taken here too)
        for k, v in obj.items():
            kk = type(k)
            if kk is str:
                if k == TAG:
                    raise InvalidInputError(f"{_Where(path)}: the key {TAG!r} is reserved by ckpt")
                key = cast(str, k)
            elif kk is int:
                key = str(k)
            else:
                raise InvalidInputError(f"{_Where(path)}: dict keys must be str or int, not {kk.__name__}")
            kv = type(v)
            if kv is tensor:  # (never when torch is not imported: no type is None)
                here.key = k
                items[k] = leaf(cast("torch.Tensor", v), prefix + key, here, lazy_ptrs)
            elif kv is dtensor:
                here.key = k
                items[k] = self.dleaf(cast("DTensor", v), prefix + key, here, lazy_ptrs)
            elif kv in _PLAIN:
                items[k] = cast(Tree, v)
            elif kv is dict and depth < 200:
                # (an optimizer's state: a dict of tensors per parameter)
                items[k] = self.walk_mapping(cast(Dict[Union[str, int], object], v), path + [key], lazy_ptrs, depth + 1)
            else:
                items[k] = self.walk(v, path + [key], lazy_ptrs, depth + 1)
        tree = self._odict(obj, items, path, depth)
        if probe is not None:
            probe.record(self, obj, n0, d0, tree)
        return tree

    def _odict(self, obj: Mapping[Union[str, int], object], items: Dict[Union[str, int], Tree], path: List[str], depth: int) -> Tree:
        """``items`` as the walked form of mapping ``obj``: an ordered dict with
        the ``_metadata`` of a module's state dict is tagged as such."""
        meta = getattr(obj, "_metadata", None)
        if isinstance(obj, OrderedDict) or meta is not None:
            encoded_meta = self.walk(meta, path + ["_metadata"], set(), depth + 1) if meta is not None else None
            return {TAG: ODICT, "items": items, "metadata": encoded_meta}
        return items

    def dleaf(self, obj: DTensor, base: str, where: object, lazy_ptrs: LazyPtrs) -> TensorRef:
        """A DTensor named ``base`` (made unique): its local shard, as pieces
        of the global tensor (no gather)."""
        if isinstance(lazy_ptrs, _Later):
            lazy_ptrs = lazy_ptrs.get()
        global_shape, pieces = local_pieces(obj, where)
        local = local_of(obj)
        may_defer = lazy_ptrs is None or local.data_ptr() in lazy_ptrs
        copy_now = self.lazy and not may_defer
        name = self.unique(base)
        whole = len(pieces) == 1 and pieces[0].shape == global_shape
        if whole or (not pieces and 0 in global_shape):
            # Replicated everywhere (or empty): a plain tensor of that name, stored once.
            dtype, shape, buf, now = self.exporter.export(local, where, copy_now)
            self.out.tensors.append(TensorSpec(name=name, dtype=dtype, shape=global_shape, data=buf, copy_now=now))
            return TensorRef(name)
        for piece in pieces:
            dtype, shape, buf, now = self.exporter.export(piece.view(local), where, copy_now)
            shard = Shard(global_shape, piece.offsets)
            self.out.tensors.append(TensorSpec(name=name, dtype=dtype, shape=shape, data=buf, copy_now=now, shard=shard))
        return TensorRef(name)


class _Later:
    """A module's lazy-safe pointers (:func:`ckpt._state.tensors.lazy_safe_pointers`),
    found when the walk first needs them: a state dict that the plan of the
    last save takes in bulk (:mod:`ckpt._save.repeat`) does not, and walking a
    module's parameters to find them costs a good part of a lazy save's stall."""

    __slots__ = ("obj", "ptrs")

    def __init__(self, obj: object) -> None:
        self.obj = obj
        self.ptrs: Optional[Set[int]] = None

    def get(self) -> Optional[Set[int]]:
        if self.ptrs is None:
            from ckpt._state.tensors import lazy_safe_pointers

            self.ptrs = lazy_safe_pointers(self.obj)[0]
        return self.ptrs


def _stateful_lazy_ptrs(obj: object) -> Tuple[LazyPtrs, Sequence[object]]:
    """See :func:`ckpt._state.tensors.lazy_safe_pointers`; a module's come later (:class:`_Later`)."""
    torch = _torch()
    if torch is None:
        return set(), []
    if isinstance(obj, torch.nn.Module):
        return _Later(obj), []
    global _LAZY_SAFE
    if _LAZY_SAFE is None:  # (imported once, not by an import statement in every save)
        from ckpt._state.tensors import lazy_safe_pointers

        _LAZY_SAFE = lazy_safe_pointers
    return _LAZY_SAFE(obj)


_LAZY_SAFE: Optional[Callable[[object], Tuple[Optional[Set[int]], List[torch.optim.Optimizer]]]] = None


def _state_of(obj: Stateful) -> object:
    """``obj.state_dict()``; a module's made in bulk where its tree is as at
    the last save (:mod:`ckpt._state.modstate`)."""
    torch = _torch()
    if torch is not None and isinstance(obj, torch.nn.Module):
        global _MODULE_STATE
        if _MODULE_STATE is None:
            from ckpt._state.modstate import state_dict

            _MODULE_STATE = state_dict
        return _MODULE_STATE(obj)
    return obj.state_dict()


_MODULE_STATE: Optional[Callable[[torch.nn.Module], object]] = None


class _NumpyExporter:
    """Exporter used when torch is not imported (no torch tensor can occur)."""

    device: Optional[DeviceCopy] = None

    def export(self, t: torch.Tensor, path: object, copy_now: bool) -> Tuple[str, Tuple[int, ...], object, bool]:  # pragma: no cover - unreachable
        raise InvalidInputError(f"{path}: torch tensor without torch")


def flatten(
    state: Mapping[str, object],
    lazy: bool,
    exporter: Optional[Exporter] = None,
    local: Optional[Mapping[str, object]] = None,
    local_prefix: str = "",
) -> Flattened:
    """Flatten a state mapping for one save.

    In lazy mode, tensors that may change before the optimizer step (module
    buffers, loose tensors, numpy arrays) are marked ``copy_now``; module
    parameters and optimizer state are copied in the background.

    ``local`` is state that belongs to this rank alone (its RNG): it is walked
    separately, its tensors named under ``local_prefix``, and its tree returned
    apart (``local_tree``) so the caller can store it per rank.
    """
    if exporter is None:
        if _torch() is not None:
            from ckpt._state.tensors import Exporter

            exporter = Exporter()
        else:
            exporter = _NumpyExporter()
    f = _Flattener(lazy, exporter)
    f.out.tree = f.walk(state, [], set())
    if local is not None:
        shared_numpy = len(f.out.numpy_names)
        f.out.local_tree = f.walk(local, [local_prefix], set())
        f.out.local_numpy_names = f.out.numpy_names[shared_numpy:]
        del f.out.numpy_names[shared_numpy:]
    f.out.device = exporter.device
    f.out.names = f.names
    return f.out


def unflatten(tree: object, make_tensor: Callable[[str], object]) -> object:
    """Rebuild Python objects from a stored tree; ``make_tensor(name)`` gives each tensor."""
    if isinstance(tree, TensorRef):
        return make_tensor(tree.name)
    if type(tree) is dict:
        tag = tree.get(TAG)
        if tag == ODICT:
            out = OrderedDict((k, unflatten(v, make_tensor)) for k, v in tree["items"].items())
            if tree.get("metadata") is not None:
                setattr(out, "_metadata", unflatten(tree["metadata"], make_tensor))
            return out
        if tag == NP_SCALAR:
            return cast("NDArray", unflatten(tree["value"], make_tensor))[()]
        if tag is not None:
            raise InvalidInputError(f"unknown encoded type {tag!r} in checkpoint (written by a newer ckpt?)")
        return {k: unflatten(v, make_tensor) for k, v in tree.items()}
    if type(tree) is list:
        return [unflatten(v, make_tensor) for v in tree]
    if type(tree) is tuple:
        return tuple(unflatten(v, make_tensor) for v in tree)
    return tree


def tensor_maker(
    tensors: Mapping[str, Tuple[str, Sequence[int], Buffer]], numpy_names: Set[str], framework: Optional[str]
) -> Callable[[str], object]:
    """``make_tensor`` for :func:`unflatten`: numpy or torch, as saved or as asked."""

    def make(name: str) -> object:
        dtype, shape, buf = tensors[name]
        kind = framework or ("np" if name in numpy_names else "pt")
        if kind == "np":
            from ckpt._state import arrays as npg

            return npg.from_buffer(dtype, tuple(shape), buf)
        if kind == "pt":
            from ckpt._state import tensors as ptg

            return ptg.from_buffer(dtype, tuple(shape), buf)
        raise InvalidInputError(f'framework must be "np", "pt" or None, not {framework!r}')

    return make
