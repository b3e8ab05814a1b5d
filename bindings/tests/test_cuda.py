"""CUDA snapshots: device-to-host copies into host slabs on a side stream.

The slab mechanics (a slot saved without a copy, a ``ready`` gate the lazy
snapshot waits on, its failure) run everywhere. The tests that need a GPU skip,
with the reason, where none is present.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import List

import pytest
import torch
from torch import nn

import ckpt
from ckpt import _ckpt

from conftest import PYTHON, python_env

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def bits(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ----------------------------------------------------------------- everywhere


def test_a_slab_slot_is_saved_without_a_copy_once_its_gate_opens(url: str) -> None:
    lens = [3 << 20, 12, 70_000]
    slab = _ckpt.HostSlab(lens)
    assert [n for _, n in slab.slots] == lens
    assert slab.address % 4096 == 0
    host = torch.frombuffer(slab, dtype=torch.uint8)
    cp = _ckpt.Checkpointer(url, lazy=True)
    filled = []

    def ready() -> None:  # the copies "land" only now, after save returned
        for i, (off, n) in enumerate(slab.slots):
            host[off : off + n].fill_(i + 1)
        filled.append(True)

    tensors = [_ckpt.TensorSpec(name=f"t{i}", dtype="U8", shape=(n,), data=slab.slot(i)) for i, n in enumerate(lens)]
    h = cp.save(1, tensors, {"state": None}, ready)
    h.wait(30)
    assert filled, "the snapshot called its gate"
    assert not slab.in_use(), "a committed save holds none of the slab"
    step, _, got, _, _ = cp.load_latest()
    assert step == 1
    for i, n in enumerate(lens):
        dtype, shape, buf = got[f"t{i}"]
        assert (dtype, tuple(shape)) == ("U8", (n,))
        assert bytes(memoryview(buf)) == bytes([i + 1]) * n


def test_a_failing_gate_fails_the_save_and_commits_nothing(url: str) -> None:
    slab = _ckpt.HostSlab([16])

    def ready() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    cp = _ckpt.Checkpointer(url, lazy=True)
    h = cp.save(1, [_ckpt.TensorSpec(name="t", dtype="U8", shape=(16,), data=slab.slot(0))], {"state": None}, ready)
    with pytest.raises(ckpt.CheckpointError, match="illegal memory access"):
        h.wait(30)
    assert cp.load_latest() is None
    assert not slab.in_use()
    with pytest.raises(ckpt.InvalidInputError):
        slab.slot(1)


# ----------------------------------------------------------------- on a GPU


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 1024), nn.LayerNorm(1024), nn.GELU(), nn.Linear(1024, 256)).cuda()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(64, 256, device="cuda", generator=g)
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


#: ``device_staging`` for lazy saves: none, all of the state (about 6 MiB), part of it.
STAGING = [0, 1 << 30, 3 << 20]


@needs_cuda
@pytest.mark.parametrize("lazy, staging", [(False, 0)] + [(True, s) for s in STAGING])
def test_a_kernel_queued_just_before_save_shows_in_the_stored_values(url: str, lazy: bool, staging: int) -> None:
    # A long kernel keeps the stream busy, then one that writes the parameters is
    # queued: a save that does not wait for the current stream stores old values.
    # (The spin kernel leaves every value finite: a chain of matrix products
    # overflowed to NaN, and NaN before and after hid a missing wait.)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 1, 0)
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False, device_staging=staging)
    for step in range(3):  # the first save copies into pageable memory, later ones into locked
        torch.cuda._sleep(int(2e8))  # about 0.1 s of the current stream
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(step + 1))
        h = cp.save(step, model=model, optimizer=opt)
        want = {k: bits(v) for k, v in model.state_dict().items()}  # synchronizes
        # Where the stall went: the walk, the device copies' start (eager:
        # until landed), the engine; the whole call holds them all.
        ph = h.phases
        assert ph is not None and ph.walk > 0 and ph.device > 0 and ph.engine > 0, ph
        assert h.stall >= ph.walk + ph.device + ph.engine
        cp.wait()
        saved = cp.read(step).state["model"]
        assert all(torch.isfinite(v).all() for v in saved.values() if v.is_floating_point()), "NaN hides a race"
        assert {k: bits(v) for k, v in saved.items()} == want, f"step {step}"
    cp.close()


@needs_cuda
@pytest.mark.parametrize("staging", STAGING)
@pytest.mark.parametrize("fused", [True, False])
def test_lazy_saves_store_the_values_at_save_while_training_continues(url: str, staging: int, fused: bool) -> None:
    # Fused AdamW keeps its step counts on the GPU; PyTorch's default (foreach)
    # on the CPU, beside the moments on the GPU: later saves take both in bulk.
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    _train(model, opt, 2, 1)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False, device_staging=staging)
    want = {}
    for step in range(4):
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ref_opt = [v.detach().clone() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        cp.save(step, model=model, optimizer=opt)
        _train(model, opt, 3, 10 + step)  # the step pre-hook fences, it does not wait
        want[step] = ({k: bits(v) for k, v in ref.items()}, [bits(v) for v in ref_opt])
    cp.wait()
    for step, (params, states) in want.items():
        saved = cp.read(step).state
        assert {k: bits(v) for k, v in saved["model"].items()} == params, f"step {step}"
        got = [bits(v) for s in saved["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)]
        assert got == states, f"step {step}: optimizer state"
    cp.close()


@needs_cuda
def test_the_memory_tier_copies_each_step_to_the_host_once_for_both_tiers(tmp_path: Path) -> None:
    from ckpt.memory import MemoryCheckpointer

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    mem = shm / f"ckpt-cuda-{os.getpid()}"
    durable = (tmp_path / "durable").as_uri()
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train(model, opt, 2, 1)
    try:
        cp = MemoryCheckpointer(durable, memory_dir=str(mem / "node{node}"), coordinate="none", lazy=True,
                                rng=False, keep_in_memory=4)
        want = {}
        for step in range(3):
            want[step] = {k: bits(v) for k, v in model.state_dict().items()}
            cp.save(step, model=model, optimizer=opt)
            _train(model, opt, 3, 20 + step)  # the pre-hook fences both tiers' saves
        cp.wait()
        pool = cp.durable._slabs
        assert cp.memory._slabs is None and pool is not None
        state = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        state += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        # One pool under one budget (twice the state by default), not one per tier.
        assert len(pool._slabs) <= 2 and pool.held_bytes() < 3 * state
        cp.close()
        for root in (cp.own.url, durable):
            reader = ckpt.Checkpointer(root, read_only=True, rng=False)
            for step, params in want.items():
                assert {k: bits(v) for k, v in reader.read(step).state["model"].items()} == params, (root, step)
        fresh = _model()
        cp = MemoryCheckpointer(durable, memory_dir=str(mem / "node{node}"), coordinate="none", rng=False)
        assert cp.load_latest(model=fresh) == 2 and cp.last_source == "memory"
        assert {k: bits(v) for k, v in fresh.state_dict().items()} == want[2]
        cp.close()
    finally:
        import shutil

        shutil.rmtree(mem, ignore_errors=True)


@needs_cuda
def test_a_resumed_run_matches_the_uninterrupted_one_bitwise(url: str) -> None:
    torch.backends.cudnn.deterministic = True

    def run(resume_at: int | None) -> dict:
        model = _model(3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        cp = ckpt.Checkpointer(url, lazy=True)
        start = 0
        if resume_at is not None:
            start = cp.load_latest(model=model, optimizer=opt)
            assert start == resume_at
        for step in range(start, 8):
            if step == 5 and resume_at is None:
                cp.save(step, model=model, optimizer=opt)
            _train(model, opt, 1, 100 + step)
        cp.close()
        return {k: bits(v) for k, v in model.state_dict().items()}

    straight = run(None)
    assert run(5) == straight


@needs_cuda
def test_the_first_save_takes_memory_locked_ahead(url: str) -> None:
    """A fresh start with a staging budget locks the first save's memory at
    ``load_latest``; a restart's first save takes the memory its restore
    locked, laid out anew (a fused optimizer's step counters are on the
    device at the save, on the host at the restore). Each save stores its
    values."""
    model = _model(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    state_bytes = 3 * sum(p.nbytes for p in model.parameters())
    cp = ckpt.Checkpointer(url, lazy=False, rng=False, staging_budget=4 * state_bytes)
    assert cp.load_latest(model=model, optimizer=opt) is None
    reserved = [s.native.address for s in cp._slabs._slabs]
    assert len(reserved) == 1
    _train(model, opt, 2, 7)
    cp.save(1, model=model, optimizer=opt)
    want = {k: bits(v) for k, v in model.state_dict().items()}
    assert [s.native.address for s in cp._slabs._slabs] == reserved, "the reserved memory, laid out for the save"
    cp.wait()
    cp.close()
    again = _model(5)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2, fused=True)
    cp = ckpt.Checkpointer(url, lazy=False, rng=False)
    assert cp.load_latest(model=again, optimizer=opt2) == 1
    assert {k: bits(v) for k, v in again.state_dict().items()} == want
    restored = [s.native.address for s in cp._slabs._slabs]
    _train(again, opt2, 1, 8)
    cp.save(2, model=again, optimizer=opt2)
    want2 = {k: bits(v) for k, v in again.state_dict().items()}
    assert [s.native.address for s in cp._slabs._slabs] == restored, "the restore's memory, laid out anew"
    cp.wait()
    assert {k: bits(v) for k, v in cp.read(2).state["model"].items()} == want2
    cp.close()


def _deep_model(seed: int) -> nn.Module:
    """Like ``_model``, with enough tensors (10) for its state dict to be taken in bulk."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(256, 512), nn.LayerNorm(512), nn.GELU(), nn.Linear(512, 512), nn.LayerNorm(512), nn.GELU(),
        nn.Linear(512, 256),
    ).cuda()


@needs_cuda
@pytest.mark.parametrize("lazy", [False, True])
def test_a_fresh_starts_first_save_takes_what_its_first_step_readied(
    url: str, bulk: List[bool], lazy: bool
) -> None:
    """Without a staging budget, the optimizer's first step after a fresh
    start's ``load_latest`` readies the first save: the state's bytes are
    page-locked in the background and the state is walked once. The first
    save takes both mappings in bulk into that memory, and stores the values
    of the save while training goes on."""
    model = _deep_model(6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False)
    assert cp.load_latest(model=model, optimizer=opt) is None
    _train(model, opt, 1, 20)
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1, "reserved at the first step"
    pool.drain()
    reserved = pool._slabs[0]
    assert reserved.locked, "page-locked in the background"
    assert "model." in pool.plans and any(k.startswith("optimizer.") for k in pool.plans), sorted(pool.plans)
    _train(model, opt, 1, 21)
    want = {k: bits(v) for k, v in model.state_dict().items()}
    want_opt = [bits(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    cp.save(1, model=model, optimizer=opt)
    _train(model, opt, 3, 22)
    cp.wait()
    assert bulk and all(bulk), f"the first save in bulk: {bulk}"
    assert [s.native.address for s in pool._slabs] == [reserved.native.address], "into the reserved memory"
    saved = cp.read(1).state
    assert {k: bits(v) for k, v in saved["model"].items()} == want
    assert [bits(v) for s in saved["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)] == want_opt
    cp.close()


@needs_cuda
def test_a_lazy_save_right_after_the_first_step_stores_its_values_without_waiting_for_the_locking(url: str) -> None:
    """A lazy save that comes right after the optimizer's first step takes
    the state's memory while it is still being locked in the background
    (nothing waits for it here: no ``drain``), and its copies are queued on
    the same thread after the locking. Training goes on at once; the stored
    values are those of the save, bitwise, in the memory reserved."""
    model = _deep_model(9)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    assert cp.load_latest(model=model, optimizer=opt) is None
    _train(model, opt, 1, 30)
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1, "reserved at the first step"
    reserved = pool._slabs[0].native.address
    want = {k: bits(v) for k, v in model.state_dict().items()}
    want_opt = [bits(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    cp.save(1, model=model, optimizer=opt)
    _train(model, opt, 3, 31)
    cp.wait()
    assert [s.native.address for s in pool._slabs] == [reserved], "into the reserved memory"
    assert pool._slabs[0].locked
    saved = cp.read(1).state
    assert {k: bits(v) for k, v in saved["model"].items()} == want
    assert [bits(v) for s in saved["optimizer"]["state"].values() for v in s.values() if torch.is_tensor(v)] == want_opt
    cp.close()


@needs_cuda
@pytest.mark.parametrize("way", ["during", "later"])
def test_a_restore_locks_its_new_slab_and_its_first_save_takes_it(
    url: str, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted process's restore reads into a new host slab and
    page-locks it while the read fills it (the default), or copies out of it
    pageable and locks it in the background; the next save takes that
    memory. Values bitwise both ways; ``last_restore`` times the copies."""
    from ckpt._device.cuda import HostStage

    if way != HostStage.lock:
        monkeypatch.setattr(HostStage, "lock", way)
    model = _model(7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train(model, opt, 2, 30)
    with ckpt.Checkpointer(url, lazy=True, rng=False) as cp:
        cp.save(1, model=model, optimizer=opt)
    want = {k: bits(v) for k, v in model.state_dict().items()}
    again = _model(8)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2, fused=True)
    _train(again, opt2, 1, 31)  # its state on the device, restored in place
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    assert cp.load_latest(model=again, optimizer=opt2) == 1
    assert {k: bits(v) for k, v in again.state_dict().items()} == want
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1
    # ("during" falls back to locking after the read where the runtime would
    # not pin pages the read was writing.)
    assert pool.restore_locks in ([way], ["after"] if way == "during" else [way]), pool.restore_locks
    if way == "during":
        assert pool._slabs[0].locked, "locked when the restore returns"
    pool.drain()  # "later": the lock in the background
    assert pool._slabs[0].locked
    p = cp.last_restore  # where the restore's time went, the copies included
    assert p is not None and p.slab == pool.restore_locks[0] and p.to_device > 0 and p.read > 0
    if way == "later":
        assert p.lock == 0, "nothing locked in the call"
    assert p.total >= p.plan + p.read + p.agree + p.lock + p.to_device + p.apply - 1e-9
    address = pool._slabs[0].native.address
    _train(again, opt2, 1, 32)
    want2 = {k: bits(v) for k, v in again.state_dict().items()}
    cp.save(2, model=again, optimizer=opt2)
    _train(again, opt2, 2, 33)
    cp.wait()
    assert [s.native.address for s in pool._slabs] == [address], "the restore's memory, laid out for the save"
    assert {k: bits(v) for k, v in cp.read(2).state["model"].items()} == want2
    cp.close()



@needs_cuda
@pytest.mark.parametrize("way", ["later", "after", "during"])
def test_a_restore_in_groups_copies_each_group_bitwise_every_way(
    url: str, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read in groups of about 1 MiB (the copies of each group queued while
    the next is read, on the caller's stream), a restore into a model and
    its fused AdamW is bitwise, whichever way its new slab is locked; a
    kernel the caller queued before the restore on its stream comes first."""
    import ckpt._device.hoststage as hs
    from ckpt._device.cuda import HostStage

    monkeypatch.setattr(hs, "TAIL_BYTES", 1 << 20)
    monkeypatch.setattr(HostStage, "lock", way)
    model = _model(11)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train(model, opt, 2, 40)
    with ckpt.Checkpointer(url, rng=False) as cp:
        cp.save(1, model=model, optimizer=opt).wait()
    want = {k: bits(v) for k, v in model.state_dict().items()}
    want_opt = [bits(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    again = _model(12)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2, fused=True)
    _train(again, opt2, 1, 41)
    torch.cuda._sleep(50_000_000)  # a long kernel on the current stream...
    for p in again.parameters():
        p.data.fill_(7.0)  # ...then a write the restore must come after
    cp = ckpt.Checkpointer(url, rng=False)
    assert cp.load_latest(model=again, optimizer=opt2) == 1
    assert {k: bits(v) for k, v in again.state_dict().items()} == want
    assert [bits(v) for s in opt2.state.values() for v in s.values() if torch.is_tensor(v)] == want_opt
    pool = cp._slabs
    # ("during" falls back to locking after the read where the runtime would
    # not pin pages the read was writing.)
    assert pool is not None and pool.restore_locks in ([way], ["after"] if way == "during" else [way])
    pool.drain()
    assert pool._slabs[0].locked
    cp.close()

@needs_cuda
def test_buffers_changed_by_the_next_forward_are_stored_as_they_were(url: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.BatchNorm1d(512)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    want = {}
    for step in range(3):
        want[step] = {k: bits(v) for k, v in model.state_dict().items()}
        cp.save(step, model=model, optimizer=opt)
        model(torch.randn(32, 64, device="cuda")).sum().backward()  # updates running stats at once
        opt.step()
    cp.wait()
    for step in range(3):
        saved = cp.read(step).state["model"]
        assert {k: bits(v) for k, v in saved.items()} == want[step], f"step {step}"
    cp.close()


# Each optimizer step adds 1 to every parameter (SGD, lr 1, gradient -1), so
# the checkpoint of step s holds s everywhere; the step pre-hook orders each
# step after the copies of the save before it.
_KILLED = """
import sys, torch, ckpt
url = sys.argv[1]
model = torch.nn.Linear(2048, 2048).cuda()
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
        p.grad = torch.full_like(p, -1.0)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
cp = ckpt.Checkpointer(url, lazy=True, rng=False)
step = 0
while True:
    cp.save(step, model=model, optimizer=opt)
    opt.step()
    if step == 1:
        print("saving", flush=True)
    step += 1
"""


@needs_cuda
def test_a_sigkill_while_copies_are_in_flight_leaves_the_last_checkpoint_loadable(tmp_path: Path) -> None:
    for k in range(3):
        url = (tmp_path / f"k{k}").as_uri()
        p = subprocess.Popen([PYTHON, "-c", textwrap.dedent(_KILLED), url], stdout=subprocess.PIPE, env=python_env())
        assert p.stdout is not None and p.stdout.readline().strip() == b"saving"
        time.sleep(0.2 + 0.3 * k)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        model = torch.nn.Linear(2048, 2048).cuda()
        cp = ckpt.Checkpointer(url, rng=False)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        step = cp.load_latest(model=model, optimizer=opt)
        assert step is not None and step >= 0
        assert torch.all(model.weight == float(step)) and torch.all(model.bias == float(step)), f"step {step}"


@needs_cuda
def test_fsdp2_on_nccl_saves_and_loads_into_a_plain_cuda_model(tmp_path: Path) -> None:
    # Repeated lazy saves, training going on after each: the later ones take
    # the DTensor state dicts in bulk (ckpt._save.repeat), which the script checks.
    script = tmp_path / "fsdp_nccl.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, torch.distributed as dist
        from torch.distributed.fsdp import fully_shard
        import ckpt
        import ckpt._save.repeat as rp
        taken = []
        real_emit = rp._emit
        def emit(*args):
            ok = real_emit(*args)
            taken.append(ok)
            return ok
        rp._emit = emit
        dist.init_process_group("nccl")
        torch.cuda.set_device(0)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(5)]).cuda()
        for m in model:
            fully_shard(m)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        def train():
            model(torch.randn(8, 128, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        cp = ckpt.Checkpointer(sys.argv[1], lazy=True)
        for step in range(1, 5):
            train()
            cp.save(step, model=model, optimizer=opt)
            if step < 4:
                cp.wait()  # (its slab is free again: the next save guesses it)
        full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
        train()  # lazy: the last save keeps the values it had
        cp.close()
        assert sum(taken) >= 2, taken
        torch.save(full, sys.argv[2])
        dist.destroy_process_group()
    """))
    url = (tmp_path / "ck").as_uri()
    ref = tmp_path / "ref.pt"
    env = python_env()
    run = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", str(script), url, str(ref)]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    plain = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(5)]).cuda()
    assert ckpt.Checkpointer(url).load_latest(model=plain) == 4
    want = torch.load(ref, weights_only=True)
    for k, v in plain.state_dict().items():
        assert torch.equal(v.cpu(), want[k]), k


def test_a_slab_is_locked_in_pieces_that_split_no_page_and_no_slot() -> None:
    from ckpt._device import slabs as _slabs

    big = 100 << 20
    lens = [12, big, 7, 300, big, big, 64, big + 5, 3]

    class Fake:  # the layout of a real slab, without mapping 400 MiB
        pass

    real = _ckpt.HostSlab(lens)
    fake = Fake()
    fake.slots, fake.nbytes = real.slots, real.nbytes
    pieces = _slabs._pieces(fake)  # type: ignore[arg-type]
    assert len(pieces) > 1, "a slab this large is locked in several pieces"
    assert pieces[0][0] == 0 and sum(n for _, n in pieces) == real.nbytes
    for (a, n), (b, _) in zip(pieces, pieces[1:]):
        assert a + n == b and b % 4096 == 0, "pieces tile the slab at page boundaries"
    for off, n in real.slots:
        inside = [a for a, m in pieces if a <= off and off + n <= a + m]
        assert len(inside) == 1 or n == 0, f"slot at {off} lies in one piece"
