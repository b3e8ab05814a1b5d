"""Every engine error arrives as its own exception class, with its details."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import ckpt
from conftest import logged


def test_hierarchy() -> None:
    for cls in (
        ckpt.NotFoundError,
        ckpt.CorruptError,
        ckpt.ConflictError,
        ckpt.InvalidInputError,
        ckpt.UnsupportedError,
        ckpt.StorageError,
        ckpt.CheckpointIOError,
        ckpt.CheckpointTimeoutError,
        ckpt.SkippedError,
        ckpt.InternalError,
    ):
        assert issubclass(cls, ckpt.CheckpointError)
    assert issubclass(ckpt.InvalidInputError, ValueError)
    assert issubclass(ckpt.CheckpointTimeoutError, TimeoutError)
    assert issubclass(ckpt.StorageError, OSError)
    assert issubclass(ckpt.NotFoundError, LookupError)


def test_not_found(url: str) -> None:
    cp = ckpt.Checkpointer(url)
    with pytest.raises(ckpt.NotFoundError, match="step 99"):
        cp.read(99)


def test_conflict_leaves_the_first_checkpoint(url: str) -> None:
    cp = ckpt.Checkpointer(url, rng=False)
    cp.save(3, w=torch.ones(4)).wait()
    with pytest.raises(ckpt.ConflictError):
        cp.save(3, w=torch.zeros(4))
    assert torch.equal(cp.read(3).state["w"], torch.ones(4))


def test_a_step_committed_by_another_writer_meanwhile_is_a_conflict_at_commit(url: str) -> None:
    mine = ckpt.Checkpointer(url, rng=False)
    mine.save(1, w=torch.zeros(4)).wait()  # its first save lists what is committed
    other = ckpt.Checkpointer(url, rng=False)
    other.save(5, w=torch.ones(4)).wait()
    h = mine.save(5, w=torch.full((4,), 2.0))  # mine does not know of step 5 yet
    with pytest.raises(ckpt.ConflictError, match="step 5"):
        h.wait()
    assert torch.equal(ckpt.Checkpointer(url, rng=False).read(5).state["w"], torch.ones(4))
    with pytest.raises(ckpt.ConflictError):  # now it knows
        mine.save(5, w=torch.zeros(4))


def test_a_save_before_a_committed_later_step_is_refused(url: str) -> None:
    """A job back at an early step (rolled back to an archived checkpoint
    with ``load``, or restarted without ``load_latest``) saved and was told
    it had; a restart then loaded the old newest (and with ``keep_last``,
    retention had retired each save as it committed). Such a save is refused
    whatever the retention, naming the way out."""
    model = torch.nn.Linear(4, 4)
    with ckpt.Checkpointer(url, keep_last=2, keep_every=100) as cp:
        for step in (100, 150, 200, 250):
            cp.save(step, model=model)
    assert cp.steps() == [100, 200, 250]
    rollback = ckpt.Checkpointer(url, keep_last=2, keep_every=100)
    assert rollback.load(100, model=model) == 100
    with pytest.raises(ckpt.ConflictError, match=r"step 110 comes before 2 committed.*\(250, 200\).*would retire it.*discard_after"):
        rollback.save(110, model=model)
    forgot = ckpt.Checkpointer(url, keep_last=2)
    with pytest.raises(ckpt.ConflictError, match="step 1 comes before"):
        forgot.save(1, model=model)
    with ckpt.Checkpointer(url) as keeps_all:  # no retention: refused all the same
        with pytest.raises(ckpt.ConflictError, match=r"step 210 comes before 1 committed.*\(250\)") as info:
            keeps_all.save(210, model=model)
        assert "would retire" not in str(info.value)
    assert forgot.steps() == [100, 200, 250]


def test_a_damaged_version_digit_in_a_manifest_is_damage_passed_over(url: str, root: Path) -> None:
    """A manifest whose header alone says another schema version (its body,
    which the hash covers, says this one) is damaged, not a newer writer's:
    ``load_latest`` skips it with a warning, like any damage, instead of
    stopping the restart with ``UnsupportedError``. (A genuine newer
    manifest, header and body agreeing, stops it: the engine's tests.)"""
    model = torch.nn.Linear(4, 4)
    with ckpt.Checkpointer(url, rng=False) as cp:
        cp.save(1, model=model)
        cp.save(2, model=model)
    (path,) = [p for p in (root / "manifests").iterdir() if p.name.startswith("00000000000000000002")]
    header, body = path.read_bytes().split(b"\n", 1)
    magic, version, *rest = header.split(b" ")
    path.write_bytes(b" ".join([magic, str(int(version) + 1).encode(), *rest]) + b"\n" + body)
    with logged(r"passing over 1 newer: step 2 .*damaged: .*damaged header"):
        assert ckpt.Checkpointer(url, rng=False).load_latest(model=model) == 1
    latest = ckpt.Checkpointer(url, read_only=True).read_latest()
    assert latest is not None and latest.step == 1
    assert [(s, type(e)) for s, _, e in latest.skipped] == [(2, ckpt.CorruptError)]


def test_corrupt_names_object_and_tensor_and_latest_falls_back(url: str, root: Path) -> None:
    cp = ckpt.Checkpointer(url, rng=False)
    cp.save(1, big=torch.zeros(1 << 16)).wait()
    before = {p for p in root.rglob("*") if p.is_file()}
    cp.save(2, big=torch.arange(1 << 16, dtype=torch.float32)).wait()
    new = [p for p in root.rglob("*") if p.is_file() and p not in before and "manifest" not in str(p)]
    target = max(new, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))

    with pytest.raises(ckpt.CorruptError) as info:
        cp.read(2)
    assert info.value.tensor == "big"
    assert info.value.object and isinstance(info.value.object, str)
    assert info.value.reason

    # The damaged newest checkpoint is skipped, and said so, not an error.
    big = torch.empty(1 << 16)
    with logged(r"resumed from step 1, passing over 1 newer: step 2 .*damaged"):
        assert cp.load_latest(big=big) == 1
    assert torch.equal(big, torch.zeros(1 << 16))
    latest = cp.read_latest()
    assert latest is not None and latest.step == 1
    assert [s for s, _, e in latest.skipped if isinstance(e, ckpt.CorruptError)] == [2]


@pytest.mark.parametrize("lazy", [False, True])
def test_a_tensor_under_the_rank_states_reserved_name_is_refused(url: str, lazy: bool) -> None:
    """Each rank's own state (its RNG) is stored as a tensor named
    ``__rank{r}__``: a tensor of the user's under that name is refused, and
    nothing is committed; under a name that only begins alike, it is saved."""
    cp = ckpt.Checkpointer(url, lazy=lazy)
    with pytest.raises(ckpt.InvalidInputError, match="reserved by ckpt"):
        cp.save(1, {"__rank0__": torch.ones(3)})
    cp.save(2, {"__rank0__x": torch.ones(3)}).wait()
    assert [s for s, _ in cp._native.committed()] == [2]
    cp.close()


def test_invalid_input() -> None:
    with pytest.raises(ckpt.InvalidInputError):
        ckpt.Checkpointer("memory://bad-opts", busy="sometimes")
    with pytest.raises(ckpt.InvalidInputError):
        ckpt.Checkpointer("memory://bad-opts", compression="lz77")
    cp = ckpt.Checkpointer("memory://bad-values", rng=False)
    with pytest.raises(ckpt.InvalidInputError, match=r"\$\['cfg'\]\['f'\]"):
        cp.save(1, cfg={"f": lambda: 1})
    with pytest.raises(ckpt.InvalidInputError, match="64 bits"):
        cp.save(1, n=2**70)
    with pytest.raises(ckpt.InvalidInputError):
        cp.save(1, {1.5: "float key"})
    with pytest.raises(ckpt.InvalidInputError):
        cp.save(1, a=np.array([object()]))
    with pytest.raises(ckpt.InvalidInputError):
        cp.save(1, c=torch.zeros(2, dtype=torch.complex128))
    assert cp.steps() == [], "nothing was written by refused saves"


def test_unsupported_scheme() -> None:
    with pytest.raises(ckpt.UnsupportedError):
        ckpt.Checkpointer("gopher://host/x")


def test_io_error_on_unusable_root(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises((ckpt.CheckpointIOError, ckpt.StorageError)) as info:
        ckpt.Checkpointer((blocker / "sub").as_uri())
    assert isinstance(info.value, OSError)


def test_timeout_and_skipped(url: str) -> None:
    model = torch.nn.Linear(4096, 2048, bias=False)  # 32 MiB of parameters
    cp = ckpt.Checkpointer(url, rng=False, lazy=True, staging_budget=40 << 20, busy="skip", compression="zstd")
    h = cp.save(1, model=model)
    # The first save holds the staging budget until it is written: the next is skipped.
    with pytest.raises(ckpt.SkippedError) as info:
        cp.save(2, model=model)
    assert info.value.step == 2
    # Compressing and writing 32 MiB takes far longer than zero seconds.
    with pytest.raises(ckpt.CheckpointTimeoutError):
        h.wait(timeout=0)
    report = h.wait()
    assert report["step"] == 1 and report["copied_bytes"] == 4096 * 2048 * 4
    cp.wait()
    assert cp.steps() == [1]


def test_a_full_disk_is_a_storage_error_with_enospc(full_disk: Path) -> None:
    import errno

    cp = ckpt.Checkpointer(full_disk.as_uri(), rng=False)
    cp.save(1, w=torch.ones(1024)).wait()
    with pytest.raises(ckpt.StorageError) as info:
        cp.save(2, w=torch.randn(4 << 20)).wait()  # 16 MiB onto a 4 MiB disk
    assert isinstance(info.value, OSError)
    assert info.value.errno == errno.ENOSPC, info.value
    cp.close()
    again = ckpt.Checkpointer(full_disk.as_uri(), rng=False)
    assert again.steps() == [1]
    assert torch.equal(again.read_latest().state["w"], torch.ones(1024))


def test_a_refused_value_is_named_by_its_path_in_the_tree() -> None:
    from ckpt import _ckpt

    with pytest.raises(ckpt.InvalidInputError, match=r"\$\['cfg'\]\[1\]\[2\]: cannot store a value of type object"):
        _ckpt.encode_tree({"cfg": [0, (1, 2, object())]})
    with pytest.raises(ckpt.InvalidInputError, match=r"\$\[3\]\['n'\]: integer \d+ does not fit in 64 bits"):
        _ckpt.encode_tree({"x": 1, 3: {"n": 2**70}})
    with pytest.raises(ckpt.InvalidInputError, match=r"\$\['a'\]: dict keys must be str or int, not float"):
        _ckpt.encode_tree({"a": {1.5: 0}})
    nested: list = []
    for _ in range(300):
        nested = [nested]
    with pytest.raises(ckpt.InvalidInputError, match=r"\$(\[0\]){257}: nested deeper than 256 levels"):
        _ckpt.encode_tree(nested)
