"""What a save returns and what a read gives: :class:`SaveHandle` (a save in
progress, and :class:`SavePhases`, where its call's time went),
:class:`RestorePhases` (where a restore's time went) and :class:`Checkpoint`
(a loaded checkpoint's state)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Tuple

from ckpt import _ckpt
from ckpt.errors import CheckpointError

if TYPE_CHECKING:
    from ckpt._ckpt import _SaveReport

__all__ = ["SavePhases", "RestorePhases", "SaveHandle", "Checkpoint"]


class Fenced(Protocol):
    """A save's device-to-host copies (a :class:`ckpt._device.cuda.DeviceCopy`, which
    sits above this module): all a handle asks of them is a fence."""

    def fence(self) -> None: ...


@dataclass(frozen=True)
class SavePhases:
    """Where one ``save`` call's time went, in seconds (:attr:`SaveHandle.phases`).

    A lazy save's stall is Python's work on the state, not its size: here is
    which part of it to look at when it is longer than expected."""

    #: The state dicts and the walk of the state (CPU tensors viewed, CUDA
    #: tensors given their slots): a few microseconds per tensor, less when a
    #: loop saves the same tensors again.
    walk: float
    #: CUDA state: the host slab chosen and the device-to-host copies started
    #: (eager: and landed).
    device: float
    #: The engine's save: the manifest's metadata, and the CPU tensors copied
    #: in the stall (all of them eager; buffers and loose tensors lazy). A
    #: memory tier's step saved to both tiers: both engines.
    engine: float
    #: The whole call, from entry to return.
    total: float
    #: From the call's entry to the walk: argument checks, finished saves
    #: reaped (their errors raised), the exporter made.
    before: float = 0.0
    #: From the engine's save to the return: a lazy save's copies handed to
    #: the launcher thread, the step pre-hooks, the collector on again.
    after: float = 0.0

    @property
    def other(self) -> float:
        """What no phase above covers (the memory tier's own work around a
        save, a wait for the GIL between phases)."""
        return max(0.0, self.total - self.walk - self.device - self.engine - self.before - self.after)


@dataclass(frozen=True)
class RestorePhases:
    """Where one restore's time went, in seconds
    (:attr:`Checkpointer.last_restore`): a ``load_latest`` or ``load`` call
    that restored a checkpoint, from its entry to its return."""

    #: The checkpoint's table read and checked against the live state, and a
    #: destination given to each tensor (CUDA tensors: a slot of a host slab).
    plan: float
    #: The engine's read into those destinations: the storage's reads, checksums
    #: and decompression (with CUDA tensors, the copies to the device of the
    #: groups read first run meanwhile, see :mod:`ckpt._device.hoststage`).
    read: float
    #: Every rank's outcome agreed on (0 with one process).
    agree: float
    #: A new host slab for CUDA tensors page-locked after the read: where
    #: ``HostStage.lock`` is ``"after"``, or, with the default ``"during"``,
    #: the wait for the lock begun during the read (next to nothing where
    #: the read outlasts it; the whole lock where the runtime refused it
    #: then); 0 where a save left one locked, where it is locked in the
    #: background (``"later"``), or there is no CUDA state.
    lock: float
    #: The host-to-device copies out of the slab after the read (the last
    #: group's, or all of them locked after the read), and the wait for all.
    to_device: float
    #: The values handed to the live objects (``load_state_dict``) and the
    #: random generators restored.
    apply: float
    #: The whole call, from entry to return.
    total: float
    #: Newer checkpoints tried first and skipped as damaged (their plans and
    #: reads), in the same call.
    damaged: float = 0.0
    #: How the host slab for CUDA tensors was locked: ``"held"`` (locked
    #: already: a save left it so, or an earlier attempt of this call),
    #: ``"during"`` the read (the default), ``"later"`` (in the background,
    #: once its copies landed), ``"after"`` the read, ``"unlocked"`` (a
    #: read-only reader's locked ``"later"``: never, as no save uses it),
    #: ``"pageable"`` (the runtime would not lock it); None without CUDA
    #: tensors.
    slab: Optional[str] = None

    @property
    def other(self) -> float:
        """What no phase above covers: the checkpoints listed, a wait for
        saves in flight, the first save's readying hooked on."""
        return max(0.0, self.total - self.plan - self.read - self.agree - self.lock - self.to_device - self.apply
                   - self.damaged)


class SaveHandle:
    """A save in progress, returned by :meth:`Checkpointer.save`.

    The state may change again once :meth:`snapshot_done` is true (at once in
    eager mode); the checkpoint is durable once :meth:`wait` returned.

    Attributes:
        phases: where the ``save`` call's time went (:class:`SavePhases`:
            ``walk``, ``device``, ``engine``, ``total``, ...), set when
            ``save`` returns; ``None`` for the durable tier's half of a
            memory tier's save.
    """

    def __init__(self, native: _ckpt.SaveHandle, device: Optional[Fenced] = None) -> None:
        self._native = native
        #: The save's device-to-host copies (:class:`ckpt._device.cuda.DeviceCopy`), if any.
        self._device = device
        #: Lazy mode: CPU tensors are still being copied on a background thread.
        self._host_lazy = False
        self._observed = False  # its outcome reached the caller through wait()
        #: ``walk``, ``device`` and ``engine`` of :class:`SavePhases`, once timed.
        #: When (``perf_counter``) the walk began, the device copies' start
        #: began, the engine's save began and ended.
        self._marks: Tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        #: Where the ``save`` call's time went (None for the durable tier's
        #: half of a memory tier's save: see the memory tier's handle).
        self.phases: Optional[SavePhases] = None

    def _finish(self, t0: float) -> "SaveHandle":
        """The save call that began at ``t0`` (``perf_counter``) returns now."""
        t_walk, t_device, t_engine, t_end = self._marks
        now = time.perf_counter()
        if t_walk < t0:  # (not timed: nothing to split)
            t_walk = t_device = t_engine = t_end = t0
        self.phases = SavePhases(
            walk=t_device - t_walk, device=t_engine - t_device, engine=t_end - t_engine, total=now - t0,
            before=t_walk - t0, after=now - t_end,
        )
        return self

    @property
    def step(self) -> int:
        """The step being saved."""
        return self._native.step

    @property
    def attempt(self) -> str:
        """The id of this save attempt (two saves of one step never share objects)."""
        return self._native.attempt

    @property
    def stall(self) -> float:
        """Seconds ``save`` kept the caller waiting, from its entry to its
        return (:attr:`phases` says where they went)."""
        return self.phases.total if self.phases is not None else self._native.stall

    def snapshot_done(self) -> bool:
        """True once the snapshot is copied (the state may be mutated again)."""
        return self._native.snapshot_done()

    def done(self) -> bool:
        """True once the save is committed or failed."""
        return self._native.done()

    def wait_snapshot(self, timeout: Optional[float] = None) -> None:
        """Block until the snapshot is copied; raises the snapshot's error."""
        self._native.wait_snapshot(timeout)

    def _before_step(self) -> None:
        """What the lazy-mode step pre-hook needs of this save before the
        optimizer mutates its sources: CPU copies done (a host wait), CUDA
        copies fenced on the current stream (no host wait)."""
        if self._host_lazy:
            self._native.wait_snapshot(None)
        elif self._device is not None:
            self._device.fence()

    def wait(self, timeout: Optional[float] = None) -> _SaveReport:
        """Block until the checkpoint is committed; returns the save report
        (seconds: ``stall``, ``snapshot``, ``persist``, ``commit``, ``total``, ...;
        bytes: ``raw_bytes``, ``stored_bytes``, ``reused_bytes``, ...)."""
        try:
            report = self._native.wait(timeout)
        except CheckpointError:
            # The save's own failure (not this wait running out) has been seen.
            self._observed = self._native.done()
            raise
        self._observed = True
        return report

    def __repr__(self) -> str:
        return repr(self._native)


@dataclass
class Checkpoint:
    """A loaded checkpoint (see :meth:`Checkpointer.read_latest`)."""

    step: int
    attempt: str
    #: The saved state: the same nesting and types as given to ``save``, with
    #: objects that had a ``state_dict`` replaced by their state dict.
    state: Dict[str, Any]
    #: Newer checkpoints that were damaged and skipped: ``(step, attempt, error)``.
    skipped: List[Tuple[int, str, CheckpointError]] = field(default_factory=list)
