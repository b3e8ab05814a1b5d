"""Coordination of the ranks of a job: ``torch.distributed``, mpi4py, or your own.

A checkpoint of a job of several ranks is one logical checkpoint: every rank
calls ``save`` for the same steps, writes its share in the background, and
rank 0 publishes the manifest once every share is durable. The engine needs
two collectives for that, on small byte messages; a *coordinator* provides them:

* ``rank`` and ``world_size`` (ints);
* ``all_gather(data: bytes) -> list[bytes]``: every rank's ``data``, in rank order;
* ``broadcast(data: bytes, root: int) -> bytes``: ``root``'s ``data`` on every rank;
* optionally ``gather(data: bytes, root: int) -> list[bytes]``: every rank's
  ``data`` on ``root`` (a save's commit uses it; without it, ``all_gather``).

Both coordinators here also have ``sendrecv(data, dst, src) -> bytearray`` (send
to one rank while receiving from another, point to point), which the memory
tier (:mod:`ckpt.memory`) uses to pass replicas between nodes.

The engine calls them from one background thread of its own (never from the
training loop's thread), one call at a time, with a deadline
(``collective_timeout``): a rank that died makes the others fail with
:class:`~ckpt.CheckpointTimeoutError` instead of hanging. Both coordinators here
run on a communicator of their own (a new gloo group; a duplicated MPI
communicator), so these background collectives never interleave with the
training loop's own collectives on the default group.

``Checkpointer(coordinate=...)`` picks one: ``"auto"``, ``"torch"``, ``"mpi"``,
``"none"``, or an object of your own with the two collectives.
"""

from __future__ import annotations

import os
import sys
from array import array
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, TypeVar, Union

from ckpt import _ckpt
from ckpt.errors import InvalidInputError, UnsupportedError

if TYPE_CHECKING:
    from mpi4py.MPI import Comm as MPIComm
    from torch import Tensor
    from torch.distributed import ProcessGroup

__all__ = ["Coordinator", "Link", "TorchCoordinator", "MPICoordinator", "mpi_world_size"]

#: Bytes a link sends or receives.
Data = Union[bytes, bytearray, memoryview]
#: A writable buffer a link receives into (see :meth:`TorchCoordinator.sendrecv_into`).
Into = TypeVar("Into", bytearray, memoryview)


class Coordinator(Protocol):
    """What ckpt asks of a coordinator (see the module docs)."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...

    def all_gather(self, data: bytes) -> List[bytes]: ...

    def broadcast(self, data: bytes, root: int) -> bytes: ...


class Link(Coordinator, Protocol):
    """A coordinator that also sends point to point (the memory tier's)."""

    def sendrecv(self, data: Data, dst: int, src: int) -> Data: ...

#: How much longer than ckpt's own deadline the transport may wait before it
#: gives up by itself (ckpt's deadline should be the one that fires).
_TRANSPORT_SLACK = 30.0


class TorchCoordinator:
    """Collectives over ``torch.distributed``, on a gloo group of ckpt's own.

    Creating it is a collective: every rank of ``process_group`` (default: the
    whole job) must create it, in the same order relative to other
    ``new_group`` calls. The group is always gloo (CPU), whatever backend the
    training uses (NCCL included), so messages never touch the GPU.

    Args:
        process_group: the ranks that checkpoint together (default: the world).
        timeout: seconds the gloo transport itself waits before failing.
    """

    def __init__(self, process_group: Optional[ProcessGroup] = None, timeout: float = 600.0 + _TRANSPORT_SLACK) -> None:
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidInputError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group() first "
                '(or use coordinate="none" for a job of one process)'
            )
        self._torch = torch
        self._dist = dist
        limit = timedelta(seconds=timeout)
        if process_group is None:
            self.group = dist.new_group(backend="gloo", timeout=limit)
        else:
            ranks = dist.get_process_group_ranks(process_group)
            # Only the members take part in creating it (they are the ones that build a Checkpointer).
            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=limit, use_local_synchronization=True)
        self.rank: int = dist.get_rank(self.group)
        self.world_size: int = dist.get_world_size(self.group)

    def _live(self) -> ModuleType:
        """``torch.distributed``, as long as the job has not shut it down."""
        dist = self._dist
        if not dist.is_initialized():
            # Called from ckpt's background thread: a save (or the memory
            # tier's replication) still in flight when the program destroyed
            # the process group. Typed, so it is not taken for a dead peer.
            raise InvalidInputError(
                "torch.distributed was shut down (destroy_process_group) while ckpt still had a save to "
                "coordinate; call Checkpointer.wait() or close() before destroy_process_group() "
                "(whether the save was committed: Checkpointer.steps())"
            )
        return dist

    def _tensor(self, data: bytes, length: int) -> Tensor:
        torch = self._torch
        out: Tensor = torch.zeros(length, dtype=torch.uint8)
        if data:
            out[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out

    def all_gather(self, data: bytes) -> List[bytes]:
        """Every rank's ``data``, in rank order (lengths first, then the padded bytes)."""
        torch, dist = self._torch, self._live()
        n = self.world_size
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(lens, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        sizes = [int(x.item()) for x in lens]
        longest = max(sizes)
        if longest == 0:
            return [b""] * n
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
        dist.all_gather(parts, self._tensor(data, longest), group=self.group)
        return [p[:s].numpy().tobytes() for p, s in zip(parts, sizes)]

    def gather(self, data: bytes, root: int) -> List[bytes]:
        """Every rank's ``data`` on ``root``, in rank order, and ``[]`` on the
        others: the longest length agreed first (an all-reduce of one number),
        then every rank's bytes, padded to it behind their own length, to
        ``root`` alone. What a save uses, so that a rank other than ``root``
        never receives more as the job grows."""
        torch, dist = self._torch, self._live()
        dst = dist.get_global_rank(self.group, root)
        longest = torch.tensor([len(data)], dtype=torch.int64)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.group)
        width = int(longest.item()) + 8
        mine = self._tensor(len(data).to_bytes(8, "little") + data, width)
        here = self.rank == root
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(self.world_size)] if here else None
        dist.gather(mine, parts, dst=dst, group=self.group)
        if parts is None:
            return []
        out = []
        for p in parts:
            raw = p.numpy().tobytes()
            out.append(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        return out

    def broadcast(self, data: bytes, root: int) -> bytes:
        """``root``'s ``data`` on every rank (its length first, then the bytes)."""
        torch, dist = self._torch, self._live()
        src = dist.get_global_rank(self.group, root)
        n = torch.tensor([len(data) if self.rank == root else 0], dtype=torch.int64)
        dist.broadcast(n, src=src, group=self.group)
        length = int(n.item())
        if length == 0:
            return b""
        buf = self._tensor(data if self.rank == root else b"", length)
        dist.broadcast(buf, src=src, group=self.group)
        out: bytes = buf.numpy().tobytes()
        return out

    def sendrecv(self, data: Data, dst: int, src: int) -> bytearray:
        """Send ``data`` to rank ``dst`` and receive what rank ``src`` sends to
        this rank, both at once (its length first, then the bytes).

        Point to point, not a collective: only the pairs talk. Used by the
        memory tier (:mod:`ckpt.memory`) to pass replicas around a ring of
        nodes, where every rank sends to one peer and receives from another.
        A writable buffer (``bytearray``, a ``memoryview`` of one) is sent without a copy.
        """
        out: bytearray = self.sendrecv_into(data, dst, src, bytearray)
        return out

    def sendrecv_into(self, data: Data, dst: int, src: int, buffer_for: Callable[[int], Into]) -> Into:
        """:meth:`sendrecv`, received into ``buffer_for(length)`` (a writable
        buffer of that length: the memory tier reuses its buffers, see
        :mod:`ckpt._memtier.wire`), which is returned."""
        torch, dist = self._torch, self._live()
        gdst = dist.get_global_rank(self.group, dst)
        gsrc = dist.get_global_rank(self.group, src)
        n_out = torch.tensor([len(data)], dtype=torch.int64)
        n_in = torch.zeros(1, dtype=torch.int64)
        works = [dist.isend(n_out, gdst, group=self.group), dist.irecv(n_in, gsrc, group=self.group)]
        for w in works:
            w.wait()
        length = int(n_in.item())
        out = buffer_for(length)
        works = []
        if len(data):
            buf = data if not memoryview(data).readonly else bytearray(data)
            works.append(dist.isend(torch.frombuffer(buf, dtype=torch.uint8), gdst, group=self.group))
        if length:
            works.append(dist.irecv(torch.frombuffer(out, dtype=torch.uint8), gsrc, group=self.group))
        for w in works:
            w.wait()
        return out

    def __repr__(self) -> str:
        return f"TorchCoordinator(rank={self.rank}, world_size={self.world_size})"


class MPICoordinator:
    """Collectives over MPI through mpi4py, on a duplicate of ``comm``.

    Creating it is a collective over ``comm`` (``MPI_Comm_dup``). Messages go as
    raw bytes (``Allgatherv``, ``Bcast``), never pickled. mpi4py initialises MPI
    with ``MPI_THREAD_MULTIPLE`` by default, which this needs: the calls come
    from ckpt's background thread.

    Args:
        comm: the communicator whose ranks checkpoint together (default:
            ``MPI.COMM_WORLD``).
    """

    def __init__(self, comm: Optional[MPIComm] = None) -> None:
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise UnsupportedError(f"MPI coordination needs mpi4py ({e})") from None
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise UnsupportedError(
                "MPI was initialised without MPI_THREAD_MULTIPLE; ckpt calls MPI from a background thread "
                '(leave mpi4py.rc.thread_level at its default, "multiple")'
            )
        self._MPI = MPI
        self.comm: Optional[MPIComm] = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank: int = self.comm.Get_rank()
        self.world_size: int = self.comm.Get_size()

    def _open(self) -> MPIComm:
        if self.comm is None:
            raise InvalidInputError("this MPICoordinator was closed")
        return self.comm

    def all_gather(self, data: bytes) -> List[bytes]:
        """Every rank's ``data``, in rank order."""
        MPI = self._MPI
        comm = self._open()
        lens = array("q", [0]) * self.world_size
        comm.Allgather([array("q", [len(data)]), MPI.INT64_T], [lens, MPI.INT64_T])
        displs, total = [], 0
        for n in lens:
            displs.append(total)
            total += n
        buf = bytearray(total)
        comm.Allgatherv([bytes(data), len(data), MPI.BYTE], [buf, (list(lens), displs), MPI.BYTE])
        return [bytes(buf[d : d + n]) for d, n in zip(displs, lens)]

    def gather(self, data: bytes, root: int) -> List[bytes]:
        """Every rank's ``data`` on ``root``, in rank order (``Gather`` of
        the lengths, then ``Gatherv``); ``[]`` on the others."""
        MPI = self._MPI
        comm = self._open()
        here = self.rank == root
        lens = array("q", [0]) * (self.world_size if here else 1)
        comm.Gather([array("q", [len(data)]), MPI.INT64_T], [lens, MPI.INT64_T], root=root)
        if not here:
            comm.Gatherv([bytes(data), len(data), MPI.BYTE], None, root=root)
            return []
        displs, total = [], 0
        for n in lens:
            displs.append(total)
            total += n
        buf = bytearray(max(total, 1))
        comm.Gatherv([bytes(data), len(data), MPI.BYTE], [buf, (list(lens), displs), MPI.BYTE], root=root)
        return [bytes(buf[d : d + n]) for d, n in zip(displs, lens)]

    def broadcast(self, data: bytes, root: int) -> bytes:
        """``root``'s ``data`` on every rank."""
        MPI = self._MPI
        comm = self._open()
        n = array("q", [len(data) if self.rank == root else 0])
        comm.Bcast([n, MPI.INT64_T], root=root)
        buf = bytearray(data) if self.rank == root else bytearray(n[0])
        if n[0]:
            comm.Bcast([buf, MPI.BYTE], root=root)
        return bytes(buf)

    def sendrecv(self, data: Data, dst: int, src: int) -> bytearray:
        """Send ``data`` to rank ``dst`` and receive what rank ``src`` sends to
        this rank (``MPI_Sendrecv``: lengths, then the bytes). Point to point."""
        out: bytearray = self.sendrecv_into(data, dst, src, bytearray)
        return out

    def sendrecv_into(self, data: Data, dst: int, src: int, buffer_for: Callable[[int], Into]) -> Into:
        """:meth:`sendrecv`, received into ``buffer_for(length)``, which is returned."""
        MPI = self._MPI
        comm = self._open()
        n_in = array("q", [0])
        comm.Sendrecv([array("q", [len(data)]), MPI.INT64_T], dst, 0, [n_in, MPI.INT64_T], src, 0)
        buf = buffer_for(n_in[0])
        comm.Sendrecv([data, len(data), MPI.BYTE], dst, 1, [buf, n_in[0], MPI.BYTE], src, 1)
        return buf

    def close(self) -> None:
        """Free the duplicated communicator (a collective; optional)."""
        if self.comm is not None:
            self.comm.Free()
            self.comm = None

    def __repr__(self) -> str:
        return f"MPICoordinator(rank={self.rank}, world_size={self.world_size})"


def mpi_world_size() -> int:
    """The size of the MPI job this process was launched in, from the launcher's
    environment (OpenMPI, MPICH/PMI, Slurm's PMI2), or 1."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        v = os.environ.get(var)
        if v and v.isdigit():
            return int(v)
    return 1


def _torch_world(process_group: Optional[ProcessGroup]) -> int:
    torch = sys.modules.get("torch")
    if torch is None:
        return 1
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size(process_group))


_NAMES = ("auto", "torch", "mpi", "none")


def _resolve(
    coordinate: Union[str, Coordinator], process_group: Optional[ProcessGroup], collective_timeout: float
) -> Optional[Coordinator]:
    """The coordinator for ``Checkpointer(coordinate=...)``, or ``None`` for one process.

    ``"auto"``: ``torch.distributed`` when it is initialised with more than one
    rank (in ``process_group``); else mpi4py when the process was launched by
    ``mpirun`` with more than one rank; else a job of one process. ``"torch"``
    and ``"mpi"`` insist on one; ``"none"`` checkpoints this process alone.
    Anything else must be a coordinator object (see the module docs).
    """
    if not isinstance(coordinate, str):
        if process_group is not None:
            raise InvalidInputError("process_group applies to coordinate=\"torch\"/\"auto\", not to a coordinator object")
        for m in ("all_gather", "broadcast"):
            if not callable(getattr(coordinate, m, None)):
                raise InvalidInputError(
                    f"coordinate must be one of {_NAMES} or an object with all_gather(data) and "
                    f"broadcast(data, root); {type(coordinate).__name__} has no {m}()"
                )
        return coordinate
    if coordinate not in _NAMES:
        raise InvalidInputError(f"coordinate must be one of {_NAMES} or a coordinator object, not {coordinate!r}")
    transport = float(collective_timeout) + _TRANSPORT_SLACK
    if coordinate == "none":
        return None
    if coordinate == "torch":
        return TorchCoordinator(process_group, transport)
    if process_group is not None and coordinate == "mpi":
        raise InvalidInputError('process_group is a torch.distributed group; it does not apply to coordinate="mpi"')
    if coordinate == "mpi":
        return MPICoordinator()
    # auto
    if _torch_world(process_group) > 1:
        return TorchCoordinator(process_group, transport)
    if process_group is not None:
        return None  # a group of one rank
    n = mpi_world_size()
    if n > 1:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            raise UnsupportedError(
                f"this process is one of {n} MPI ranks, but mpi4py is not installed and torch.distributed is "
                "not initialised, so the ranks cannot agree on a checkpoint: install mpi4py, initialise "
                'torch.distributed, or pass coordinate="none" to checkpoint each process on its own '
                "(each to its own URL)"
            ) from None
        return MPICoordinator()
    return None


def _agree(
    coordinator: Optional[Any], error: Optional[BaseException], phase: str = "a collective"
) -> Optional[BaseException]:
    """Agree across ranks on the outcome of a step every rank took (a load).

    Every rank passes its own failure, or ``None``; every rank gets the same
    verdict: ``None`` when all succeeded, else the failure to raise. A rank
    that failed gets its own exception back; the others get one of the same
    ckpt class (a :class:`~ckpt.CorruptError` on rank 1 is a ``CorruptError``
    on rank 0 too), naming the rank. Failures that are not damage (bad input, a
    failing store, data this build cannot read) win over damage, so ranks never
    disagree on whether to fall back to an older checkpoint. The failures cross
    in ckpt-core's wire form, and ckpt-core decides the verdict
    (``_ckpt.verdict``, with its one damage predicate).

    ``coordinator`` is best a native checkpointer (``_ckpt.Checkpointer``):
    its collective has the checkpointer's timeout and names the ranks that
    do not take part (:class:`~ckpt.StragglerError`, with ``phase``).
    """
    if coordinator is None or getattr(coordinator, "world_size", 1) <= 1:
        return error
    mine = b"" if error is None else _ckpt.error_to_wire(error)
    if isinstance(coordinator, _ckpt.Checkpointer):
        everyone = coordinator.all_gather(mine, phase)
    else:
        everyone = coordinator.all_gather(mine)
    chosen = _ckpt.verdict(everyone)
    if chosen is None:
        return None
    rank, damage = chosen
    if error is not None and (damage or not _ckpt.is_damage(error)):
        return error
    verdict: BaseException = _ckpt.error_from_wire(everyone[rank], f"rank {rank}: ")
    return verdict
