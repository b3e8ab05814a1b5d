"""Where the stall of a ckpt save goes, on a GPU: the phases of ``save``
timed one by one, and a profile of the Python calls, on ``gpu_bench.py``'s
model. A diagnosis tool beside the benchmark, not part of the report:

    python gpu_stall.py --dir D [--layers 24] [--width 1024] [--saves 8] [--optimizer foreach]

First, for lazy and eager mode, a fresh start's first save right after its
first step (``early_*``: the first step's time, the save's stall, and the
next step's time beside a plain one's), with a checkpointer of its own. Then, for lazy and eager mode, in one
process: ``--saves`` saves, two training
steps apart, each once the previous one is written, each timed whole and by phase (the state dicts, the walk, the
device copies' start, the slots, the engine's ``save``); then the same
saves with Python's thread switch interval raised to 0.5 s (a stall that
shrinks then was spent waiting for the GIL held by ckpt's launcher thread);
then a profile of three lazy saves, the 30 costliest functions by own time.
Medians in milliseconds, printed and written as JSON with ``--json``.

With ``--restore``, instead: one save, then ``--saves`` restores of it into
the live model and optimizer, each by a new checkpointer (as a restarted
process restores: no slab of its own yet), timed by phase as the
checkpointer reports it (``Checkpointer.last_restore``: the plan, the
engine's read, the slab's locking, the host-to-device copies, the apply).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckpt  # noqa: E402
import ckpt.checkpointer as cpm  # noqa: E402
import ckpt._device.cuda as cudam  # noqa: E402
from gpu_bench import Trainer, model_args, restore_phases  # noqa: E402


class Phases:
    """Accumulates the time of wrapped calls, by name, per save."""

    def __init__(self) -> None:
        self.now: Dict[str, float] = {}
        self.saves: List[Dict[str, float]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        depth = [0]  # a recursive call (a module's children) counts once

        def timed(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    self.now[name] = self.now.get(name, 0.0) + time.perf_counter() - t0

        return timed

    def close(self, total: float) -> None:
        self.now["total"] = total
        self.saves.append(self.now)
        self.now = {}

    def medians(self) -> Dict[str, float]:
        keys = sorted({k for s in self.saves for k in s})
        return {k: 1e3 * statistics.median(s.get(k, 0.0) for s in self.saves) for k in keys}


class NativeProxy:
    """The native checkpointer with its ``save`` timed."""

    def __init__(self, native: Any, phases: Phases, name: str = "engine save", method: str = "save") -> None:
        self._native = native
        setattr(self, method, phases.wrap(name, getattr(native, method)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)


def instrument(phases: Phases) -> None:
    cpm.flatten = phases.wrap("flatten (walk + state dicts)", cpm.flatten)
    cpm._small_now = phases.wrap("small tensors now", cpm._small_now)
    cpm._into_slots = phases.wrap("into slots", cpm._into_slots)
    cudam.DeviceCopy.start = phases.wrap("device copies start", cudam.DeviceCopy.start)
    cudam.DeviceCopy.wait_landed = phases.wrap("wait landed", cudam.DeviceCopy.wait_landed)
    torch.nn.Module.state_dict = phases.wrap("module state_dict", torch.nn.Module.state_dict)
    torch.optim.Optimizer.state_dict = phases.wrap("optimizer state_dict", torch.optim.Optimizer.state_dict)
    ckpt.RNGState.state_dict = phases.wrap("rng state", ckpt.RNGState.state_dict)


def restores(tr: Trainer, root: str, n: int) -> Dict[str, Any]:
    """One save, then ``n`` restores of it, each by a new checkpointer, each
    split by phase as the checkpointer reports it (``Checkpointer.last_restore``)."""
    shutil.rmtree(root, ignore_errors=True)
    cp = ckpt.Checkpointer(root, lazy=False, keep_last=1, gc_grace=0.0)
    cp.save(1, model=tr.model, optimizer=tr.opt).wait()
    cp.close()
    ref = tr.reference()
    times, runs = [], []
    for _ in range(n):
        tr.scramble()
        tr.sync()
        reader = ckpt.Checkpointer(root, read_only=True)
        t0 = time.perf_counter()
        assert reader.load_latest(model=tr.model, optimizer=tr.opt) == 1
        tr.sync()
        dt = time.perf_counter() - t0
        got = restore_phases(reader.last_restore)
        assert got is not None
        slab = got.pop("slab")
        runs.append(got)
        reader.close()
        times.append(dt)
        tr.check(ref, "ckpt restore")
    shutil.rmtree(root, ignore_errors=True)
    return {
        "first_ms": 1e3 * times[0],
        "median_ms": 1e3 * statistics.median(times),
        "phases_ms": {k: 1e3 * statistics.median(r[k] for r in runs) for k in runs[0]},
        "slab": slab,
    }


def early(tr: Trainer, root: str, lazy: bool) -> Dict[str, float]:
    """A fresh start's first save right after its first step, as a job that
    saves at once would make it: ``load_latest`` (nothing to restore), one
    step (after which the first save is readied in the background), the save
    at once, then the next step (which waits for the save's copies where they
    are not done), beside a plain step's time; the first step is timed too
    (the readying's part on the training thread: the walk ahead, and with
    CUDA state a collection of the garbage collector)."""
    shutil.rmtree(root, ignore_errors=True)
    cp = ckpt.Checkpointer(root, lazy=lazy, keep_last=1, gc_grace=0.0)
    assert cp.load_latest(model=tr.model, optimizer=tr.opt) is None
    tr.sync()
    t0 = time.perf_counter()
    tr.step()
    tr.sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    cp.save(0, model=tr.model, optimizer=tr.opt)
    stall = time.perf_counter() - t0
    t0 = time.perf_counter()
    tr.step()
    tr.sync()
    after = time.perf_counter() - t0
    cp.wait()
    t0 = time.perf_counter()
    tr.step()
    tr.sync()
    plain = time.perf_counter() - t0
    cp.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"first_step_ms": 1e3 * first, "stall_ms": 1e3 * stall, "next_step_ms": 1e3 * after,
            "plain_step_ms": 1e3 * plain}


def saves(tr: Trainer, cp: Any, n: int, step0: int, phases: Phases) -> List[float]:
    stalls = []
    for i in range(n):
        tr.step()
        tr.step()
        cp.wait()  # as in a loop that saves every few dozen steps: the last save is written
        tr.sync()
        phases.now = {}
        t0 = time.perf_counter()
        cp.save(step0 + i, model=tr.model, optimizer=tr.opt)
        dt = time.perf_counter() - t0
        phases.close(dt)
        stalls.append(dt)
    tr.step()
    cp.wait()
    return stalls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--json")
    model_args(ap)
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--restore", action="store_true", help="time restores by a new checkpointer instead")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return
    tr = Trainer(a, a.device)
    tensors = len(tr.tensors())
    out: Dict[str, Any] = {"tensors": tensors, "state_bytes": tr.nbytes()}
    phases = Phases()
    if a.restore:
        out["restore"] = restores(tr, os.path.join(a.dir, "restore"), a.saves)
        print(f"[stall] {tensors} tensors, restore: {json.dumps(out['restore'], indent=1)}", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    for lazy in (True, False):
        mode = "lazy" if lazy else "eager"
        out[f"early_{mode}"] = early(tr, os.path.join(a.dir, f"early-{mode}"), lazy)
        print(f"[stall] {mode}, a fresh start's save right after its first step: "
              f"{json.dumps(out[f'early_{mode}'])}", flush=True)
    instrument(phases)
    step = 0
    for lazy in (True, False):
        mode = "lazy" if lazy else "eager"
        root = os.path.join(a.dir, mode)
        shutil.rmtree(root, ignore_errors=True)
        # Retired checkpoints go at once: a device disk holds a few of these states only.
        cp = ckpt.Checkpointer(root, lazy=lazy, keep_last=1, gc_grace=0.0)
        cp._native = NativeProxy(cp._native, phases)
        first = saves(tr, cp, 1, step, phases)[0]
        step += 1
        phases.saves = []
        later = saves(tr, cp, a.saves, step, phases)
        step += a.saves
        out[mode] = {"first_ms": 1e3 * first, "later_ms": 1e3 * statistics.median(later), "phases_ms": phases.medians()}
        print(f"[stall] {tensors} tensors, {mode}: {json.dumps(out[mode], indent=1)}", flush=True)
        phases.saves = []
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.5)
        try:
            held = saves(tr, cp, a.saves, step, phases)
        finally:
            sys.setswitchinterval(old)
        step += a.saves
        out[mode]["switch_0.5s"] = {"later_ms": 1e3 * statistics.median(held), "phases_ms": phases.medians()}
        phases.saves = []
        if lazy:
            prof = cProfile.Profile()
            for i in range(3):
                tr.step()
                tr.step()
                tr.sync()
                prof.enable()
                cp.save(step, model=tr.model, optimizer=tr.opt)
                prof.disable()
                step += 1
            cp.wait()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
            out["profile_lazy"] = s.getvalue()
        cp.close()
        shutil.rmtree(root, ignore_errors=True)
        print(f"[stall] {mode}, switch interval 0.5 s: {json.dumps(out[mode]['switch_0.5s'], indent=1)}", flush=True)
    print(out.get("profile_lazy", ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
