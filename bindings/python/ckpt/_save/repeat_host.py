"""A loop's repeated saves of the same CPU tensors, taken in bulk.

The CPU half of :mod:`ckpt._save.repeat`. A CPU training loop saves the same state
dicts every time, and the walk of :mod:`ckpt._state.tree` spends a few microseconds
of Python on each tensor (its view as bytes, its name made unique, its spec),
in the stall of a lazy save: most of that stall on a model of a hundred
tensors or more. So the walk of a mapping of CPU tensors records a
:class:`HostPlan` (names, dtypes, shapes, which tensors were copied at once,
the walked form), and a later save whose mapping :func:`ckpt._save.repeat.probe`
finds the same (keys, dtypes, shapes and addresses, checked in bulk) takes
its tensors with two calls that each run over all of them in C: their
storages (``Tensor.untyped_storage``), then every spec at once over them
(:class:`ckpt._ckpt.HostRun`, which checks each tensor's bytes lie in its
storage). That spares each tensor a numpy view, made in Python, and its
export through the buffer protocol in the engine. A DTensor (FSDP2 and
tensor parallel on CPU, under gloo) is taken by its local tensor, as the
CUDA plans take it, where the walk stored that in one piece (with its layout
checked by identity).

A plan holds no tensor, view or storage: each save takes the storages of the
tensors it was given (and holds them until its copy is done), so a plan never
keeps memory alive that the loop let go. A tensor under the same key, at the
same address, of the same dtype and shape, is the same tensor as at the last
save (the memory the last save took, still in use by it), so it is copied at
once or left to the background copy as then. Where a set of lazy-safe
addresses was given (a DCP ``AppState``), it is looked up again, for each
tensor.
"""

from __future__ import annotations

import operator
import sys
from typing import TYPE_CHECKING, List, Optional, Tuple, Union

import torch

from ckpt._ckpt import HostRun, TensorSpec
from ckpt.errors import InvalidInputError

if TYPE_CHECKING:
    from ckpt._state.tree import LazyPtrs, Tree, _Flattener

#: A probed mapping's keys (:func:`ckpt._save.repeat.probe`): its own, or for a
#: mapping of dicts (an optimizer's state), its keys and each dict's.
FlatKeys = Tuple[Union[str, int], ...]
Keys = Union[FlatKeys, Tuple[FlatKeys, Tuple[FlatKeys, ...]]]
#: Each tensor's dtype and shape, as a plan compares them.
Meta = Tuple[torch.dtype, torch.Size]

__all__ = ["HostPlan", "Views", "make", "emit", "take", "ndarray"]

_NAME = operator.attrgetter("name")
_DATA = operator.attrgetter("data")
_COPY_NOW = operator.attrgetter("copy_now")
_NBYTES = operator.attrgetter("nbytes")
_STORAGE = torch.Tensor.untyped_storage


def ndarray() -> Optional[type]:
    """numpy's array type, where numpy is imported (the walk views CPU
    tensors through it); else None: then no spec holds an array, and no plan
    of CPU tensors is made (ckpt does not need numpy for CUDA state)."""
    np = sys.modules.get("numpy")
    return np.ndarray if np is not None else None


class Views:
    """How a save takes a run of CPU tensors that the walk viewed as they are:
    the whole of a :class:`HostPlan`'s mapping, or the CPU tensors of a
    mapping of CUDA tensors (:attr:`ckpt._save.repeat.Plan.mixed`)."""

    __slots__ = ("names", "ptrs", "copy_now", "run")

    def __init__(self, names: List[str], ptrs: List[int], specs: List[TensorSpec]) -> None:
        """From the tensors' names, addresses and the specs the walk made of them."""
        self.names = names
        self.ptrs = ptrs
        #: Whether the walk copied each tensor at once (lazy mode).
        self.copy_now: List[bool] = list(map(_COPY_NOW, specs))
        #: Each tensor's name, dtype, shape and piece as the walk stored it (a
        #: DTensor: the global shape, or its local tensor's as a piece of it),
        #: from which a later save's specs are made over the tensors' storages.
        self.run = HostRun(specs)


class HostPlan:
    """What the walk made of one mapping of CPU tensors (see the module docs)."""

    __slots__ = ("keys", "meta", "layouts", "raw_meta", "tree", "views")

    def __init__(
        self, keys: Keys, meta: List[Meta], layouts: Optional[List[object]], raw_meta: object, tree: Tree, views: Views
    ) -> None:
        #: What :func:`ckpt._save.repeat.probe` compares: the keys, each tensor's
        #: ``(dtype, shape)`` and address (:attr:`ptrs`; a DTensor's: its local
        #: tensor's), DTensor layouts (:func:`ckpt._save.repeat._layout`), the
        #: module's ``_metadata``.
        self.keys = keys
        self.meta = meta
        self.layouts = layouts
        self.raw_meta = raw_meta
        #: The walked form of the mapping, returned as it is by a save that matches.
        self.tree = tree
        self.views = views

    @property
    def ptrs(self) -> List[int]:
        return self.views.ptrs


def make(keys: Keys, meta: List[Meta], ptrs: List[int], layouts: Optional[List[object]], vals: List[torch.Tensor],
         names: List[str], tree: Tree, raw_meta: object, outs: List[TensorSpec]) -> Optional[HostPlan]:
    """A plan from the specs the walk made of a mapping's tensors (``vals``,
    a DTensor's local tensor in its place): ``outs``. None unless each tensor
    made one spec, in order, under the name the plan expects, over all of its
    own bytes (not a device slot, nor a DTensor's piece).

    (Made in the stall of the save that walked the mapping, so each check is
    one bulk call. A view of as many bytes is a view of the tensor's own: the
    walk copies only tensors that are not contiguous or have their conjugate
    or negative bit set, which :func:`ckpt._save.repeat.probe` keeps out of plans.)"""
    n = len(names)
    if len(outs) != n or list(map(_NAME, outs)) != names:
        return None
    datas = list(map(_DATA, outs))
    array = ndarray()
    if array is None or set(map(type, datas)) != {array}:
        return None
    if list(map(_NBYTES, datas)) != list(map(_NBYTES, vals)):
        return None
    return HostPlan(keys, meta, layouts, raw_meta, tree, Views(names, ptrs, outs))


def emit(fl: _Flattener, plan: HostPlan, vals: List[torch.Tensor], lazy_ptrs: LazyPtrs) -> bool:
    """Add a spec per tensor of ``vals`` (the mapping the plan was made of) to
    the save's specs; False, with nothing added, where a tensor cannot be
    taken by its storage (the walk then says why)."""
    specs = take(fl, plan.views, vals, lazy_ptrs)
    if specs is None:
        return False
    fl.out.tensors.extend(specs)
    fl.names.update(plan.views.names)
    return True


def take(fl: _Flattener, views: Views, vals: List[torch.Tensor], lazy_ptrs: LazyPtrs) -> Optional[List[TensorSpec]]:
    """The specs of ``vals`` (the tensors ``views`` was made of, in order, at
    the addresses it was made with), or None where a tensor's storage cannot
    be had or does not hold its bytes (the walk then says why)."""
    try:
        storages = list(map(_STORAGE, vals))
    except (RuntimeError, TypeError, NotImplementedError):
        # (A tensor whose storage cannot be had, as a functional tensor's or a
        # subclass's that does not implement it: the walk takes it as it can.)
        return None
    if fl.lazy and isinstance(lazy_ptrs, (set, frozenset)):
        flags: List[bool] = [p not in lazy_ptrs for p in views.ptrs]
    else:
        # (None: an optimizer's, all of them left to the background copy; a
        # module's: as the last time, the same tensors.)
        flags = views.copy_now
    try:
        return views.run.specs(storages, views.ptrs, flags)
    except InvalidInputError:
        return None
