"""``ckpt._restore.plan.Spans``, the ranges of memory a restore's plan has taken as
destinations in place: the same answers as a scan of every earlier range,
which it replaced (the scan made a plan of thousands of tensors quadratic)."""

from __future__ import annotations

import random
from typing import List, Tuple

import torch

import ckpt
from ckpt._restore.plan import Spans


def _scan(taken: List[Tuple[int, int]], start: int, end: int) -> bool:
    """The rule as it was: free unless some earlier range overlaps it."""
    if any(start < e and s < end for s, e in taken):
        return False
    taken.append((start, end))
    return True


def test_spans_answer_as_a_scan_of_every_earlier_range() -> None:
    rng = random.Random(20261127)
    for trial in range(40):
        spans, taken = Spans(), []  # type: Spans, List[Tuple[int, int]]
        room = rng.choice([64, 1_000, 1 << 20])
        for _ in range(400):
            start = rng.randrange(room)
            end = start + rng.choice([1, 2, 3, 8, rng.randrange(1, room)])
            assert spans.take(start, end) == _scan(taken, start, end), (trial, start, end)
        assert len(spans) == len(taken)


def test_touching_ranges_do_not_overlap_and_nested_ones_do() -> None:
    spans = Spans()
    assert spans.take(100, 200)
    assert spans.take(200, 300) and spans.take(0, 100)  # end to end on both sides
    assert not spans.take(150, 160) and not spans.take(50, 350) and not spans.take(299, 301)
    assert not spans.take(100, 200)  # the same range again
    assert spans.take(300, 301) and spans.take(5, 5)  # an empty range takes nothing
    assert len(spans) == 4


def test_a_restore_into_views_of_one_storage_fills_each_once(url: str) -> None:
    """Destinations that share memory: a tensor and a view inside it are read
    once, the view through a buffer of its own (it overlaps); disjoint views
    of one storage are each read in place."""
    base = torch.arange(1000, dtype=torch.float32)
    state = {"whole": base, "inner": base[100:200], "a": torch.zeros(64), "b": torch.ones(64)}
    with ckpt.Checkpointer(url, rng=False) as cp:
        cp.save(1, state).wait()
    big = torch.zeros(1000)
    back = {"whole": big, "inner": big[100:200], "a": torch.empty(64), "b": torch.empty(64)}
    parts = torch.zeros(128)
    back["a"], back["b"] = parts[:64], parts[64:]
    with ckpt.Checkpointer(url, rng=False) as cp:
        assert cp.load_latest(back) == 1
    assert torch.equal(back["whole"], base) and torch.equal(back["inner"], base[100:200])
    assert torch.equal(parts, torch.cat([torch.zeros(64), torch.ones(64)]))
