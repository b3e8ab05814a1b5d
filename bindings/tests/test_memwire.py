"""The memory tier's objects on the wire (ckpt._memtier.wire): buffers reused from
object to object, each object written while the next arrives, every one
landing byte for byte. The multi-rank tests (test_memory_tier.py) send them
between processes; here a rank sends to itself, through a link that copies
(the shape of a world of one), so the buffers' turns can be checked alone."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import ckpt
from ckpt._memtier.root import MemoryRoot, rebuild
from ckpt._memtier.wire import Incoming, Outgoing


class SelfLink:
    """``sendrecv_into`` to and from this rank: what is sent is what arrives."""

    def __init__(self) -> None:
        self.received = 0

    def sendrecv_into(self, data: Any, dst: int, src: int, buffer_for: Callable[[int], Any]) -> Any:
        out = buffer_for(len(data))
        out[:] = data
        self.received += 1
        return out


class PlainLink:
    """A link with ``sendrecv`` alone (a coordinator of the user's)."""

    def sendrecv(self, data: Any, dst: int, src: int) -> bytearray:
        return bytearray(data)


def _roots(tmp_path: Path) -> tuple[MemoryRoot, MemoryRoot]:
    return (MemoryRoot(tmp_path / "a", tmp_path / "a.in"), MemoryRoot(tmp_path / "b", tmp_path / "b.in"))


def test_objects_of_every_size_arrive_whole_through_reused_buffers(tmp_path: Path) -> None:
    src, dst = _roots(tmp_path)
    sizes = [5 << 20, 1, 3 << 20, 7 << 20, 2 << 20, 6 << 20]
    want = {}
    for i, n in enumerate(sizes):
        key = f"chunks/{i:02}"
        (src.path / "chunks").mkdir(parents=True, exist_ok=True)
        want[key] = os.urandom(n)
        (src.path / key).write_bytes(want[key])
    for link in (SelfLink(), PlainLink()):
        sending, receiving = Outgoing([(src, k) for k in want]), Incoming()
        for key in want:
            got = receiving.swap(link, sending.next(), 0, 0)
            assert receiving.write(dst, key, got) is None
        assert receiving.close() is None
        assert len(sending.next()) == 0  # past the last object
        for key, data in want.items():
            assert (dst.path / key).read_bytes() == data, key
            (dst.path / key).unlink()


def test_an_object_gone_or_not_held_is_sent_empty(tmp_path: Path) -> None:
    src, _ = _roots(tmp_path)
    (src.path / "here").write_bytes(b"x" * 10)
    sending = Outgoing([(src, "here"), (src, "gone"), (None, "elsewhere")])
    assert bytes(sending.next()) == b"x" * 10
    assert len(sending.next()) == 0
    assert len(sending.next()) == 0


def test_a_write_that_fails_is_reported_at_the_next_object(tmp_path: Path) -> None:
    src, dst = _roots(tmp_path)
    (src.path / "ok").write_bytes(b"1" * 100)
    link = SelfLink()
    receiving = Incoming()
    got = receiving.swap(link, b"1" * 100, 0, 0)
    assert receiving.write(dst, "../escape", got) is None  # (its failure comes next)
    got = receiving.swap(link, b"2" * 100, 0, 0)
    failure = receiving.write(dst, "fine", got)
    assert failure is not None and isinstance(rebuild(0, failure, "write"), ckpt.InvalidInputError), failure
    assert receiving.close() is None
    assert (dst.path / "fine").read_bytes() == b"2" * 100
    assert not (tmp_path / "escape").exists()
