"""The slab pool of CUDA snapshots (``ckpt._device.cuda.SlabPool``): its default
budget, its collection when a checkpointer is never closed, where a restore
lays its buffers out in a slab a save left, and which device ckpt's own
threads make current for their CUDA calls.

No GPU here: the real pool and ``DeviceCopy`` run on CPU tensors through the
stand-in CUDA streams and events of ``test_device_copy.py`` (a test double;
``test_cuda.py`` runs on a GPU). The page locking is the stand-in's too, so
what is checked is the pool's bookkeeping, not the driver's.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
from torch import nn

import ckpt
import ckpt._save.ahead as _ahead
import ckpt._device.slabs as slabs
import ckpt._device.cuda as cudam
from ckpt._device.device import Event, Stream, _Locker, current, using
from cpu_device import CpuDevice, CpuEvent
from test_device_copy import (  # noqa: F401 - the fixture is used by name
    Net, as_cuda_state, check_stored, fake_cuda, fresh, snapshot, train,
)


class _Landing:
    """Stands for a save's copies that have not landed yet."""

    def landed(self) -> bool:
        return False


def test_the_default_budget_holds_two_slabs(fake_cuda: Dict[str, List[int]], tmp_path: Any) -> None:
    # Large slots start STAGING_LEAD bytes into a page: the slab is longer than its tensors.
    # (Twice this slab is more than the engine's least default budget, 64 MiB.)
    lens = [16 << 20, 16 << 20, 1000]
    pool = cudam.SlabPool(ckpt._ckpt.Checkpointer(tmp_path.as_uri(), busy="skip"))
    first = pool.take(lens, 1)
    assert first.nbytes > sum(lens)
    first.owner = _Landing()  # still being written when the next save comes
    second = pool.take(lens, 2)
    assert second is not first, "the next save gets a slab of its own"
    second.owner = _Landing()
    with pytest.raises(ckpt.SkippedError):
        pool.take(lens, 3)  # two slabs are the default budget
    first.owner = None
    assert pool.take(lens, 4) is first


def test_a_save_waiting_for_memory_wakes_when_a_save_lets_its_slab_go(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """``busy="wait"``: a save that finds the budget held blocks until the
    engine lets go of a slab's bytes, which notifies the pool (the wait's
    bound without a notice is set to a minute, so only the notice wakes it)."""
    monkeypatch.setattr(slabs, "_UNANNOUNCED", 60.0)
    lens = [1 << 20]
    # Room for two slabs of 1 MiB and a page (a slot of 1 MiB starts past a page).
    cp = ckpt._ckpt.Checkpointer(tmp_path.as_uri(), lazy=True, staging_budget=2 * ((1 << 20) + 4096))
    pool = cudam.SlabPool(cp)
    first = pool.take(lens, 1)
    gate = threading.Event()
    spec = ckpt._ckpt.TensorSpec(name="t", dtype="U8", shape=(1 << 20,), data=first.slot_objs()[0])
    handle = cp.save(1, [spec], {"state": None}, lambda: None if gate.wait(30) else None)
    assert first.native.in_use(), "the engine holds its bytes until it has written them"
    pool.take(lens, 2).owner = _Landing()  # the budget's second slab, held too
    got: List[Any] = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(lens, 3)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "the save waits while both slabs are held"
    gate.set()
    handle.wait(30)
    waiter.join(10)
    assert not waiter.is_alive() and got == [first], "the release woke it, into the slab let go"
    pool.close()


@pytest.mark.parametrize("ahead", ["reserved", "restored"])
def test_the_default_budget_holds_a_second_slab_beside_memory_locked_ahead(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, ahead: str, tmp_path: Any
) -> None:
    """A reservation or a restore's slab is a little larger than the first
    save's tensors; the default budget (twice the first save's slab) must be
    twice that slab, or a save that comes while the first is being written
    waits for it (or is skipped) instead of taking a second slab."""
    _counting_locks()
    lens = [16 << 20, 16 << 20, 1000]
    pool = cudam.SlabPool(ckpt._ckpt.Checkpointer(tmp_path.as_uri(), busy="skip"))
    if ahead == "reserved":
        pool.reserve(_ahead.for_state(sum(lens), len(lens)), None)
        pool._settle()
    else:
        slab, _ = pool.borrow(lens)
        pool.prepare(slab, None, whole=True)
    first = pool.take(lens, 1)
    assert first is pool._slabs[0], "the first save takes the memory locked ahead"
    first.owner = _Landing()  # still being written when the next save comes
    second = pool.take(lens, 2)
    assert second is not first
    pool.close()


def test_a_pool_never_closed_is_collected_and_unlocks_its_slabs(
    cpu_device: CpuDevice
) -> None:
    gc.collect()  # earlier tests' pools first: only this one's slabs are unlocked below
    unlocked = cpu_device.unlocked
    unlocked.clear()
    pool = cudam.SlabPool()
    slab = pool.take([1 << 20, 3000], 1)
    pool.prepare(slab, None)
    assert slab.locked
    pieces = list(slab.pieces)
    ref = weakref.ref(pool)
    del pool, slab
    gc.collect()
    assert ref() is None, "the pool is collected"
    assert unlocked == pieces, "and what it locked is unlocked"


def _within_one_piece(slab: Any, offsets: List[int], lens: List[int]) -> bool:
    pieces = slabs._pieces(slab)
    return all(any(at <= off and off + n <= at + size for at, size in pieces) for off, n in zip(offsets, lens))


def test_a_restore_lays_its_buffers_out_within_locked_pieces(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slabs, "_LOCK_PIECE", 1 << 20)  # a small slab locked in several pieces
    saved = [600_000] * 6
    pool = cudam.SlabPool()
    slab = pool.take(saved, 1)
    pool.prepare(slab, None)
    assert len(slab.pieces) > 1
    # The same layout: the save's own slots.
    got, offsets = pool.borrow(saved)
    assert got is slab and offsets == [off for off, _ in slab.slots]
    # Another layout, which packed would cross from one locked piece into the
    # next: not in this slab (a copy must lie within one piece).
    other = [1_000_000, 1_000_000, 1_000_000]
    got, offsets = pool.borrow(other)
    assert _within_one_piece(got, offsets, other)
    # A slab locked in one piece takes any layout that fits, packed.
    small = cudam.SlabPool()
    one = small.take([300_000, 300_000], 1)
    small.prepare(one, None)
    got, offsets = small.borrow([200_000, 200_000, 150_000])
    assert got is one and _within_one_piece(one, offsets, [200_000, 200_000, 150_000])


class _Current(threading.local):
    device: Optional[torch.device] = None


def test_ckpts_own_threads_make_the_tensors_device_current(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread starts on device 0; a CUDA call there would create a context
    on GPU 0 for every rank of a node. Every CUDA call ckpt makes outside the
    caller's thread must run inside the device's ``on(device)``."""
    here = _Current()
    strays: List[Tuple[str, str]] = []

    def check(what: str) -> None:
        if threading.current_thread() is not threading.main_thread() and here.device is None:
            strays.append((what, threading.current_thread().name))

    class Checked(CpuEvent):
        def query(self) -> bool:
            check("Event.query")
            return True

        def synchronize(self) -> None:
            check("Event.synchronize")

    class Checking(CpuDevice):
        """Notes each call made on a thread of ckpt's own without a device current."""

        @contextlib.contextmanager
        def on(self, device: Optional[torch.device]) -> Iterator[None]:
            prev, here.device = here.device, device
            try:
                yield
            finally:
                here.device = prev

        def record(self, stream: Stream, blocking: bool = False) -> Event:
            check("Event.record")
            return Checked()

        def lock(self, address: int, nbytes: int, quiet: bool = False) -> bool:
            check("cudaHostRegister")
            return True

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt)
    with using(Checking()):
        for lazy in (True, False):
            cp = ckpt.Checkpointer(url, lazy=lazy, rng=False, keep_last=2)
            for step in range(3):
                cp.save(step + (10 if lazy else 20), model=model, optimizer=opt)
                train(model, opt)
            cp.wait()
            cp.close()
    assert not strays, strays


def test_a_failed_page_lock_takes_its_error_off_the_runtime() -> None:
    """PyTorch checks the CUDA runtime's last error after every kernel launch;
    a failed ``cudaHostRegister`` left there would fail the training's next
    kernel. (The runtime is a test double: there is no CUDA here.)"""
    calls: List[str] = []

    class Runtime:
        def cudaHostRegister(self, address: Any, n: int, flags: int) -> int:
            calls.append("register")
            return 2  # cudaErrorMemoryAllocation

        def cudaHostUnregister(self, address: Any) -> int:
            calls.append("unregister")
            return 1  # cudaErrorInvalidValue

        def cudaGetLastError(self) -> int:
            calls.append("clear")
            return 0

    locker = _Locker()
    locker._lib = Runtime()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a quiet try (a restore's, during its read) warns of nothing
        assert not locker.lock(1 << 20, 4096, quiet=True)
    with pytest.warns(UserWarning, match="could not page-lock"):
        assert not locker.lock(1 << 20, 4096)
    locker.unlock(1 << 20)
    assert calls == ["register", "clear", "register", "clear", "unregister", "clear"]


def _counting_locks() -> Dict[str, List[Any]]:
    """The page locking the tests' device in use records from now on:
    ``(address, bytes)`` locked, addresses unlocked."""
    device = current()
    assert isinstance(device, CpuDevice), "the cpu_device fixture is in use"
    device.locked.clear()
    device.unlocked.clear()
    return {"lock": device.locked, "unlock": device.unlocked}


def test_memory_locked_in_one_piece_is_laid_out_anew_for_other_shapes(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting_locks()
    pool = cudam.SlabPool()
    restored = [500_000, 500_000, 1000]
    slab, offsets = pool.borrow(restored)  # a restore's new slab...
    assert _within_one_piece(slab, offsets, restored)
    pool.prepare(slab, None, whole=True)  # ...locked after its read
    assert len(calls["lock"]) == 1
    # The first save's layout differs: step counters of a fused optimizer on
    # the device, each moving a large slot to the next page, and an empty tensor.
    saved = [500_000, 4, 500_000, 4, 1000, 4, 0]
    got = pool.take(saved, 1)
    assert got is slab and got.native.fits(saved)
    assert got.native.address == slab.native.address
    assert len(calls["lock"]) == 1 and not calls["unlock"], "nothing mapped or locked anew"
    view = got.view(2, torch.uint8, (500_000,))
    view.fill_(7)
    assert got.host[got.slots[2][0]] == 7


def test_memory_locked_in_pieces_is_not_laid_out_anew(
    fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting_locks()
    monkeypatch.setattr(slabs, "_LOCK_PIECE", 1 << 20)
    pool = cudam.SlabPool()
    slab = pool.take([600_000] * 6, 1)
    pool.prepare(slab, None)  # in a training loop: piece by piece
    assert len(slab.pieces) > 1
    got = pool.take([1_000_000] * 3, 2)
    assert got is not slab and slab not in pool._slabs
    assert sorted(calls["unlock"]) == sorted(slab.pieces) or not slab.locked


def test_a_reservation_is_the_first_saves_memory(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _counting_locks()
    model, opt = fresh(monkeypatch)
    cp = ckpt.Checkpointer(url, lazy=False, rng=False, staging_budget=1 << 20)
    assert cp.load_latest(model=model, optimizer=opt) is None  # a fresh start
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1
    reserved = pool._slabs[0]
    address = reserved.native.address
    train(model, opt)  # the optimizer's state exists only now
    want = {k: v.clone() for k, v in model.state_dict().items()}
    cp.save(1, model=model, optimizer=opt)
    assert [s.native.address for s in pool._slabs] == [address], "the save took the reserved memory"
    assert len(calls["lock"]) == 1, "locked once, ahead"
    cp.wait()
    cp.close()
    got = ckpt.Checkpointer(url, read_only=True, rng=False).read(1).state["model"]
    assert all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("lazy", [False, True])
def test_without_a_budget_a_fresh_start_reserves_the_state_after_the_first_step(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, lazy: bool
) -> None:
    """The first save's slab was mapped and locked in its stall unless a
    ``staging_budget`` said the state's size (0.36-0.46 s for 4 GiB eager, on
    an H100 host). The optimizer's first step makes the state whole: its
    bytes are counted then and locked ahead, in the background."""
    calls = _counting_locks()
    model, opt = fresh(monkeypatch)
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False)
    assert cp.load_latest(model=model, optimizer=opt) is None  # a fresh start
    assert cp._slabs is None or not cp._slabs._slabs, "nothing before the optimizer's state exists"
    train(model, opt)
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1
    reserved = pool._slabs[0]
    address = reserved.native.address
    distinct = {(t.data_ptr(), t.nbytes): t.nbytes for t in [*model.parameters(), *model.buffers()]}
    distinct.update({(t.data_ptr(), t.nbytes): t.nbytes for s in opt.state.values() for t in s.values()})
    state = sum(distinct.values())
    assert state <= reserved.nbytes <= 2 * state + 4096, "the state and its alignment, about the default budget"
    train(model, opt)
    assert len(pool._slabs) == 1, "reserved once"
    expected = {1: snapshot(model, opt)}
    assert len(opt._optimizer_step_post_hooks) == 1, "fired, and left in place (see ckpt._save.ahead)"
    cp.save(1, model=model, optimizer=opt)
    assert not opt._optimizer_step_post_hooks, "the first save takes the hook off"
    assert [s.native.address for s in pool._slabs] == [address], "the save took the reserved memory"
    assert len(calls["lock"]) == 1, "locked once, ahead"
    cp.close()
    check_stored(url, expected)


@pytest.mark.parametrize("lazy", [True, False])
def test_a_lazy_save_does_not_wait_for_the_memory_being_locked_ahead(
    url: str, cpu_device: CpuDevice, monkeypatch: pytest.MonkeyPatch, lazy: bool
) -> None:
    """A save that comes just after the optimizer's first step, while the
    state's memory is still being locked in the background, stalled until
    the locking was done (0.32-0.38 s for 4 GiB on an H200 host). A lazy one
    now takes that memory as it is and returns: its copies are queued on
    the thread that locks it, after the locking. An eager one waits (its
    copies start in its stall, on the caller's thread)."""
    locking, release = threading.Event(), threading.Event()
    calls: List[Tuple[int, int]] = []

    def lock(address: int, n: int, quiet: bool) -> bool:
        calls.append((address, n))
        locking.set()
        assert release.wait(60), "never released"
        return True

    cpu_device.lock_with = lock
    model, opt = fresh(monkeypatch)
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False)
    assert cp.load_latest(model=model, optimizer=opt) is None  # a fresh start
    train(model, opt)  # the first step: the state's memory is reserved, and its locking starts
    assert locking.wait(60)
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1
    address = pool._slabs[0].native.address
    expected = {1: snapshot(model, opt)}
    # (A save that waits for the locking is let go after 5 s, and fails below.)
    watchdog = threading.Timer(5.0, release.set)
    watchdog.start()
    try:
        cp.save(1, model=model, optimizer=opt)
        returned_first = not release.is_set()
    finally:
        release.set()
        watchdog.cancel()
    assert returned_first is lazy, "a lazy save returns while the memory is being locked; an eager one waits"
    assert [s.native.address for s in pool._slabs] == [address], "the save took the memory locked ahead"
    train(model, opt)  # the step waits for the copies, queued once the memory is locked
    assert len(calls) == 1, "locked once, ahead"
    cp.close()
    check_stored(url, expected)


def test_a_lazy_save_into_memory_whose_locking_failed_stores_its_values(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory locked ahead fails to be prepared after a lazy save took it
    (as it may when the memory cannot be had): the save's copies still land
    (in pageable memory), and a later save stores its values too."""
    _counting_locks()
    release = threading.Event()
    real = cudam.SlabPool.prepare

    def prepare(self: Any, slab: Any, device: Any, whole: bool = False) -> None:
        if whole and not slab.prepared:  # the reservation's
            slab.prepared = True
            assert release.wait(60), "never released"
            raise MemoryError("no memory to be had (a test's)")
        real(self, slab, device, whole)

    monkeypatch.setattr(cudam.SlabPool, "prepare", prepare)
    model, opt = fresh(monkeypatch)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    assert cp.load_latest(model=model, optimizer=opt) is None
    train(model, opt)
    expected = {1: snapshot(model, opt)}
    cp.save(1, model=model, optimizer=opt)  # (returns: it takes the memory being prepared)
    release.set()
    train(model, opt)
    cp.wait()
    expected[2] = snapshot(model, opt)
    cp.save(2, model=model, optimizer=opt)
    train(model, opt)
    cp.close()
    check_stored(url, expected)


def test_with_two_optimizers_the_reservation_waits_for_both_states(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    as_cuda_state(monkeypatch)
    torch.manual_seed(0)
    model = Net()
    first = torch.optim.Adam(model.blocks.parameters(), lr=0.1)
    second = torch.optim.SGD([model.emb.weight], lr=0.1, momentum=0.9)
    cp = ckpt.Checkpointer(url, rng=False)
    assert cp.load_latest({"model": model, "optimizers": [first, second]}) is None
    train(model, first)
    train(model, first)
    assert cp._slabs is None or not cp._slabs._slabs, "the second optimizer's state does not exist yet"
    train(model, second)
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1
    momentum = sum(s["momentum_buffer"].nbytes for s in second.state.values())
    adam = sum(t.nbytes for s in first.state.values() for t in s.values())
    assert pool._slabs[0].nbytes >= adam + momentum + sum(t.nbytes for t in model.parameters())
    cp.close()


class _AppState:
    """What DCP users pass: an object holding the model and the optimizer."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, broken: bool = False) -> None:
        self.model, self.optimizer, self.broken = model, opt, broken

    def state_dict(self) -> Dict[str, Any]:
        if self.broken:
            raise RuntimeError("no state dict today")
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.model.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optim"])


@pytest.mark.parametrize("broken", [False, True])
def test_an_app_states_optimizer_is_found_and_a_failing_count_only_warns(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, broken: bool
) -> None:
    model, opt = fresh(monkeypatch)
    cp = ckpt.Checkpointer(url, rng=False)
    assert cp.load_latest(app=_AppState(model, opt, broken)) is None
    assert len(opt._optimizer_step_post_hooks) == 1
    if broken:
        with pytest.warns(RuntimeWarning, match="no memory locked ahead .*no state dict today"):
            train(model, opt)  # the training's step goes on
        assert cp._slabs is None or not cp._slabs._slabs
    else:
        train(model, opt)
        assert cp._slabs is not None and len(cp._slabs._slabs) == 1
        adam = sum(t.nbytes for s in opt.state.values() for t in s.values())
        assert cp._slabs._slabs[0].nbytes >= adam + sum(t.nbytes for t in model.parameters())
    cp.close()
    assert not opt._optimizer_step_post_hooks


def test_a_model_alone_is_reserved_at_once_and_a_restart_reserves_nothing(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = fresh(monkeypatch)
    cp = ckpt.Checkpointer(url, rng=False)
    assert cp.load_latest(model=model) is None
    assert cp._slabs is not None and len(cp._slabs._slabs) == 1, "no optimizer: the state is whole now"
    train(model, opt)
    cp.save(1, model=model, optimizer=opt).wait()
    cp.close()
    for budget in (None, 1 << 20):
        cp = ckpt.Checkpointer(url, rng=False, staging_budget=budget)
        assert cp.load_latest(model=model, optimizer=opt) == 1
        assert cp._slabs is None or all(s.preparing is None for s in cp._slabs._slabs), "a restart: nothing reserved"
        assert not opt._optimizer_step_post_hooks
        cp.close()


def test_a_checkpointer_closed_before_the_first_step_reserves_nothing(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = fresh(monkeypatch)
    cp = ckpt.Checkpointer(url, rng=False)
    assert cp.load_latest(model=model, optimizer=opt) is None
    assert len(opt._optimizer_step_post_hooks) == 1
    cp.close()
    assert not opt._optimizer_step_post_hooks, "close takes the hook off"
    train(model, opt)
    assert cp._slabs is None or not cp._slabs._slabs


def test_a_budget_of_twice_the_state_reserves_room_for_the_first_saves_alignment(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The documented setting, exactly twice the state's bytes: tensors of
    1 MiB or more each start on a page of their own, so the first save's slab
    is larger than the state, and it still fits in what was reserved."""
    calls = _counting_locks()
    as_cuda_state(monkeypatch)

    def make() -> Tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(3)))
        return model, torch.optim.Adam(model.parameters(), lr=0.1)

    twin, twin_opt = make()
    wide_train(twin, twin_opt)
    state = sum(v.nbytes for v in twin.state_dict().values())
    state += sum(v.nbytes for s in twin_opt.state.values() for v in s.values())
    model, opt = make()
    cp = ckpt.Checkpointer(url, lazy=False, rng=False, staging_budget=2 * state)
    assert cp.load_latest(model=model, optimizer=opt) is None  # a fresh start
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1
    address = pool._slabs[0].native.address
    assert pool._slabs[0].nbytes <= 2 * state, "within the budget"
    wide_train(model, opt)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    cp.save(1, model=model, optimizer=opt)
    slab = pool._slabs[0]
    assert [s.native.address for s in pool._slabs] == [address], "the save took the reserved memory"
    assert slab.nbytes > state and sum(slab.lens) == state, "its slots need more than the state's bytes"
    assert len(calls["lock"]) == 1, "locked once, ahead"
    cp.wait()
    cp.close()
    got = ckpt.Checkpointer(url, read_only=True, rng=False).read(1).state["model"]
    assert all(torch.equal(got[k], v) for k, v in want.items())


def wide_train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(4, 512)).square().mean().backward()
    opt.step()
    opt.zero_grad()
