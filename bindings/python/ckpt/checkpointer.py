"""The user-facing :class:`Checkpointer`: save a training state, restore it in place."""

from __future__ import annotations

import json
import sys
import threading
import time
import weakref
from collections.abc import Mapping, MutableMapping, MutableSequence, Sized
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional, Tuple, Type, Union, cast, overload

from ckpt import _ckpt
from ckpt._save import ahead as _ahead
from ckpt._runtime import exit as _exit
from ckpt._restore import load as _load
from ckpt._restore import passed as _passed
from ckpt._state import own as _own
from ckpt._runtime.gc import collector_paused
from ckpt.handles import Checkpoint, RestorePhases, SaveHandle, SavePhases
from ckpt._ckpt import GcReport
from ckpt.distributed import _agree, _resolve
from ckpt.errors import CheckpointError, CorruptError, InvalidInputError, NotFoundError
from ckpt._state.tree import Flattened, flatten

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.optim import Optimizer
    from torch.utils.hooks import RemovableHandle

    from ckpt._ckpt import _Listed
    from ckpt._save.repeat import PlannedExporter
    from ckpt._save.repeat_host import HostPlan
    from ckpt._device.cuda import HostStage, SlabPool
    from ckpt.distributed import Coordinator

#: A state restored in place, as the caller holds it: any mapping of names
#: (invariant in its values, so a ``Dict[str, torch.nn.Module]`` is one too).
LiveState = MutableMapping[str, Any]

__all__ = ["Checkpointer", "SaveHandle", "SavePhases", "RestorePhases", "Checkpoint"]


class Checkpointer:
    """Saves training state under a URL and restores it, with no pickle.

    Args (in full: bindings/README.md, "Checkpointer arguments"):
        url: ``file:///abs/dir`` (or a plain path), ``memory://name``,
            ``s3://bucket/prefix`` or ``tiered+<fast URL>?durable=<URL>``.
        keep_last: keep only the newest N checkpoints (default: keep all).
        keep_every: also keep every checkpoint whose step is a multiple of K.
        compression: ``None`` (the default) or ``"zstd"`` (``level`` 1..22).
        lazy: ``False`` (the default: ``save`` returns once the state is
            copied) or ``True``: ``save`` returns at once, and a step
            pre-hook on each optimizer in the state blocks
            ``optimizer.step()`` until parameters and optimizer state are
            copied. Anything else that mutates them must call
            :meth:`wait_snapshot` first.
        staging_budget: bytes of host staging and page-locked memory
            (default: twice the first save's state).
        device_staging: bytes of GPU memory a lazy save may snapshot CUDA
            state into first, so the next step waits only for that copy.
        busy: when the budget is in use by earlier saves: ``"wait"`` or
            ``"skip"`` (``save`` raises :class:`~ckpt.SkippedError`).
        rng: also save and restore the global random generators
            (:class:`~ckpt.RNGState`) under the key ``"rng"``.
        format: ``"native"``, ``"safetensors"``, ``"torch"`` or ``"hdf5"``,
            for new checkpoints; any of them can be loaded.
        coordinate: ``"auto"`` (``torch.distributed``, else ``mpirun``'s MPI,
            else none), ``"torch"``, ``"mpi"``, ``"none"``, or a coordinator
            object (:mod:`ckpt.distributed`).
        process_group: the ``torch.distributed`` ranks that checkpoint
            together (default: the whole job).
        collective_timeout: seconds a rank waits for the others; past it the
            save or load fails with :class:`~ckpt.StragglerError` naming the
            ranks that were not taking part (:class:`~ckpt.CheckpointTimeoutError`
            when none can be named).
        read_only: only read the root, and never fence the job writing it
            (``save`` and ``gc`` raise :class:`~ckpt.InvalidInputError`).
        gc_grace: seconds GC spares unreferenced data a save may be writing.
        direct_io: write local objects of 1 MiB or more with ``O_DIRECT``
            (default ``None``: on; ``CKPT_DIRECT_IO=0|1`` overrides it).
        fencing: ``False``: never claim a writer epoch (the memory tier's roots).

    **Several ranks**: create it on every rank with the same URL, ``save``
    the same steps in the same order, and ``wait`` or ``close`` on every
    rank before the process group is destroyed (bindings/README.md).
    """

    def __init__(
        self,
        url: str,
        *,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        compression: Optional[str] = None,
        level: int = 3,
        lazy: bool = False,
        staging_budget: Optional[int] = None,
        device_staging: int = 0,
        busy: str = "wait",
        rng: bool = True,
        format: str = "native",  # noqa: A002 - matches the engine's option
        coordinate: Union[str, Coordinator] = "auto",
        process_group: Optional[ProcessGroup] = None,
        collective_timeout: float = 600.0,
        read_only: bool = False,
        fencing: bool = True,
        gc_grace: float = 60.0,
        direct_io: Optional[bool] = None,
    ) -> None:
        if isinstance(collective_timeout, bool) or not isinstance(collective_timeout, (int, float)):
            raise InvalidInputError(f"collective_timeout must be a number of seconds, not {collective_timeout!r}")
        if not collective_timeout > 0:
            raise InvalidInputError(f"collective_timeout must be positive, not {collective_timeout!r}")
        if type(device_staging) is not int or device_staging < 0:
            raise InvalidInputError(f"device_staging must be a non-negative int of bytes, not {device_staging!r}")
        if direct_io is not None and not isinstance(direct_io, bool):
            raise InvalidInputError(f"direct_io must be True, False or None, not {direct_io!r}")
        coordinator = _resolve(coordinate, process_group, collective_timeout)
        self._native = _ckpt.Checkpointer(
            url,
            keep_last=keep_last,
            keep_every=keep_every,
            compression=compression,
            level=level,
            lazy=lazy,
            staging_budget=staging_budget,
            busy=busy,
            format=format,
            coordinator=coordinator,
            collective_timeout=float(collective_timeout),
            read_only=bool(read_only),
            fencing=bool(fencing),
            gc_grace=float(gc_grace),
            direct_io=direct_io,
        )
        self._coordinator = coordinator
        self._rng = rng
        self._pending: List[SaveHandle] = []  # snapshots possibly still copying
        self._unwaited: List[SaveHandle] = []  # saves whose outcome nobody checked
        self._hooks: Dict[int, RemovableHandle] = {}
        self._closed = False
        #: Where the last restore's time went (:meth:`load_latest` or :meth:`load`
        #: that restored a checkpoint); None before one.
        self.last_restore: Optional[RestorePhases] = None
        #: This rank's ``per_rank`` state as the last restore found it (a
        #: dict, its tensors new), or None: no restore asked for it, or the
        #: checkpoint holds none for this rank (the saving job had no rank
        #: of this number).
        self.last_per_rank: Optional[Dict[str, object]] = None
        #: Removes the step post-hooks that ready a fresh start's first save (:mod:`ckpt._save.ahead`).
        self._ahead_hooks_off: Callable[[], None] = _ahead.nothing
        self._slabs: Optional[SlabPool] = None  # host slabs of CUDA snapshots
        #: The thread readying the first save's staging memory, while it runs (:func:`ckpt._save.ahead.rehearse`).
        self._readying: Optional[threading.Thread] = None
        #: What the last save made of each mapping of CPU tensors (:mod:`ckpt._save.repeat_host`).
        self._host_plans: Dict[str, HostPlan] = {}
        # Another checkpointer whose slab pool this one uses (the memory tier's
        # roots use its durable checkpointer's: one pool, one budget).
        self._pool_of: Optional["Checkpointer"] = None
        self._staging_budget = staging_budget
        self._device_staging = device_staging
        self._busy = busy
        self._read_only = bool(read_only)
        # ``(rank, ranks)`` whose own state (RNG) this checkpointer saves and
        # restores, when not its own: the memory tier's per-rank roots
        # (ckpt.memory) save alone on behalf of a rank of the job.
        self._acting_for: Optional[Tuple[int, int]] = None

    # ------------------------------------------------------------------ saving

    @property
    def url(self) -> str:
        """The root URL."""
        return self._native.url

    @property
    def lazy(self) -> bool:
        """Whether snapshots are lazy."""
        return self._native.lazy

    @property
    def rank(self) -> int:
        """This process's rank among the ranks that checkpoint together (0 alone)."""
        return self._native.rank

    @property
    def world_size(self) -> int:
        """How many ranks checkpoint together (1 alone)."""
        return self._native.world_size

    def save(self, step: int, state: Optional[Mapping[str, object]] = None, /, **named: object) -> SaveHandle:
        """Start saving the checkpoint of ``step``; returns once the snapshot is
        taken (eager) or started (lazy). Persisting continues in the background.

        ``state`` and the keyword arguments together form the saved mapping, e.g.
        ``cp.save(step, model=model, optimizer=opt, extra={"epoch": e})``. Values
        may be objects with ``state_dict()`` (modules, optimizers, schedulers),
        torch tensors (CPU or CUDA), numpy arrays, and nested plain data.

        Every rank saves the same names; a name's value is taken for a
        replica, stored once, and ranks whose values differ fail the save.
        State of this rank alone (its data loader, a prefetched batch) goes
        in ``per_rank``, a mapping stored in this rank's own part beside its
        RNG state: ``cp.save(step, model=m, optimizer=o, per_rank={"loader":
        loader, "batch": (x, y)})``; :meth:`load_latest` with ``per_rank=``
        gives it back to the same rank.

        A save still in progress when the interpreter exits normally is
        finished then (see :mod:`ckpt._runtime.exit`); :meth:`wait` is where its
        failure raises.

        Raises :class:`~ckpt.ConflictError` if ``step`` is already committed
        (as far as this checkpointer knows: what its load or first save listed,
        and its own commits since; no storage request in the stall). A step
        that another process committed meanwhile is refused at commit, before
        anything is published: :meth:`SaveHandle.wait` raises the
        :class:`~ckpt.ConflictError`.
        """
        t0 = time.perf_counter()
        with collector_paused():  # see ckpt._runtime.gc: a save's objects die young
            handle, _, _ = self._save_shared(step, self._entries(state, named), None)
        return handle._finish(t0)

    def _save_shared(
        self, step: int, entries: Dict[str, object], also: Optional["Checkpointer"]
    ) -> Tuple[SaveHandle, Optional[SaveHandle], Optional[Exception]]:
        """``save``; with ``also``, the same snapshot is saved by that
        checkpointer's engine too (the memory tier's durable steps): one walk,
        one copy of the state (CPU tensors into this save's staging, CUDA
        tensors into one slab), two engine saves; in lazy mode the second
        takes the first's copies once they are taken.

        Returns this checkpointer's handle, ``also``'s, and ``also``'s failure
        (an earlier save of its that failed, or this one refused): it is
        returned, not raised, since this checkpointer's save has started. This
        checkpointer's pre-hooks and :meth:`wait_snapshot` cover both saves."""
        if type(step) is not int or step < 0:
            raise InvalidInputError(f"step must be a non-negative int, not {step!r}")
        if also is not None and also.lazy != self.lazy:
            raise InvalidInputError("a shared snapshot needs both checkpointers eager or both lazy")
        if also is not None and also._own_identity() != self._own_identity():
            raise InvalidInputError("a shared snapshot needs both checkpointers to save the same rank's state")
        self._reap()
        if self._ahead_hooks_off is not _ahead.nothing:
            _ahead.hooks_off(self)
        if also is not None and also._ahead_hooks_off is not _ahead.nothing:
            _ahead.hooks_off(also)
        exporter = self._exporter()
        try:
            handle, flat, second, failure = self._save(step, entries, exporter, also)
        except BaseException:
            device = getattr(exporter, "device", None)
            if device is not None:
                device.abandon()  # nothing may still land in a slab the next save reuses
            raise
        if flat.device is not None and exporter is not None:  # (a device copy is the exporter's)
            flat.device.launch()  # lazy: the copies are queued in the background from now on
            exporter.make_plans()  # (then, on the same thread, what the next save walks in bulk)
        self._unwaited.append(handle)
        _exit.track_save(handle)
        if also is not None and second is not None:
            also._unwaited.append(second)
            _exit.track_save(second)
        if self.lazy:
            # The second save reads this one's copies, not the live state: the
            # step pre-hook waits for this one alone.
            self._pending.append(handle)
            for obj in flat.stateful:
                self._guard(obj)
        return handle, second, failure

    def _save(
        self, step: int, entries: Dict[str, object], exporter: Optional[PlannedExporter], also: Optional["Checkpointer"] = None
    ) -> Tuple[SaveHandle, Flattened, Optional[SaveHandle], Optional[Exception]]:
        """``save`` up to the engine's: the walk, the device copies' start, the
        engine's save (and ``also``'s, see :meth:`_save_shared`); returns the
        handles, the walk's result and ``also``'s failure."""
        me, ranks = self._own_identity()
        prefix = _own.name(me)
        local = _own.local(entries, self._rng)  # (entries: this save's own dict)
        t0 = time.perf_counter()
        flat = flatten(entries, self.lazy, exporter, local, prefix)
        own_ranks: Optional[int] = None
        if local is not None:
            # Only rank 0's metadata reaches the manifest: each rank's own tree
            # travels as a tensor of its own (see ckpt._state.own).
            if prefix in flat.names:
                raise InvalidInputError(f"the tensor name {prefix!r} is reserved by ckpt")
            flat.tensors.append(_own.encode(flat.local_tree, flat.local_numpy_names, me))
            own_ranks = ranks
        meta = _ckpt.meta(flat.tree, flat.numpy_names, own_ranks, self._acting_for)
        device = flat.device
        t1 = time.perf_counter()
        ready = None
        # Lazy mode: whether the step pre-hook must wait on the host for CPU
        # tensors still copied in the background (CUDA copies are fenced on
        # the GPU's stream instead).
        host_lazy = False
        if device is not None:
            if self.lazy:
                host_lazy = _small_now(flat.tensors)
            slots = device.start(step)
            if slots is not None:
                flat.tensors = _into_slots(flat.tensors, slots)
            if self.lazy:
                ready = device.wait_landed
            else:
                device.wait_landed()  # eager: the copy is complete when save returns
        elif self.lazy:
            host_lazy = any(not t.copy_now for t in flat.tensors)
        t2 = time.perf_counter()
        native = self._native.save(step, flat.tensors, meta, ready, share=also is not None)
        handle = SaveHandle(native, device)
        handle._host_lazy = host_lazy
        second: Optional[SaveHandle] = None
        failure: Optional[Exception] = None
        if also is not None:
            # The snapshot's own bytes: CPU tensors are copied once, CUDA
            # tensors land once in one slab. Eager: taken already. Lazy: once
            # this save's background copy has taken them.
            tag = _ckpt.meta(None, flat.numpy_names, own_ranks, also._acting_for)
            try:
                also._reap()
                if self.lazy:
                    # Without "state", the engine reuses this save's tree as
                    # it converted it (converting it again cost about 1.5 ms).
                    native = also._native.save_after(step, native, tag)
                else:
                    meta = _ckpt.meta(flat.tree, flat.numpy_names, own_ranks, also._acting_for)
                    native = also._native.save(step, native.snapshot_specs() or flat.tensors, meta)
            except Exception as e:  # noqa: BLE001 - returned: this save has started
                failure = e
            else:
                second = SaveHandle(native, device)
                second._host_lazy = host_lazy
        handle._marks = (t0, t1, t2, time.perf_counter())
        return handle, flat, second, failure

    def wait_snapshot(self, timeout: Optional[float] = None) -> None:
        """Block until every snapshot in progress is copied (lazy mode): call it
        before mutating saved state other than through a guarded optimizer step."""
        while self._pending:
            self._pending[0].wait_snapshot(timeout)
            self._pending.pop(0)

    def _before_step(self) -> None:
        """The lazy-mode step pre-hook: each snapshot in progress is copied, or
        its CUDA copies are ordered before whatever the current streams run next."""
        for h in self._pending:
            h._before_step()
        self._pending = [h for h in self._pending if not h.snapshot_done()]

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every save started so far is committed (and what they
        leave to ckpt's background thread is done); raises the first failure
        among them."""
        self._native.flush(timeout)
        handles, self._unwaited = self._unwaited, []
        self._pending.clear()
        for h in handles:
            if not h._observed:
                h.wait(timeout)
        pool = self._pool(False)
        if pool is not None:
            pool.drain()  # (the plans of repeated saves, ckpt._save.repeat)

    def close(self) -> None:
        """Wait for every save, then remove the optimizer hooks."""
        self._closed = True
        _ahead.hooks_off(self)
        try:
            self.wait()
        finally:
            for h in self._hooks.values():
                h.remove()
            self._hooks.clear()
            if self._slabs is not None:
                self._slabs.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- loading

    def load_latest(self, state: Optional[LiveState] = None, /, **named: object) -> Optional[int]:
        """Restore the newest intact checkpoint in place; return its step, or
        ``None`` when there is none (a fresh start).

        Objects with ``load_state_dict`` get their state dict back, tensors and
        arrays are filled in place, dicts and lists are updated in place, and
        other values of a ``state`` dict are replaced. The global RNGs are
        restored too (unless ``rng=False``).

        Tensor data goes straight into the live tensors (CPU memory is handed to
        the engine; CUDA tensors are filled through host buffers). A sharded
        tensor (DTensor: FSDP2, tensor parallel) gets the part of the global
        tensor its local shard covers, whatever the mesh was at save, and only
        the stored pieces that overlap it are read; an optimizer that has not
        stepped yet gets its state with its parameters' layout. A checkpoint
        saved by N ranks loads into M ranks, or into one plain process.

        Damaged newer checkpoints are skipped; with several ranks every rank
        skips the same ones (a checkpoint counts as intact only if every rank
        read its part intact). Rank 0 says once, on logger ``"ckpt"``
        (``WARNING``), what it passed over: those, and newer saves that never
        committed (:mod:`ckpt._restore.passed`). If every checkpoint is damaged after
        some data was already written into the live tensors, this raises
        :class:`~ckpt.CorruptError` instead of returning ``None``.

        Raises :class:`~ckpt.InvalidInputError`, before anything is written,
        when the call does not fit the newest checkpoint: an entry it does not
        have, a module whose state dict keys differ from the stored ones (one
        that loads its own way is left to its ``load_state_dict``), an
        optimizer over other parameters, a tensor of another shape or dtype
        or on the meta device. That is the caller's mistake, not damage: no checkpoint is skipped
        for it (see :mod:`ckpt._state.match`).

        ``per_rank=d`` (a dict) restores this rank's ``per_rank`` state of
        the save into ``d`` as ``extra`` entries are restored: objects with
        ``load_state_dict`` (a ``StatefulDataLoader``) in place, tensors
        copied into, other values (a tuple batch) replaced in ``d``; stored
        keys ``d`` lacks are added, keys the save lacks stay as they are.
        Rank r gets what rank r saved. A rank the saving job did not have
        (a restart with more ranks) gets nothing: ``d`` stays as it was, a
        logger ``"ckpt"`` says so and :attr:`last_per_rank` is None; with fewer
        ranks, the state of the ranks beyond them is not read.

        :attr:`last_restore` then says where the call's time went, and
        :attr:`last_per_rank` what ``per_rank`` state it found.
        """
        t0 = time.perf_counter()
        skipped: List[Tuple[int, str, CheckpointError]] = []
        wrote = False
        restored: Optional[int] = None
        damaged = 0.0
        with collector_paused():  # see ckpt._runtime.gc: a restore's plan and walk make as many objects as a save's
            targets = self._targets(state, named)
            self._native.flush(None)  # no save of ours is using the coordinator now
            for step, attempt in reversed(self._candidates()):
                error, started, times = self._attempt(step, attempt, state, targets)
                if error is None:
                    restored = step
                    break
                wrote = wrote or started
                skipped.append((step, attempt, error))
                damaged += times.total
        if restored is None and skipped and wrote:
            s, a, err = skipped[0]
            raise CorruptError(
                f"no intact checkpoint to restore, and the live state was partly overwritten while trying "
                f"({len(skipped)} damaged; the newest, step {s} attempt {a}: {err})"
            )
        _passed.say(self._native, restored, skipped)
        if restored is None:
            _ahead.reserve(self, state, named)
        else:
            _ahead.after_restore(self, state, named)
            self.last_restore = times.ending(t0, damaged)
        return restored

    def load(self, step: int, state: Optional[LiveState] = None, /, **named: object) -> int:
        """Restore the checkpoint of ``step`` in place (see :meth:`load_latest`);
        a damaged checkpoint raises its error (on every rank).

        To train on from it while checkpoints of later steps are committed
        (a rollback), call :meth:`discard_after` with ``step`` before saving
        again: a save of a step before a committed checkpoint's is refused."""
        t0 = time.perf_counter()
        if type(step) is not int or step < 0:
            raise InvalidInputError(f"step must be a non-negative int, not {step!r}")
        with collector_paused():  # (as in load_latest)
            targets = self._targets(state, named)
            self._native.flush(None)
            found = [a for s, a in self._native.committed() if s == step]
            if not found:
                raise NotFoundError(f"no committed checkpoint of step {step}")
            error, _, times = self._attempt(step, found[-1], state, targets)
        if error is not None:
            raise error
        _ahead.after_restore(self, state, named)
        self.last_restore = times.ending(t0)
        return step

    def read_latest(self, framework: Optional[str] = None) -> Optional[Checkpoint]:
        """The newest intact checkpoint as data, or ``None``.

        Tensors come back as they were saved (torch tensors as torch, numpy
        arrays as numpy) unless ``framework`` is ``"np"`` or ``"pt"``.
        """
        with collector_paused():  # see ckpt._runtime.gc: thousands of objects made at once, few of them cyclic
            loaded = self._native.load_latest()
            return None if loaded is None else self._checkpoint(loaded, framework)

    def read(self, step: int, framework: Optional[str] = None) -> Checkpoint:
        """The checkpoint of ``step`` as data (see :meth:`read_latest`)."""
        with collector_paused():  # (as in read_latest)
            return self._checkpoint(self._native.load(step), framework)

    def steps(self) -> List[int]:
        """Steps of the committed checkpoints, oldest first."""
        return [s for s, _ in self._native.committed()]

    def list(self, verify: bool = False) -> List[_Listed]:
        """Every checkpoint under the root with its status (``verify`` reads all data)."""
        return self._native.list(verify)

    def io_counts(self) -> Dict[str, int]:
        """What this process has read from and written to storage so far:
        ``read_bytes``, ``written_bytes``, ``gets``, ``puts``, ``deletes``,
        ``lists``. Subtract two readings to measure one save or load."""
        return dict(self._native.io_counts())

    def gc(self) -> GcReport:
        """Apply the retention policy (``keep_last``, ``keep_every``) and delete
        unreferenced data now, instead of after the next commit: retired
        checkpoints, the data of incomplete saves (a crash's leftovers) and
        chunks no kept checkpoint references. Waits for this process's saves
        in flight to be written first; returns what was removed.

        In a job of several ranks only rank 0 collects (it alone publishes
        checkpoints); the other ranks return an empty report at once.
        """
        if self.rank != 0:
            return GcReport()
        return self._native.gc()

    def discard_after(self, step: int) -> GcReport:
        """Discard every committed checkpoint of a step after ``step``, so
        that ``step``'s is the newest: how a job rolls back.

        A job that goes back to an earlier checkpoint (after a loss spike,
        say) restores it with :meth:`load`, then calls this before it saves
        again. Without it, its saves are refused with
        :class:`~ckpt.ConflictError`: :meth:`load_latest` resumes from the
        newest step, so a restart would go back to the run the job left, not
        to those saves.

        With fencing on (the default), one claim of the root's next writer
        epoch makes the change, whole or not at all if the job dies meanwhile,
        on both tiers of a ``tiered+`` root; the later checkpoints' files are
        then deleted. An older incarnation of the job still running gets
        :class:`~ckpt.FencedError` and discards nothing.

        Call it on every rank, after this process's saves (it waits for those
        in flight). Rank 0 discards; every rank returns once it has, with the
        same outcome. Returns what rank 0 removed (the discarded checkpoints
        are in ``retired``, with whatever retention retired in the same
        round); other ranks get an empty report.
        """
        if type(step) is not int or step < 0:
            raise InvalidInputError(f"step must be a non-negative int, not {step!r}")
        self._native.flush(None)  # no save of ours is using the coordinator now
        report = GcReport()
        error: Optional[BaseException] = None
        if self.rank == 0:
            try:
                report = self._native.discard_after(step)
            except (KeyboardInterrupt, SystemExit):
                raise
            except Exception as e:  # noqa: BLE001 - every rank must learn of it
                error = e
        verdict = _agree(self._native, error, f"discard after step {step}")
        if verdict is not None:
            raise verdict
        return report

    def __repr__(self) -> str:
        return f"ckpt.Checkpointer({self.url!r}, lazy={self.lazy})"

    # ---------------------------------------------------------------- helpers

    def _own_identity(self) -> Tuple[int, int]:
        """The rank whose own state this checkpointer keeps, and the job's ranks."""
        return self._acting_for or (self.rank, self.world_size)

    def _entries(self, state: Optional[Mapping[str, object]], named: Dict[str, object]) -> Dict[str, object]:
        entries: Dict[str, object] = {}
        if state is not None:
            if not isinstance(state, Mapping):
                raise InvalidInputError(f"state must be a mapping, not {type(state).__name__}")
            entries.update(state)
        for k, v in named.items():
            if k in entries:
                raise InvalidInputError(f"{k!r} given both in state and as a keyword")
            entries[k] = v
        if self._rng and "rng" in entries:
            raise InvalidInputError('the key "rng" is reserved for the RNG state (open with rng=False to use it)')
        return entries

    def _targets(self, state: Optional[LiveState], named: Dict[str, object]) -> List[Tuple[str, object]]:
        if state is not None and not isinstance(state, MutableMapping):
            raise InvalidInputError(f"state must be a mutable mapping, not {type(state).__name__}")
        targets = list((state or {}).items()) + list(named.items())
        keys = [k for k, _ in targets]
        if len(set(keys)) != len(keys):
            raise InvalidInputError("an entry was given both in state and as a keyword")
        return targets

    def _candidates(self) -> List[Tuple[int, str]]:
        """The committed checkpoints, oldest first, as rank 0 sees them once it
        has claimed its writer epoch (fencing an older incarnation still running:
        what that one commits from now on is passed over). Every rank tries the
        same ones in the same order."""
        self._native.claim()
        ids = self._native.committed()
        if self._native.world_size > 1:
            agreed = self._native.broadcast(json.dumps(ids).encode(), 0, "load, which checkpoints")
            ids = [(int(s), str(a)) for s, a in json.loads(agreed)]
        return ids

    def _attempt(
        self, step: int, attempt: str, state: Optional[LiveState], targets: List[Tuple[str, object]]
    ) -> Tuple[Optional[CheckpointError], bool, "_AttemptTimes"]:
        """Restore one checkpoint: plan, load, agree, apply (see :mod:`ckpt._restore.load`).

        Returns ``(error, wrote, times)``: ``error`` is None when restored, the
        damage when the checkpoint is damaged on any rank; ``wrote`` whether
        the load wrote into memory (live tensors included); ``times`` where
        the attempt's time went. Other errors are raised, on every rank."""
        error: Optional[BaseException] = None
        restore: Optional[_load.Restore] = None
        stage: Optional[HostStage] = None
        self.last_per_rank = None
        marks = [time.perf_counter()]  # start, planned, read, agreed, applied
        try:
            me = self._own_identity()[0]
            stage = self._host_stage()
            restore = _load.plan(self._native, step, attempt, targets, self._rng, stage, me)
            marks.append(time.perf_counter())
            native = self._native
            restore.plan.load(lambda requests: native.load_into(step, attempt, requests))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
        while len(marks) < 3:  # read (or failed before or during it)
            marks.append(time.perf_counter())
        wrote = restore is not None and restore.writes
        verdict = _agree(self._native, error, f"load of step {step}")
        marks.append(time.perf_counter())
        if verdict is not None:
            if restore is not None:
                restore.plan.abandon()
            if isinstance(verdict, CheckpointError) and _ckpt.is_damage(verdict):
                self._native.note_damaged(step, attempt)
                return verdict, wrote, _AttemptTimes(marks + [marks[-1]], stage)
            raise verdict
        assert restore is not None  # no rank failed, this one included
        self.last_per_rank = _load.apply(restore, state, targets, self._own_identity()[0], self._rng)
        marks.append(time.perf_counter())
        return None, wrote, _AttemptTimes(marks, stage)

    def _checkpoint(self, loaded: _load.Loaded, framework: Optional[str]) -> Checkpoint:
        step, attempt = loaded[0], loaded[1]
        state, skipped = _load.read(loaded, framework, self._own_identity()[0])
        return Checkpoint(step, attempt, state, skipped)

    def _reap(self) -> None:
        """Forget finished saves; raise the error of one that failed in the background."""
        self._pending = [h for h in self._pending if not h.snapshot_done()]
        still, failed = [], None
        for h in self._unwaited:
            if h._observed:
                continue
            if not h.done():
                still.append(h)
                continue
            try:
                h.wait(0.0)
            except CheckpointError as e:
                failed = failed or e
        self._unwaited = still
        if failed is not None:
            raise failed

    def _exporter(self) -> Optional[PlannedExporter]:
        if "torch" not in sys.modules:
            return None
        exporter = _exporter_class()
        return exporter(self._pool(_ahead.cuda_ready()), self.lazy, self._host_plans)

    @overload
    def _pool(self, create: Literal[True]) -> SlabPool: ...
    @overload
    def _pool(self, create: bool) -> Optional[SlabPool]: ...
    def _pool(self, create: bool) -> Optional[SlabPool]:
        """The slab pool this checkpointer's CUDA saves and restores use (its
        own, or the one of ``_pool_of``), made now if ``create``."""
        owner = self._pool_of or self
        if owner._slabs is None and create:
            from ckpt._device.cuda import SlabPool

            owner._slabs = SlabPool(owner._native, owner._device_staging)
        return owner._slabs

    def _host_stage(self) -> Optional[HostStage]:
        """Where a restore's CUDA tensors land on the host: a slab of this
        checkpointer's pool (page-locked, reused by later saves and restores)."""
        if not _ahead.cuda_ready():
            return None
        from ckpt._device.cuda import HostStage

        return HostStage(self._pool(True), keep=not self._read_only)

    def _guard(self, obj: object) -> None:
        """Install the lazy-mode step pre-hook on an optimizer (once)."""
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.optim.Optimizer) or id(obj) in self._hooks:
            return
        me = weakref.ref(self)

        def wait_for_snapshots(_opt: Optimizer, _args: object, _kwargs: object) -> None:
            cp = me()
            if cp is not None:
                cp._before_step()

        self._hooks[id(obj)] = cast("Optimizer", obj).register_step_pre_hook(wait_for_snapshots)


class _AttemptTimes:
    """One restore attempt's marks (``perf_counter``: its start, the plan made,
    the read done, the ranks agreed, applied) and its host stage's timings."""

    def __init__(self, marks: List[float], stage: Optional[HostStage]) -> None:
        self.marks = marks
        self.stage = stage

    @property
    def total(self) -> float:
        return self.marks[-1] - self.marks[0]

    def ending(self, t0: float, damaged: float = 0.0) -> RestorePhases:
        """The phases of a call that began at ``t0`` and restored with this attempt."""
        start, planned, read, agreed, applied = self.marks
        lock = getattr(self.stage, "lock_s", 0.0)
        to_device = getattr(self.stage, "to_device_s", 0.0)
        return RestorePhases(
            plan=planned - start, read=read - planned, agree=agreed - read, lock=lock, to_device=to_device,
            apply=max(0.0, applied - agreed - lock - to_device), total=time.perf_counter() - t0, damaged=damaged,
            slab=getattr(self.stage, "how", None),
        )


_EXPORTER: Optional[Type[PlannedExporter]] = None


def _exporter_class() -> Type[PlannedExporter]:
    """:class:`ckpt._save.repeat.PlannedExporter`, imported once (torch is imported):
    an import statement in every save's stall went through the import
    machinery each time, tens of microseconds."""
    global _EXPORTER
    if _EXPORTER is None:
        from ckpt._save.repeat import PlannedExporter

        _EXPORTER = PlannedExporter
    return _EXPORTER


#: In lazy mode, CPU tensors smaller than this are copied at once when the save
#: also has CUDA tensors (an optimizer's ``step`` counters): copying them costs
#: microseconds, and it spares the step pre-hook a host wait.
_SMALL = 64 << 10


def _small_now(tensors: List[_ckpt.TensorSpec]) -> bool:
    """Mark CPU tensors under ``_SMALL`` bytes to be copied at once; returns
    whether a CPU tensor is still left to copy in the background."""
    from ckpt._device.cuda import Pending

    deferred = False
    for i, t in enumerate(tensors):
        if t.copy_now:
            continue
        data = t.data
        kind = type(data)
        if kind is Pending or kind is _ckpt.SlabSlot:
            continue
        if _nbytes(data) < _SMALL:
            tensors[i] = t.replace(copy_now=True)
        else:
            deferred = True
    return deferred


def _nbytes(buf: object) -> int:
    n = getattr(buf, "nbytes", None)
    return len(cast(Sized, buf)) if n is None else int(n)


def _into_slots(tensors: List[_ckpt.TensorSpec], slots: List[_ckpt.SlabSlot]) -> List[_ckpt.TensorSpec]:
    """The tensors with their CUDA bytes (pending, or a slot of a guessed slab
    that turned out not to fit) replaced by the slots they land in."""
    from ckpt._device.cuda import Pending

    out = []
    for t in tensors:
        data = t.data
        if type(data) is Pending or type(data) is _ckpt.SlabSlot:
            t = t.replace(data=slots[data.index], copy_now=False)
        out.append(t)
    return out
