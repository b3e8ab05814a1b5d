"""A restore's CUDA destinations, filled through one host slab
(:class:`HostStage`): the engine reads into the slab's slots, and the
host-to-device copies of each group of slots start as soon as that group is
read, while the engine reads the next.

- **Groups.** The slots are read in groups whose sizes halve towards the end
  (:func:`groups`): the copies of every group but the last overlap the read
  of the ones after it, and only the last, small group's copies come after
  the read. Each group is one call of the engine's load (its own reading of
  the manifest), so they are few.
- **Copies.** They are queued on the slab pool's launcher thread, on the
  stream that was current when the restore began, and the restore waits for
  them (and synchronizes that stream) before it hands the values over, as a
  copy made after the read would be.
- **Page locking** of a new slab (a restarted process's first restore), by
  :attr:`HostStage.lock`:

  * ``"during"`` (the default): mapped on several threads and locked on the
    launcher thread while the read fills the slab
    (:meth:`~ckpt._device.slabs.SlabPool.lock_while_filled`); the copies of each
    group queue behind the lock, from locked memory, at the link's speed.
    Where the runtime refuses to lock pages the read is writing, the slab
    is locked after the read, as ``"after"`` does. The slab stays locked
    for the job's first save (a read-only reader's is unlocked at its
    close).
  * ``"later"``: the copies come from pageable memory (the driver stages
    them); once they are done the slab is locked in one piece on the
    launcher thread, for the first save. The job's first CUDA calls may
    wait for that lock once. A read-only reader locks nothing.
  * ``"after"``: locked on the caller's thread once the read is done (pages
    the read mapped lock fast), then every copy, at the link's speed.

  ``"during"`` measured as fast as any way cold and the fastest warm
  (docs/perf.md, "Restore"; ``gpu_bench --restore-ways``). A slab a save
  left locked is used as it is.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ckpt._ckpt import LoadTarget
from ckpt._device.device import Stream, current
from ckpt._device.slabs import SlabPool, _Slab
from ckpt.errors import InvalidInputError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["HostStage", "groups", "LOCK_WAYS"]

#: The ways a restore may page-lock a new slab (see the module docs).
LOCK_WAYS = ("during", "later", "after")

#: The last group's bytes, at least: what is copied after the read.
TAIL_BYTES = 64 << 20


def groups(lens: Sequence[int], tail: Optional[int] = None) -> List[Tuple[int, int]]:
    """Slot ranges ``[start, end)`` covering ``lens`` in order, whose sizes
    halve towards the end: counted from the end, a group closes once it
    holds ``tail`` bytes (default :data:`TAIL_BYTES`) and as many as all the
    groups after it. A group holds at least one slot; no slots, no groups."""
    tail = TAIL_BYTES if tail is None else tail
    out: List[Tuple[int, int]] = []
    end, size, after = len(lens), 0, 0
    for i in range(len(lens) - 1, -1, -1):
        size += lens[i]
        if size >= max(tail, after):
            out.append((i, end))
            after += size
            end, size = i, 0
    if end > 0:
        if out:  # too small to stand alone: joins the first group
            out[-1] = (0, out[-1][1])
        else:
            out.append((0, end))
    out.reverse()
    return out


class HostStage:
    """A restore's CUDA destinations filled through one slab (see the module
    docs): :meth:`add` each destination, :meth:`buffers` for the engine,
    :meth:`fill` to read and copy group by group, :meth:`copy_back` to finish."""

    #: How a new slab is page-locked: one of :data:`LOCK_WAYS`.
    lock = "during"

    def __init__(self, pool: SlabPool, keep: bool = True) -> None:
        """``keep``: whether saves may use the slab after the restore (False
        for a read-only reader: ``"later"`` then locks nothing)."""
        self._pool = pool
        self._keep = keep
        self._dst: List[torch.Tensor] = []
        self._views: List[torch.Tensor] = []
        #: Each destination's bytes, once :meth:`buffers` laid the slots out.
        self._lens: List[int] = []
        self.slab: Optional[_Slab] = None
        self._held = False
        self._way = self.lock
        #: The copies queued so far (on the launcher thread), and the slots they cover.
        self._copies: List["Future[None]"] = []
        self._copied = 0
        #: The streams the copies go on: current on the caller's thread when the fill began.
        self._streams: Dict[torch.device, Stream] = {}
        #: Seconds :meth:`copy_back` spent locking a new slab, and copying to the device (or waiting for the copies).
        self.lock_s = 0.0
        self.to_device_s = 0.0
        #: How the slab was locked (as ``SlabPool.restore_locks`` records it), once copied back.
        self.how: Optional[str] = None
        #: Bytes copied to the device during the read (before :meth:`copy_back`).
        self.early_bytes = 0

    def add(self, t: torch.Tensor) -> int:
        self._dst.append(t)
        return len(self._dst) - 1

    def __len__(self) -> int:
        return len(self._dst)

    def buffers(self) -> List[npt.NDArray[np.uint8]]:
        """A writable byte buffer (numpy) for each destination, in order: the slab's slots."""
        if self._way not in LOCK_WAYS:
            raise InvalidInputError(f"HostStage.lock must be one of {LOCK_WAYS}, not {self._way!r}")
        self._lens = lens = [t.numel() * t.element_size() for t in self._dst]
        slab, offsets = self._pool.borrow(lens)
        slab.owner = None
        self.slab = slab
        self._held = slab.locked
        if self._way == "during":
            self._pool.lock_while_filled(slab, self._dst[0].device if self._dst else None)
        self._views = [slab.host[off : off + n] for off, n in zip(offsets, lens)]
        return [v.numpy() for v in self._views]

    def fill(
        self, read: Callable[[List[LoadTarget]], None], head: List[LoadTarget], slots: List[LoadTarget]
    ) -> None:
        """Run the load: ``read(requests)`` (the engine's load) for ``head``
        (the restore's other requests) with the first group, then group by
        group; ``slots[i]`` is the request that fills slot ``i``. Each group's
        copies to the device are queued once it is read, unless the slab is to
        be locked after the read. On an error the copies queued are waited
        for (the slab may be reused next) and it is raised."""
        lens = self._lens
        if len(slots) != len(lens):
            raise ValueError(f"{len(slots)} requests for the {len(lens)} slots of a host stage")
        self._streams = self._current_streams()
        try:
            for start, end in groups(lens) or [(0, 0)]:
                read((head if start == 0 else []) + slots[start:end])
                if self._held or self._way != "after":
                    self._queue(start, end)
                    self.early_bytes += sum(lens[start:end])
        except BaseException:
            self.abandon()
            raise

    def _queue(self, start: int, end: int) -> None:
        """Queue the copies of slots ``[start, end)`` on the launcher thread."""
        if start >= end:
            return
        assert start == self._copied, "groups are copied in order"
        self._copied = end
        pairs = list(zip(self._dst[start:end], self._views[start:end]))
        self._copies.append(self._pool.launcher().submit(_copy, pairs, self._streams))

    def copy_back(self) -> None:
        """Finish: the slab locked as :attr:`lock` says (``"after"``, or
        ``"during"`` and refused then: now, before the copies left), every
        copy queued and landed, and with ``"later"`` the slab's lock queued in
        the background once nothing copies out of it."""
        t0 = time.perf_counter()
        if not self._streams:  # (not filled through fill(): one group)
            self._streams = self._current_streams()
        slab, device = self.slab, self._dst[0].device if self._dst else None
        new = slab is not None and device is not None and not self._held
        lock_s = 0.0
        if new and self._way != "later":
            # Locked during the read, else now, in one piece (no training runs
            # yet), so the first save may lay it out anew.
            assert slab is not None
            self._pool.settle(slab)
            how = "during" if slab.locked else "after"
            self._pool.prepare(slab, device, whole=True)
            self.how = how if slab.locked else "pageable"
            lock_s = time.perf_counter() - t0
        self._queue(self._copied, len(self._dst))
        self._wait_copies()
        self._sync()
        if new and self._way == "later" and not self._keep:
            self.how = "unlocked"  # no save will use it
        elif new and self._way == "later":
            assert slab is not None
            self.how = "later" if self._pool.lock_later(slab, device) else "pageable"
        elif slab is not None and device is not None and self._held:
            self.how = "held"
        if self.how is not None:
            self._pool.restore_locks.append(self.how)
        self._dst, self._views = [], []
        self.lock_s, self.to_device_s = lock_s, time.perf_counter() - t0 - lock_s

    def abandon(self) -> None:
        """Wait for the copies already queued to land (their errors dropped):
        a failed restore's slab is reused by the next attempt."""
        for f in self._copies:
            try:
                f.result()
            except Exception:  # noqa: BLE001 - the restore failed already
                pass
        self._copies = []
        try:
            self._sync()
        except Exception:  # noqa: BLE001 - as above
            pass

    def _current_streams(self) -> Dict[torch.device, Stream]:
        """This thread's current stream on each destination's device (the caller's)."""
        dev = current()
        return {d: dev.current_stream(d) for d in {t.device for t in self._dst}}

    def _wait_copies(self) -> None:
        copies, self._copies = self._copies, []
        for f in copies:
            f.result()

    def _sync(self) -> None:
        for s in self._streams.values():
            s.synchronize()


def _copy(pairs: List[Tuple[torch.Tensor, torch.Tensor]], streams: Dict[torch.device, Stream]) -> None:
    """Each slot's bytes into its live tensor, on that device's stream (the
    restore's caller's), from the launcher thread."""
    dev = current()
    with torch.no_grad():
        for t, v in pairs:
            with dev.on(t.device), dev.on_stream(streams[t.device]):
                t.copy_(v.view(t.dtype).view(t.shape), non_blocking=True)
