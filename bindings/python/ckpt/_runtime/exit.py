"""What ckpt finishes when the interpreter exits normally.

``save`` returns before the checkpoint is durable; the rest runs on ckpt's
own threads. A script that saves at its last step and ends without
:meth:`~ckpt.Checkpointer.wait` (or ``close``, or a ``with`` block) used to
lose that save now and then: the process ended while it was being written,
the more often the smaller the state (docs/perf.md, "At exit"). So at exit (``atexit``, which runs after Python has
joined the program's own threads) ckpt:

1. finishes the memory tier's replication and stops its thread
   (:meth:`ckpt.MemoryCheckpointer._at_exit`);
2. waits for every save this process started and nobody has waited for,
   whether or not its checkpointer is still referenced. After
   :data:`NOTICE_AFTER` seconds it says on stderr what it waits for; Ctrl-C
   abandons what is left (a checkpoint's manifest is published last, so the
   last committed one stays whole). A save that failed is reported there
   too, since nobody else will;
3. joins the threads that still hold tensors (a restore readies the first
   save's staging memory on one, :func:`ckpt._save.ahead.rehearse`).

The third is about more than the checkpoint. A thread that is inside ckpt's
native code, or that drops the last reference to a torch tensor, when the
interpreter finalizes is ended by CPython as it takes the GIL back, through
C++ and Rust frames: the process aborted (``terminate called without an
active exception``, exit status 134) about once in 20 runs of a script that
restored and then exited. With these threads joined first, and no save left
running, none of ckpt's threads takes the GIL after this.

A process that ends through ``os._exit`` (a forked worker) or a signal runs
none of this, and a fork child skips what its parent started.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from typing import List, Optional, Protocol, Tuple

from ckpt.errors import CheckpointError

__all__ = ["track_save", "track_thread", "track_tier", "say", "NOTICE_AFTER"]

#: Seconds of waiting at exit before ckpt says on stderr what it waits for.
NOTICE_AFTER = 2.0



class Save(Protocol):
    """What the exit reads of a save (a :class:`ckpt.SaveHandle`)."""

    _observed: bool

    @property
    def step(self) -> int: ...
    def done(self) -> bool: ...
    def wait(self, timeout: Optional[float] = None) -> object: ...


class Tier(Protocol):
    """What the exit asks of a memory tier (a :class:`ckpt.MemoryCheckpointer`)."""

    def _at_exit(self) -> None: ...


_saves: List[Tuple[int, Save]] = []  # (pid, SaveHandle)
_threads: List[Tuple[int, threading.Thread]] = []
_tiers: "weakref.WeakSet[Tier]" = weakref.WeakSet()
_lock = threading.Lock()


def track_save(handle: Save) -> None:
    """Remember a save just started, to be finished at exit if nobody waits for it."""
    me = os.getpid()
    with _lock:
        # Finished saves go (what a handle holds goes with it, as a
        # checkpointer's own list of them lets go at its next save), and a
        # fork child's list starts with its parent's saves: not its to finish.
        _saves[:] = [(p, h) for p, h in _saves if p == me and not (h._observed or h.done())]
        _saves.append((me, handle))


def track_thread(thread: threading.Thread) -> None:
    """Remember a thread of ckpt's that holds tensors, to be joined at exit."""
    with _lock:
        _threads[:] = [(p, t) for p, t in _threads if t.is_alive()]
        _threads.append((os.getpid(), thread))


def track_tier(tier: Tier) -> None:
    """Remember a memory tier (held weakly), whose replication ends at exit."""
    _tiers.add(tier)


def say(text: str) -> None:
    """One line on stderr, as ckpt's exit speaks."""
    try:
        sys.stderr.write(f"ckpt: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed
        pass


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _wait_one(h: Save, timeout: Optional[float]) -> None:
    """Wait for one save, at most ``timeout`` seconds; its failure is said."""
    try:
        h.wait(timeout)
    except CheckpointError as e:
        if h.done():  # (else this wait ran out: the save goes on)
            say(f"the save of step {h.step} failed: {type(e).__name__}: {e}")


def _wait_saves(pending: List[Save]) -> None:
    """Wait for ``pending`` saves: quietly for :data:`NOTICE_AFTER` seconds,
    then, with a note on stderr, for as long as they take. Each failure is
    said. ``KeyboardInterrupt`` propagates (abandon)."""
    deadline = time.monotonic() + NOTICE_AFTER
    for h in pending:
        _wait_one(h, max(0.0, deadline - time.monotonic()))
    rest = [h for h in pending if not h.done()]
    if rest:
        say(f"finishing {_plural(len(rest), 'save')} still in progress before exiting (Ctrl-C abandons)")
        for h in rest:
            _wait_one(h, None)


def _finish() -> None:
    me = os.getpid()
    with _lock:
        pending = [h for p, h in _saves if p == me and not h._observed]
        threads = [t for p, t in _threads if p == me]
        _saves.clear()
        _threads.clear()
    try:
        for tier in list(_tiers):
            tier._at_exit()
        _wait_saves(pending)
    except KeyboardInterrupt:
        left = sum(1 for h in pending if not h.done())
        say(f"exit: abandoned {_plural(left, 'save')} in progress; the last committed checkpoint is intact")
    finally:
        # Joined even after a Ctrl-C: each ends within about a copy of the
        # state, and one left running could abort the finalizing process.
        for t in threads:
            try:
                while t.is_alive():
                    t.join(0.1)
            except KeyboardInterrupt:
                pass


atexit.register(_finish)
