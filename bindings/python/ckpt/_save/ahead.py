"""A checkpointer's first save, readied ahead of it, so that it is like any
later one: page-locked memory, and a walk of the state (:func:`rehearse`, once
the state is whole; with CPU state on a fresh start, also at once, with the
optimizer state to come foreseen by :func:`state_lens`).
``Checkpointer.load_latest`` calls :func:`reserve` on a fresh start and
:func:`after_restore` after a restore; a save or ``close`` calls
:func:`hooks_off`.

A new host slab is mapped and page-locked before its first copies, which in
an eager first save is in its stall (docs/perf.md, "CUDA"). Where the
state's size is known ahead, ``load_latest`` on a fresh start reserves the
first save's slab in the background (:meth:`ckpt._device.slabs.SlabPool.reserve`):

- with a ``staging_budget``, half of it (the budget is twice the state);
- without one, the CUDA bytes of the state it was given, counted once each of
  its optimizers has stepped (their state exists only from then on), or at
  once when it was given no optimizer. The count is one walk of the state,
  once per process.

Either way the reservation holds the state and room for the slab's alignment,
so that the first save lays it out anew for its own tensors instead of
mapping and locking more. It is locked in one piece, during which the CUDA
driver takes no other call of the process: once, among a job's first steps,
in place of the first save's lock.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Literal, Optional, Protocol, Sequence, Set, Tuple, Type, overload

from ckpt import _ckpt
from ckpt._runtime import exit as _exit
from ckpt._state import own as _own
from ckpt._runtime.gc import collect_now, collector_paused
from ckpt._sharded.dtensor import local_tensor
from ckpt._state.tree import flatten

if TYPE_CHECKING:
    from torch import Tensor
    from torch import device as Device
    from torch.nn import Module
    from torch.optim import Optimizer
    from torch.utils.hooks import RemovableHandle

    from ckpt._save.repeat import PlannedExporter
    from ckpt._device.cuda import SlabPool


class Owner(Protocol):
    """What readying a first save reads of its checkpointer (a
    :class:`ckpt.Checkpointer`, which this module does not import: it sits
    below it). The two it writes: the hooks' remover and the staging thread."""

    _ahead_hooks_off: Callable[[], None]
    _readying: Optional[threading.Thread]

    @property
    def _native(self) -> _ckpt.Checkpointer: ...
    @property
    def _read_only(self) -> bool: ...
    @property
    def _closed(self) -> bool: ...
    @property
    def _rng(self) -> bool: ...
    @property
    def _staging_budget(self) -> Optional[int]: ...
    @property
    def _pool_of(self) -> Optional[object]: ...
    @property
    def lazy(self) -> bool: ...
    @overload
    def _pool(self, create: Literal[True]) -> SlabPool: ...
    @overload
    def _pool(self, create: bool) -> Optional[SlabPool]: ...
    def _exporter(self) -> Optional[PlannedExporter]: ...
    def _entries(self, state: Optional[Mapping[str, object]], named: Dict[str, object]) -> Dict[str, object]: ...
    def _own_identity(self) -> Tuple[int, int]: ...

__all__ = [
    "reserve", "after_restore", "rehearse", "hooks_off", "nothing", "cuda_ready", "cuda_device_in",
    "for_budget", "for_state", "cuda_bytes", "optimizers_in", "after_first_step", "state_lens",
]


def reserve(cp: Owner, state: Optional[Mapping[str, object]], named: Dict[str, object]) -> None:
    """A fresh start of a job with torch state: ready its first save. With
    CUDA state, its slab is mapped and page-locked in the background: half
    the ``staging_budget`` now, else the state's CUDA bytes once its
    optimizers have stepped. Then (CPU state too) the state is walked once
    (:func:`rehearse`); CPU state also at once, its staging memory readied
    during the first steps."""
    if cp._read_only or cp._pool_of is not None or "torch" not in sys.modules:
        return
    objs = [state, *named.values()]
    device = cuda_device_in(objs) if cuda_ready() else None
    if device is not None and cp._staging_budget is not None:
        cp._pool(True).reserve(for_budget(cp._staging_budget), device)
    optimizers = optimizers_in(objs)
    if device is None and optimizers:
        # CPU state: its staging memory is faulted in from now on, during
        # the first steps, the optimizers' state to come included (by its
        # kind's rule, :func:`state_lens`): readied only after the first
        # step, it was still being faulted in when a save came right after
        # it, which then faulted the rest itself (a first eager stall of
        # 150-500 ms for GPT-2's 166 MiB, against 10 ms later).
        rehearse(cp, state, named, also=state_lens(optimizers))

    def ready(cp: Owner) -> None:
        if device is not None and cp._staging_budget is None:
            try:
                nbytes, count = cuda_bytes(objs, device)
                cp._pool(True).reserve(for_state(nbytes, count), device)
            except Exception as e:  # noqa: BLE001 - in the training's step: only the first save's stall is at stake
                warnings.warn(f"ckpt: no memory locked ahead of the first save ({type(e).__name__}: {e}); "
                              "it locks its own", RuntimeWarning, stacklevel=2)
        rehearse(cp, state, named)

    _when_stepped(cp, objs, ready)


def after_restore(cp: Owner, state: Optional[Mapping[str, object]], named: Dict[str, object]) -> None:
    """After a restore of torch state: the restored state is the first
    save's, walked once (:func:`rehearse`), also by a checkpointer that saves
    through another's pool (the memory tier's: the plans are the pool's).
    CUDA state at once, where the restore's slab is laid out for the first
    save; CPU state after the optimizers' next step, out of the restore (a
    restart's time to its first step is not lengthened)."""
    if cp._read_only or "torch" not in sys.modules:
        return
    objs = [state, *named.values()]
    if cuda_ready() and cuda_device_in(objs) is not None:
        rehearse(cp, state, named)
        return
    _when_stepped(cp, objs, lambda cp: rehearse(cp, state, named))


def hooks_off(cp: Owner) -> None:
    """Take off the step post-hooks that ready ``cp``'s first save (fired or
    not: a hook never removes itself, see :func:`after_first_step`)."""
    off, cp._ahead_hooks_off = cp._ahead_hooks_off, nothing
    off()


def nothing() -> None:
    """What removes no hooks (a checkpointer's ``_ahead_hooks_off`` with none on)."""


def _when_stepped(cp: Owner, objs: List[object], ready: Callable[[Owner], None]) -> None:
    """Call ``ready`` with ``cp`` once every optimizer among ``objs`` has
    stepped (at once where there is none), unless ``cp`` was closed or
    collected meanwhile (the hooks hold it weakly)."""
    me = weakref.ref(cp)

    def fire() -> None:
        live = me()
        if live is not None and not live._closed:
            ready(live)

    optimizers = optimizers_in(objs)
    hooks_off(cp)  # (an earlier start's: the first save is readied once)
    if optimizers:
        cp._ahead_hooks_off = after_first_step(optimizers, fire)
    else:
        fire()


def rehearse(cp: Owner, state: Optional[Mapping[str, object]], named: Dict[str, object], also: Sequence[int] = ()) -> None:
    """Walk the state as a save would, saving nothing, so that the first
    save is like a loop's later ones: it takes its mappings in bulk
    (:mod:`ckpt._save.repeat`; the plans are made on the pool's thread) into a
    slab already laid out for it (:meth:`ckpt._device.slabs.SlabPool.lay_out_ahead`),
    and finds the staging memory for its CPU tensors' copies mapped (by a
    thread of its own, :func:`_ready_staging`): without it, a first save's
    stall is mostly the walk without plans and, on the CPU, page faults
    (docs/perf.md, "Save: the stall"). Called where the state is whole,
    out of any save: after a restore, and after a fresh start's first
    optimizer steps. Then, with CUDA state, a full collection of the garbage
    collector, which the new plans could otherwise bring due inside the first
    save (:func:`ckpt._runtime.gc.collect_now`; costly with torch loaded, so not
    for CPU state, whose first save made as many plans before). ``also``:
    the byte lengths of CPU tensors the first save copies that do not exist
    yet, readied with the others. Best effort: the save itself reports what
    is wrong."""
    exporter = cp._exporter()
    if exporter is None:
        return
    pool = cp._pool(cuda_ready())
    if pool is not None:
        pool.forget_layout()  # (a walk ahead takes no slab)
    cuda = True
    try:
        lens, host = _walk(cp, exporter, state, named)
        cuda = exporter.device is not None
        exporter.make_plans()
        if lens and pool is not None:
            pool.lay_out_ahead(lens)
        if (host or also) and cp._pool_of is None:
            _ready_staging(cp, host, also)
    except Exception as e:  # noqa: BLE001 - in a restore's return or a training step: only a stall is at stake
        warnings.warn(f"ckpt: the first save could not be readied ({type(e).__name__}: {e}); it walks "
                      "the state itself", RuntimeWarning, stacklevel=2)
    if cuda:
        collect_now()


def _walk(
    cp: Owner, exporter: PlannedExporter, state: Optional[Mapping[str, object]], named: Dict[str, object]
) -> Tuple[List[int], List[_ckpt.TensorSpec]]:
    """:func:`rehearse`'s walk, as a save walks (the RNG state too); the slot
    lengths of its CUDA tensors and the specs of its CPU tensors, or none
    where it failed (the first save walks, and raises what this met).
    Nothing is queued: its device copies are let go (buffers' clones are
    dropped)."""
    try:
        with collector_paused():
            entries = cp._entries(state, named)
            local = _own.local(entries, cp._rng)
            flat = flatten(entries, cp.lazy, exporter, local, _own.name(cp._own_identity()[0]))
        if exporter.device is None:
            return [], flat.tensors
        from ckpt._device.cuda import Pending

        host = [t for t in flat.tensors if not isinstance(t.data, (Pending, _ckpt.SlabSlot))]
        return exporter.device.lens(), host
    except Exception:  # noqa: BLE001 - see above
        exporter.later = []
        return [], []
    finally:
        if exporter.device is not None:
            exporter.device.abandon()


def _ready_staging(cp: Owner, specs: List[_ckpt.TensorSpec], also: Sequence[int] = ()) -> None:
    """Map and fault in the staging memory the first save copies these
    specs' CPU tensors into (each memory span once, as the engine stages
    them) and buffers of the lengths ``also``, on a thread of its own (it
    takes about as long as that copy would; with the GIL released), after
    the one an earlier call started (so that the two do not ready the same
    buffers twice); ``cp._readying`` while it runs."""
    native = cp._native
    before = cp._readying
    lens = list(also)

    def run() -> None:
        if before is not None:
            before.join()
        try:
            native.ready_staging(specs, lens)
        except Exception as e:  # noqa: BLE001 - best effort: the save maps its own
            warnings.warn(f"ckpt: no staging memory readied for the first save ({type(e).__name__}: {e})",
                          RuntimeWarning, stacklevel=2)

    t = threading.Thread(target=run, name="ckpt-ready-staging", daemon=True)
    cp._readying = t
    t.start()
    _exit.track_thread(t)  # joined at exit: it holds tensors (see ckpt._runtime.exit)


def cuda_ready() -> bool:
    """True when the device in use is ready (so device tensors can occur):
    for CUDA, once torch has initialised it (:class:`ckpt._device.device.CudaDevice`).
    Without torch imported, False (nothing imports it here)."""
    if "torch" not in sys.modules:
        return False
    from ckpt._device.device import current

    return current().ready()


def cuda_device_in(objs: Sequence[object], depth: int = 3) -> Optional[Device]:
    """The device of the first CUDA tensor met in ``objs`` (tensors, modules,
    optimizers, mappings and sequences of them), or None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    tensor, module, optimizer = _classes(torch)
    for obj in objs:
        inner: Sequence[object]
        if isinstance(obj, tensor):
            if obj.is_cuda:
                return obj.device
            continue
        if isinstance(obj, module):
            inner, below = [*obj.parameters(), *obj.buffers()], 0
        elif isinstance(obj, optimizer):
            inner, below = [p for g in obj.param_groups for p in g["params"]], 0
        elif depth > 0 and isinstance(obj, (Mapping, list, tuple)):
            inner, below = list(obj.values() if isinstance(obj, Mapping) else obj), depth - 1
        else:
            continue
        found = cuda_device_in(inner, below)
        if found is not None:
            return found
    return None


def for_budget(budget: int) -> int:
    """Bytes a fresh start reserves out of a ``staging_budget`` set to twice
    the state: half of it and room for the slab's alignment, which puts each
    tensor of 1 MiB or more on a page of its own (a page per tensor: a small
    fraction of a large state). Exactly half would leave the first save
    without room, mapping and locking its slab in its stall; the reservation
    stays within the budget."""
    half = budget // 2
    return min(budget, half + max(half // 64, 4 << 20))


def for_state(nbytes: int, count: int) -> int:
    """Bytes to reserve for ``count`` tensors of ``nbytes`` in all: the bytes
    and room for the alignment (a page per tensor at most), within the
    default budget of twice the state."""
    return nbytes + min(nbytes, max(nbytes // 64, 4096 * (count + 16)))


def _classes(torch: ModuleType) -> Tuple[Type[Tensor], Type[Module], Type[Optimizer]]:
    """torch's tensor, module and optimizer classes (torch is imported)."""
    return torch.Tensor, torch.nn.Module, torch.optim.Optimizer


def _items(obj: object) -> Optional[Iterable[object]]:
    """A mapping's values, a list's or tuple's items; None for anything else."""
    if isinstance(obj, Mapping):
        return obj.values()
    if isinstance(obj, (list, tuple)):
        return obj
    return None


def cuda_bytes(objs: Sequence[object], device: Device, depth: int = 6) -> Tuple[int, int]:
    """``(bytes, count)`` of the distinct tensors on ``device`` in ``objs``:
    modules' parameters and buffers, optimizers' state, tensors (a DTensor's
    local shard), mappings and sequences of them, and what any other object's
    ``state_dict()`` holds."""
    tensor, module, optimizer = _classes(sys.modules["torch"])
    seen: Set[Tuple[int, int]] = set()
    total = 0

    def add(t: Tensor) -> None:
        nonlocal total
        t = local_tensor(t)
        if not isinstance(t, tensor) or t.device != device:
            return
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes

    def visit(obj: object, depth: int) -> None:
        if isinstance(obj, tensor):
            add(obj)
        elif isinstance(obj, module):
            for t in obj.parameters():
                add(t)
            for b in obj.buffers():
                add(b)
        elif isinstance(obj, optimizer):
            for state in obj.state.values():
                visit(state, 1)
        elif depth > 0:
            inner = _items(obj)
            state_dict = getattr(obj, "state_dict", None) if inner is None else None
            if callable(state_dict):
                inner = [state_dict()]
            for v in inner or ():
                visit(v, depth - 1)

    for obj in objs:
        visit(obj, depth)
    return total, len(seen)


def optimizers_in(objs: Sequence[object], depth: int = 3) -> List[Optimizer]:
    """The optimizers among ``objs``: themselves, in mappings and sequences,
    and those other objects with a ``state_dict`` hold as a save's lazy mode
    finds them (DCP's ``AppState``: ``ckpt._state.tensors._held``)."""
    tensor, module, optimizer = _classes(sys.modules["torch"])
    from ckpt._state.tensors import _held

    found: List[Optimizer] = []

    def visit(obj: object, depth: int) -> None:
        if isinstance(obj, optimizer):
            if all(o is not obj for o in found):
                found.append(obj)
        elif not isinstance(obj, (tensor, module)) and depth > 0:
            inner = _items(obj)
            if inner is None and callable(getattr(obj, "state_dict", None)):
                inner = _held(obj)[1]
            for v in inner or ():
                visit(v, depth - 1)

    for obj in objs:
        visit(obj, depth)
    return found


def after_first_step(optimizers: List[Optimizer], then: Callable[[], None]) -> Callable[[], None]:
    """Call ``then`` once, when every one of ``optimizers`` has stepped (a
    step post-hook each); returns what removes the hooks.

    A hook does not remove itself: it runs while the optimizer iterates over
    its post-hooks, and removing one then failed the step (``RuntimeError:
    OrderedDict mutated during iteration``) wherever another post-hook came
    after it (a second checkpointer's, the user's). Once it has fired it does
    nothing; the checkpointer takes the hooks off at its next save or close."""
    handles: Dict[int, RemovableHandle] = {}
    waiting = {id(opt) for opt in optimizers}

    def remove() -> None:
        for h in handles.values():
            h.remove()
        handles.clear()

    def hook(opt: Optimizer, _args: object, _kwargs: object) -> None:
        if id(opt) not in waiting:
            return
        waiting.discard(id(opt))
        if not waiting:
            then()

    for opt in optimizers:
        handles[id(opt)] = opt.register_step_post_hook(hook)
    return remove


def state_lens(optimizers: List[Optimizer]) -> List[int]:
    """The byte lengths of the CPU tensors these optimizers' first step will
    create, for torch's own optimizers, whose state is known by kind: per
    parameter without state yet, that takes gradients, buffers shaped like
    it (Adam's two moments, SGD's momentum, ...) and scalar counters
    (``step``) of the default scalar type. Nothing for other optimizers, or
    parameters elsewhere: the walk after the first step readies the rest."""
    torch = sys.modules["torch"]
    optim = torch.optim
    scalar = 8 if torch.get_default_dtype() == torch.float64 else 4
    out: List[int] = []
    for opt in optimizers:
        for group in opt.param_groups:
            like, scalars = _slots(optim, opt, group)
            for p in group["params"]:
                if not p.requires_grad or p in opt.state or p.device.type != "cpu":
                    continue
                n = local_tensor(p).nbytes
                out.extend([n] * like)
                out.extend([scalar] * scalars)
    return out


def _slots(optim: ModuleType, opt: Optimizer, group: Mapping[str, Any]) -> Tuple[int, int]:
    """``(buffers shaped like a parameter, scalar counters)`` a torch
    optimizer's step creates per parameter, by its kind and this group's
    options; ``(0, 0)`` for a kind not known here."""
    if isinstance(opt, (optim.Adam, optim.AdamW)):
        return 2 + bool(group.get("amsgrad")), 1
    if isinstance(opt, optim.NAdam):
        return 2, 2  # step, mu_product
    if isinstance(opt, (optim.RAdam, optim.Adamax, optim.Adadelta)):
        return 2, 1
    if isinstance(opt, optim.SGD):
        return int(group.get("momentum", 0) != 0), 0
    if isinstance(opt, optim.RMSprop):
        return 1 + int(group.get("momentum", 0) > 0) + bool(group.get("centered")), 1
    if isinstance(opt, optim.Rprop):
        return 2, 1
    return 0, 0
