"""Host slabs for CUDA snapshots: host memory with a slot per tensor
(:class:`~ckpt._ckpt.HostSlab`), page-locked with the CUDA runtime, and the
pool (:class:`SlabPool`) that keeps a checkpointer's slabs under a budget and
reuses them by layout. :mod:`ckpt._device.cuda` copies into them.

- **Page locking.** A new slab is populated (its pages mapped, on several
  threads) and page-locked with the CUDA runtime (``cudaHostRegister``) before
  its first copies; in lazy mode all of that, and the queueing of the copies,
  runs on a background thread, so ``save`` returns at once and only the first
  optimizer step after a process's first save waits for it. Copies into
  locked memory are several times faster than into pageable memory; locking
  is much faster for pages already mapped, and the CUDA driver takes no
  other call from the process meanwhile (docs/perf.md, "CUDA"). So memory is
  locked ahead where it can be: a restore's slab while its read fills it by
  default (:class:`~ckpt._device.cuda.HostStage`, :meth:`SlabPool.lock_while_filled`;
  or after its copies, :meth:`SlabPool.lock_later`), and a fresh start
  reserves the first save's in the background
  (:meth:`SlabPool.reserve`, sized by :mod:`ckpt._save.ahead`). Both are locked
  in one piece, and the first save lays such memory out anew for its own
  tensors (:meth:`SlabPool.take`) instead of mapping and locking more.
- **Budget.** Slabs are reused by layout; the pool holds at most
  ``staging_budget`` bytes of them (default: twice the first save's slab,
  its CUDA bytes and their alignment, so a save can start while the previous
  one is still being written), and that is also the most host memory it
  locks. When every slab is still held
  by saves being written, ``busy="wait"`` waits and ``busy="skip"`` raises
  :class:`~ckpt.SkippedError`.
- **Threads.** The pool's launcher thread (locking, and the lazy copies
  :mod:`ckpt._device.cuda` queues there) runs each CUDA call with the tensors'
  device current (:func:`_on`): a thread starts on device 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ContextManager, Dict, List, Optional, Protocol, Tuple

import torch

from ckpt import _ckpt
from ckpt.errors import SkippedError

__all__ = ["SlabPool"]

#: The tensors a device stage's views are laid out for: dtype, shape and offset each.
_Layout = Tuple[Tuple[torch.dtype, Tuple[int, ...], int], ...]


class Filler(Protocol):
    """The copy that fills a slab (a :class:`ckpt._device.cuda.DeviceCopy`, which
    sits above this module): all a slab asks of it is whether it landed."""

    def landed(self) -> bool: ...


# ----------------------------------------------------------------- page locking


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
                          "device-to-host copies go through pageable memory", stacklevel=2)
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


_LOCKER: Optional[_Locker] = None


def _locker() -> _Locker:
    """The process's one :class:`_Locker` (one CUDA runtime per process)."""
    global _LOCKER
    if _LOCKER is None:
        _LOCKER = _Locker()
    return _LOCKER


def _on(device: Optional[torch.device]) -> ContextManager[object]:
    """``device`` current in this thread for the block (see the module docs:
    a thread of ckpt's own starts on device 0); nothing changes for None."""
    return contextlib.nullcontext() if device is None else torch.cuda.device(device)


# ----------------------------------------------------------------- slabs


class _Slab:
    """One :class:`~ckpt._ckpt.HostSlab`, its torch view and its state."""

    def __init__(self, lens: List[int]) -> None:
        #: How many layouts it had (what was made for its slots holds for one).
        self.layouts = 0
        self._lay_out(_ckpt.HostSlab(lens), lens)
        self.nbytes: int = self.native.nbytes
        self.host = (
            torch.frombuffer(self.native, dtype=torch.uint8) if self.nbytes else torch.empty(0, dtype=torch.uint8)
        )
        self.locked = False
        self.prepared = False
        #: Addresses of its page-locked pieces (see ``_pieces``).
        self.pieces: List[int] = []
        #: Its preparation in the background (:meth:`SlabPool.reserve`), until taken.
        self.preparing: Optional["Future[None]"] = None
        #: The copy that last filled it (the slab is free once it has landed).
        self.owner: Optional[Filler] = None

    def view(self, i: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
        """Slot ``i`` as a tensor of ``dtype`` and ``shape`` (cached: a loop saves the same shapes)."""
        key = (dtype, shape)
        hit = self._views.get(i)
        if hit is not None and hit[0] == key:
            return hit[1]
        off, n = self.slots[i]
        v = self.host[off : off + n].view(dtype).view(shape)
        self._views[i] = (key, v)
        return v

    def relaid(self, lens: List[int]) -> bool:
        """Lay the same memory out for ``lens`` (a slot each), if it has room
        and no save holds its bytes; its locked memory is kept."""
        native = self.native.relayout(lens)
        if native is None:
            return False
        # ``host`` views the same memory (and keeps the old layout's object alive).
        self._lay_out(native, lens)
        return True

    def _lay_out(self, native: _ckpt.HostSlab, lens: List[int]) -> None:
        self.layouts += 1
        self.native = native
        self.slots: List[Tuple[int, int]] = native.slots
        #: The slot lengths, in order (the layout a save must have to use it).
        self.lens: Tuple[int, ...] = tuple(lens)
        self._slot_objs: Optional[List[_ckpt.SlabSlot]] = None
        self._views: Dict[int, Tuple[Tuple[torch.dtype, Tuple[int, ...]], torch.Tensor]] = {}

    def slot_objs(self) -> List[_ckpt.SlabSlot]:
        """Every slot as handed to ``save`` (made once: a loop saves into the same slots)."""
        if self._slot_objs is None:
            self._slot_objs = self.native.slot_list(list(range(len(self.slots))))
        return self._slot_objs

    def free(self) -> bool:
        """Neither a save (the engine) nor copies still landing hold it."""
        if self.native.in_use():
            return False
        return self.owner is None or self.owner.landed()


class SlabPool:
    """The slabs of one checkpointer, under a byte budget (see the module docs)."""

    def __init__(self, budget: Optional[int], busy: str, device_staging: int = 0) -> None:
        self._budget = budget
        self._busy = busy
        #: Bytes of device memory a lazy save may snapshot into, per device.
        self.device_staging = device_staging
        #: Per device: the staging memory and the views of the last layout in it.
        self._stages: Dict[torch.device, torch.Tensor] = {}
        self._stage_views: Dict[torch.device, Tuple[_Layout, List[torch.Tensor]]] = {}
        self._slabs: List[_Slab] = []
        self._streams: Dict[torch.device, torch.cuda.Stream] = {}
        self._locked_addresses: List[int] = []
        self._launcher: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
        #: Notified on every release of a slab (a save let go of its bytes, a
        #: copy let its slab go, a slab dropped): what :meth:`take` waits on.
        self._freed = threading.Condition()
        # What each slab calls on its release: the pool held weakly (a slab
        # must not keep its pool alive, see the finalizer below).
        me = weakref.ref(self)

        def on_release() -> None:
            pool = me()
            if pool is not None:
                pool.released()

        self._on_release = on_release
        #: Most bytes page-locked at once.
        self.peak_locked = 0
        #: The slot lengths of the last save (see :meth:`guess`).
        self._layout: Optional[Tuple[int, ...]] = None
        #: What the walk made of each mapping of tensors, by path (:mod:`ckpt._save.repeat`).
        self.plans: Dict[str, Any] = {}
        #: How each restore's slab came to be page-locked (:class:`HostStage`):
        #: "held" (locked already: by a save, or by an earlier attempt of the
        #: same restore), "during" the read, "later" (in the background once
        #: its copies landed), "after" it, "pageable" (the runtime refused),
        #: or "unlocked" (a read-only reader's, locked "later": never).
        self.restore_locks: List[str] = []
        # Unlocks what is left when the pool is collected (a checkpointer never
        # closed); it must not hold the pool itself, or the pool lives forever.
        weakref.finalize(self, SlabPool._unlock_all, self._locked_addresses)

    # -- what the copies use

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """This pool's side stream on ``device``."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def device_stage(self, device: torch.device, srcs: List[torch.Tensor]) -> Tuple[List[int], List[torch.Tensor]]:
        """Which of ``srcs`` (tensors of ``device``, by index) a lazy save
        snapshots into this pool's device memory, and a view of that memory
        for each: in order, while they fit in ``device_staging`` bytes (at
        256-byte offsets). The memory is allocated on the side stream, which
        alone uses it (its copies are ordered there), and kept."""
        cap = self.device_staging
        if cap <= 0:
            return [], []
        picked: List[int] = []
        offsets: List[int] = []
        end = 0
        for i, t in enumerate(srcs):
            at = (end + 255) & ~255
            if at + t.nbytes > cap:
                continue
            picked.append(i)
            offsets.append(at)
            end = at + t.nbytes
        if not picked:
            return [], []
        layout: _Layout = tuple((srcs[i].dtype, tuple(srcs[i].shape), at) for i, at in zip(picked, offsets))
        hit = self._stage_views.get(device)
        if hit is not None and hit[0] == layout:
            return picked, hit[1]
        buf = self._stages.get(device)
        if buf is None or buf.numel() < end:
            self._stages.pop(device, None)
            try:
                buf = self._new_stage(device, end)
            except RuntimeError as e:  # torch.cuda.OutOfMemoryError among them
                # No room on the device: this pool copies straight to the host.
                self.device_staging = 0
                warnings.warn(f"ckpt: no device memory for device_staging ({end} bytes: {e}); "
                              "lazy saves copy straight to the host", stacklevel=2)
                return [], []
            self._stages[device] = buf
        views = [
            buf[at : at + srcs[i].nbytes].view(srcs[i].dtype).view(srcs[i].shape) for i, at in zip(picked, offsets)
        ]
        self._stage_views[device] = (layout, views)
        return picked, views

    def _new_stage(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """Device memory for staged copies, allocated on the side stream."""
        with torch.cuda.stream(self.stream(device)):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def launcher(self) -> ThreadPoolExecutor:
        """The thread that prepares slabs and queues lazy saves' copies."""
        if self._launcher is None:
            self._launcher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-d2h")
        return self._launcher

    def drain(self) -> None:
        """Wait for what the launcher thread was given so far."""
        if self._launcher is not None:
            self._launcher.submit(lambda: None).result()

    # -- slabs

    def guess(self, lazy: bool = False) -> Optional[_Slab]:
        """A free, prepared slab with the last save's layout, or None. A loop
        saves the same tensors each time, so a save can hand the engine this
        slab's slots while it walks the state, and an eager one can start its
        copies then, before the walk knows every length (:class:`DeviceCopy`).
        A ``lazy`` save may also have a slab still being prepared in the
        background (memory locked ahead, see :meth:`take`)."""
        if self._layout is None:
            return None
        for s in self._slabs:
            if s.lens != self._layout or not s.free():
                continue
            if s.prepared and (s.preparing is None or s.preparing.done()):
                return s
            if lazy and s.preparing is not None:
                return s
        return None

    def forget_layout(self) -> None:
        """No slab is guessed until the next save takes one (a walk ahead of a
        save must not queue copies into a slab)."""
        self._layout = None

    def lay_out_ahead(self, lens: List[int]) -> None:
        """The first save's slot lengths, known from a walk ahead of it
        (:func:`ckpt._save.ahead.rehearse`): a free slab locked (or being locked)
        in one piece, reserved or left by a restore, is laid out for them
        now, and that save guesses it (:meth:`guess`) as a loop's later saves
        guess theirs: its walk hands out the slots themselves."""
        want = tuple(lens)
        for s in self._slabs:
            if s.free() and len(s.pieces) <= 1 and (s.lens == want or s.relaid(lens)):
                self._layout = want
                self._first(s)
                s.slot_objs()  # (made once, now)
                return

    def take(self, lens: List[int], step: int, lazy: bool = False) -> _Slab:
        """A free slab with these slot lengths: reused, else new within the
        budget. An eager save waits for memory being locked ahead (its copies
        start on this thread); a ``lazy`` one takes it as it is: its copies
        are queued on the launcher thread after that memory's preparation
        (:meth:`prepare` on the same thread, see :meth:`reserve`), so a save
        that comes just after the optimizer's first step does not stall for
        the locking."""
        self._layout = tuple(lens)
        self._settle(wait=not lazy)
        new: Optional[_Slab] = None
        while True:
            for s in self._slabs:
                if s.native.fits(lens) and s.free():
                    return self._first(s)
            # Memory mapped and locked already, in one piece (reserved ahead, or
            # left by a restore), laid out anew for this save.
            for s in self._slabs:
                if s.free() and len(s.pieces) <= 1 and s.relaid(lens):
                    return self._first(s)
            # Room for a new one: first drop free slabs of other layouts.
            for s in [s for s in self._slabs if s.free() and not s.native.fits(lens)]:
                self._drop(s)
            if new is None:
                # Its bytes with the slots' alignment (mapped, not yet touched).
                new = self._watched(_Slab(lens))
            if self._budget is None:
                self._budget = 2 * new.nbytes
            held = sum(s.nbytes for s in self._slabs)
            if held + new.nbytes <= self._budget or not self._slabs:
                self._slabs.append(new)
                return new
            if self._busy == "skip":
                raise SkippedError(
                    f"step {step} skipped: the snapshot memory ({held} of {self._budget} bytes) is held by "
                    "saves still being written"
                )
            with self._freed:
                # Checked under the lock a release notifies with: none is missed.
                if not any(s.free() for s in self._slabs):
                    self._freed.wait(_UNANNOUNCED)

    def released(self) -> None:
        """A slab may be free now: wake the saves waiting for one (:meth:`take`)."""
        with self._freed:
            self._freed.notify_all()

    def _watched(self, slab: _Slab) -> _Slab:
        """``slab``, which calls :meth:`released` when a save lets go of its bytes."""
        slab.native.on_release(self._on_release)  # (a relayout keeps it)
        return slab

    def _first(self, slab: _Slab) -> _Slab:
        """``slab``, the default budget set from it if this is the first save
        (twice its slab: a reservation or a restore's slab is a little larger
        than the save's tensors, and a second slab must fit beside it)."""
        if self._budget is None:
            self._budget = 2 * slab.nbytes
        return slab

    def borrow(self, lens: List[int]) -> Tuple[_Slab, List[int]]:
        """A free slab with room for ``lens`` (a locked one first) and the
        offset of each in it. A restore uses what a save left free (already
        locked) instead of mapping and locking anew: a slab of the same layout
        by its own slots, else one not locked in several pieces, packed at
        64-byte alignment (a copy must lie within one locked piece, see
        ``_pieces``; a restore locks a new slab in one piece during its read).
        Else a new slab of this layout, with room to spare (:func:`_spare`)
        for the first save to lay it out anew."""
        offsets, end = [], 0
        for n in lens:
            end = (end + 63) & ~63
            offsets.append(end)
            end += n
        want = tuple(lens)
        self._settle()
        free = [s for s in self._slabs if s.free() and s.nbytes >= end]
        free.sort(key=lambda s: (not s.locked, s.nbytes))
        for s in free:
            if s.lens == want:
                return s, [off for off, _ in s.slots]
            if len(s.pieces) <= 1:
                return s, offsets
        s = self.take([*lens, _spare(lens)], -1)
        return s, [off for off, _ in s.slots[: len(lens)]]

    def reserve(self, nbytes: int, device: Optional[torch.device]) -> None:
        """Map and page-lock ``nbytes`` of slab memory now, in the background
        and in one piece, for the first save: it takes them whatever its
        layout (see :meth:`take`), so it does not map and lock in its stall.
        Only into an empty pool (a job's start)."""
        if nbytes <= 0 or self._slabs:
            return
        slab = self._watched(_Slab([nbytes]))
        self._slabs.append(slab)
        self.lock_later(slab, device)

    def lock_later(self, slab: _Slab, device: Optional[torch.device]) -> bool:
        """Page-lock ``slab`` in the background, in one piece, on the launcher
        thread: a reservation (:meth:`reserve`), or a restore's new slab once
        its copies have landed (:class:`~ckpt._device.hoststage.HostStage`), so that
        the job's first save finds it locked. Whether it was queued (not for
        a slab locked, or tried, already)."""
        if slab.locked or slab.prepared or slab.nbytes == 0 or slab.preparing is not None:
            return False
        slab.preparing = self.launcher().submit(self.prepare, slab, device, True)
        return True

    def _settle(self, wait: bool = True) -> None:
        """Wait for the reservations in flight (a save or restore takes their
        memory next); one that failed is dropped, unless a lazy save took it
        meanwhile (it stays, pageable, in use). Without ``wait``, only those
        already done are settled."""
        for s in list(self._slabs):
            fut = s.preparing
            if fut is None or not (wait or fut.done()):
                continue
            s.preparing = None
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - no memory to be had: the save maps its own
                if s.free():
                    self._drop(s)

    def prepare(self, slab: _Slab, device: Optional[torch.device], whole: bool = False) -> None:
        """Populate and page-lock a new slab (once), with ``device`` (the
        copies') current; a slab that cannot be locked stays pageable, and
        copies into it block until done. ``whole``: in one piece, outside a
        training loop (a reservation, a restore), so that a save of other
        shapes can lay it out anew; else piece by piece (see ``_pieces``)."""
        if slab.locked or slab.prepared or slab.nbytes == 0:
            return
        slab.prepared = True  # tried once: a slab the runtime will not lock stays pageable
        slab.native.populate()
        with _on(device):
            self._lock_slab(slab, [(0, slab.nbytes)] if whole else _pieces(slab))

    def lock_while_filled(self, slab: _Slab, device: Optional[torch.device]) -> None:
        """Page-lock a new slab in one piece, on the launcher thread, while
        another thread fills it (a restore's read). Its pages are mapped first
        on several threads by the kernel's advice alone, which changes no byte
        the read wrote (:meth:`_populate_beside_read`; where the kernel lacks
        the advice, the runtime maps what the read has not reached): the
        runtime then pins pages already there, as after a read, not fresh
        ones one by one, which made this way slower than locking after the
        read. Quiet
        when the runtime refuses (pages it cannot pin while the read holds
        them): :meth:`prepare` after the read tries again."""
        if slab.locked or slab.prepared or slab.nbytes == 0 or slab.preparing is not None:
            return
        slab.preparing = self.launcher().submit(self._lock_quietly, slab, device)

    def _lock_quietly(self, slab: _Slab, device: Optional[torch.device]) -> None:
        self._populate_beside_read(slab)
        with _on(device):
            self._lock_slab(slab, [(0, slab.nbytes)], quiet=True)
        slab.prepared = slab.locked  # else tried again after the read

    @staticmethod
    def _populate_beside_read(slab: _Slab) -> bool:
        """Map a slab's pages while a read writes into it; whether all were."""
        return slab.native.populate_beside_writes()

    def settle(self, slab: _Slab) -> None:
        """Wait for ``slab``'s preparation in the background, if any."""
        fut, slab.preparing = slab.preparing, None
        if fut is not None:
            fut.result()

    def _lock_slab(self, slab: _Slab, pieces: List[Tuple[int, int]], quiet: bool = False) -> None:
        # In a training loop, piece by piece: the driver takes no other call of
        # the process while it locks, so the training's launches get in between.
        locker = _locker()
        done: List[int] = []
        for at, n in pieces:
            if not locker.lock(slab.native.address + at, n, quiet):
                for a in done:
                    locker.unlock(a)
                return
            done.append(slab.native.address + at)
        with self._lock:
            slab.locked = True
            slab.pieces = done
            self._locked_addresses.extend(done)
            self.peak_locked = max(self.peak_locked, self.locked_bytes())

    def locked_bytes(self) -> int:
        """Bytes page-locked now."""
        return sum(s.nbytes for s in self._slabs if s.locked)

    def held_bytes(self) -> int:
        """Bytes of all slabs, free or held."""
        return sum(s.nbytes for s in self._slabs)

    def close(self) -> None:
        """Unlock and free every free slab (after the saves are done)."""
        if self._launcher is not None:
            self._launcher.shutdown(wait=True)
        self._launcher = None
        for s in [s for s in self._slabs if s.free()]:
            self._drop(s)

    def _drop(self, s: _Slab) -> None:
        if s.preparing is not None:
            try:
                s.preparing.result()  # not unlocked while it is being locked
            except Exception:  # noqa: BLE001 - dropped anyway
                pass
            s.preparing = None
        if s.locked:
            for a in s.pieces:
                _locker().unlock(a)
            with self._lock:
                for a in s.pieces:
                    self._locked_addresses.remove(a)
            s.locked, s.pieces = False, []
        self._slabs.remove(s)
        self.released()  # (its bytes leave the budget)

    @staticmethod
    def _unlock_all(addresses: List[int]) -> None:
        for a in list(addresses):
            _locker().unlock(a)
        addresses.clear()


def _spare(lens: List[int]) -> int:
    """Room a restore's slab keeps past its tensors, so that the first save
    fits in it laid out anew: a save may hold tensors a restore does not fill
    through the slab (a fused optimizer's step counters on the device, empty
    tensors), and each may move the large slot after it to the next page."""
    return 4096 * (len(lens) + 16)


#: Bytes page-locked per call, about (4 GiB took 0.135 s in one call).
#: The longest :meth:`SlabPool.take` waits without a notice, for a release none
#: announces: copies that land on the device with no save left to read them.
_UNANNOUNCED = 0.05

_LOCK_PIECE = 256 << 20


def _pieces(slab: _Slab) -> List[Tuple[int, int]]:
    """``(offset, length)`` of the pieces a slab is locked in: each ends where a
    slot's page begins where no earlier slot reaches into that page (large
    slots start ``STAGING_LEAD`` bytes into a fresh page), so no page is in
    two pieces, and every slot lies in one piece, which a copy into it
    needs)."""
    out: List[Tuple[int, int]] = []
    start = reached = 0
    for off, n in slab.slots:
        page = off - (off % 4096)
        if page >= reached and page - start >= _LOCK_PIECE:
            out.append((start, page - start))
            start = page
        reached = max(reached, off + n)
    if slab.nbytes > start:
        out.append((start, slab.nbytes - start))
    return out
