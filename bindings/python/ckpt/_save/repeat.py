"""A loop's repeated saves of the same CUDA tensors, walked in bulk.

A training loop saves the same state dicts every time: the same keys, and
under each key a tensor of the same dtype and shape at the same address (a
module's parameters; an optimizer's state, a dict of tensors per parameter).
The walk of :mod:`ckpt._state.tree` spends a few microseconds of Python on each
tensor, in the stall of a lazy save. So the walk of such a mapping records
what it made of it (a :class:`Plan`: the tree, names, dtypes, shapes, which
tensors are tied), and a later save checks the mapping against the plan with
a handful of calls that each run over all of its tensors in C (``map`` of
attribute getters, list comparisons), then hands out the guessed slab's slots
for all of them at once (:meth:`ckpt._device.cuda.DeviceCopy.add_many`), with the
``TensorSpec`` objects made for that slab the last time it was used. Without
a guessed slab (the last one of this layout still being written, as when a
save's write takes about as long as the interval between saves), they are
handed out as :class:`ckpt._device.cuda.Pending`, as the walk would, and the save's
``start`` puts them in the slab it chooses.

Two shapes of mapping are taken: tensors by key (a module's state dict), and
dicts of tensors by key (an optimizer's ``state``). A DTensor (FSDP2, tensor
parallel) is taken by its local tensor, with the shard the walk gave it, as
long as its spec (and the spec's placements, mesh and global metadata) is
the same object as at the last save. Anything that differs (a
key, a dtype, a shape, an address, a tensor that is not contiguous or has its
conjugate or negative bit set, a name already taken, a tensor this save
met before) sends the mapping through the walk, which records a new plan. Tensors
the walk copies at once (module buffers in lazy mode) are taken by the walk
one by one, as always. A mapping of CPU tensors alone gets a plan of its own
(:mod:`ckpt._save.repeat_host`), checked here as these are.
"""

from __future__ import annotations

import copy
import operator
from collections import OrderedDict
import warnings
import weakref
from functools import partial
from itertools import chain
from typing import TYPE_CHECKING, Callable, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple, Union, cast

import torch

from ckpt._save import repeat_host as _repeat_host
from ckpt._ckpt import Shard, SlabSlot, TensorSpec
from ckpt._save.repeat_host import FlatKeys, HostPlan, Keys, Meta
from ckpt._device.cuda import Pending
from ckpt._state.tensors import Exporter
from ckpt._state.tree import ODICT, TAG, LazyPtrs, Tree, _Flattener, _Later

if TYPE_CHECKING:
    from ckpt._state.arrays import NDArray
    from ckpt._device.slabs import SlabPool, _Slab
    from ckpt._device.cuda import DeviceCopy

__all__ = ["Plan", "Probe", "probe", "PlannedExporter"]

#: What is compared tensor by tensor. The address stands for the rest: it is
#: the same only on the same device (CUDA's unified addressing), a tensor that
#: is not strided has none (``data_ptr`` raises), and a quantized one has a
#: dtype of its own.
_META = operator.attrgetter("dtype", "shape")
_PTR = torch.Tensor.data_ptr
_CONJ = torch.Tensor.is_conj
_NEG = torch.Tensor.is_neg
_CONTIGUOUS = torch.Tensor.is_contiguous
_VALUES = dict.values
#: What a plan reads of the walk's specs and copies, in bulk (:func:`_in_order`).
_NAME = operator.attrgetter("name")
_DATA = operator.attrgetter("data")
_COPY_NOW = operator.attrgetter("copy_now")
_INDEX = operator.attrgetter("index")
_MADE = operator.attrgetter("dtype", "shape", "shard")
_NBYTES = operator.attrgetter("nbytes")
_DEVICE = operator.attrgetter("device")
_SLOTS = {Pending, SlabSlot}


def _layout(v: object) -> object:
    """What fixes a DTensor's pieces besides its local tensor's shape: its spec
    and the spec's placements, mesh and global metadata, compared by identity
    (FSDP2 and TP keep one spec per parameter and optimizer state), as
    :func:`ckpt._sharded.dtensor.local_pieces` caches them."""
    spec = getattr(v, "_spec", None)
    if spec is None:
        return object()  # (equal to nothing, a plan's included: the walk decides)
    return (spec, getattr(spec, "placements", None), getattr(spec, "mesh", None), getattr(spec, "tensor_meta", None))


#: Mappings with fewer tensors go through the walk (the checks cost more than they save).
_MIN = 8

#: Lazy-safe pointers for tensors to be copied at once: none.
_AT_ONCE: FrozenSet[int] = frozenset()


class Plan:
    """What the walk made of one mapping of tensors (see the module docs)."""

    __slots__ = (
        "keys", "meta", "ptrs", "names", "tree", "raw_meta", "runs", "uniq_ptrs", "nbytes", "device", "specs", "slot_of",
        "walk_ptrs", "layouts", "made", "pending", "mixed",
    )

    def __init__(self, keys: Keys, meta: List[Meta], ptrs: List[int]) -> None:
        self.keys = keys
        self.meta = meta
        self.ptrs = ptrs
        #: Every tensor's name, in the order of ``meta``.
        self.names: List[str] = []
        #: The walked form of the mapping, returned as it is by a save that matches.
        self.tree: Tree = None
        #: A copy of the mapping's ``_metadata`` (a module's state dict), if any.
        self.raw_meta: object = None
        #: The tensors in the walk's order, in runs: ``(positions, distinct,
        #: first, end)`` for tensors copied from the device as they are
        #: (``distinct``: the positions of those not tied to an earlier one;
        #: ``first:end``: their specs in ``specs``), ``(positions, None, 0, 0)``
        #: for tensors the walk takes one by one (a buffer it clones).
        self.runs: List[Tuple[List[int], Optional[List[int]], int, int]] = []
        #: Addresses of the distinct device tensors.
        self.uniq_ptrs: List[int] = []
        #: The lengths of the slots the mapping takes, in order (clones included).
        self.nbytes: Tuple[int, ...] = ()
        self.device: Optional[torch.device] = None
        #: The specs of the device tensors made for a slab: ``id(slab)`` to
        #: ``(weakref to it, (its layout's number, first slot index), specs)``.
        self.specs: Dict[int, Tuple[weakref.ref[_Slab], Tuple[int, int], List[TensorSpec]]] = {}
        #: (Filled while the plan is made: each device tensor's slot, from the mapping's first.)
        self.slot_of: List[Tuple[int, int]] = []
        #: Whether a tensor the walk takes one by one was left to the
        #: background copy: then a module's pointers are looked up to decide
        #: again. Else (buffers cloned at once, the common case) they are
        #: copied at once again, and the pointers are not looked up.
        self.walk_ptrs = False
        #: Per tensor, a DTensor's layout (:func:`_layout`), None for a plain tensor.
        self.layouts: Optional[List[object]] = None
        #: (Filled while the plan is made: what the walk made of each device
        #: tensor, ``(dtype, shape, shard)`` of its spec.)
        self.made: Dict[int, Tuple[str, List[int], Optional[Shard]]] = {}
        #: The specs made for a slab not yet chosen: ``(first slot index, specs)``.
        self.pending: Optional[Tuple[int, List[TensorSpec]]] = None
        #: Where every tensor the walk takes one by one is a CPU tensor it
        #: views as it is (an optimizer's CPU ``step`` beside its CUDA moments,
        #: as PyTorch's Adam and AdamW keep them unless fused or capturable):
        #: ``(positions of the distinct device tensors, positions of the CPU
        #: ones, where each spec goes among the device specs then the CPU
        #: ones, how the CPU ones are taken)``, so that a save takes both in bulk.
        self.mixed: Optional[Tuple[List[int], List[int], List[int], _repeat_host.Views]] = None


class Probe:
    """One mapping checked against its plan: ``tree`` when it was walked in
    bulk, else :meth:`record` after the walk."""

    __slots__ = ("tree", "_plans", "_host", "_prefix", "_keys", "_vals", "_meta", "_ptrs", "_ok", "_nested", "_layouts")

    def __init__(
        self, plans: Optional[Dict[str, Plan]], host: Optional[Dict[str, HostPlan]], prefix: str, keys: Keys,
        vals: List[torch.Tensor], nested: bool,
    ) -> None:
        self.tree: Tree = None
        #: The plans of mappings of CUDA tensors (the slab pool's), and of CPU
        #: tensors (:mod:`ckpt._save.repeat_host`), where kept.
        self._plans = plans
        self._host = host
        self._prefix = prefix
        self._keys = keys
        self._vals = vals
        self._nested = nested
        self._meta: Optional[List[Meta]] = None
        self._ptrs: List[int] = []
        self._ok = False
        #: Per tensor, a DTensor's layout, None for a plain tensor (None: no DTensor).
        self._layouts: Optional[List[object]] = None

    def record(self, fl: _Flattener, obj: Mapping[Union[str, int], object], n0: int, d0: int, tree: Tree) -> None:
        """After the walk of the mapping (its walked form ``tree``): its tensor
        specs are ``fl.out.tensors[n0:]``, its device copies the DeviceCopy's
        from index ``d0`` on. What the plan needs of them is taken now; the
        plan is made later, out of the save's stall (the exporter's
        ``later``, run on the pool's launcher thread once the save's copies
        are queued: see :func:`make_later`)."""
        if self._ok:
            return  # the plan held (a name was taken, or a tensor met before): keep it
        device = fl.exporter.device
        outs = fl.out.tensors[n0:]
        if device is None or len(device) == d0:
            # No CUDA tensor in the mapping: a plan for CPU tensors, made now
            # (it costs a few bulk calls, once).
            if self._plans is not None:
                self._plans.pop(self._prefix, None)
            self._record_host(outs, tree, getattr(obj, "_metadata", None))
            return
        if self._host is not None:
            self._host.pop(self._prefix, None)
        if self._meta is None or self._plans is None:
            if self._plans is not None:
                self._plans.pop(self._prefix, None)
            return
        srcs = device._srcs[d0:]
        _planned(fl).later.append(partial(self.make, outs, srcs, d0, tree, getattr(obj, "_metadata", None)))

    def make(self, outs: List[TensorSpec], srcs: List[torch.Tensor], d0: int, tree: Tree, meta: object) -> None:
        """Make the plan :meth:`record` took the makings of."""
        assert self._plans is not None
        try:
            plan = _plan(self, outs, srcs, d0, tree, meta)
        except Exception as e:  # noqa: BLE001 - no plan: the next save walks, as it would
            _failed(self._prefix, e)
            plan = None
        if plan is None:
            self._plans.pop(self._prefix, None)
        else:
            self._plans[self._prefix] = plan

    def _record_host(self, outs: List[TensorSpec], tree: Tree, meta: object) -> None:
        """The plan of a mapping of CPU tensors, from what the walk made of it."""
        host = self._host
        if host is None:
            return
        plan = None
        try:
            names = _names(self, tree) if self._meta is not None else None
            if names is not None:
                plan = _repeat_host.make(
                    self._keys, self._meta or [], self._ptrs, self._layouts, self._vals, names, tree, _copied(meta), outs
                )
        except Exception as e:  # noqa: BLE001 - no plan: the next save walks, as it would
            _failed(self._prefix, e)
        if plan is None:
            host.pop(self._prefix, None)
        else:
            host[self._prefix] = plan


_WARNED = False


def _failed(prefix: str, e: Exception) -> None:
    """A plan that could not be made (a bug: the data is safe, the walk takes
    its tensors) is said once per process, not swallowed."""
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(f"ckpt: no repeated-save plan for {prefix!r} ({type(e).__name__}: {e}); its saves "
                      "take every tensor one by one (correct, slower). Please report it.", RuntimeWarning,
                      stacklevel=2)


def make_later(jobs: List[Callable[[], None]]) -> None:
    """Make the plans a save's walk recorded (:meth:`Probe.record`), in order."""
    for job in jobs:
        job()


def probe(
    fl: _Flattener, plans: Optional[Dict[str, Plan]], obj: Mapping[Union[str, int], object], prefix: str,
    lazy_ptrs: LazyPtrs, host: Optional[Dict[str, HostPlan]] = None,
) -> Optional[Probe]:
    """Walk ``obj`` in bulk if its plan holds (then the probe's ``tree`` is
    set); None when it is not a mapping this module takes. ``plans`` are the
    plans of mappings of CUDA tensors, ``host`` those of CPU tensors (either
    None where none are kept)."""
    n = len(obj)
    if n < 2:
        return None
    if n < _MIN and type(next(iter(obj.values()))) is not dict:
        return None  # (a few tensors, as an optimizer's state of one parameter: the walk's)
    outer = list(obj.values())
    types = set(map(type, outer))
    dtensor = fl._dtensor
    # Plain tensors, and DTensors (FSDP2, TP) taken by their local tensors.
    tensors = {torch.Tensor, dtensor} if dtensor is not None else {torch.Tensor}
    if types <= tensors:
        if len(outer) < _MIN:
            return None
        p = Probe(plans, host, prefix, tuple(obj), cast(List[torch.Tensor], outer), False)
    elif types == {dict}:
        # An optimizer's state: every value a dict of tensors.
        vals: List[torch.Tensor] = list(chain.from_iterable(map(_VALUES, cast(List[Dict[object, torch.Tensor]], outer))))
        if len(vals) < _MIN:
            return None
        types = set(map(type, vals))
        if not types <= tensors:
            return None
        p = Probe(plans, host, prefix, (tuple(obj), tuple(map(tuple, cast(List[Dict[Union[str, int], torch.Tensor]], outer)))), vals, True)
    else:
        return None
    vals = p._vals
    if dtensor is not None and dtensor in types:
        from ckpt._sharded.dtensor import local_of

        p._layouts = [_layout(v) if type(v) is dtensor else None for v in vals]
        vals = p._vals = [local_of(v) if type(v) is dtensor else v for v in vals]
    try:
        ptrs = list(map(_PTR, vals))
    except RuntimeError:  # a tensor without storage of its own (sparse, ...): the walk says what
        return p  # (no plan: ``_meta`` stays None)
    if any(map(_NEG, vals)) or not all(map(_CONTIGUOUS, vals)) or any(map(_CONJ, vals)):
        return p
    p._meta = list(map(_META, vals))
    p._ptrs = ptrs
    hplan = host.get(prefix) if host is not None else None
    if hplan is not None and _holds(hplan, p, obj):
        p._ok = True
        if fl.names.isdisjoint(hplan.views.names) and _repeat_host.emit(fl, hplan, vals, lazy_ptrs):
            p.tree = hplan.tree
        return p
    plan = plans.get(prefix) if plans is not None else None
    if plan is None or not _holds(plan, p, obj):
        return p
    if fl.lazy and isinstance(lazy_ptrs, (set, frozenset)) and not lazy_ptrs.issuperset(plan.uniq_ptrs):
        return p  # a device tensor must now be copied at once: the walk decides
    # (A module's pointers are not even looked up: a tensor under the same key,
    # at the same address, of the same dtype and shape, is the same parameter.)
    p._ok = True
    if fl.names.isdisjoint(plan.names) and _emit(fl, plan, vals, lazy_ptrs):
        p.tree = plan.tree
    return p


class PlannedExporter(Exporter):
    """A checkpointer's exporter (:class:`ckpt._state.tensors.Exporter`): its walk
    takes mappings of tensors in bulk by the last save's plans (the pool's,
    of CUDA tensors, and ``host_plans``, of CPU tensors), and records them."""

    def __init__(
        self, slabs: Optional[SlabPool] = None, lazy: bool = True, host_plans: Optional[Dict[str, HostPlan]] = None
    ) -> None:
        super().__init__(slabs, lazy)
        #: The plans of mappings of CPU tensors (:mod:`ckpt._save.repeat_host`), where kept.
        self._host_plans = host_plans
        #: The makings of the plans the walk recorded, made by
        #: :meth:`make_plans` once the save has started.
        self.later: List[Callable[[], None]] = []

    def probe(self, fl: _Flattener, obj: Mapping[Union[str, int], object], prefix: str, lazy_ptrs: LazyPtrs) -> Optional[Probe]:
        """A mapping of tensors walked in bulk, as the last save's (:func:`probe`);
        None when it is no mapping of tensors."""
        plans = self._slabs.plans if self._slabs is not None else None
        if plans is None and self._host_plans is None:
            return None
        # (A first save records the plans: the next may come while its slab is
        # still being written, and take its tensors in bulk all the same.)
        return probe(fl, plans, obj, prefix, lazy_ptrs, self._host_plans)

    def make_plans(self) -> None:
        """Make the plans this save's walk recorded on the pool's launcher
        thread, after the save's own copies are queued there: out of the
        stall (a first save's plans cost about as much as its walk)."""
        jobs, self.later = self.later, []
        if jobs and self._slabs is not None:
            self._slabs.launcher().submit(make_later, jobs)


def _planned(fl: _Flattener) -> PlannedExporter:
    """The exporter of a walk that probes (only a :class:`PlannedExporter` does)."""
    return cast(PlannedExporter, fl.exporter)


def _copied(meta: object) -> object:
    """A copy of a module state dict's ``_metadata`` (an ordered dict of
    small dicts of plain values: one per submodule), to compare a later
    save's with; anything else copied deeply."""
    if meta is None:
        return None
    if type(meta) is OrderedDict and all(type(v) is dict for v in meta.values()):
        return OrderedDict([(k, dict(v)) for k, v in meta.items()])
    return copy.deepcopy(meta)


def _holds(plan: Union[Plan, HostPlan], p: Probe, obj: Mapping[Union[str, int], object]) -> bool:
    """Whether the mapping ``obj`` (probed as ``p``) is the one ``plan`` (a
    :class:`Plan` or a :class:`ckpt._save.repeat_host.HostPlan`) was made of."""
    if plan.keys != p._keys or plan.meta != p._meta or plan.ptrs != p._ptrs:
        return False
    if plan.layouts != p._layouts:  # (identical objects compare equal without __eq__)
        return False
    return bool(plan.raw_meta == getattr(obj, "_metadata", None))


def _emit(fl: _Flattener, plan: Plan, vals: List[torch.Tensor], lazy_ptrs: LazyPtrs) -> bool:
    mixed = plan.mixed
    host: Optional[List[TensorSpec]] = None
    if mixed is not None:
        # (Made first: a CPU tensor that cannot be viewed sends the mapping
        # through the walk before any device tensor was queued.)
        host = _repeat_host.take(fl, mixed[3], [vals[j] for j in mixed[1]], lazy_ptrs)
        if host is None:
            return False
    device = _planned(fl)._device()
    got = device.fits(plan.nbytes, plan.uniq_ptrs)
    if got is None:
        return False
    assert plan.device is not None  # (a plan's device tensors are on one device, noted as it was made)
    i0, slab, slots = got
    specs = _specs(slab, plan, i0, slots) if slab is not None else _pending(plan, i0)
    out = fl.out.tensors
    names = fl.names
    if mixed is not None and host is not None:
        uniq = mixed[0]
        device.add_many([vals[j] for j in uniq], [plan.ptrs[j] for j in uniq], plan.device)
        every = specs + host
        out.extend(map(every.__getitem__, mixed[2]))
        names.update(plan.names)
        return True
    for pos, distinct, first, end in plan.runs:
        if distinct is None:
            if lazy_ptrs is not None and not isinstance(lazy_ptrs, (set, frozenset)):
                # A module's: looked up now if a tensor taken one by one may
                # wait for the background copy; else all of them are copied at
                # once, as the last time (always safe, and what buffers need).
                lazy_ptrs = cast(_Later, lazy_ptrs).get() if plan.walk_ptrs else _AT_ONCE
            for j in pos:
                # (the walk's own path, for tensors it takes one by one; the name is free)
                fl.leaf(vals[j], plan.names[j], plan.names[j], lazy_ptrs)
            continue
        device.add_many([vals[j] for j in distinct], [plan.ptrs[j] for j in distinct], plan.device)
        run = specs[first:end]
        out.extend(run)
        names.update([plan.names[j] for j in pos])
    return True


def _pending(plan: Plan, i0: int) -> List[TensorSpec]:
    """The specs of the plan's device tensors from slot ``i0`` of a slab not
    yet chosen: their bytes :class:`ckpt._device.cuda.Pending` until the save's
    ``start`` (made once per ``i0``; specs and ``Pending`` do not change)."""
    hit = plan.pending
    if hit is not None and hit[0] == i0:
        return hit[1]
    specs = _made_specs(plan, [Pending(i0 + f) for _, f in plan.slot_of])
    plan.pending = (i0, specs)
    return specs


def _specs(slab: _Slab, plan: Plan, i0: int, slots: Optional[List[SlabSlot]]) -> List[TensorSpec]:
    """The specs of the plan's device tensors in ``slab`` from slot ``i0`` (made once per slab)."""
    hit = plan.specs.get(id(slab))
    # (A slab laid out anew has new slot objects: the engine counts its use by them.)
    if hit is not None and hit[0]() is slab and hit[1] == (slab.layouts, i0):
        return hit[2]
    assert slots is not None  # (a slab comes with its slots)
    specs = _made_specs(plan, [slots[i0 + f] for _, f in plan.slot_of])
    plan.specs[id(slab)] = (weakref.ref(slab), (slab.layouts, i0), specs)
    return specs


def _made_specs(plan: Plan, datas: Sequence[Union[Pending, SlabSlot]]) -> List[TensorSpec]:
    """A spec for each of the plan's device tensors, as the walk made it, with its bytes from ``datas``."""
    out = []
    for (j, _), data in zip(plan.slot_of, datas):
        dtype, shape, shard = plan.made[j]
        out.append(TensorSpec(name=plan.names[j], dtype=dtype, shape=shape, data=data, shard=shard))
    return out


def _plan(p: Probe, outs: List[TensorSpec], srcs: List[torch.Tensor], d0: int, tree: Tree, meta: object) -> Optional[Plan]:
    """A plan from what the walk did with the mapping (the specs it made,
    ``outs``; the device tensors it took from slot ``d0`` on, ``srcs``; the
    walked form ``tree``; the mapping's ``_metadata``), or None if its tensors
    cannot be taken in bulk next time."""
    if p._meta is None:
        return None
    names = _names(p, tree)
    if names is None:
        return None
    plan = Plan(p._keys, p._meta, p._ptrs)
    plan.layouts = p._layouts
    vals = p._vals
    plan.names, plan.tree = names, tree
    plan.raw_meta = _copied(meta)
    if _in_order(plan, outs, srcs, d0, vals):
        return plan
    # Tensor by tensor: tied ones, clones, DTensors in pieces, other devices.
    viewed: Dict[int, TensorSpec] = {}  # CPU tensors the walk viewed as they are: their specs
    array = _repeat_host.ndarray()
    specs: Dict[str, TensorSpec] = {}
    twice: Set[str] = set()  # (names of DTensors stored in several pieces)
    for t in outs:
        if t.name in specs:
            twice.add(t.name)
        specs[t.name] = t
    nbytes: List[int] = []
    for j, name in enumerate(names):
        spec = specs.get(name)
        data = spec.data if spec is not None else None
        dev = False
        if spec is not None and isinstance(data, (Pending, SlabSlot)) and not spec.copy_now:
            f = data.index - d0
            if not 0 <= f <= len(nbytes) or f >= len(srcs):
                return None
            src = srcs[f]
            new_slot = f == len(nbytes)
            if new_slot:
                nbytes.append(src.nbytes)  # the tensor's own slot, or its clone's
            if _PTR(src) == p._ptrs[j] and name not in twice and src.nbytes == vals[j].nbytes:
                if plan.device is None:
                    plan.device = src.device
                elif plan.device != src.device:
                    return None
                dev = True
                plan.slot_of.append((j, f))
                assert spec is not None
                plan.made[j] = (spec.dtype, spec.shape, spec.shard)
                _run(plan, True).append(j)
                if new_slot:
                    distinct = plan.runs[-1][1]
                    assert distinct is not None
                    distinct.append(j)
                    plan.uniq_ptrs.append(p._ptrs[j])
                # (else tied to an earlier tensor: its slot, no copy of its own)
            elif not new_slot:
                return None
        if not dev:
            if p._layouts is not None and p._layouts[j] is not None:
                return None  # a DTensor taken one by one: its pieces are the walk's to make
            _run(plan, False).append(j)
            # (a device tensor with a slot of its own at another address: a clone, copied at once)
            if spec is None or not (spec.copy_now or isinstance(data, (Pending, SlabSlot))):
                plan.walk_ptrs = True
            if spec is not None and array is not None and type(data) is array and name not in twice:
                view = cast("NDArray", data)
                if view.__array_interface__["data"][0] == p._ptrs[j] and view.nbytes == vals[j].nbytes:
                    viewed[j] = spec  # (a CPU tensor viewed as it is)
    if not plan.slot_of or len(srcs) != len(nbytes):
        return None  # nothing to take in bulk, or a slot the walk took that no tensor here explains
    first = 0
    for k, (pos, distinct, _, _) in enumerate(plan.runs):
        if distinct is not None:
            plan.runs[k] = (pos, distinct, first, first + len(pos))
            first += len(pos)
    plan.nbytes = tuple(nbytes)
    plan.mixed = _mixed(plan, p, viewed, first)
    return plan


def _mixed(
    plan: Plan, p: Probe, viewed: Dict[int, TensorSpec], ndev: int
) -> Optional[Tuple[List[int], List[int], List[int], _repeat_host.Views]]:
    """:attr:`Plan.mixed`, where every tensor the walk takes one by one was
    viewed as it is (``viewed``: their specs); ``ndev`` device specs."""
    walked = [j for pos, distinct, _, _ in plan.runs if distinct is None for j in pos]
    if not walked or not all(j in viewed for j in walked):
        return None
    views = _repeat_host.Views(
        [plan.names[j] for j in walked], [p._ptrs[j] for j in walked], [viewed[j] for j in walked]
    )
    order: List[int] = []
    h = ndev
    for pos, distinct, first, end in plan.runs:
        if distinct is None:
            order.extend(range(h, h + len(pos)))
            h += len(pos)
        else:
            order.extend(range(first, end))
    distinct_all = [j for _, distinct, _, _ in plan.runs if distinct is not None for j in distinct]
    return distinct_all, walked, order, views


def _names(p: Probe, tree: Tree) -> Optional[List[str]]:
    """The names the walk gave the probed mapping's tensors (walked form
    ``tree``), in the order of the probe's tensors; None where one is not the
    name its keys make (a name made unique, a shape not expected)."""
    prefix = p._prefix
    items = cast(Dict[Union[str, int], Tree], tree["items"] if type(tree) is dict and tree.get(TAG) == ODICT else tree)
    refs: List[Tree] = []
    names: List[str] = []
    if p._nested:
        outer, inners = cast(Tuple[FlatKeys, Tuple[FlatKeys, ...]], p._keys)
        for k, inner in zip(outer, inners):
            sub = items[k]
            if type(sub) is not dict or TAG in sub:
                return None
            base = prefix + (k if type(k) is str else str(k)) + "."
            for k2 in inner:
                refs.append(sub[k2])
                names.append(base + (k2 if type(k2) is str else str(k2)))
    else:
        for k in cast(FlatKeys, p._keys):
            refs.append(items[k])
            names.append(prefix + (k if type(k) is str else str(k)))
    if [getattr(r, "name", None) for r in refs] != names:
        return None
    return names


def _in_order(plan: Plan, outs: List[TensorSpec], srcs: List[torch.Tensor], d0: int, vals: List[torch.Tensor]) -> bool:
    """Fill ``plan`` for the common case, checked in bulk: each tensor of the
    mapping (``vals``) made one spec (``outs``) and is copied from one device
    as it is, into a slot of its own, in order (``srcs``, slots from ``d0``):
    no tied weights, clones, DTensors in pieces or tensors taken one by one.
    False (the plan untouched) when that is not so."""
    n = len(plan.names)
    if len(outs) != n or len(srcs) != n or list(map(_NAME, outs)) != plan.names or any(map(_COPY_NOW, outs)):
        return False
    datas = list(map(_DATA, outs))
    if not set(map(type, datas)) <= _SLOTS or list(map(_INDEX, datas)) != list(range(d0, d0 + n)):
        return False
    if list(map(_PTR, srcs)) != plan.ptrs:
        return False
    nbytes = list(map(_NBYTES, srcs))
    devices = set(map(_DEVICE, srcs))
    if nbytes != list(map(_NBYTES, vals)) or len(devices) != 1:
        return False
    every = list(range(n))
    plan.device = devices.pop()
    plan.runs = [(every, list(every), 0, n)]
    plan.slot_of = list(zip(every, every))
    plan.made = dict(enumerate(map(_MADE, outs)))
    plan.uniq_ptrs = list(plan.ptrs)
    plan.nbytes = tuple(nbytes)
    return True


def _run(plan: Plan, dev: bool) -> List[int]:
    """The positions of the plan's last run, a new one if it is of the other kind."""
    if not plan.runs or (plan.runs[-1][1] is not None) != dev:
        plan.runs.append(([], [] if dev else None, 0, 0))
    return plan.runs[-1][0]
