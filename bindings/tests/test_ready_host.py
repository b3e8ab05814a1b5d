"""A CPU job's first save readied ahead of it, as later saves find theirs:
the walk's plans made, and the staging memory its copies go to mapped and
faulted in (``ckpt._save.ahead.rehearse``): on a fresh start from
``load_latest`` on (the optimizer state to come included, by the
optimizer's kind), after a restore from the optimizer's next step."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Tuple

import pytest
import torch
from torch import nn

import ckpt
from ckpt import _ckpt
from ckpt._save import ahead as _ahead


class Tied(nn.Module):
    """An embedding whose weight the head shares (as GPT-2's), and a layer between."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(512, 64)  # 128 KiB, saved under two names
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 512, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(x))))


def train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 512, (4, 8), generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def staged_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """The bytes a save copies: each tensor's memory once (the tied weight too)."""
    seen: Dict[int, int] = {}
    tensors = list(model.state_dict().values())
    for s in opt.state_dict()["state"].values():
        tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        seen[t.data_ptr()] = t.nbytes
    return sum(seen.values())


def readied(cp: ckpt.Checkpointer) -> int:
    if cp._readying is not None:
        cp._readying.join(timeout=60)
    return cp._native.staging_idle_bytes()


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("stepped", [False, True], ids=["new", "stepped"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_a_fresh_start_readies_its_first_save_before_the_first_step(tmp_path, lazy, stepped):
    """``stepped``: the optimizer state exists before ``load_latest`` (a
    model fine-tuned in the same process, a benchmark): readied once all the
    same, not once more after the step."""
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stepped:
        train(model, opt, 0)
    cp = ckpt.Checkpointer(f"file://{tmp_path}", lazy=lazy, rng=False)
    assert cp.load_latest(model=model, optimizer=opt) is None
    # From load_latest on, during the first step: the AdamW state that step
    # creates included (a save right after it found its memory unfaulted).
    early = readied(cp)
    train(model, opt, 1)
    want = staged_bytes(model, opt)
    # Every span once: the tied weight is not readied twice (128 KiB more), and
    # each buffer adds at most its lead (STAGING_LEAD bytes).
    assert want <= early <= want + _ckpt.STAGING_LEAD * 64, (early, want)
    # The walk after the first step found nothing left to ready.
    got = readied(cp)
    assert got == early
    assert cp._host_plans, "the walk's plans were made ahead (the optimizer state's)"
    train(model, opt, 2)
    expect = {k: bits(v) for k, v in model.state_dict().items()}
    h = cp.save(2, model=model, optimizer=opt)
    train(model, opt, 3)  # (lazy: the step waits for the snapshot)
    h.wait()
    # The save copied into the readied buffers: back in the pool after it, and
    # no more of them than before (new ones would have doubled the idle bytes).
    assert cp._native.staging_idle_bytes() == got
    saved = cp.read(2).state["model"]
    assert {k: bits(v) for k, v in saved.items()} == expect
    cp.close()


def state_bytes(opt: torch.optim.Optimizer) -> List[int]:
    return sorted(v.nbytes for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


KINDS: List[Tuple[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]]] = [
    ("AdamW", lambda ps: torch.optim.AdamW(ps)),
    ("Adam-amsgrad", lambda ps: torch.optim.Adam(ps, amsgrad=True)),
    ("Adam-foreach-off", lambda ps: torch.optim.Adam(ps, foreach=False)),
    ("AdamW-fused", lambda ps: torch.optim.AdamW(ps, fused=True)),
    ("NAdam", lambda ps: torch.optim.NAdam(ps)),
    ("RAdam", lambda ps: torch.optim.RAdam(ps)),
    ("Adamax", lambda ps: torch.optim.Adamax(ps)),
    ("Adadelta", lambda ps: torch.optim.Adadelta(ps)),
    ("Adagrad", lambda ps: torch.optim.Adagrad(ps)),  # (its state exists from the start)
    ("SGD", lambda ps: torch.optim.SGD(ps, lr=0.1)),
    ("SGD-momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    ("SGD-momentum-fused", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True)),
    ("RMSprop", lambda ps: torch.optim.RMSprop(ps)),
    ("RMSprop-centered-momentum", lambda ps: torch.optim.RMSprop(ps, momentum=0.9, centered=True)),
    ("Rprop", lambda ps: torch.optim.Rprop(ps)),
]


@pytest.mark.parametrize("make", [k[1] for k in KINDS], ids=[k[0] for k in KINDS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_state_a_first_step_creates_is_foreseen_by_kind(make, dtype):
    """``state_lens`` against the state torch's optimizers really create: a
    change in torch's layout shows here, not as a slower first save."""
    torch.manual_seed(0)
    model = Tied().to(dtype)
    model.mid.bias.requires_grad_(False)  # (no state for it)
    opt = make(model.parameters())
    before = state_bytes(opt)
    foreseen = _ahead.state_lens([opt])
    train(model, opt, 1)
    assert sorted(before + foreseen) == state_bytes(opt)


class Heavy(torch.optim.Optimizer):
    """An optimizer ckpt has no rule for: a buffer per parameter, made at its first step."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    buf.add_(p.grad)
                    p.sub_(buf, alpha=group["lr"])


def test_an_optimizer_of_another_kind_is_readied_once_its_state_exists(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    opt = Heavy(model.parameters())
    assert _ahead.state_lens([opt]) == []
    cp = ckpt.Checkpointer(f"file://{tmp_path}", rng=False)
    assert cp.load_latest(model=model, optimizer=opt) is None
    params = staged_bytes(model, opt)
    assert params <= readied(cp) <= params + _ckpt.STAGING_LEAD * 64  # the parameters' share
    train(model, opt, 1)
    want = staged_bytes(model, opt)
    assert want == 2 * params
    got = readied(cp)
    assert want <= got <= want + _ckpt.STAGING_LEAD * 64, (got, want)
    cp.save(1, model=model, optimizer=opt).wait()
    assert cp._native.staging_idle_bytes() == got
    cp.close()


def test_a_restore_readies_the_next_save_and_a_reader_readies_nothing(tmp_path):
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    with ckpt.Checkpointer(f"file://{tmp_path}", rng=False) as cp:
        cp.save(1, model=model, optimizer=opt).wait()

    fresh = Tied()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    train(fresh, fopt, 7)  # (other values; its optimizer state exists)
    reader = ckpt.Checkpointer(f"file://{tmp_path}", rng=False, read_only=True)
    assert reader.load_latest(model=fresh, optimizer=fopt) == 1
    assert readied(reader) == 0
    reader.close()

    cp = ckpt.Checkpointer(f"file://{tmp_path}", rng=False)
    assert cp.load_latest(model=fresh, optimizer=fopt) == 1
    # Not in the restore's return (a restart's first step would wait for it):
    # after the optimizer's next step.
    assert readied(cp) == 0 and not cp._host_plans
    train(fresh, fopt, 8)
    want = staged_bytes(fresh, fopt)
    got = readied(cp)
    assert want <= got <= want + _ckpt.STAGING_LEAD * 64, (got, want)
    cp.save(2, model=fresh, optimizer=fopt).wait()
    assert cp._native.staging_idle_bytes() == got
    cp.close()


def test_readying_hooks_leave_other_post_hooks_and_a_second_checkpointer_alone(tmp_path):
    """Two checkpointers readying on one optimizer (a memory tier's two roots)
    and a post-hook of the user's after theirs: the steps go on, every hook
    runs, and each checkpointer's first save takes its own hook off."""
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    a = ckpt.Checkpointer(f"file://{tmp_path}/a", rng=False)
    b = ckpt.Checkpointer(f"file://{tmp_path}/b", rng=False)
    assert a.load_latest(model=model, optimizer=opt) is None
    assert b.load_latest(model=model, optimizer=opt) is None
    seen = []
    opt.register_step_post_hook(lambda *_: seen.append(1))
    train(model, opt, 1)  # removing a fired hook here failed this step
    train(model, opt, 2)
    assert seen == [1, 1]
    want = staged_bytes(model, opt)
    assert readied(a) >= want and readied(b) >= want
    assert len(opt._optimizer_step_post_hooks) == 3
    a.save(2, model=model, optimizer=opt).wait()
    assert len(opt._optimizer_step_post_hooks) == 2
    b.close()
    assert len(opt._optimizer_step_post_hooks) == 1
    a.close()
