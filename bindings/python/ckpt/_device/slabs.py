"""Host slabs for CUDA snapshots: host memory with a slot per tensor
(:class:`~ckpt._ckpt.HostSlab`), page-locked with the CUDA runtime, and the
pool (:class:`SlabPool`) that keeps a checkpointer's slabs and reuses them by
layout. :mod:`ckpt._device.cuda` copies into them.

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
- **Budget.** A checkpointer's slab holds its size of the engine's staging
  budget from ``Checkpointer.new_slab`` until the save using it lets its last
  bytes go, and again from ``Checkpointer.charge_slab`` when a save reuses
  it; beside the CPU tensors' staging buffers: one ``staging_budget`` bounds
  both in use (a free slab holds none, so a CPU save never waits for it). When a new slab does not fit and none is free for reuse,
  ``busy="wait"`` blocks in the engine (woken when memory comes back or a
  slab comes free) and ``busy="skip"`` raises :class:`~ckpt.SkippedError`.
  A pool without a checkpointer (a reader's) has no budget.
- **Threads.** The pool's launcher thread (locking, and the lazy copies
  :mod:`ckpt._device.cuda` queues there) runs each CUDA call with the tensors'
  device current (:meth:`~ckpt._device.device.Device.on`): a thread starts on device 0.
  Page locking and streams are the device's (:mod:`ckpt._device.device`).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch

from ckpt import _ckpt
from ckpt._device.device import Stream, current
from ckpt.errors import SkippedError

__all__ = ["SlabPool"]

#: The tensors a device stage's views are laid out for: dtype, shape and offset each.
_Layout = Tuple[Tuple[torch.dtype, Tuple[int, ...], int], ...]


class Filler(Protocol):
    """The copy that fills a slab (a :class:`ckpt._device.cuda.DeviceCopy`, which
    sits above this module): all a slab asks of it is whether it landed."""

    def landed(self) -> bool: ...


# ----------------------------------------------------------------- slabs


class _Slab:
    """One :class:`~ckpt._ckpt.HostSlab` (``native``, else a new uncharged
    one), its torch view and its state."""

    def __init__(self, lens: List[int], native: Optional[_ckpt.HostSlab] = None) -> None:
        #: How many layouts it had (what was made for its slots holds for one).
        self.layouts = 0
        self._lay_out(_ckpt.HostSlab(lens) if native is None else native, lens)
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
    """The slabs of one checkpointer, charged to its staging budget
    (``staging``; see the module docs)."""

    def __init__(self, staging: Optional[_ckpt.Checkpointer] = None, device_staging: int = 0) -> None:
        self._staging = staging
        #: Bytes of device memory a lazy save may snapshot into, per device.
        self.device_staging = device_staging
        #: Per device: the staging memory and the views of the last layout in it.
        self._stages: Dict[torch.device, torch.Tensor] = {}
        self._stage_views: Dict[torch.device, Tuple[_Layout, List[torch.Tensor]]] = {}
        self._slabs: List[_Slab] = []
        self._streams: Dict[torch.device, Stream] = {}
        self._locked_addresses: List[int] = []
        self._launcher: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()
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

    def stream(self, device: torch.device) -> Stream:
        """This pool's side stream on ``device``."""
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = current().new_stream(device)
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
        with current().on_stream(self.stream(device)):
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
                s.slot_objs()  # (made once, now)
                return

    def take(self, lens: List[int], step: int, lazy: bool = False) -> _Slab:
        """A free slab with these slot lengths: reused, else new within the
        staging budget (see the module docs). An eager save waits for memory being locked ahead (its copies
        start on this thread); a ``lazy`` one takes it as it is: its copies
        are queued on the launcher thread after that memory's preparation
        (:meth:`prepare` on the same thread, see :meth:`reserve`), so a save
        that comes just after the optimizer's first step does not stall for
        the locking."""
        self._layout = tuple(lens)
        self._settle(wait=not lazy)
        while True:
            # Read before looking: a slab let go after it ends the wait below.
            since = self._returns()
            reuse = next((s for s in self._slabs if s.native.fits(lens) and s.free()), None)
            if reuse is None:
                # Memory mapped and locked already, in one piece (reserved ahead, or
                # left by a restore), laid out anew for this save.
                reuse = next((s for s in self._slabs if s.free() and len(s.pieces) <= 1 and s.relaid(lens)), None)
            if reuse is not None:
                if self._charged(reuse, step, since):
                    return reuse
                continue
            # Room for a new one: first drop free slabs of other layouts.
            for s in [s for s in self._slabs if s.free() and not s.native.fits(lens)]:
                self._drop(s)
            # Copies landing with no save to announce them: look again soon.
            pending = any(not s.native.in_use() and not s.free() for s in self._slabs)
            new = self._new(lens, step, since, _UNANNOUNCED if pending else None)
            if new is not None:
                # Woken by a slab a save let go of (its budget came back):
                # reuse that one, mapped and locked already, not the new one.
                again = next((s for s in self._slabs if s.native.fits(lens) and s.free()), None)
                if again is None:
                    self._slabs.append(new)
                    return new
                new.native.discharge()
                if self._charged(again, step, self._returns()):
                    return again

    def charge(self, slab: _Slab, step: int) -> None:
        """Charge a free slab to the staging budget again before a save uses
        it (a save's release gave its budget back), waiting for room or
        raising :class:`~ckpt.SkippedError` as the busy policy says."""
        while not self._charged(slab, step, self._returns()):
            pass

    def _charged(self, slab: _Slab, step: int, since: int) -> bool:
        """Whether ``slab`` holds its budget, charging it if not; False when
        memory came back after ``since`` without room (look again)."""
        if self._staging is None or slab.native.charged:
            return True
        pending = any(not s.native.in_use() and not s.free() for s in self._slabs)
        return self._staging.charge_slab(slab.native, max(step, 0), since, _UNANNOUNCED if pending else None)

    def _returns(self) -> int:
        return 0 if self._staging is None else self._staging.staging_returns()

    def _new(self, lens: List[int], step: int, since: int, timeout: Optional[float] = None) -> Optional[_Slab]:
        """A new slab for ``lens`` (mapped, not yet touched), charged to the
        budget; None when memory came back after ``since`` without room, or
        after ``timeout`` seconds."""
        if self._staging is None:
            return _Slab(lens)
        native = self._staging.new_slab(lens, max(step, 0), since, timeout)
        return None if native is None else _Slab(lens, native)

    def released(self) -> None:
        """A slab may be free now, unannounced: wake the saves waiting for memory."""
        if self._staging is not None:
            self._staging.staging_nudge()

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
        try:
            slab = self._new([nbytes], 0, _NEVER)  # (never waits)
        except SkippedError:
            return
        if slab is None:
            return
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
        with current().on(device):
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
        with current().on(device):
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
        locker = current()
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
                current().unlock(a)
            with self._lock:
                for a in s.pieces:
                    self._locked_addresses.remove(a)
            s.locked, s.pieces = False, []
        self._slabs.remove(s)
        s.native.discharge()  # (its bytes leave the budget)

    @staticmethod
    def _unlock_all(addresses: List[int]) -> None:
        for a in list(addresses):
            current().unlock(a)
        addresses.clear()


def _spare(lens: List[int]) -> int:
    """Room a restore's slab keeps past its tensors, so that the first save
    fits in it laid out anew: a save may hold tensors a restore does not fill
    through the slab (a fused optimizer's step counters on the device, empty
    tensors), and each may move the large slot after it to the next page."""
    return 4096 * (len(lens) + 16)


#: Bytes page-locked per call, about (4 GiB took 0.135 s in one call).
#: How long :meth:`SlabPool.take` sleeps between looks for a release none
#: announces: copies that land on the device with no save left to read them.
_UNANNOUNCED = 0.05
#: A ``since`` no reading matches: ``new_slab`` does not wait.
_NEVER = 2**64 - 1

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
