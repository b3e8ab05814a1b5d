"""The memory tier's objects on the wire between peers: read and received
into buffers reused from object to object, each written into its file while
the next one arrives.

An object goes from a peer's memory root to another's (a replica after a
save, a replica fetched back by a replaced node, a merge's objects) one at a
time through the link's ``sendrecv``. The sender used to read each whole
file into a new buffer, and the receiver to get it into another and write
that into its file before taking the next. A new buffer's pages are faulted
in as it is filled, which on a 2-core VM cost about as much as the copy.
(Receiving straight into a mapping of the destination file was tried and
was slower: mapping fresh tmpfs pages costs more than ``write``.)

Now the sender reads every object into the same buffer (:class:`Outgoing`),
and a link with ``sendrecv_into`` (ckpt's torch and MPI links) receives into
two buffers in turn (:class:`Incoming`); their pages are faulted once. Each
object received is written into its root by a thread of its own (file I/O
releases the GIL) while the next arrives. A link with ``sendrecv`` alone
gets its own buffer per object, written the same way. The caller learns a
write's failure at the next object or at :meth:`Incoming.close`, and the
ranks stay in step on the link whatever fails. Figures: docs/perf.md, "The
memory tier".
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple, Union, cast

from ckpt._memtier.root import MemoryRoot, write_object

if TYPE_CHECKING:
    from ckpt.distributed import Data, Link

#: A failure as it crosses ranks (:func:`ckpt._memtier.root.describe`).
Failure = Dict[str, object]
#: A link's ``sendrecv_into`` (:meth:`ckpt.distributed.TorchCoordinator.sendrecv_into`).
_Into = Callable[["Data", int, int, Callable[[int], memoryview]], memoryview]

__all__ = ["Outgoing", "Incoming"]


class Outgoing:
    """Objects to send, in order, each read into the same buffer (grown as
    needed). (Reading the next one on a thread of its own while one is sent
    was no faster on 2 cores, where both ranks' copies already take the
    CPU.)"""

    def __init__(self, items: List[Tuple[Optional[MemoryRoot], str]]) -> None:
        """``items``: each object's root (``None``: not held here, sent empty) and key."""
        self._items = items
        self._buf = bytearray()
        self._i = 0

    def next(self) -> Union[bytearray, memoryview]:
        """The next object's bytes, valid until the next call; empty past the
        last object, or when the object is not here, gone or shortened (the
        receiver then sees the wrong length)."""
        if self._i >= len(self._items):
            return bytearray()
        root, key = self._items[self._i]
        self._i += 1
        size = None if root is None else root.size(key)
        if root is None or size is None:
            return bytearray()
        if size > len(self._buf):
            self._buf = bytearray(size)
        view = memoryview(self._buf)[:size]
        return view if root.read_into(key, view) else bytearray()


class Incoming:
    """Objects being received, each into one of two buffers in turn, and
    written into its root on a thread of its own while the next arrives."""

    def __init__(self) -> None:
        self._bufs: List[bytearray] = [bytearray(), bytearray()]
        self._turn = 0
        self._writer: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future[Optional[Failure]]] = None

    def buffer_for(self, n: int) -> memoryview:
        """Where the next object's ``n`` bytes are received (``sendrecv_into``)."""
        buf = self._bufs[self._turn]
        if n > len(buf):
            buf = self._bufs[self._turn] = bytearray(n)
        return memoryview(buf)[:n]

    def swap(self, link: Link, data: Data, dst: int, src: int) -> Data:
        """Send ``data`` to ``dst`` while receiving from ``src``: the bytes received."""
        into = cast(Optional[_Into], getattr(link, "sendrecv_into", None))
        if into is None:
            return link.sendrecv(data, dst, src)
        return into(data, dst, src, self.buffer_for)

    def write(self, root: MemoryRoot, key: str, got: Data) -> Optional[Failure]:
        """Write ``got`` (what :meth:`swap` returned last) as ``key`` of
        ``root`` in the background; returns the failure of the write before
        it, described, if it failed."""
        failure = self.finish()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-memory-write")
        self._pending = self._writer.submit(write_object, root, key, got)
        self._turn ^= 1  # (the next object goes into the other buffer)
        return failure

    def finish(self) -> Optional[Failure]:
        """Wait for the write in progress; its failure, described."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self) -> Optional[Failure]:
        """:meth:`finish`, and the writer thread ends."""
        try:
            return self.finish()
        finally:
            if self._writer is not None:
                self._writer.shutdown()
                self._writer = None
