"""Sharded training state (FSDP2, tensor parallel, DTensor) saved by N ranks, loaded by M.

Real jobs under ``torchrun`` on CPU with gloo (``fsdp_worker.py``), checked
against the full state PyTorch gathers itself
(``get_state_dict(..., full_state_dict=True)``), bitwise. Byte counts come from
the store each checkpointer wraps in a counter (``Checkpointer.io_counts``).
The in-process tests use a one-rank gloo group for DTensors.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import warnings
from pathlib import Path
from typing import Dict, List

import pytest
import torch

import ckpt
from conftest import PYTHON, python_env

WORKER = str(Path(__file__).with_name("fsdp_worker.py"))
LIMIT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n: int, *args: str, expect_ok: bool = True, monitor_s: float = 0) -> subprocess.CompletedProcess:
    """Run the worker on ``n`` ranks; ``monitor_s`` is how long the launcher may
    take to notice a dead worker (and tear the others down)."""
    monitor = ["--monitor-interval", str(monitor_s)] if monitor_s else []
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *monitor, WORKER, *args]
    p = subprocess.run(cmd, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=LIMIT)
    if expect_ok:
        assert p.returncode == 0, p.stdout[-6000:]
    return p


def plain(*args: str) -> None:
    p = subprocess.run([PYTHON, WORKER, "plain", *args], env=python_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=LIMIT)
    assert p.returncode == 0, p.stdout[-6000:]


def rows(out: Path, mode: str, n: int) -> List[Dict]:
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(n)]


def stored_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in (root / "chunks").iterdir())


def test_fsdp2_saved_by_2_loads_into_3_1_and_2_bitwise(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "out"
    url = root.as_uri()
    torchrun(2, "train", url, str(out / "a"), "--steps", "6", "--save-at", "3")
    saved = rows(out / "a", "train", 2)
    ref = saved[0]["at_save"]
    assert all(r["at_save"] == ref for r in saved)
    total = stored_bytes(root)
    # Each rank wrote about half the bytes; no rank gathered the others' shards.
    for r in saved:
        assert 0.4 * total < r["written_bytes"] < 0.62 * total, (r["written_bytes"], total)
        assert r["written_bytes"] < 1.1 * r["local_bytes"] + 200_000

    # 2 -> 3 ranks: every tensor bitwise equal to what PyTorch gathered at save.
    torchrun(3, "load", url, str(out / "b"), "--steps", "6")
    three = rows(out / "b", "load", 3)
    assert all(r["loaded"] == 3 and r["at_save"] == ref for r in three)
    # Each rank reads its share plus the overlap of the stored pieces, not the whole state.
    reads = [r["read_bytes"] for r in three]
    assert sum(reads) < 2.3 * total, (reads, total)
    assert min(reads) < 0.6 * total, (reads, total)

    # 2 -> 1 plain process, no process group.
    plain(url, str(out / "c"), "--steps", "6")
    assert rows(out / "c", "plain", 1)[0]["at_save"] == ref

    # Consolidation: one unsharded safetensors file, as PyTorch gathered it.
    from safetensors.torch import load_file

    from fsdp_worker import digests

    ckpt.export(url, tmp_path / "model.safetensors", entry="model")
    exported = {f"model.{k}": v for k, v in load_file(str(tmp_path / "model.safetensors")).items()}
    assert digests(exported) == {k: v for k, v in ref.items() if k.startswith("model.")}

    # 2 -> 2: training continued after the load matches uninterrupted training bitwise.
    torchrun(2, "load", url, str(out / "d"), "--steps", "6")
    resumed = rows(out / "d", "load", 2)
    assert all(r["at_save"] == ref for r in resumed)
    assert [r["final"] for r in resumed] == [r["final"] for r in saved]
    for r in resumed:
        assert r["read_bytes"] < 0.62 * total, (r["read_bytes"], total)


def test_fsdp2_saved_compiled_loads_uncompiled_and_the_other_way(tmp_path: Path) -> None:
    """torch.compile's wrapper prefixes every key (``_orig_mod.``): a job
    trained compiled restores into the bare sharded model and one process,
    and a bare model's checkpoint into a compiled job (ckpt._state.wrappers)."""
    out = tmp_path / "out"
    compiled, bare = (tmp_path / "compiled").as_uri(), (tmp_path / "bare").as_uri()
    torchrun(2, "train", compiled, str(out / "a"), "--steps", "4", "--save-at", "2", "--compile")
    ref = rows(out / "a", "train", 2)[0]["at_save"]
    torchrun(2, "load", compiled, str(out / "b"), "--steps", "4")
    assert all(r["loaded"] == 2 and r["at_save"] == ref for r in rows(out / "b", "load", 2))
    plain(compiled, str(out / "c"), "--steps", "4")
    assert rows(out / "c", "plain", 1)[0]["at_save"] == ref

    torchrun(2, "train", bare, str(out / "d"), "--steps", "4", "--save-at", "2")
    ref = rows(out / "d", "train", 2)[0]["at_save"]
    torchrun(3, "load", bare, str(out / "e"), "--steps", "4", "--compile")
    assert all(r["loaded"] == 2 and r["at_save"] == ref for r in rows(out / "e", "load", 3))


def test_fsdp2_repeated_lazy_saves_through_the_cuda_path_take_the_shards_in_bulk(tmp_path: Path) -> None:
    # A loop's later saves take a mapping of DTensors (the model's state dict,
    # the optimizer's state) in bulk, as the last save's plan says, with each
    # local shard's piece of the global tensor. The CUDA path runs on CPU
    # tensors on the worker's own device (see cpu_device.py).
    root, out = tmp_path / "ck", tmp_path / "out"
    url = root.as_uri()
    deep = ("--depth", "6")
    torchrun(2, "train", url, str(out / "a"), "--steps", "5", "--save-at", "2,3,4,5", "--lazy", "--stand-in", *deep)
    saved = rows(out / "a", "train", 2)
    ref = saved[0]["at_save"]
    assert all(r["at_save"] == ref for r in saved)
    for r in saved:
        # The first save records the plans; from the third on, a slab is
        # guessed and both mappings go in bulk.
        assert r["bulk"][0] == 0 and r["bulk"][2:] == [2, 2], r["bulk"]
    # The last save's shards, as PyTorch gathers the state: into one plain
    # process, and into 3 ranks sharded anew.
    plain(url, str(out / "b"), "--steps", "5", *deep)
    assert rows(out / "b", "plain", 1)[0]["at_save"] == ref
    torchrun(3, "load", url, str(out / "c"), "--steps", "5", *deep)
    assert all(r["loaded"] == 5 and r["at_save"] == ref for r in rows(out / "c", "load", 3))


@pytest.mark.parametrize("lazy", [True, False])
def test_fsdp2_repeated_cpu_saves_take_the_shards_in_bulk(tmp_path: Path, lazy: bool) -> None:
    # FSDP2 on CPU (gloo): a loop's later saves take the model's state dict
    # and the optimizer's state, DTensors by their local shards, from the
    # plans of CPU tensors; what they store loads as PyTorch gathers it.
    root, out = tmp_path / "ck", tmp_path / "out"
    url = root.as_uri()
    deep = ("--depth", "6")
    mode = ("--lazy",) if lazy else ()
    torchrun(2, "train", url, str(out / "a"), "--steps", "4", "--save-at", "2,3,4", *mode, *deep)
    saved = rows(out / "a", "train", 2)
    ref = saved[0]["at_save"]
    assert all(r["at_save"] == ref for r in saved)
    assert all(r["bulk"] == [0, 2, 2] for r in saved), [r["bulk"] for r in saved]
    plain(url, str(out / "b"), "--steps", "4", *deep)
    assert rows(out / "b", "plain", 1)[0]["at_save"] == ref
    torchrun(3, "load", url, str(out / "c"), "--steps", "4", *deep)
    assert all(r["loaded"] == 4 and r["at_save"] == ref for r in rows(out / "c", "load", 3))


def test_fsdp2_first_lazy_save_after_a_fresh_start_takes_the_shards_in_bulk(tmp_path: Path) -> None:
    # After a fresh start's load_latest, the optimizer's first step readies
    # the first save: the state is walked once (DTensors by their local
    # shards), so that save takes both mappings in bulk too.
    root, out = tmp_path / "ck", tmp_path / "out"
    url = root.as_uri()
    deep = ("--depth", "6")
    torchrun(2, "train", url, str(out / "a"), "--steps", "3", "--save-at", "2,3", "--lazy", "--stand-in", "--ready", *deep)
    saved = rows(out / "a", "train", 2)
    ref = saved[0]["at_save"]
    assert all(r["at_save"] == ref for r in saved)
    assert all(r["bulk"] == [2, 2] for r in saved), [r["bulk"] for r in saved]
    plain(url, str(out / "b"), "--steps", "3", *deep)
    assert rows(out / "b", "plain", 1)[0]["at_save"] == ref


def test_fsdp2_saved_by_3_loads_into_2(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "out"
    torchrun(3, "train", root.as_uri(), str(out / "a"), "--steps", "4", "--save-at", "2", "--lazy")
    ref = rows(out / "a", "train", 3)[0]["at_save"]
    torchrun(2, "load", root.as_uri(), str(out / "b"), "--steps", "4")
    assert all(r["loaded"] == 2 and r["at_save"] == ref for r in rows(out / "b", "load", 2))


def test_fsdp_x_tp_2x2_loads_into_2_rank_fsdp_and_one_process(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "out"
    url = root.as_uri()
    torchrun(4, "train", url, str(out / "a"), "--steps", "4", "--save-at", "3", "--tp")
    saved = rows(out / "a", "train", 4)
    ref = saved[0]["at_save"]
    assert all(r["at_save"] == ref for r in saved)
    total = stored_bytes(root)
    for r in saved:  # a quarter each: pieces replicated over the TP dimension are written once
        assert r["written_bytes"] < 0.35 * total, (r["written_bytes"], total)
    torchrun(2, "load", url, str(out / "b"), "--steps", "4")
    assert all(r["at_save"] == ref for r in rows(out / "b", "load", 2))
    plain(url, str(out / "c"), "--steps", "4")
    assert rows(out / "c", "plain", 1)[0]["at_save"] == ref


def test_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    root, out = tmp_path / "ck", tmp_path / "out"
    url = root.as_uri()
    # The launcher tears the job down once it sees the dead rank: give the
    # survivor its whole timeout to report first, however loaded the machine.
    p = torchrun(2, "train", url, str(out / "a"), "--steps", "6", "--save-at", "2,4", "--die-rank", "1",
                 "--die-at", "4", "--timeout", "10", expect_ok=False, monitor_s=12)
    assert p.returncode != 0
    survivor = json.loads((out / "a" / "train-rank0.json").read_text())
    # Typed; named (StragglerError) when the roll call found the dead rank unmarked.
    assert survivor["error"] in ("CheckpointTimeoutError", "StragglerError"), survivor
    assert ckpt.Checkpointer(url, coordinate="none").steps() == [2]


# ----------------------------------------------------------- in process


@pytest.fixture
def mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_partial_placement_is_refused_before_anything_is_written(url: str, mesh) -> None:
    from torch.distributed.tensor import DTensor, Partial, Shard

    cp = ckpt.Checkpointer(url)
    good = DTensor.from_local(torch.arange(6.0), mesh, [Shard(0)])
    cp.save(1, {"w": good}).wait()
    bad = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with pytest.raises(ckpt.UnsupportedError, match=r"'b'.*Partial") as info:
        cp.save(2, {"w": good, "b": bad})
    assert "b" in str(info.value)
    cp.wait()
    assert cp.steps() == [1]
    target = {"w": DTensor.from_local(torch.zeros(6), mesh, [Shard(0)])}
    assert cp.load_latest(target) == 1
    assert torch.equal(target["w"].to_local(), torch.arange(6.0))


def test_a_live_layout_the_restore_cannot_take_is_raised_not_taken_for_damage(url: str, mesh) -> None:
    """A live DTensor placed ``Partial`` was once an ``UnsupportedError``
    counted as damage: every checkpoint was skipped and ``load_latest``
    returned None, a fresh start over the job's checkpoints."""
    from torch.distributed.tensor import DTensor, Partial

    with ckpt.Checkpointer(url, keep_last=2) as cp:
        cp.save(1, {"w": torch.arange(4.0)})
        cp.save(2, {"w": torch.arange(4.0) + 1})
    cp = ckpt.Checkpointer(url, keep_last=2)
    target = {"w": DTensor.from_local(torch.zeros(4), mesh, [Partial()])}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a skipped checkpoint is a warning)
        with pytest.raises(ckpt.UnsupportedError, match=r"'w'|w:.*Partial"):
            cp.load_latest(target)
    with pytest.raises(ckpt.ConflictError):  # step 2 still commits its step
        cp.save(2, {"w": torch.zeros(4)})
    plain = {"w": torch.zeros(4)}
    assert cp.load_latest(plain) == 2 and torch.equal(plain["w"], torch.arange(4.0) + 1)


def test_shape_or_dtype_mismatch_names_the_tensor_and_writes_nothing(url: str, mesh) -> None:
    from torch.distributed.tensor import DTensor, Shard

    cp = ckpt.Checkpointer(url)
    cp.save(1, {"a": torch.arange(4.0), "w": DTensor.from_local(torch.arange(6.0), mesh, [Shard(0)])}).wait()
    a = torch.full((4,), 7.0)
    wrong_shape = DTensor.from_local(torch.zeros(5), mesh, [Shard(0)])
    with pytest.raises(ckpt.InvalidInputError, match=r"'w'.*\(6,\).*\(5,\)"):
        cp.load_latest({"a": a, "w": wrong_shape})
    assert torch.equal(a, torch.full((4,), 7.0))  # nothing half-restored
    wrong_dtype = DTensor.from_local(torch.zeros(6, dtype=torch.float64), mesh, [Shard(0)])
    with pytest.raises(ckpt.InvalidInputError, match=r"'w'.*F32.*F64"):
        cp.load_latest({"a": a, "w": wrong_dtype})
    assert torch.equal(a, torch.full((4,), 7.0))


def test_dcp_state_dict_apis_are_accepted(url: str, mesh) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=0.1)

    m, opt = make()
    m(torch.randn(2, 7)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(m, opt)
    cp = ckpt.Checkpointer(url)
    cp.save(1, {"model": msd, "optim": osd}).wait()

    m2, opt2 = make()
    msd2, osd2 = get_state_dict(m2, opt2)
    assert cp.load_latest({"model": msd2, "optim": osd2}) == 1
    set_state_dict(m2, opt2, model_state_dict=msd2, optim_state_dict=osd2)
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), k
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    for pid in s1:
        for k in s1[pid]:
            x, y = s1[pid][k], s2[pid][k]
            x = x.full_tensor() if hasattr(x, "full_tensor") else x
            y = y.full_tensor() if hasattr(y, "full_tensor") else y
            assert torch.equal(x, y), (pid, k)


def test_layout_cache_follows_a_spec_whose_mesh_or_placements_change() -> None:
    """Layouts are cached by the DTensor's spec object; one whose fields are
    reassigned must not be served the old boxes. The layout maths needs a
    coordinate on a mesh of 2 (the in-process group has 1 rank), so the
    DTensor and its mesh are stand-ins with the attributes ckpt reads."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Shard

    from ckpt._sharded.dtensor import local_pieces

    class Mesh:
        def __init__(self, coord: int) -> None:
            self.coord = coord

        def get_coordinate(self):
            return [self.coord]

        def size(self, dim: int = 0) -> int:
            return 2

    class Fake:
        def __init__(self, mesh: Mesh) -> None:
            self._spec = SimpleNamespace(placements=(Shard(0),), mesh=mesh)
            self._local_tensor = torch.zeros(2)
            self.shape = torch.Size([4])

        placements = property(lambda self: self._spec.placements)
        device_mesh = property(lambda self: self._spec.mesh)

    t = Fake(Mesh(1))
    assert [p.offsets for p in local_pieces(t, "t")[1]] == [(2,)]
    assert [p.offsets for p in local_pieces(t, "t")[1]] == [(2,)]  # from the cache
    t._spec.mesh = Mesh(0)
    assert [p.offsets for p in local_pieces(t, "t")[1]] == [(0,)]
    t._spec.placements = (Shard(0),)
    t._spec.mesh = Mesh(1)
    assert [p.offsets for p in local_pieces(t, "t")[1]] == [(2,)]


def test_dcp_stateful_app_state_saves_lazily_and_loads(url: str, mesh) -> None:
    """DCP's tutorial pattern: an ``AppState`` (``Stateful``) whose state dict is
    ``get_state_dict(model, optimizer)``. In lazy mode its parameters and
    optimizer state are copied in the background and its optimizer's step waits
    for the copy, as when the model and optimizer are passed themselves."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.fsdp import fully_shard

    from ckpt._state.tree import flatten

    class AppState(Stateful):
        def __init__(self, model, optimizer) -> None:
            self.model, self.optimizer = model, optimizer

        def state_dict(self):
            msd, osd = get_state_dict(self.model, self.optimizer)
            return {"model": msd, "optim": osd}

        def load_state_dict(self, sd) -> None:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def make(seed: int):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 5))
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=0.1)

    def step(m, opt) -> None:
        m(torch.randn(3, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    def snapshot(m, opt) -> dict:
        msd, osd = get_state_dict(m, opt)
        out = {f"m.{k}": v.full_tensor().clone() for k, v in msd.items()}
        for fqn, s in osd["state"].items():
            for k, v in s.items():
                out[f"o.{fqn}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
        return out

    m, opt = make(0)
    step(m, opt)
    app = AppState(m, opt)
    flat = flatten({"app": app}, True)
    deferred = {t.name for t in flat.tensors if not t.copy_now}
    assert len(deferred) == len(flat.tensors), [t.name for t in flat.tensors if t.copy_now]
    assert opt in flat.stateful

    cp = ckpt.Checkpointer(url, lazy=True, rng=False)
    want = snapshot(m, opt)
    cp.save(1, app=app)
    step(m, opt)  # waits for the background copy before changing anything
    cp.wait()
    assert len(opt._optimizer_step_pre_hooks) == 1
    cp.close()

    m2, opt2 = make(1)
    step(m2, opt2)
    assert ckpt.Checkpointer(url).load_latest(app=AppState(m2, opt2)) == 1
    got = snapshot(m2, opt2)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
