"""The memory tier: each rank's newest checkpoints in host memory that outlives
the training process, replicated to a peer node, so a restart after losing a
rank or a whole node reads memory instead of storage.

:class:`MemoryCheckpointer` wraps two checkpoint roots per rank:

* **Memory** (``<memory_dir>/rank<r>``, on ``/dev/shm`` by default): every
  :meth:`~MemoryCheckpointer.save` is a checkpoint of this rank's own state
  by the same engine as any other root, saved by this rank alone. It
  outlives the process, not the node; the newest ``keep_in_memory`` stay.
* **Durable** (``url``): every ``durable_every``-th save also goes there as
  the job's usual coordinated checkpoint (any URL, ``tiered+...`` included).

**Replication.** Nodes are groups of consecutive ranks (``ranks_per_node``,
else ``CKPT_RANKS_PER_NODE``, MPI's shared-memory split or torchrun's
``LOCAL_WORLD_SIZE``). Rank ``r`` on node ``k`` sends each committed memory
checkpoint to the same local rank on node ``k+1`` (mod the node count),
which keeps it in ``<its memory_dir>/replica<r>``: losing any one node
leaves a copy of every rank's state. Replicas travel from one background
thread, in save order, over a communicator of ckpt's own (never interleaved
with the training's collectives); chunks the receiver holds are not sent
again, and the replica's manifest is written last, only if every object
arrived whole.

**Restart.** :meth:`~MemoryCheckpointer.load_latest` (call it at start-up on
every rank, also on a fresh start) takes the newest step every rank can get
from memory, its own copy or the replica its peer keeps, unless the durable
tier has a newer one; if any rank cannot load it, all go on to the next
older step, then to the durable tier. Memory checkpoints newer than the
resumed step are dropped.

**Another job shape.** A job restarted with another number of ranks, or on
other nodes, merges the old job's per-rank checkpoints of the newest step
every old rank still has somewhere and loads that, resharding sharded state
(:mod:`ckpt._memtier.reshape`; :attr:`last_source` is ``"memory, merged"``).

A full memory tier (ENOSPC on tmpfs) fails that memory save on every rank
(:meth:`wait` raises :class:`~ckpt.StorageError`); durable saves go on.
See ARCHITECTURE.md, "The memory tier", for the protocol.
"""

from __future__ import annotations

import errno as _errno
import hashlib
import json
import os
import queue
import shutil
import threading
import time
import warnings
from pathlib import Path
from collections.abc import Mapping, Sized
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple, Union, cast

from ckpt._runtime import exit as _exit
from ckpt._memtier import wire as wire
from ckpt import errors as errs
from ckpt._memtier import reshape as reshape
from ckpt._ckpt import GcReport
from ckpt._runtime.gc import collector_paused
from ckpt._memtier.root import MemoryRoot, Topology, describe, load_outcome, message, rebuild, write_object
from ckpt.handles import RestorePhases, SaveHandle
from ckpt.checkpointer import Checkpointer
from ckpt.distributed import MPICoordinator, TorchCoordinator, _agree
from ckpt.errors import CheckpointError, InvalidInputError, StorageError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ckpt._memtier.reshape import Holdings
    from ckpt._memtier.wire import Failure
    from ckpt.checkpointer import LiveState
    from ckpt.distributed import Coordinator, Link

__all__ = ["MemoryCheckpointer", "Topology"]


class MemoryCheckpointer:
    """Checkpoints in host memory, replicated to a peer node, with a durable
    tier written every ``durable_every`` saves (see the module docs).

    Args:
        url: the durable tier (any URL :class:`~ckpt.Checkpointer` takes).
        memory_dir: this node's memory-tier directory; ``{node}`` in it is
            replaced by the node's index (simulated nodes on one machine need
            one each). Default: ``/dev/shm/ckpt-<hash of url>/node{node}``.
        ranks_per_node: ranks per node (default: from the launcher, see the
            module docs; one node when unknown). Nodes must be the same size.
        durable_every: also save to ``url`` on every Nth save (the first save
            included); 0: never.
        keep_in_memory: memory checkpoints (and replicas) kept per rank.
        replicate: send each memory checkpoint to the peer node (needs two
            nodes or more).
        coordinate, process_group, collective_timeout: as for
            :class:`~ckpt.Checkpointer`; ``collective_timeout`` is also how
            long a replica's peer may take to answer.
        **options: the other options of :class:`~ckpt.Checkpointer` (``lazy``,
            ``rng``, ``compression``, ``keep_last`` of the durable tier, ...).
    """

    def __init__(
        self,
        url: str,
        *,
        memory_dir: Optional[str] = None,
        ranks_per_node: Optional[int] = None,
        durable_every: int = 1,
        keep_in_memory: int = 2,
        replicate: bool = True,
        coordinate: Union[str, Coordinator] = "auto",
        process_group: Optional[ProcessGroup] = None,
        collective_timeout: float = 600.0,
        **options: Any,
    ) -> None:
        if type(durable_every) is not int or durable_every < 0:
            raise InvalidInputError(f"durable_every must be an int >= 0, not {durable_every!r}")
        if type(keep_in_memory) is not int or keep_in_memory < 1:
            raise InvalidInputError(f"keep_in_memory must be an int >= 1, not {keep_in_memory!r}")
        self.durable = Checkpointer(
            url, coordinate=coordinate, process_group=process_group, collective_timeout=collective_timeout, **options
        )
        coord = self.durable._coordinator
        self.timeout = float(collective_timeout)
        # A communicator of our own for replicas and restarts (never the engine's).
        self._link: Optional[Link] = None
        if coord is not None and self.durable.world_size > 1:
            if isinstance(coord, TorchCoordinator):
                self._link = TorchCoordinator(process_group, timeout=self.timeout)
            elif isinstance(coord, MPICoordinator):
                self._link = MPICoordinator()
            elif callable(getattr(coord, "sendrecv", None)):
                self._link = cast("Link", coord)  # (it has sendrecv)
            else:
                raise InvalidInputError("the memory tier needs a coordinator with sendrecv(data, dst, src)")
        if ranks_per_node is None and "CKPT_RANKS_PER_NODE" not in os.environ and isinstance(self._link, MPICoordinator):
            # MPI's own view of the node: the ranks that share memory with this one.
            local = self._link._open().Split_type(self._link._MPI.COMM_TYPE_SHARED)
            ranks_per_node = local.Get_size()
            local.Free()
        self.topology = Topology.from_env(self.durable.rank, self.durable.world_size, ranks_per_node)
        if memory_dir is None:
            digest = hashlib.sha256(url.encode()).hexdigest()[:16]
            memory_dir = f"/dev/shm/ckpt-{digest}/node{{node}}"
        self.node_dir = Path(memory_dir.replace("{node}", str(self.topology.node())))
        me, topo = self.topology.rank, self.topology
        incoming = self.node_dir / f".incoming{me}"
        shutil.rmtree(incoming, ignore_errors=True)  # a dead process's temporary files
        shutil.rmtree(self.node_dir / f".merged{me}", ignore_errors=True)
        self.own = MemoryRoot(self.node_dir / f"rank{me}", incoming)
        self.replica: Optional[MemoryRoot] = None
        if replicate and topo.nodes > 1:
            self.replica = MemoryRoot(self.node_dir / f"replica{topo.source()}", incoming)
        self._mem_options = {k: v for k, v in options.items() if k not in ("keep_last", "keep_every")}
        self.keep_in_memory = keep_in_memory
        self.memory = self._open_memory()
        self.durable_every = durable_every
        self._saves = 0
        self._broken = False  # the link failed; no more replication
        self._errors: List[CheckpointError] = []
        self._lock = threading.Lock()
        self._jobs: "queue.Queue[Optional[Tuple[int, Optional[SaveHandle], Optional[BaseException]]]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="ckpt-memory-tier", daemon=True)
        self._thread.start()
        _exit.track_tier(self)
        #: Where the last :meth:`load_latest` read this rank's state from:
        #: ``"memory"``, ``"peer"`` (a replica), ``"memory, merged"`` (the
        #: checkpoints of a job of another shape), ``"durable"`` or ``None``.
        self.last_source: Optional[str] = None
        #: Where the restore of the last :meth:`load_latest` went, as the
        #: checkpointer that restored timed it (the memory root's or the
        #: durable one's ``last_restore``; the tier's own agreement between
        #: ranks is outside it); ``None`` after a fresh start or a merged restore.
        self.last_restore: Optional[RestorePhases] = None
        #: Seconds each replication took on this rank (its thread), newest last.
        self.replication_seconds: List[float] = []

    def _open_memory(self, root: Optional[MemoryRoot] = None, read_only: bool = False) -> Checkpointer:
        """The checkpointer of a memory root, this rank's own by default. Its
        index of stored chunks is listed here: a root emptied behind its back
        needs a new one."""
        # The memory roots are the tier's own, and it copies checkpoints
        # between them (replicas, restores): they carry no writer epochs, and
        # an older incarnation is fenced on the durable root.
        cp = Checkpointer(
            (root or self.own).url, keep_last=self.keep_in_memory, coordinate="none", fencing=False,
            read_only=read_only, **self._mem_options,
        )
        # It saves alone, on behalf of this rank of the job (its own state, its
        # identity in the manifest: what a job of another shape merges by).
        cp._acting_for = (self.topology.rank, self.topology.world_size)
        # CUDA snapshots and restores use the durable checkpointer's slabs: a
        # durable step's one snapshot serves both tiers (see ``save``).
        cp._pool_of = self.durable
        return cp

    def _remove_strangers(self) -> None:
        """Remove the roots of ranks that no longer live on this node, or whose
        replica it no longer keeps (a job started with another shape), so the
        node's memory holds only what this job's ranks use."""
        topo = self.topology
        node = topo.node()
        mine = [r for r in range(topo.world_size) if topo.node(r) == node]
        keep = {f"rank{r}" for r in mine}
        if topo.nodes > 1:
            keep |= {f"replica{topo.source(r)}" for r in mine}
        try:
            entries = list(self.node_dir.iterdir())
        except FileNotFoundError:
            return
        for e in entries:
            stem = e.name.rstrip("0123456789")
            if stem in ("rank", "replica") and e.name != stem and e.name not in keep:
                shutil.rmtree(e, ignore_errors=True)

    # ------------------------------------------------------------------ saving

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    def memory_steps(self) -> Dict[str, List[int]]:
        """What this rank's node holds in memory, without asking the other
        ranks: ``"own"``, the steps of this rank's own memory checkpoints, and
        ``"replica"``, the steps of the replica it keeps for its peer on the
        previous node (empty with a single node). Replications in flight are
        not counted until their manifest is written."""
        held = self._holdings([])
        return {"own": list(held["own"]), "replica": list(held["held"])}

    def save(self, step: int, state: Optional[Mapping[str, object]] = None, /, **named: object) -> Optional[SaveHandle]:
        """Save ``step`` to the memory tier (and replicate it in the
        background), and every ``durable_every``-th time to the durable tier.
        Returns after the snapshot. A step the memory tier refuses
        (:class:`~ckpt.ConflictError`: it holds a checkpoint of this step or
        a later one; :class:`~ckpt.InvalidInputError`) raises here, and
        neither tier saves it. A memory-tier failure does not stop the
        durable save; :meth:`wait` raises it on every rank.

        Returns the memory tier's save, whose :attr:`~ckpt.SaveHandle.stall`
        and :attr:`~ckpt.SaveHandle.phases` cover this whole call (None when
        the memory tier refused the step). Wait with :meth:`wait`, which
        covers both tiers and the replication.

        A step saved to both tiers is walked and copied once: both engines
        save the same snapshot (CUDA tensors cross to the host once, into one
        slab of one pool; in lazy mode the optimizer's step pre-hook waits for
        both saves)."""
        t0 = time.perf_counter()
        with collector_paused():  # see ckpt._runtime.gc: a save's objects die young
            handle = self._save(step, state, named)
        return handle._finish(t0) if handle is not None else None

    def _save(self, step: int, state: Optional[Mapping[str, object]], named: Dict[str, object]) -> Optional[SaveHandle]:
        durable = self.durable_every > 0 and self._saves % self.durable_every == 0
        self._saves += 1
        handle, error = None, None
        failure: Optional[Exception] = None
        try:
            if durable:
                entries = self.memory._entries(state, named)
                handle, _, failure = self.memory._save_shared(step, entries, self.durable)
            else:
                handle = self.memory.save(step, state, **named)
        except CheckpointError as e:
            error = e
        if isinstance(error, (errs.ConflictError, InvalidInputError)):
            # Refused before anything was written (a step the memory tier
            # committed, or a state it cannot take): raised here, as a
            # checkpointer's save raises it, and the durable tier does not
            # save the step either (memory and durable would hold two runs'
            # checkpoints of one step). Every rank still takes its turn on
            # the link, offering nothing.
            self._saves -= 1
            self._jobs.put((step, None, None))
            raise error
        self._jobs.put((step, handle, error))
        if failure is not None:
            raise failure  # the durable tier refused the step (as its own save would)
        if durable and handle is None:
            self.durable.save(step, state, **named)  # the memory save failed: the durable one alone
        return handle

    def wait_snapshot(self, timeout: Optional[float] = None) -> None:
        """Block until every snapshot in progress is copied (lazy mode)."""
        self.memory.wait_snapshot(timeout)
        self.durable.wait_snapshot(timeout)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every save is committed on its tiers and replicated;
        raises a durable failure, else the first memory-tier failure (the same
        on every rank)."""
        self.durable.wait(timeout)
        self._jobs.join()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait for every save and replication, then stop the replication thread."""
        try:
            self.wait()
        finally:
            self._jobs.put(None)
            self._thread.join()
            self.memory.close()
            self.durable.close()  # last: it owns the slabs

    def _at_exit(self) -> None:
        """At the interpreter's exit (:mod:`ckpt._runtime.exit`), unless closed: the
        replications queued finish (each waits for its save), the thread
        stops, and their failures are said on stderr (nobody waits for them)."""
        if not self._thread.is_alive():
            return
        self._jobs.put(None)
        while self._thread.is_alive():
            self._thread.join(0.1)
        with self._lock:
            errors, self._errors = self._errors, []
        for e in errors:
            _exit.say(f"memory tier: {type(e).__name__}: {e}")

    def __enter__(self) -> "MemoryCheckpointer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- loading

    def load_latest(self, state: Optional[LiveState] = None, /, **named: object) -> Optional[int]:
        """Restore the newest checkpoint complete across the tiers in place
        (see the module docs) and return its step, the same on every rank, or
        ``None`` for a fresh start. :attr:`last_source` says where this rank's
        state came from."""
        self._jobs.join()  # no replication in flight: the link is ours
        # (Fencing an older incarnation on the durable root before choosing.)
        mine = self._holdings(self._durable_steps(claim=True))
        try:
            return self._load_latest(state, named, mine)
        finally:
            if self.topology.rank % self.topology.ranks_per_node == 0:
                self._remove_strangers()

    def _durable_steps(self, claim: bool) -> List[int]:
        """The durable tier's committed steps (having claimed the root's next
        writer epoch first, with ``claim``); none, with a warning, when it
        cannot be listed: memory may still do without it (and if it cannot,
        the durable load says why)."""
        try:
            if claim:
                self.durable._native.claim()
            return self.durable.steps()
        except CheckpointError as e:
            warnings.warn(f"ckpt: cannot list the durable tier ({e}); trying memory alone", stacklevel=3)
            return []

    def _holdings(self, durable: List[int]) -> Holdings:
        """What this rank can restore: the memory steps of its own root and of
        the replica it keeps (saved by the rank of this job they stand for),
        the newest durable step, and the node's memory inventory."""
        topo = self.topology
        inventory = reshape.inventory(self.node_dir, self.own.incoming)

        def steps(root: Optional[MemoryRoot], rank: int) -> List[int]:
            # Saved by rank ``rank`` of a job of this size (or saying nothing:
            # saved before the tier recorded it).
            name = None if root is None else root.path.name
            return sorted(s for r, n, s, where in inventory if where == name and r in (None, rank)
                          and n in (None, topo.world_size))

        return {
            "own": steps(self.own, topo.rank),
            "held": steps(self.replica, topo.source()),
            "durable": durable[-1] if durable else None,
            "inventory": inventory,
        }

    def _in_memory(self, everyone: List[Holdings]) -> Set[int]:
        """The steps every rank can restore from memory: its own copy, or the
        replica its peer keeps."""
        topo = self.topology
        have: List[Set[int]] = []
        for r in range(topo.world_size):
            got = set(everyone[r]["own"])
            if self.replica is not None:
                got |= set(everyone[topo.holder(r)]["held"])
            have.append(got)
        return set.intersection(*have)

    def _load_latest(self, state: Optional[LiveState], named: Dict[str, object], mine: Holdings) -> Optional[int]:
        try:
            if self._broken:
                raise RuntimeError("the link failed earlier")
            everyone = self._gather(mine)
            newest_durable = max((e["durable"] for e in everyone if e["durable"] is not None), default=None)
            for step in sorted(self._in_memory(everyone), reverse=True):
                if newest_durable is not None and step < newest_durable:
                    break
                source = self._load_from_memory(step, state, named, everyone)
                if source is not None:
                    self._forget_newer(step)
                    self.last_source, self.last_restore = source, self.memory.last_restore
                    return step
            # Checkpoints of a job of another shape (N ranks then, M now).
            found = reshape.load(self, state, named, everyone, newest_durable)
            if found is not None:
                self.last_source, self.last_restore = "memory, merged", None
                return found
        except RuntimeError as e:  # the link failed (gloo, MPI): a peer is gone or stuck
            warnings.warn(f"ckpt: the memory tier's peers did not answer ({e}); loading from durable storage", stacklevel=2)
        resumed = self.durable.load_latest(state, **named)
        self._forget_newer(-1 if resumed is None else resumed)
        self.last_source = None if resumed is None else "durable"
        self.last_restore = None if resumed is None else self.durable.last_restore
        return resumed

    def load(self, step: int, state: Optional[LiveState] = None, /, **named: object) -> int:
        """Restore the checkpoint of ``step`` in place and return ``step``:
        from memory where every rank can get it there (its own copy, else the
        replica its peer keeps, fetched first), else from the durable tier.
        :attr:`last_source` says where this rank's state came from.

        Memory checkpoints of later steps are kept: to train on from ``step``
        (a rollback), call :meth:`discard_after` with it before saving again.
        A step neither tier holds raises :class:`~ckpt.NotFoundError`; one
        whose memory copies are damaged on some rank is read from the durable
        tier, and raises the damage if that holds none (on every rank)."""
        if type(step) is not int or step < 0:
            raise InvalidInputError(f"step must be a non-negative int, not {step!r}")
        self._jobs.join()  # no replication in flight: the link is ours
        durable = self._durable_steps(claim=False)
        mine = self._holdings(durable)
        mine["has_step"] = step in durable
        damaged = False
        try:
            if self._broken:
                raise RuntimeError("the link failed earlier")
            everyone = self._gather(mine)
            if step in self._in_memory(everyone):
                source = self._load_from_memory(step, state, named, everyone)
                if source is not None:
                    self.last_source, self.last_restore = source, self.memory.last_restore
                    return step
                damaged = True
            if damaged and not any(e["has_step"] for e in everyone):
                raise errs.CorruptError(
                    f"the memory checkpoints of step {step} are damaged on some rank (and their replicas "
                    f"missing or damaged too), and the durable tier holds none of step {step}"
                )
        except RuntimeError as e:  # the link failed (gloo, MPI): a peer is gone or stuck
            warnings.warn(f"ckpt: the memory tier's peers did not answer ({e}); loading from durable storage", stacklevel=2)
        self.durable.load(step, state, **named)
        self.last_source, self.last_restore = "durable", self.durable.last_restore
        return step

    def discard_after(self, step: int) -> GcReport:
        """Discard every checkpoint of a step after ``step``, in memory (this
        rank's and the replicas it holds) and on the durable tier (see
        :meth:`ckpt.Checkpointer.discard_after`): a rollback. ``step`` must be
        a checkpoint the tier holds, in memory or durable. Call it on every
        rank; returns rank 0's report of the durable tier."""
        if type(step) is not int or step < 0:
            raise InvalidInputError(f"step must be a non-negative int, not {step!r}")
        self._jobs.join()  # no replication in flight
        self.durable._native.flush(None)  # no durable save is using the coordinator now
        durable = self.durable.steps()
        in_memory = sorted(self.own.committed())
        # The durable tier goes back to its newest checkpoint up to the step
        # (saved every ``durable_every`` saves, it may not hold the step).
        base = max((s for s in durable if s <= step), default=None)
        error: Optional[BaseException] = None
        if step not in durable and step not in in_memory:
            error = InvalidInputError(
                f"no checkpoint of step {step} to go back to (durable: {durable}, in memory: "
                f"{in_memory}); discard_after takes the step the job went back to"
            )
        elif base is None and any(s > step for s in durable):
            error = InvalidInputError(
                f"the durable tier holds no checkpoint up to step {step} (it holds {durable}): it "
                f"cannot go back to it"
            )
        verdict = _agree(self.durable._native, error, f"discard after step {step}")  # one answer on every rank
        if verdict is not None:
            raise verdict
        report = GcReport() if base is None else self.durable.discard_after(base)
        self._forget_newer(step)
        return report

    def _forget_newer(self, step: int) -> None:
        """Memory checkpoints past the resumed step belong to a timeline that is
        not resumed (the job saves those steps again)."""
        self.own.drop_newer(step)
        if self.replica is not None:
            self.replica.drop_newer(step)

    def _try_load(self, step: int, state: Optional[LiveState], named: Dict[str, object]) -> Dict[str, Any]:
        attempt = self.own.committed().get(step)
        if attempt is None:
            return {"status": "absent"}
        outcome, damage = load_outcome(lambda: self.memory.load(step, state, **named))
        if damage is not None:
            warnings.warn(f"ckpt: memory checkpoint of step {step} is damaged ({damage}); trying its replica",
                          stacklevel=4)
            self.own.drop(step, attempt)
        return outcome

    def _agree(self, mine: Dict[str, Any]) -> List[Dict[str, Any]]:
        """Every rank's outcome; a failure that is not damage is raised on every rank."""
        everyone = self._gather(mine)
        for r, o in enumerate(everyone):
            if o["status"] == "error":
                raise rebuild(r, o["error"], "load")
        return everyone

    def _load_from_memory(
        self, step: int, state: Optional[LiveState], named: Dict[str, object], everyone: List[Holdings]
    ) -> Optional[str]:
        """Load ``step`` from memory on every rank: its own copy, else the
        replica its peer keeps. ``None`` (on every rank) when some rank could
        not; its live state may then be partly overwritten, as the caller
        goes on to load an older checkpoint.

        A rank without a copy of its own (a replacement node) fetches its
        replica before any rank loads, so the other ranks' loads overlap its
        own; a copy that fails verification is replaced by its replica after."""
        me = self.topology.rank
        absent = {r for r, e in enumerate(everyone) if step not in e["own"]}
        if absent and not self._fetch(step, absent, everyone):
            return None
        first = self._agree(self._try_load(step, state, named))
        need = {r for r, o in enumerate(first) if o["status"] != "ok"}
        if not need:
            return "peer" if me in absent else "memory"
        if need & absent or not self._fetch(step, need, everyone):
            return None  # a fetched replica failed too, or there is none
        second = self._try_load(step, state, named) if me in need else {"status": "ok"}
        if any(o["status"] != "ok" for o in self._agree(second)):
            return None
        return "peer" if me in need | absent else "memory"

    def _fetch(self, step: int, need: Set[int], everyone: List[Holdings]) -> bool:
        """Every rank in ``need`` gets the replica of ``step`` its peer keeps,
        into its own memory root (a collective: every rank takes part). False
        on every rank when one of them has no replica to get; a transfer that
        fails leaves that rank without a copy, which its load then finds."""
        topo = self.topology
        me = topo.rank
        if self.replica is None or self._link is None:
            return False
        if any(step not in everyone[topo.holder(r)]["held"] for r in need):
            return False
        outgoing: List[Tuple[str, int]] = []
        if topo.source() in need:
            try:
                outgoing = self.replica.objects(step, self.replica.committed()[step])
            except (CheckpointError, KeyError):
                outgoing = []
        lists = [[tuple(x) for x in lst] for lst in self._gather(outgoing)]
        incoming = lists[topo.holder()] if me in need else []
        failure = self._transfer(self.replica, outgoing, topo.source(), self.own, incoming, topo.holder(), lists)
        if failure is not None and me in need:
            warnings.warn(f"ckpt: fetching the replica of step {step} failed: {message(failure)}", stacklevel=4)
        return True

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                t0 = time.perf_counter()
                self._replicate(*job)
                self.replication_seconds.append(time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - reported through wait()
                with self._lock:
                    self._errors.append(e if isinstance(e, CheckpointError) else errs.InternalError(f"memory tier: {e}"))
            finally:
                self._jobs.task_done()

    def _gather(self, obj: object) -> List[Any]:
        if self._link is None:
            return [obj]
        return [json.loads(b) for b in self._link.all_gather(json.dumps(obj).encode())]

    def _replicate(self, step: int, handle: Optional[SaveHandle], error: Optional[BaseException]) -> None:
        """One save's turn: learn every rank's outcome, then pass replicas on."""
        if self._broken:
            if handle is not None:
                handle.wait()  # its own failure is raised through wait()
            return
        try:
            self._replicate_on_link(step, handle, error)
        except RuntimeError as e:
            # The transport failed or timed out (a peer died): the ranks are out
            # of step on the link, so replication stops; durable saves go on.
            self._broken = True
            raise errs.CheckpointTimeoutError(f"memory tier: replication of step {step} failed: {e}") from None

    def _replicate_on_link(self, step: int, handle: Optional[SaveHandle], error: Optional[BaseException]) -> None:
        offer: Dict[str, object] = {"ok": False}
        pinned = self.node_dir / f".outgoing{self.topology.rank}"
        if handle is not None:
            try:
                handle.wait()
                if self.replica is not None:
                    objects = self.own.pin(step, handle.attempt, pinned)
                    # None: already retired by newer saves, which replicate instead.
                    offer = {"ok": objects is not None, "objects": objects}
            except CheckpointError as e:
                error = e
            except (OSError, ValueError) as e:
                error = StorageError(getattr(e, "errno", None) or _errno.EIO, f"reading back the memory checkpoint: {e}")
        if error is not None:
            offer = {"ok": False, "error": describe(error)}
        try:
            self._pass_on(step, offer, MemoryRoot(pinned, self.own.incoming))
        finally:
            shutil.rmtree(pinned, ignore_errors=True)

    def _pass_on(self, step: int, offer: Dict[str, object], pinned: MemoryRoot) -> None:
        offers = self._gather(offer)
        for r, o in enumerate(offers):
            if not o["ok"] and "error" in o:
                self._record(rebuild(r, o["error"], f"save of step {step}"))
        if self.replica is None or self._link is None:
            return
        topo = self.topology
        incoming = offers[topo.source()]
        want: List[Tuple[str, int]] = []
        if incoming["ok"]:
            objs = [tuple(x) for x in incoming["objects"]]
            want = [(k, n) for k, n in objs[:-1] if not self.replica.has(k, n)] + [objs[-1]]
        wants = self._gather(want)
        outgoing = [tuple(x) for x in wants[topo.holder()]]
        result = self._transfer(pinned, outgoing, topo.holder(), self.replica, want, topo.source(), wants)
        if result is None and want:
            try:
                self.replica.gc(self.keep_in_memory)
            except CheckpointError as e:
                result = describe(e)
        outcomes = self._gather(result)
        for r, d in enumerate(outcomes):
            if d is not None:
                self._record(rebuild(r, d, f"replica of step {step} from rank {topo.source(r)}"))

    def _record(self, e: CheckpointError) -> None:
        with self._lock:
            self._errors.append(e)

    def _transfer(
        self,
        out_root: MemoryRoot,
        outgoing: List[Tuple[str, int]],
        dst: int,
        in_root: MemoryRoot,
        incoming: List[Tuple[str, int]],
        src: int,
        everyone: Sequence[Sized],
    ) -> Optional[Failure]:
        """Send ``outgoing`` objects to ``dst`` while receiving ``incoming``
        from ``src``, one object each way per round, as many rounds as the
        longest list of any rank (``everyone``), so every pair stays in step.
        The last incoming object (the manifest) is written only if every other
        one arrived whole. Returns ``None`` or the failure, described."""
        link = self._link
        assert link is not None  # (the callers pass on replicas only over one)
        rounds = max((len(w) for w in everyone), default=0)
        failure: Optional[Failure] = None
        manifest: Optional[bytes] = None
        # Buffers reused, each object written while the next one arrives (ckpt._memtier.wire).
        sending = wire.Outgoing([(out_root, key) for key, _ in outgoing])
        receiving = wire.Incoming()
        try:
            for i in range(rounds):
                got = receiving.swap(link, sending.next(), dst, src)
                if i >= len(incoming) or failure is not None:
                    continue
                key, size = incoming[i]
                if len(got) != size:
                    failure = describe(errs.CorruptError(f"{key}: {len(got)} bytes arrived, {size} offered"))
                elif i == len(incoming) - 1:
                    manifest = bytes(got)  # written below, last
                else:
                    failure = receiving.write(in_root, key, got)
        finally:
            closing = receiving.close()
            failure = failure or closing
        if failure is None and manifest is not None:
            failure = write_object(in_root, incoming[-1][0], manifest)
        return failure
