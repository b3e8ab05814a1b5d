"""The training job the recovery experiment kills and restarts, in Python.

A small PyTorch MLP (a frozen input projection, as a fine-tuned model's
pretrained layer, then two hidden layers with dropout) trained with AdamW on
batches drawn from ``(seed, step)``, one intra-op thread. It checkpoints
through ``ckpt.Checkpointer`` as a user's loop does (lazy by default, the RNGs
restored by ``load_latest``) and speaks the fault campaign's victim protocol
(the same arguments and lines as the Rust ``fault_victim``, see
``faults/src/victim.rs`` and ``faults/src/event.rs``):

- stdout: ``fresh start`` / ``resumed from step N``, ``step N loss L``,
  ``checkpoint N started``, ``checkpoint N committed``,
  ``checkpoint N failed: ...``, ``done N``;
- ``--report FILE``: one JSON event a line, fsynced (``start``,
  ``first_step``, ``save``, ``done``, ``error``, ``torch_save``,
  ``torch_load``);
- ``--out FILE``: the final weights and optimizer state, name by name, so
  that two runs compare byte for byte;
- ``--torch-baseline save|restore --torch-file FILE``: the same state through
  ``torch.save`` / ``torch.load(weights_only=True)`` instead of ckpt (``save``
  trains to ``--steps``, writes and fsyncs, takes one more step; ``restore``
  reads it in a fresh process and takes that step again).

Only the campaign's kills are for this victim: store faults (``--store-faults``)
need the Rust victim's fault-injecting store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional

T0 = time.perf_counter()

import torch  # noqa: E402

import ckpt  # noqa: E402

INPUTS, HIDDEN, OUTPUTS, BATCH = 32, 96, 8, 64
NO_FAULTS = {"ops": 0, "errors": 0, "timeouts": 0, "partial": 0, "lost_acks": 0}


def ms_since(t: float) -> float:
    return (time.perf_counter() - t) * 1e3


class Report:
    """The campaign's event file: a JSON line per event, fsynced."""

    def __init__(self, path: Optional[str]) -> None:
        self.f = open(path, "a", encoding="utf-8") if path else None

    def __call__(self, event: str, **fields: Any) -> None:
        if self.f is None:
            return
        self.f.write(json.dumps({"event": event, **fields}) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())


class Trainer:
    def __init__(self, seed: int, device: str) -> None:
        self.seed, self.device = seed, torch.device(device)
        torch.manual_seed(seed)
        proj = torch.nn.Linear(INPUTS, INPUTS, bias=False)
        proj.weight.requires_grad_(False)
        self.model = torch.nn.Sequential(
            proj,
            torch.nn.Linear(INPUTS, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, OUTPUTS),
        ).to(self.device)
        self.target = torch.randn(INPUTS, OUTPUTS).to(self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=3e-3)

    def step(self, step: int) -> float:
        """Train on the batch of ``step``; the loss."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        x = torch.randn(BATCH, INPUTS, generator=g).to(self.device)
        loss = torch.nn.functional.mse_loss(self.model(x), x @ self.target)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor of the training state, by name (for ``--out`` and the baseline)."""
        out = {f"model.{k}": v for k, v in self.model.state_dict().items()}
        for i, st in self.opt.state_dict()["state"].items():
            for k, v in st.items():
                out[f"opt.{i}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
        return out

    def write_out(self, path: str) -> None:
        with open(path, "wb") as f:
            for name, t in sorted(self.tensors().items()):
                f.write(name.encode() + b"\0")
                f.write(t.detach().cpu().contiguous().numpy().tobytes())


def failure(e: BaseException) -> Dict[str, str]:
    kind = {
        ckpt.CorruptError: "corrupt",
        ckpt.NotFoundError: "not_found",
        ckpt.ConflictError: "conflict",
    }.get(type(e), "other")
    return {"kind": kind, "error": str(e)}


def train(a: argparse.Namespace, report: Report) -> None:
    tr = Trainer(a.seed, a.device)
    cp = ckpt.Checkpointer(f"file://{os.path.abspath(a.root)}", lazy=not a.eager, keep_last=a.keep)
    t = time.perf_counter()
    resumed = cp.load_latest(model=tr.model, optimizer=tr.opt)
    load_ms = ms_since(t)
    attempt = next((c["attempt"] for c in cp.list() if c["step"] == resumed), None)
    report(
        "start",
        pid=os.getpid(),
        load_ms=load_ms,
        since_exec_ms=ms_since(T0),
        resumed_from=resumed,
        attempt=attempt,
        skipped=[],
    )
    print(f"resumed from step {resumed}" if resumed is not None else "fresh start", flush=True)
    step = resumed or 0
    pending: Optional[ckpt.SaveHandle] = None
    pending_step = 0
    first = True

    def finish() -> None:
        assert pending is not None
        try:
            pending.wait()
            print(f"checkpoint {pending_step} committed", flush=True)
            report("save", step=pending_step, failed=None, faults=NO_FAULTS)
        except ckpt.CheckpointError as e:
            print(f"checkpoint {pending_step} failed: {e}", flush=True)
            report("save", step=pending_step, failed=failure(e), faults=NO_FAULTS)

    while step < a.steps:
        loss = tr.step(step)
        step += 1
        print(f"step {step} loss {loss:.6f}", flush=True)
        if first:
            first = False
            report("first_step", step=step, since_exec_ms=ms_since(T0), faults=NO_FAULTS)
        if step % a.every == 0:
            if pending is not None:
                finish()
            pending, pending_step = cp.save(step, model=tr.model, optimizer=tr.opt), step
            print(f"checkpoint {step} started", flush=True)
    if pending is not None:
        finish()
    cp.close()
    tr.write_out(a.out)
    report("done", step=step, faults=NO_FAULTS)
    print(f"done {step}", flush=True)


def baseline_state(tr: Trainer, step: int) -> Dict[str, torch.Tensor]:
    state = tr.tensors()
    state["rng"] = torch.get_rng_state()
    state["step"] = torch.tensor(step)
    return state


def torch_save(a: argparse.Namespace, report: Report) -> None:
    tr = Trainer(a.seed, a.device)
    for step in range(a.steps):
        tr.step(step)
    t = time.perf_counter()
    state = baseline_state(tr, a.steps)
    with open(a.torch_file, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    report(
        "torch_save",
        step=a.steps,
        tensors=len(state),
        bytes=os.path.getsize(a.torch_file),
        save_ms=ms_since(t),
    )
    print(f"step {a.steps + 1} loss {tr.step(a.steps):.6f}", flush=True)


def torch_restore(a: argparse.Namespace, report: Report) -> None:
    tr = Trainer(a.seed, a.device)
    # The optimizer's state exists once it has stepped: build it as a resumed
    # job would (lr 0 leaves the weights as they are), then overwrite it all.
    for group in tr.opt.param_groups:
        group["lr"] = 0.0
    tr.step(0)
    for group in tr.opt.param_groups:
        group["lr"] = 3e-3
    # Timed as ckpt's load_latest is: until the model, the optimizer and the
    # RNG hold the checkpoint's values.
    t = time.perf_counter()
    loaded = torch.load(a.torch_file, weights_only=True)
    with torch.no_grad():
        for name, dst in tr.tensors().items():
            dst.copy_(loaded[name])
    torch.set_rng_state(loaded["rng"])
    load_ms = ms_since(t)
    step = int(loaded["step"])
    report("torch_load", pid=os.getpid(), step=step, load_ms=load_ms, since_exec_ms=ms_since(T0))
    print(f"resumed from step {step}", flush=True)
    print(f"step {step + 1} loss {tr.step(step):.6f}", flush=True)
    report("first_step", step=step + 1, since_exec_ms=ms_since(T0), faults=NO_FAULTS)


def main(argv: List[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--report")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--store-faults")
    p.add_argument("--torch-baseline", choices=["save", "restore"])
    p.add_argument("--torch-file")
    a = p.parse_args(argv)
    a.every = max(a.every, 1)
    torch.set_num_threads(1)
    report = Report(a.report)
    try:
        if a.store_faults:
            raise ckpt.UnsupportedError("--store-faults needs the Rust fault_victim (its fault-injecting store)")
        if a.torch_baseline and not a.torch_file:
            raise ckpt.InvalidInputError("--torch-baseline needs --torch-file")
        {"save": torch_save, "restore": torch_restore, None: train}[a.torch_baseline](a, report)
    except Exception as e:  # reported to the campaign, then the job fails
        report("error", **failure(e))
        print(f"recovery_victim: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
