"""Python's cyclic garbage collector held off while a save walks the state,
and while a restore plans, reads and applies one (or a read builds one).

A save makes thousands of short-lived objects that the collector tracks: the
``state_dict()`` mappings and their detached tensors, the walk's lists and
tuples, a ``TensorSpec`` per tensor. Each 700 of them (CPython's default
threshold) start a collection of the young generation, every tenth of those
one of the middle generation, and now and then a full collection, which in a
process holding torch and transformers scans its whole heap, inside a save's
stall.

Those objects die when the save returns (the engine keeps bytes, not Python
objects), so with the collector off meanwhile the counts it keeps fall back
by the time it is on again, and most of those collections never run
(docs/perf.md, "The garbage collector"). Nothing is leaked: cycles made
during the save are found by the next collection. The collector, on again
as the save returns, may start one collection of the young objects still
alive (a lazy save's tensors until they are copied), and a full one, when
due, can still come then, six times more rarely.

A restore makes as many: its plan's entries, a destination per tensor, the
state dicts handed to ``load_state_dict``; without the pause a large
restore spent much of its time in collections.

The collector is process-wide. A save leaves it as it found it: off if the
program turned it off (some training loops collect by hand, at steps of their
choosing), and a nested save (the memory tier's) changes nothing.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

__all__ = ["collector_paused", "collect_now"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector for the ``with`` block, if it is on."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def collect_now() -> None:
    """A full collection now, if the collector is on: once per process, where a
    checkpointer readies its first save out of any stall (after a restore, or
    a fresh start's first step). Readying it leaves thousands of long-lived
    objects (the plans of ``ckpt._save.repeat``), and a full collection comes due
    when they are a quarter of the heap's long-lived objects, which put one
    inside a first save now and then (docs/perf.md, "The garbage
    collector"). Collected now, the next full collection is as far
    off as the heap's growth makes it."""
    if gc.isenabled():
        gc.collect()
