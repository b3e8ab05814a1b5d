"""CUDA snapshots: device-to-host copies into page-locked host slabs, queued on
a side stream, saved without a second host copy.

A save's CUDA tensors are copied into one :class:`~ckpt._ckpt.HostSlab` (host
memory with a slot per tensor, laid out so the native format writes chunks
from it with ``O_DIRECT``), which the engine then takes as the tensors' bytes:
one trip over PCIe, no copy through the CPU. Streams, events and copies are
the device in use's (:func:`ckpt._device.device.current`).

- **Ordering.** The copies run on a side stream after an event recorded on
  the current stream at ``save``, so they see every kernel queued before it
  and overlap whatever the loop queues next (forward and backward). In lazy
  mode the optimizer's step pre-hook makes the current stream wait for the
  copies' event (:meth:`DeviceCopy.fence`): the host does not wait at all.
  Tensors that may change before the step (module buffers, loose tensors) are
  first cloned on the current stream, which orders the clone before the next
  forward; the clone is copied to the host like the rest.
- **Device staging.** With ``device_staging`` bytes, a lazy save first
  copies the tensors that fit into device memory the pool keeps (allocated
  once, on the side stream, which alone uses it), and the step pre-hook waits
  only for that copy (and for any tensors that did not fit, copied straight
  to the host); the staged bytes then go on to the host from there, on the
  side stream, while training goes on. Without it the step waits for the
  whole trip over PCIe, which can outlast forward and backward
  (docs/perf.md, "CUDA"). With everything staged, a new slab
  is populated and locked after the device copies are queued, so the first
  save's step does not wait for that either. A device without room for it
  warns, and its saves copy straight to the host from then on.
- **Slabs.** The host memory, its page locking and its budget are
  :mod:`ckpt._device.slabs`' (:class:`SlabPool`, one per checkpointer): a new
  slab is page-locked before its first copies, on a background thread in
  lazy mode, so that ``save`` returns at once; memory is locked ahead where
  it can be (a restore's read, a fresh start's first step).
- **Threads.** Every CUDA call of ckpt's own threads (the one that locks
  slabs and queues lazy copies, the engine's that wait for copies to land)
  runs with the tensors' device current: a thread starts on device 0, and a
  call there would create a CUDA context on GPU 0 for every rank of a node.
  Slabs are left out of forked children (``MADV_DONTFORK``).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Dict, List, Optional, Set, Tuple, Union

import torch

from ckpt import _ckpt
from ckpt._device.device import Event, Stream, current
from ckpt._device.hoststage import HostStage
from ckpt._device.slabs import SlabPool, _Slab

__all__ = ["SlabPool", "DeviceCopy", "Pending", "HostStage"]

# ----------------------------------------------------------------- one save


class Pending:
    """Stands for a CUDA tensor's bytes until the save's slab is chosen."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class DeviceCopy:
    """The device-to-host copies of one save's CUDA tensors.

    The walk of the state passes each tensor to :meth:`add`. When the pool has a free
    slab with the last save's layout (:meth:`SlabPool.guess`: a training loop
    saves the same tensors every time), each tensor gets that slab's slot at
    once, as long as its length matches the slot's, and an eager save queues
    the copies in batches while the walk goes on, so they overlap it. A
    tensor that does not match ends the guess: the copies queued so far are
    waited for, the slab is let go, and :meth:`start` lays out a slab from
    the lengths (the first save of a loop, or a changed state).
    """

    def __init__(self, pool: SlabPool, lazy: bool = True) -> None:
        self._pool = pool
        self._lazy = lazy
        self._srcs: List[torch.Tensor] = []
        #: The devices of ``_srcs`` (noted as they come: asking 1,000 tensors costs 0.1 ms of the stall).
        self._devices: Set[torch.device] = set()
        #: Index of the first tensor at each address (tied weights are copied once).
        self._seen: Dict[int, int] = {}
        self.slab: Optional[_Slab] = None
        self._start: Dict[torch.device, Event] = {}
        self._events: List[Tuple[torch.device, Event]] = []
        #: Lazy, with device staging: events after which the sources were read
        #: (the step may change them), before the staged copies to the host.
        self._read: List[Tuple[torch.device, Event]] = []
        self._launch: Optional[Future[None]] = None
        #: Lazy: done once ``_read`` (or ``_events``) is set, which ``fence`` needs.
        self._readable: Optional[Future[None]] = None
        self._launched = False
        self._fenced = False
        #: While the walk adds tensors, the slab is this save's even before
        #: copies are queued into it.
        self._open = True
        guess = pool.guess(lazy)
        if guess is not None:
            guess.owner = self
        self._guess = guess
        self._guess_slots = guess.slot_objs() if guess is not None else None
        self._guess_lens: Tuple[int, ...] = guess.lens if guess is not None else ()
        #: Eager saves into the guessed slab: indices not yet queued, by device.
        self._batch: Dict[torch.device, List[int]] = {}
        self._queued_early = 0

    def add(self, t: torch.Tensor, now: bool) -> Union[_ckpt.SlabSlot, Pending]:
        """Queue ``t`` (on a CUDA device); ``now``: it may change before the
        optimizer step, so the copy starts from a clone taken on the current
        stream. Returns what stands for its bytes: a slot of the guessed slab,
        or a :class:`Pending` until :meth:`start`."""
        if now:
            t = t.detach().clone()
        else:
            ptr = t.data_ptr()
            j = self._seen.get(ptr)
            if j is not None:
                u = self._srcs[j]
                if u.dtype == t.dtype and u.shape == t.shape and u.stride() == t.stride():
                    # The same memory again (a tied weight): one copy, one slot.
                    return self._guess_slots[j] if self._guess_slots is not None else Pending(j)
            else:
                self._seen[ptr] = len(self._srcs)
        i = len(self._srcs)
        self._srcs.append(t)
        self._devices.add(t.device)
        slots = self._guess_slots
        if slots is not None:
            lens = self._guess_lens
            if i < len(lens) and lens[i] == t.nbytes:
                if not self._lazy:
                    batch = self._batch.setdefault(t.device, [])
                    batch.append(i)
                    if len(batch) >= _BATCH:
                        self._queue_batch(t.device)
                return slots[i]
            self._drop_guess()
        return Pending(i)

    def fits(
        self, nbytes: Tuple[int, ...], ptrs: List[int]
    ) -> Optional[Tuple[int, Optional[_Slab], Optional[List[_ckpt.SlabSlot]]]]:
        """Where the next ``len(nbytes)`` tensors go, if no tensor at ``ptrs``
        was met before in this save (:mod:`ckpt._save.repeat` checks a mapping
        before it takes it in bulk): ``(index of the next slot, slab, its
        slots)`` when the next slots of the guessed slab have these lengths;
        ``(index, None, None)`` when there is no guessed slab (the previous
        slab of this layout still being written, or a layout that differs
        from the last save's): their bytes are :class:`Pending` until
        :meth:`start`. A guessed slab that does not fit is let go first, as
        :meth:`add` would let it go. None when a tensor was met before."""
        if not self._seen.keys().isdisjoint(ptrs):
            return None
        i0 = len(self._srcs)
        slots, slab = self._guess_slots, self._guess
        if slots is not None and slab is not None and self._guess_lens[i0 : i0 + len(nbytes)] == nbytes:
            return i0, slab, slots
        self._drop_guess()
        return i0, None, None

    def add_many(self, ts: List[torch.Tensor], ptrs: List[int], device: torch.device) -> None:
        """Queue distinct tensors ``ts`` of one device at their addresses
        ``ptrs``, to be copied as they are, into the next slots (of the guessed
        slab, if :meth:`fits` said they fit in it)."""
        i0 = len(self._srcs)
        n = len(ts)
        self._srcs.extend(ts)
        if n:
            self._devices.add(device)
        self._seen.update(zip(ptrs, range(i0, i0 + n)))
        if not self._lazy and n and self._guess is not None:
            batch = self._batch.setdefault(device, [])
            batch.extend(range(i0, i0 + n))
            if len(batch) >= _BATCH:
                self._queue_batch(device)

    def __len__(self) -> int:
        return len(self._srcs)

    def lens(self) -> List[int]:
        """The bytes of each tensor added so far, in order: the slab's slot lengths."""
        return [t.nbytes for t in self._srcs]

    def _queue_batch(self, device: torch.device) -> None:
        """Queue the copies of an eager save's batch into the guessed slab,
        ordered after everything queued so far on the current stream (the
        clones of buffers included)."""
        idx = self._batch.pop(device, None)
        slab = self._guess
        if not idx or slab is None:
            return
        ev = _now_on(device)
        self._start.setdefault(device, ev)
        side = self._pool.stream(device)
        current().wait(side, ev)
        src = [self._srcs[i] for i in idx]
        dst = [slab.view(i, t.dtype, t.shape) for i, t in zip(idx, src)]
        with torch.no_grad(), current().on_stream(side):
            current().copy_all(dst, src)
        self._queued_early += len(idx)

    def _drop_guess(self) -> None:
        """The state differs from the last save's: wait for the copies queued
        into the guessed slab, and let it go."""
        slab = self._guess
        self._guess, self._guess_slots, self._guess_lens, self._batch = None, None, (), {}
        if slab is None:
            return
        if self._queued_early:
            for device in self._start:
                self._pool.stream(device).synchronize()
            self._queued_early = 0
        self._start = {}
        slab.owner = None
        self._pool.released()

    def start(self, step: int) -> Optional[List[_ckpt.SlabSlot]]:
        """Choose the slab and queue the copies (or what is left of them), ordered
        after the work queued so far on the current streams. Returns each
        tensor's slot, in order, or None when the walk already handed them out
        (the guessed slab). In lazy mode the copies are queued by a background
        thread once :meth:`launch` is called (after the engine took the save),
        so this returns at once."""
        slots: Optional[List[_ckpt.SlabSlot]] = None
        if self._guess is not None and len(self._srcs) == len(self._guess_lens):
            self._pool.charge(self._guess, step)
            self.slab = self._guess
        else:
            self._drop_guess()
            slab = self._pool.take(self.lens(), step, lazy=self._lazy)
            slab.owner = self
            self.slab = slab
            slots = slab.slot_objs()
        # The copies' order: after what was queued before ``save`` on each
        # device's current stream (this thread's: a launcher thread's differs).
        for device in self._devices:
            if device not in self._start:
                self._start[device] = _now_on(device)
        self._open = False
        if self._lazy:
            self._launch, self._readable = Future(), Future()
        else:
            self._queue()
        return slots

    def launch(self) -> None:
        """Lazy mode: hand the queueing of the copies to the pool's background
        thread (once). It prepares a new slab first (populate, page-lock)."""
        if self._launch is None or self._launched:
            return
        self._launched = True
        fut, readable = self._launch, self._readable
        assert readable is not None

        device = self._device()

        def run() -> None:
            try:
                with current().on(device):
                    self._queue()
            except BaseException as e:  # noqa: BLE001 - the save's gate raises it
                if not readable.done():
                    readable.set_exception(e)
                fut.set_exception(e)
            else:
                if not readable.done():
                    readable.set_result(None)
                fut.set_result(None)

        self._pool.launcher().submit(run)

    def abandon(self) -> None:
        """The save failed: before :meth:`start`, let the guessed slab go; after
        it, let every copy land (nothing may still land in a slab the next
        save reuses)."""
        if self._open:
            self._drop_guess()
            self._open = False
            return
        self.launch()
        self.wait_landed()

    def _device(self) -> Optional[torch.device]:
        """The device of the save's first CUDA tensor (made current in ckpt's threads)."""
        return self._srcs[0].device if self._srcs else None

    def _queue(self) -> None:
        slab = self.slab
        assert slab is not None
        try:
            staged = self._stage_on_device() if self._lazy else {}
            # A new slab is populated and locked after the copies into device
            # memory are queued: with everything staged, the step need not wait.
            self._pool.prepare(slab, self._device())
            self._queue_copies(slab, staged)
        except BaseException:
            # Copies queued before the failure still land: the slab is not
            # free until they have (``landed`` sees no events).
            for device in self._start:
                self._pool.stream(device).synchronize()
            raise

    def _stage_on_device(self) -> Dict[torch.device, Tuple[List[int], List[torch.Tensor]]]:
        """Lazy: queue the copies of the tensors that fit in the pool's device
        staging into it (by device: their indices and the staged copies). When
        all of them fit, the sources are read once these are done: the events
        that say so are recorded, and ``fence`` may go on."""
        if self._pool.device_staging <= 0:
            return {}
        by_device: Dict[torch.device, List[int]] = {}
        for i, t in enumerate(self._srcs):
            by_device.setdefault(t.device, []).append(i)
        staged: Dict[torch.device, Tuple[List[int], List[torch.Tensor]]] = {}
        every = True
        with torch.no_grad():
            for device, idx in by_device.items():
                picked, views = self._pool.device_stage(device, [self._srcs[i] for i in idx])
                every = every and len(picked) == len(idx)
                if not picked:
                    continue
                which = [idx[j] for j in picked]
                side = self._pool.stream(device)
                current().wait(side, self._start[device])
                with current().on_stream(side):
                    current().copy_all(views, [self._srcs[i] for i in which])
                staged[device] = (which, views)
        if staged and every:
            self._read = [(device, _recorded(self._pool.stream(device))) for device in staged]
            assert self._readable is not None
            self._readable.set_result(None)
        return staged

    def _queue_copies(self, slab: _Slab, staged: Dict[torch.device, Tuple[List[int], List[torch.Tensor]]]) -> None:
        events = []
        #: By device: an event after which its sources are read, when some are staged.
        read: Dict[torch.device, Event] = {}
        with torch.no_grad():
            if self._queued_early or self._batch:
                # Eager into the guessed slab: most copies were queued during the walk.
                for device in list(self._batch):
                    self._queue_batch(device)
                devices = list(self._start)
            else:
                on_device = {i for which, _ in staged.values() for i in which}
                by_device: Dict[torch.device, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
                for i, t in enumerate(self._srcs):
                    dst, src = by_device.setdefault(t.device, ([], []))
                    if i not in on_device:
                        dst.append(slab.view(i, t.dtype, t.shape))
                        src.append(t)
                for device, (dst, src) in by_device.items():
                    side = self._pool.stream(device)
                    current().wait(side, self._start[device])
                    with current().on_stream(side):
                        if dst:
                            current().copy_all(dst, src)
                        if device in staged:
                            # The sources are read (the step may go on); the
                            # staged copies then go on to the host.
                            read[device] = _recorded(side)
                            which, views = staged[device]
                            current().copy_all([slab.view(i, v.dtype, v.shape) for i, v in zip(which, views)], views)
                devices = list(by_device)
            for device in devices:
                # Blocking: a thread that waits for it sleeps instead of spinning a core.
                ev = current().record(self._pool.stream(device), blocking=True)
                events.append((device, ev))
        if staged and not self._read:
            # Some tensors went straight to the host: the step waits for those
            # copies, and on a device without staging for all of them.
            self._read = [(device, read.get(device, ev)) for device, ev in events]
        self._events = events

    def landed(self) -> bool:
        """True once every copy has landed in host memory (without waiting)."""
        if self._open:
            return False
        if self._launch is not None and not self._launch.done():
            return False
        for device, ev in self._events:
            with current().on(device):
                if not ev.query():
                    return False
        return True

    def wait_landed(self) -> None:
        """Block until every copy has landed (the GIL is released meanwhile); then
        the sources are let go."""
        if self._launch is not None:
            self._launch.result()
        for device, ev in self._events:
            with current().on(device):  # also from the engine's threads
                ev.synchronize()
        self._srcs = []

    def fence(self) -> None:
        """Make the current streams wait for the copies (before the optimizer
        step mutates their sources); the host waits only for the copies to be
        queued (after a new slab was prepared, on a process's first save)."""
        if self._fenced:
            return
        if self._readable is not None:
            self._readable.result()
        for device, ev in self._read or self._events:
            dev = current()
            dev.wait(dev.current_stream(device), ev)
        self._fenced = True


#: Copies an eager save queues at once while it walks the state.
_BATCH = 64


def _recorded(stream: Stream) -> Event:
    """An event recorded on ``stream`` now."""
    return current().record(stream)


def _now_on(device: torch.device) -> Event:
    """An event recorded on this thread's current stream of ``device``: what
    is queued there so far comes before whatever waits for it."""
    dev = current()
    return dev.record(dev.current_stream(device))

