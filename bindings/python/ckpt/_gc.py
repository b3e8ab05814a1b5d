"""Python's cyclic garbage collector held off while a save walks the state,
and while a restore plans, reads and applies one (or a read builds one).

A save makes thousands of short-lived objects that the collector tracks: the
``state_dict()`` mappings and their detached tensors, the walk's lists and
tuples, a ``TensorSpec`` per tensor. Each 700 of them (CPython's default
threshold) start a collection of the young generation, every tenth of those
one of the middle generation, and now and then a full collection, which in a
process holding torch and transformers scans its whole heap: measured on a
2-core VM, a GPT-2 of 1,169 tensors and AdamW saved lazily every 5 steps ran
6 collections inside each save, 363 in a run of 60 saves, one of them a full
collection of 170-240 ms inside a save's stall.

Those objects die when the save returns (the engine keeps bytes, not Python
objects), so with the collector off meanwhile the counts it keeps fall back
by the time it is on again, and most of those collections never run: the
same run made 63 collections in all, 5 ms of collection instead of 190 ms,
and its longest stall was 12 ms instead of 180 ms. In one process, rounds of
20 saves with and without the pause alternating: 1.9 ms of collection per
round against 5.5 ms, and no full collection inside a save against one of
220 ms in 160 saves. Nothing is leaked: cycles made during the save are found
by the next collection. The collector, on again as the save returns, may
start one collection of the young objects still alive (a lazy save's tensors
until they are copied), and a full one, when due, can still come then, six
times more rarely.

A restore makes as many: its plan's entries, a destination per tensor, the
state dicts handed to ``load_state_dict``. A fresh process's restore of a
mixture of experts of 12,493 tensors (326 MiB, AdamW, 2 cores) ran its
collections for 37 % of its time, and took 0.42 s where the same restore
with the collector held off took 0.26 s; ``read_latest`` of it, whose
arrays all outlive the call, 0.37 s against 0.29 s, with one full collection
of 1.0 s among twelve reads.

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
    objects (the plans of ``ckpt._repeat``), and a full collection comes due
    when they are a quarter of the heap's long-lived objects: on the CPU
    stand-in of the tests, two first saves in eight then took 154-158 ms
    instead of 4-6 ms. Collected now, the next full collection is as far
    off as the heap's growth makes it."""
    if gc.isenabled():
        gc.collect()
