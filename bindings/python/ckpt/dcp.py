"""PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``) on a ckpt root.

>>> import torch.distributed.checkpoint as dcp
>>> from ckpt.dcp import StorageReader, StorageWriter
>>> dcp.save(state, checkpoint_id="step-100", storage_writer=StorageWriter("file:///ckpt/run"))   # doctest: +SKIP
>>> dcp.load(state, checkpoint_id="step-100", storage_reader=StorageReader("file:///ckpt/run"))   # doctest: +SKIP

A DCP save is an ordinary ckpt checkpoint of the root at ``url``, committed by
ckpt's engine (verified chunks, deduplication of unchanged data, the manifest
last, writer epochs): each rank's write items become ckpt tensors named by
their fully qualified names, a shard of a sharded tensor (DTensor, FSDP2) a
piece of its global tensor at its offsets, so a load on any number of ranks
reads only the boxes DCP's planner asks for. DCP's ``Metadata`` is stored as
plain data in the checkpoint (its state is ``{"dcp": ..., "tensors": ...,
"bytes": ...}``, see :mod:`ckpt._dcpmeta`); DCP's opaque byte items are
stored as ``uint8`` tensors and handed back to DCP as bytes. Nothing of ours
is pickled.

``checkpoint_id`` names the step: an int, or a string or path whose last
component ends in digits (``"step-100"``, ``"/ckpt/run/100"``: step 100; the
rest of the path is not used, the root is ``url``). A checkpoint is written
once: saving a step that is already committed raises
:class:`~ckpt.ConflictError`. The checkpoint is readable by
``ckpt.Checkpointer(url, read_only=True)`` and the ``ckpt`` command.
"""

from __future__ import annotations

import dataclasses
import io
import os
import re
import uuid
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union, cast

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint import planner as _planner
from torch.distributed.checkpoint import storage as _storage
from torch.futures import Future

from ckpt import _ckpt
from ckpt._dcpmeta import METADATA, Names, check, names, pack, tree, unpack
from ckpt._state.tensors import dtype_name
from ckpt._runtime import exit as _exit
from ckpt.distributed import Coordinator, _agree, _resolve
from ckpt.handles import SaveHandle
from ckpt.errors import CheckpointError, ConflictError, InvalidInputError, NotFoundError, UnsupportedError

if TYPE_CHECKING:
    import numpy
    from torch.distributed import ProcessGroup
    from typing_extensions import Buffer

__all__ = ["StorageWriter", "StorageReader", "step_of"]

CheckpointId = Union[str, "os.PathLike[str]", int]

_DIGITS = re.compile(r"(\d+)$")


def step_of(checkpoint_id: CheckpointId) -> int:
    """The ckpt step a DCP ``checkpoint_id`` names (see the module docs);
    raises ``ValueError`` for one that names none."""
    if isinstance(checkpoint_id, bool):
        raise ValueError(f"checkpoint_id must be an int or a path ending in digits, not {checkpoint_id!r}")
    if isinstance(checkpoint_id, int):
        if checkpoint_id < 0:
            raise ValueError(f"checkpoint_id must be a non-negative step, not {checkpoint_id}")
        return checkpoint_id
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise ValueError(f"checkpoint_id must be an int, str or path, not {type(checkpoint_id).__name__}")
    last = os.path.basename(os.fspath(checkpoint_id).rstrip("/"))
    m = _DIGITS.search(last)
    if m is None:
        raise ValueError(
            f"checkpoint_id {checkpoint_id!r} names no step: ckpt needs an int or a last path component "
            'ending in digits ("step-100" is step 100)'
        )
    return int(m.group(1))


def _valid(checkpoint_id: object) -> bool:
    try:
        step_of(cast(CheckpointId, checkpoint_id))
    except ValueError:
        return False
    return True


def _byte_view(t: torch.Tensor) -> numpy.ndarray[Tuple[int], numpy.dtype[numpy.uint8]]:
    """The bytes of a contiguous CPU tensor as a numpy ``uint8`` array (a view)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class StorageWriter(_storage.StorageWriter):
    """Writes DCP saves as ckpt checkpoints of the root ``url``.

    Every rank of the job creates one with the same ``url`` and options. The
    ckpt checkpointer behind it is opened at the first save (on every rank:
    it creates a gloo group when there are several ranks, see
    :mod:`ckpt.distributed`), so the writer can be sent to the process of
    ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``.

    Each rank hands its items to the engine at ``write_data``; rank 0 hands
    its own and DCP's metadata at ``finish`` and returns once the checkpoint
    is committed, so ``dcp.save`` returns on every rank after the commit (or
    raises its failure). Other ranks' engine saves end with that commit; the
    writer's next save, :meth:`close` or the interpreter's exit waits for them.
    A failure on any rank fails the save on every rank at once (no rank is
    left waiting for a collective timeout): the ranks agree before any engine
    save starts, and rank 0 ends them if its own part then fails.

    Args:
        url: the ckpt root (``file:///abs/dir``, a plain path, ``s3://...``).
        keep_last, keep_every, compression, level, staging_budget,
        collective_timeout, gc_grace, direct_io: as for
            :class:`ckpt.Checkpointer`.
        process_group: the ``torch.distributed`` ranks that save together
            (DCP's ``process_group``; default: the whole job).
    """

    def __init__(
        self,
        url: str,
        *,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        compression: Optional[str] = None,
        level: int = 3,
        staging_budget: Optional[int] = None,
        process_group: Optional[ProcessGroup] = None,
        collective_timeout: float = 600.0,
        gc_grace: float = 60.0,
        direct_io: Optional[bool] = None,
    ) -> None:
        super().__init__()
        self.url = url
        self._options: Dict[str, Any] = dict(
            keep_last=keep_last, keep_every=keep_every, compression=compression, level=level,
            staging_budget=staging_budget, collective_timeout=float(collective_timeout), gc_grace=float(gc_grace),
            direct_io=direct_io,
        )
        self._process_group = process_group
        self._id: Optional[CheckpointId] = None
        self._step: Optional[int] = None
        self.save_id = uuid.uuid4().hex
        self._native: Optional[_ckpt.Checkpointer] = None
        self._ranks: Optional[Coordinator] = None  # (None alone)
        self._coordinator = False
        #: Rank 0's tensors, handed to the engine with the metadata at ``finish``.
        self._held: List[_ckpt.TensorSpec] = []
        #: Another rank's engine save, ended by rank 0's commit (and finished at exit, see ckpt._runtime.exit).
        self._pending: Optional[SaveHandle] = None
        #: The state every rank hands the engine (the same on every rank).
        self._meta: object = None

    @property
    def checkpoint_id(self) -> Optional[CheckpointId]:
        """The ``checkpoint_id`` of the save in progress (or the last one)."""
        return self._id

    @property
    def step(self) -> Optional[int]:
        """The ckpt step of the save in progress (or the last one)."""
        return self._step

    def __getstate__(self) -> Dict[str, Any]:
        """What reaches the process of a process-based ``async_save``: the
        URL, options and step, not the open checkpointer."""
        if self._process_group is not None:
            raise UnsupportedError("a StorageWriter with a process_group cannot be sent to another process")
        state = dict(self.__dict__)
        state.update(_native=None, _ranks=None, _held=[], _pending=None, _meta=None)
        return state

    def reset(self, checkpoint_id: Optional[CheckpointId] = None) -> None:
        self.settle()
        if checkpoint_id is not None:
            self._step = step_of(checkpoint_id)
            self._id = checkpoint_id
        self.save_id = uuid.uuid4().hex
        self._held = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._step is None:
            raise ValueError("ckpt.dcp.StorageWriter needs a checkpoint_id (the step) for each save")
        if kwargs.get("use_collectives", True) is False:
            raise UnsupportedError("ckpt.dcp.StorageWriter commits with collectives (use_collectives=False is not supported)")
        self.settle()
        native = self._open()
        rank = kwargs.get("rank")
        if (rank is not None and int(rank) != native.rank) or bool(is_coordinator) != (native.rank == 0):
            raise InvalidInputError(
                f"DCP's rank {rank} (coordinator: {is_coordinator}) is ckpt's rank {native.rank}: give the "
                "StorageWriter the process_group given to DCP"
            )
        self._coordinator = bool(is_coordinator)

    def _open(self) -> _ckpt.Checkpointer:
        if self._native is None:
            timeout = self._options["collective_timeout"]
            self._ranks = _resolve("auto", self._process_group, timeout)
            self._native = _ckpt.Checkpointer(self.url, coordinator=self._ranks, **self._options)
        return self._native

    def prepare_local_plan(self, plan: _planner.SavePlan) -> _planner.SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[_planner.SavePlan]) -> List[_planner.SavePlan]:
        # What would fail the save at rank 0's finish fails it here, before any
        # rank writes: a committed step (as far as rank 0 knows), what ckpt
        # cannot store of DCP's metadata.
        step = self._step
        if step in {s for s, _ in self._open().committed()}:
            raise ConflictError(f"step {step} is already committed under {self.url}; a DCP checkpoint is written once")
        check(plans)
        # Every rank hands the engine the same state, naming every item.
        every = names(plans)
        return [dataclasses.replace(p, storage_data=every) for p in plans]

    def write_data(self, plan: _planner.SavePlan, planner: _planner.SavePlanner) -> Future[List[_storage.WriteResult]]:
        native, step = self._open(), self._step
        assert step is not None  # (set_up_storage_writer checked it)
        specs: List[_ckpt.TensorSpec] = []
        results: List[_storage.WriteResult] = []
        error: Optional[Exception] = None
        meta: object = None
        try:
            every = cast(Optional[Names], plan.storage_data)
            if not isinstance(every, dict):
                raise InvalidInputError("write_data of a plan that StorageWriter.prepare_global_plan did not prepare")
            for item in plan.items:
                spec, size = _spec(item, planner.resolve_data(item))
                if spec is not None:
                    specs.append(spec)
                results.append(_storage.WriteResult(index=item.index, size_in_bytes=size, storage_data=item.index.fqn))
            meta = _ckpt.meta(tree(every), [], None, None)
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
        # The ranks agree first (on ckpt's group, idle between saves): once one
        # rank's engine save starts, the commit needs every rank's, so none
        # starts unless every rank can.
        native.flush(None)
        verdict = _agree(native, error, f"dcp.save of step {step}, write_data")
        if verdict is not None:
            raise verdict
        self._meta = meta
        if self._coordinator:
            self._held = specs
        else:
            self._pending = SaveHandle(native.save(step, specs, meta))
            _exit.track_save(self._pending)
        done: Future[List[_storage.WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: _md.Metadata, results: List[List[_storage.WriteResult]]) -> None:
        step = self._step
        assert step is not None
        native = self._open()
        specs, self._held = self._held, []
        try:
            metadata.storage_meta = self.storage_meta()
            metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
            data = pack(metadata)
            specs.append(_ckpt.TensorSpec(name=METADATA, dtype="U8", shape=[len(data)], data=data))
        except BaseException:
            self._abort(native, step)
            raise
        native.save(step, specs, self._meta).wait()

    def _abort(self, native: _ckpt.Checkpointer, step: int) -> None:
        """End the other ranks' engine saves of ``step`` now, when rank 0
        cannot save its part: a save of nothing with another state fails
        on every rank at once (the engine compares the ranks' states)."""
        if native.world_size <= 1:
            return
        try:
            native.save(step, [], _ckpt.meta({"aborted": True}, [], None, None)).wait()
        except CheckpointError:
            pass

    def storage_meta(self) -> Optional[_md.StorageMeta]:
        cid = self._id
        return _md.StorageMeta(checkpoint_id=str(cid) if isinstance(cid, int) else cid, save_id=self.save_id)

    def settle(self, timeout: Optional[float] = None) -> None:
        """Wait for this rank's engine save of the last checkpoint (ranks other
        than 0). Its failure is not raised again: the commit is rank 0's, and
        rank 0's ``finish`` failed with it, which DCP raised on every rank."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.wait(timeout)
            except CheckpointError:
                pass

    def close(self) -> None:
        """Wait for this rank's last save (:meth:`settle`) and let go of the checkpointer."""
        self.settle()
        self._native = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike[str]]) -> bool:
        """Whether ``checkpoint_id`` names a ckpt step (see the module docs)."""
        return _valid(checkpoint_id)


def _spec(item: _planner.WriteItem, data: Union[torch.Tensor, io.BytesIO]) -> Tuple[Optional[_ckpt.TensorSpec], int]:
    """The engine's tensor for one write item (``None`` for an empty piece), and its bytes."""
    fqn = item.index.fqn
    if item.type == _planner.WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise InvalidInputError(f"{fqn}: the planner resolved a byte item to {type(data).__name__}")
        raw = data.getvalue()
        return _ckpt.TensorSpec(name=fqn, dtype="U8", shape=[len(raw)], data=raw), len(raw)
    if not isinstance(data, torch.Tensor) or item.tensor_data is None:
        raise InvalidInputError(f"{fqn}: the planner resolved a tensor item to {type(data).__name__}")
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    chunk = item.tensor_data.chunk
    size = [int(s) for s in item.tensor_data.size]
    offsets = [int(o) for o in chunk.offsets]
    shape = [int(s) for s in t.shape]
    if shape != [int(s) for s in chunk.sizes]:
        raise InvalidInputError(f"{fqn}: the planner's chunk has shape {list(chunk.sizes)}, its tensor {shape}")
    whole = shape == size and not any(offsets)
    if t.numel() == 0 and not whole:
        return None, 0  # an empty piece of a sharded tensor: nothing to store
    shard = None if whole else _ckpt.Shard(size, offsets)
    spec = _ckpt.TensorSpec(name=fqn, dtype=dtype_name(t.dtype), shape=shape, data=_byte_view(t), shard=shard)
    return spec, t.numel() * t.element_size()


class StorageReader(_storage.StorageReader):
    """Reads a checkpoint of the ckpt root ``url`` for ``dcp.load``.

    Each rank reads the boxes its own plan asks for, and nothing else.
    ``checkpoint_id`` names the step (see the module docs); without one, each
    rank reads the newest committed checkpoint it finds (give one while a job
    may be committing to the root, so all ranks read the same). A damaged chunk fails the load with
    :class:`~ckpt.CorruptError` (inside DCP's ``CheckpointException`` when
    DCP gathers the ranks' failures).
    """

    def __init__(self, url: str, *, direct_io: Optional[bool] = None) -> None:
        super().__init__()
        self.url = url
        self._direct_io = direct_io
        self._id: Optional[CheckpointId] = None
        self._step: Optional[int] = None
        self.load_id = uuid.uuid4().hex
        self._native: Optional[_ckpt.Checkpointer] = None
        self._attempt: Optional[Tuple[int, str]] = None
        self._metadata: Optional[_md.Metadata] = None

    @property
    def checkpoint_id(self) -> Optional[CheckpointId]:
        return self._id

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_native=None)
        return state

    def reset(self, checkpoint_id: Optional[CheckpointId] = None) -> None:
        if checkpoint_id is not None:
            self._step = step_of(checkpoint_id)
            self._id = checkpoint_id
        self.load_id = uuid.uuid4().hex
        self._attempt = None
        self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> _md.Metadata:
        # Opened anew for each load: it lists the root then (a read-only
        # checkpointer never fences the job writing it).
        native = _ckpt.Checkpointer(self.url, read_only=True, direct_io=self._direct_io)
        committed = native.committed()
        if self._step is None:
            if not committed:
                raise NotFoundError(f"no committed checkpoint under {self.url}")
            step, attempt = committed[-1]
        else:
            found = [a for s, a in committed if s == self._step]
            if not found:
                raise NotFoundError(f"no committed checkpoint of step {self._step} under {self.url}")
            step, attempt = self._step, found[-1]
        state, _, _ = _ckpt.read_meta(native.meta(step, attempt))
        if state.get("dcp") != _ckpt.TensorRef(METADATA):
            raise UnsupportedError(f"the checkpoint of step {step} under {self.url} was not written through ckpt.dcp")
        (_, _, buf), = native.load_tensors(step, [METADATA], attempt).values()
        metadata = unpack(bytes(memoryview(buf)))
        if metadata.storage_meta is None:
            metadata.storage_meta = _md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._native, self._attempt = native, (step, attempt)
        return metadata

    def set_up_storage_reader(self, metadata: _md.Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._native is None:
            self.read_metadata()
        self._metadata = metadata

    def prepare_local_plan(self, plan: _planner.LoadPlan) -> _planner.LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[_planner.LoadPlan]) -> List[_planner.LoadPlan]:
        return plans

    def read_data(self, plan: _planner.LoadPlan, planner: _planner.LoadPlanner) -> Future[None]:
        native, at, metadata = self._native, self._attempt, self._metadata
        if native is None or at is None or metadata is None:
            raise InvalidInputError("read_data before set_up_storage_reader")
        step, attempt = at
        byte_items = [r for r in plan.items if r.type == _planner.LoadItemType.BYTE_IO]
        if byte_items:
            loaded = native.load_tensors(step, sorted({r.storage_index.fqn for r in byte_items}), attempt)
            for r in byte_items:
                planner.load_bytes(r, io.BytesIO(bytes(memoryview(loaded[r.storage_index.fqn][2]))))
        boxes: List[Tuple[_planner.ReadItem, torch.Tensor, Optional[torch.Tensor]]] = []
        targets: List[_ckpt.LoadTarget] = []
        for r in plan.items:
            if r.type == _planner.LoadItemType.BYTE_IO:
                continue
            fqn = r.storage_index.fqn
            md = metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, _md.TensorStorageMetadata):
                raise NotFoundError(f"the checkpoint of step {step} has no tensor {fqn!r}")
            dest = planner.resolve_tensor(r).detach()
            lengths = [int(n) for n in r.lengths]
            if [int(n) for n in dest.shape] != lengths:
                raise InvalidInputError(f"{fqn}: DCP's destination has shape {list(dest.shape)}, its read {lengths}")
            direct = dest.device.type == "cpu" and dest.is_contiguous() and dest.dtype == md.properties.dtype
            into = dest if direct else torch.empty(lengths, dtype=md.properties.dtype)
            boxes.append((r, dest, None if direct else into))
            if into.numel() == 0:
                continue
            base = r.storage_index.offset or [0] * len(lengths)
            at_offsets = [int(a) + int(b) for a, b in zip(base, r.storage_offsets)]
            size = [int(s) for s in md.size]
            shard = None if at_offsets == [0] * len(size) and lengths == size else _ckpt.Shard(size, at_offsets)
            targets.append(
                _ckpt.LoadTarget(name=fqn, dtype=dtype_name(into.dtype), shape=lengths, dest=cast("Buffer", _byte_view(into)), shard=shard)
            )
        if targets:
            native.load_into(step, attempt, targets)
        for r, dest, staged in boxes:
            if staged is not None:
                dest.copy_(staged)
            planner.commit_tensor(r, dest)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike[str]]) -> bool:
        """Whether ``checkpoint_id`` names a ckpt step (see the module docs)."""
        return _valid(checkpoint_id)

