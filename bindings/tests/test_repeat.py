"""Repeated saves walked in bulk (``ckpt._save.repeat``): a later save of the same
state dicts takes each mapping of CUDA tensors at once, as its plan says, and
anything that differs goes through the walk again.

Run on CPU tensors through the device path, on the tests' own device
(``cpu_device.CpuDevice``; ``test_device_copy.py`` says why).
"""

from __future__ import annotations

import threading
from typing import Dict, List, Tuple

import pytest
import torch

import ckpt
import ckpt._save.repeat as rp
import ckpt._device.cuda as cudam
from cpu_device import CpuDevice
from test_device_copy import (  # noqa: F401 - the fixture is used by name
    Net, as_cuda_state, check_stored, fake_cuda, fresh, snapshot, train,
)


@pytest.fixture()
def emitted(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """The path of each mapping walked in bulk, in order."""
    out: List[str] = []
    real = rp._emit

    def emit(fl: object, plan: rp.Plan, vals: List[torch.Tensor], lazy_ptrs: object) -> bool:
        ok = real(fl, plan, vals, lazy_ptrs)
        if ok:
            out.append("model" if plan.names[0].startswith("model.") else "optimizer")
        return ok

    monkeypatch.setattr(rp, "_emit", emit)
    return out


def trained(tied: bool = True) -> Tuple[Net, torch.optim.Optimizer]:
    """A :class:`Net` (its embedding and head tied, unless not ``tied``; a
    buffer the loop changes) and its Adam, one step in."""
    torch.manual_seed(0)
    model = Net()
    if not tied:
        model.head.weight = torch.nn.Parameter(model.emb.weight.detach().clone())
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    train(model, opt)
    return model, opt


@pytest.mark.parametrize("lazy", [False, True])
def test_later_saves_take_the_model_and_the_optimizer_state_in_bulk(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str], lazy: bool
) -> None:
    model, opt = trained()  # tied embedding and head, and a buffer the loop changes
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False)
    expected = {}
    for step in range(1, 7):
        expected[step] = snapshot(model, opt)
        cp.save(step, model=model, optimizer=opt)
        train(model, opt)  # lazy: after the copies (step pre-hook); the buffer changes at once
        cp.wait()
    cp.close()
    # The first save records the plans; once a slab is guessed, both mappings
    # go in bulk every time.
    assert emitted.count("model") >= 3 and emitted.count("optimizer") >= 3, emitted
    check_stored(url, expected)


@pytest.mark.parametrize("lazy", [False, True])
def test_an_adams_cpu_steps_go_in_bulk_with_its_cuda_moments(
    url: str, cpu_device: CpuDevice, monkeypatch: pytest.MonkeyPatch, emitted: List[str], lazy: bool
) -> None:
    # PyTorch's Adam and AdamW keep each parameter's step on the CPU beside
    # its moments on the GPU (unless fused or capturable): the optimizer's
    # state is a mapping of both, which later saves take in bulk all the same.
    import ckpt._state.tree as tree

    cpu_device.cpu_scalars = True
    leaves: List[str] = []
    real_leaf = tree._Flattener.leaf

    def leaf(self: object, obj: torch.Tensor, base: str, *args: object) -> object:
        leaves.append(base)
        return real_leaf(self, obj, base, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(tree._Flattener, "leaf", leaf)
    orders: List[List[str]] = []
    real_flatten = ckpt.checkpointer.flatten

    def flatten(*args: object, **kwargs: object) -> object:
        flat = real_flatten(*args, **kwargs)  # type: ignore[arg-type]
        orders.append([t.name for t in flat.tensors])
        return flat

    monkeypatch.setattr(ckpt.checkpointer, "flatten", flatten)
    model, opt = trained()
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False)
    expected, walked = {}, {}
    for step in range(1, 7):
        expected[step] = snapshot(model, opt)
        del leaves[:]
        cp.save(step, model=model, optimizer=opt)
        walked[step] = list(leaves)
        train(model, opt)
        cp.wait()
    plan = cp._pool(False).plans["optimizer.state."]
    cp.close()
    assert emitted.count("optimizer") >= 3, emitted
    assert plan.mixed is not None
    steps = [n for n in plan.names if n.endswith(".step")]
    assert [plan.names[j] for j in plan.mixed[1]] == steps and len(steps) == len(opt.state)
    # The first save walks every tensor; the last walks none of the optimizer's
    # (lazy mode: the model's buffer alone, which it copies at once).
    assert sum(n.endswith(".step") for n in walked[1]) == len(steps)
    assert walked[6] == (["model.seen"] if lazy else []), walked[6]
    # In the walk's order, so the same state is laid out the same way.
    assert orders[-1] == orders[0]
    check_stored(url, expected)


def test_a_parameter_in_new_memory_or_of_a_new_shape_is_walked_again(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str]
) -> None:
    model, opt = trained()
    cp = ckpt.Checkpointer(url, lazy=True, rng=False, staging_budget=1 << 30)
    expected = {}
    for step in range(1, 5):
        expected[step] = snapshot(model, opt)
        cp.save(step, model=model, optimizer=opt)
        train(model, opt)
        cp.wait()
    before = len(emitted)
    # The same shape at a new address.
    with torch.no_grad():
        model.blocks[5].weight.data = model.blocks[5].weight.detach().clone() + 7.0
    expected[5] = snapshot(model, opt)
    cp.save(5, model=model, optimizer=opt)
    cp.wait()
    assert "model" not in emitted[before:]
    # A new shape (the optimizer state of it stays as it was).
    with torch.no_grad():
        model.blocks[6].bias.data = torch.full((3,), 2.5)
    expected[6] = snapshot(model, opt)
    cp.save(6, model=model, optimizer=opt)
    cp.wait()
    # And the same again: taken in bulk once more, with the new plan.
    expected[7] = snapshot(model, opt)
    cp.save(7, model=model, optimizer=opt)
    cp.wait()
    cp.close()
    assert emitted[-2:] == ["model", "optimizer"] or emitted[-1] == "model", emitted[before:]
    check_stored(url, expected)
    got = ckpt.Checkpointer(url, read_only=True, rng=False).read(6).state["model"]
    assert torch.equal(got["blocks.6.bias"], torch.full((3,), 2.5))


def test_later_lazy_saves_leave_the_modules_parameters_unlooked_up(
    url: str, cpu_device: CpuDevice, emitted: List[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Which tensors of a module may wait for the background copy is known by
    # walking its parameters, a good part of a lazy save's stall. A save whose
    # plan holds needs no such walk: its parameters are those of the plan, and
    # its buffer is copied at once as the last time.
    import ckpt._state.tensors as ct

    looked_up: List[int] = []
    real = ct.lazy_safe_pointers

    def counted(obj: object) -> object:
        if isinstance(obj, torch.nn.Module):
            looked_up.append(len(emitted))
        return real(obj)

    monkeypatch.setattr(ct, "lazy_safe_pointers", counted)
    # The background copies wait until the buffer has changed: a buffer left
    # to them would be stored as it is after the save.
    gate = threading.Event()

    def gated() -> None:
        assert gate.wait(10)

    cpu_device.before_copy = gated
    model, opt = trained()  # with a buffer
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    expected = {}
    for step in range(1, 7):
        expected[step] = snapshot(model, opt)
        gate.clear()
        cp.save(step, model=model, optimizer=opt)
        model.seen += 100  # forward changes buffers before any optimizer step
        gate.set()
        train(model, opt)
        cp.wait()
    cp.close()
    assert emitted.count("model") >= 3, emitted
    assert looked_up and max(looked_up) == 0, (looked_up, emitted)  # the first save's walk only
    check_stored(url, expected)  # the buffer as it was at each save


def test_a_save_while_the_last_slab_is_still_being_written_takes_the_state_in_bulk(
    url: str, cpu_device: CpuDevice, emitted: List[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # When writing a save takes about as long as the interval between saves,
    # the next save finds the last slab still busy: there is no slab to guess,
    # and one is chosen at its start. Its plans hold all the same: its tensors
    # go in bulk, their bytes pending until that start.
    gate = threading.Event()
    gate.set()

    def gated() -> None:
        assert gate.wait(10)

    cpu_device.before_copy = gated
    model, opt = trained()
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    expected = {1: snapshot(model, opt)}
    cp.save(1, model=model, optimizer=opt)  # the walk records the plans
    cp.wait()  # (and they are made once the save has started)
    train(model, opt)
    expected[2] = snapshot(model, opt)
    gate.clear()  # save 2's copies do not land, so its slab stays busy
    cp.save(2, model=model, optimizer=opt)
    pool = cp._pool(False)
    assert pool.guess() is None  # (the one slab of this layout is save 2's)
    before = len(emitted)
    expected[3] = snapshot(model, opt)
    cp.save(3, model=model, optimizer=opt)
    assert emitted[before:] == ["model", "optimizer"], emitted
    gate.set()
    train(model, opt)
    cp.wait()
    # Then a slab is free again, and guessed.
    expected[4] = snapshot(model, opt)
    cp.save(4, model=model, optimizer=opt)
    train(model, opt)
    cp.wait()
    assert emitted[-2:] == ["model", "optimizer"], emitted
    assert len(pool._slabs) == 2  # (saves 2 and 3 had one each)
    cp.close()
    check_stored(url, expected)


def test_an_eager_save_without_a_guessed_slab_takes_the_state_in_bulk(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str]
) -> None:
    # The same for an eager save: its copies are queued at its start (none
    # during the walk, with no slab to put them in), and stored bitwise.
    model, opt = trained()
    cp = ckpt.Checkpointer(url, lazy=False, rng=False)
    expected = {1: snapshot(model, opt)}
    cp.save(1, model=model, optimizer=opt)
    cp.wait()
    train(model, opt)
    pool = cp._pool(False)
    holder = cudam.DeviceCopy(pool, lazy=False)  # another save's copies hold the one slab
    assert pool.guess() is None
    before = len(emitted)
    expected[2] = snapshot(model, opt)
    cp.save(2, model=model, optimizer=opt)
    assert emitted[before:] == ["model", "optimizer"], emitted
    train(model, opt)  # (eager: the copies were taken in the save)
    cp.wait()
    holder.abandon()
    cp.close()
    check_stored(url, expected)


def _described(plans: Dict[str, rp.Plan]) -> Dict[str, object]:
    return {
        k: (p.names, p.runs, p.slot_of, {j: (d, tuple(s), repr(sh)) for j, (d, s, sh) in p.made.items()},
            p.uniq_ptrs, p.nbytes, p.device, p.walk_ptrs)
        for k, p in plans.items()
    }


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_a_plan_checked_in_bulk_is_the_plan_made_tensor_by_tensor(
    tmp_path: object, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, lazy: bool, tied: bool
) -> None:
    # Most mappings are plain (each tensor copied as it is into a slot of its
    # own, in order), and their plan is checked in bulk; the rest go tensor by
    # tensor. Both must make the same plan where the bulk check applies.
    model, opt = trained(tied)
    real = rp._in_order
    fast: List[bool] = []

    def counted(*args: object) -> bool:
        ok = real(*args)  # type: ignore[arg-type]
        fast.append(ok)
        return ok

    made = []
    for bulk in (True, False):
        monkeypatch.setattr(rp, "_in_order", counted if bulk else (lambda *args: False))
        cp = ckpt.Checkpointer(f"file://{tmp_path}/{bulk}", lazy=lazy, rng=False)
        cp.save(1, model=model, optimizer=opt)
        cp.wait()
        made.append(_described(cp._pool(False).plans))
        cp.close()
    assert made[0] == made[1]
    assert set(made[0]) == {"model.", "optimizer.state."}
    # The optimizer's state is plain; the model's is not when its head is
    # tied, nor in lazy mode (its buffer is cloned at once).
    assert fast == [not tied and not lazy, True], fast


@pytest.mark.parametrize("lazy", [False, True])
def test_plans_are_made_out_of_the_stall(
    url: str, fake_cuda: Dict[str, List[int]], monkeypatch: pytest.MonkeyPatch, lazy: bool
) -> None:
    # A first save's plans cost about as much as its walk: the walk takes what
    # they need, and ckpt's background thread makes them once the save has started.
    where: List[str] = []
    real = rp._plan

    def plan(*args: object) -> object:
        where.append(threading.current_thread().name)
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(rp, "_plan", plan)
    model, opt = trained()
    with ckpt.Checkpointer(url, lazy=lazy, rng=False) as cp:
        cp.save(1, model=model, optimizer=opt)
        cp.wait()
        assert set(cp._pool(False).plans) == {"model.", "optimizer.state."}
    assert len(where) == 2 and all(w.startswith("ckpt-d2h") for w in where), where


def test_a_plan_that_cannot_be_made_is_said_once_and_the_saves_stay_whole(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plans are made on a background thread; a bug there must not pass unseen.
    def broken(*args: object) -> object:
        raise ValueError("a bug in the plan")

    monkeypatch.setattr(rp, "_plan", broken)
    monkeypatch.setattr(rp, "_WARNED", False)
    model, opt = trained()
    expected = {}
    with pytest.warns(RuntimeWarning, match="no repeated-save plan .*ValueError: a bug in the plan") as got:
        with ckpt.Checkpointer(url, lazy=True, rng=False) as cp:
            for step in (1, 2, 3):
                expected[step] = snapshot(model, opt)
                cp.save(step, model=model, optimizer=opt)
                train(model, opt)
                cp.wait()
    assert sum("no repeated-save plan" in str(w.message) for w in got) == 1, "once per process"
    assert not emitted, "without plans, every save walks"
    check_stored(url, expected)


@pytest.mark.parametrize("lazy", [False, True])
def test_the_same_mappings_in_another_order_go_in_bulk_into_a_new_slab(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str], lazy: bool
) -> None:
    # The guessed slab has the last save's layout; a plan that holds but does
    # not fit it lets it go, and the tensors go in bulk into a slab laid out
    # at the save's start.
    model, opt = trained()
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=False)
    expected = {1: snapshot(model, opt)}
    cp.save(1, model=model, optimizer=opt)
    train(model, opt)
    cp.wait()
    before = len(emitted)
    expected[2] = snapshot(model, opt)
    cp.save(2, optimizer=opt, model=model)
    train(model, opt)
    cp.wait()
    assert emitted[before:] == ["optimizer", "model"], emitted
    cp.close()
    check_stored(url, expected)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_fresh_starts_first_save_goes_in_bulk_into_a_slab_laid_out_for_it(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str], monkeypatch: pytest.MonkeyPatch, lazy: bool
) -> None:
    # A first save's stall was 2-3x a later one's: it walked every tensor, and
    # took its slab then. After the optimizer's first step the state is walked
    # once, out of any save: the first save takes both mappings in bulk, into
    # the reserved slab laid out for it, whose slots its walk hands out.
    model, opt = fresh(monkeypatch)
    collections: List[int] = []
    monkeypatch.setattr(ckpt._save.ahead, "collect_now", lambda: collections.append(1))
    cp = ckpt.Checkpointer(url, lazy=lazy, rng=True)
    assert cp.load_latest(model=model, optimizer=opt) is None
    assert not collections
    train(model, opt)
    assert collections == [1], "a full collection once the first save is readied, out of it"
    pool = cp._slabs
    assert pool is not None
    pool.drain()  # (the plans are made on the pool's thread)
    assert set(pool.plans) == {"model.", "optimizer.state."}
    assert [s.lens for s in pool._slabs] == [pool._layout], "the reserved slab, laid out for the first save"
    address = pool._slabs[0].native.address
    assert not emitted, "nothing saved yet"
    train(model, opt)
    expected = {1: snapshot(model, opt)}
    handed = len(fake_cuda["into_slots"])
    cp.save(1, model=model, optimizer=opt)
    train(model, opt)
    cp.wait()
    assert emitted == ["model", "optimizer"], emitted
    assert collections == [1]
    assert len(fake_cuda["into_slots"]) == handed, "the walk handed out the slots (the slab was guessed)"
    assert [s.native.address for s in pool._slabs] == [address]
    cp.close()
    check_stored(url, expected)


def test_a_restarts_first_save_goes_in_bulk(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    as_cuda_state(monkeypatch)
    model, opt = trained()
    with ckpt.Checkpointer(url, lazy=True, rng=False) as cp:
        cp.save(1, model=model, optimizer=opt)
    # A restarted process: a new checkpointer restores, then saves.
    emitted.clear()
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    assert cp.load_latest(model=model, optimizer=opt) == 1
    train(model, opt)
    expected = {2: snapshot(model, opt)}
    cp.save(2, model=model, optimizer=opt)
    train(model, opt)
    cp.close()
    assert emitted == ["model", "optimizer"], emitted
    check_stored(url, expected)


def test_a_walk_ahead_under_other_names_leaves_the_first_save_whole(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The names given to load_latest are not the save's: the plans made ahead
    # do not apply, and the first save walks, as it did before.
    model, opt = fresh(monkeypatch)
    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    assert cp.load_latest({"net": model, "adam": opt}) is None
    train(model, opt)
    expected = {1: snapshot(model, opt)}
    cp.save(1, model=model, optimizer=opt)
    train(model, opt)
    cp.close()
    assert not emitted, emitted
    check_stored(url, expected)


def test_a_slab_laid_out_anew_gets_specs_for_its_new_slots(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str]
) -> None:
    # The specs a plan made for a slab hold its slot objects, by which the
    # engine counts the slab as in use; a slab laid out for another state and
    # then for this one again has new slot objects, and needs specs of its own.
    model, opt = trained()
    cp = ckpt.Checkpointer(url, lazy=False, rng=False, keep_last=10)
    expected = {}

    def save(step: int, **state: object) -> None:
        if "optimizer" in state:
            expected[step] = snapshot(model, opt)
        cp.save(step, **state)
        train(model, opt)
        cp.wait()

    save(1, model=model, optimizer=opt)
    save(2, model=model, optimizer=opt)  # into the guessed slab: specs made for it
    pool = cp._slabs
    assert pool is not None and len(pool._slabs) == 1
    slab = pool._slabs[0]
    first = slab.layouts
    save(3, model=model)  # another state: the slab is laid out for it
    save(4, model=model, optimizer=opt)  # and for this one again
    save(5, model=model, optimizer=opt)  # guessed
    assert pool._slabs == [slab] and slab.layouts > first
    slots = {id(s) for s in slab.slot_objs()}
    for prefix in ("model.", "optimizer.state."):
        _, _, specs = pool.plans[prefix].specs[id(slab)]
        assert all(id(spec.data) in slots for spec in specs), prefix
    cp.close()
    check_stored(url, expected)


def test_a_walk_ahead_queues_no_copies_and_a_failing_one_only_warns(
    url: str, fake_cuda: Dict[str, List[int]], emitted: List[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = fresh(monkeypatch)
    cp = ckpt.Checkpointer(url, lazy=False, rng=False)
    assert cp.load_latest(model=model, optimizer=opt) is None
    train(model, opt)  # readied: a slab laid out, which the next save would guess
    assert cp._slabs is not None and cp._slabs._layout is not None
    copies = len(fake_cuda["copies"])
    ckpt._save.ahead.rehearse(cp, None, {"model": model, "optimizer": opt})  # (as a later restore would)
    assert len(fake_cuda["copies"]) == copies, "an eager walk ahead queued copies into the guessed slab"
    monkeypatch.setattr(cudam.SlabPool, "lay_out_ahead", lambda self, lens: 1 / 0)
    with pytest.warns(RuntimeWarning, match="could not be readied .*ZeroDivisionError"):
        ckpt._save.ahead.rehearse(cp, None, {"model": model, "optimizer": opt})
    expected = {1: snapshot(model, opt)}
    cp.save(1, model=model, optimizer=opt)
    cp.close()
    check_stored(url, expected)
