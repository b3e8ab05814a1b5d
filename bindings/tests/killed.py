"""Kill a training job with SIGKILL, run it again, compare with a run never killed.

Both sides of the framework tests' crash pattern (test_lightning.py,
test_accelerate.py, test_hf_trainer.py, test_dcp.py):

- the worker (a script run as a subprocess) trains N steps, saving every k
  through ckpt; after each committed save it calls :func:`mark`; once it has
  trained to the end it calls :func:`write_final` with its final weights and
  optimizer state, as plain tensors (safetensors, nothing pickled);
- the test runs it once to the end (the reference), runs it again and kills
  the whole process group with SIGKILL once the marker of step j appears
  (:func:`run_killed`), reruns it to the end, and compares the two final
  states bitwise (:func:`final`).

After its marker the worker trains on slowly (:func:`slow`), so the kill
lands mid-training with progress since the save that the kill loses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional

#: How long a worker may run (seconds); each is a few seconds on 2 cores.
LIMIT = 240
#: The pause of each step after the marker (seconds), until the kill.
SLOW = 0.2


# ------------------------------------------------------------------ worker side


def mark(out: Path, step: int) -> None:
    """Record that the checkpoint of ``step`` is committed (written atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".saved-{step}.tmp"
    tmp.write_text(str(step))
    os.replace(tmp, out / f"saved-{step}")


def slow(out: Path, after: Optional[int]) -> None:
    """Pause a step once the marker of step ``after`` is written (``None``: never)."""
    if after is not None and (out / f"saved-{after}").exists():
        time.sleep(SLOW)


def write_final(out: Path, tensors: Mapping[str, object], info: Mapping[str, object]) -> None:
    """The final state of a run that trained to the end: ``tensors`` (name ->
    torch tensor) as safetensors, ``info`` (plain data) as JSON."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    flat: Dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        assert isinstance(t, torch.Tensor), k
        flat[k] = t.detach().cpu().contiguous().clone()
    save_file(flat, str(out / "final.safetensors"))
    (out / "final.json").write_text(json.dumps(dict(info), sort_keys=True))


def optimizer_tensors(prefix: str, state: Mapping[str, object]) -> Dict[str, object]:
    """The tensors of an optimizer's ``state_dict()["state"]``, by flat name."""
    import torch

    out: Dict[str, object] = {}
    for i, s in state.items():
        assert isinstance(s, Mapping)
        for k, v in s.items():
            out[f"{prefix}.{i}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


# ------------------------------------------------------------------- test side


def run(cmd: List[str], env: Mapping[str, str]) -> str:
    """Run ``cmd`` to the end; its output. Fails the test unless it exits 0."""
    p = subprocess.run(cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=LIMIT)
    assert p.returncode == 0, p.stdout[-6000:]
    return p.stdout


def descendants(pid: int) -> List[int]:
    """Every live process below ``pid`` (from /proc): torchrun starts its
    workers in sessions of their own, out of reach of a kill of its group."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_all(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it."""
    below = descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for c in below:
        try:
            os.kill(c, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_killed(cmd: List[str], env: Mapping[str, str], out: Path, step: int) -> str:
    """Start ``cmd`` in a session of its own, and SIGKILL every process of it
    (its group and everything below it) as soon as the marker of ``step`` appears in ``out``; its output. Fails
    the test if the job ends (or times out) before the marker."""
    log = out / "killed.log"
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, env=dict(env), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + LIMIT
        try:
            while not (out / f"saved-{step}").exists():
                if p.poll() is not None:
                    raise AssertionError(f"the job ended ({p.returncode}) before saving step {step}:\n{log.read_text()[-6000:]}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"no save of step {step} in {LIMIT} s:\n{log.read_text()[-6000:]}")
                time.sleep(0.02)
            kill_all(p.pid)
        finally:
            if p.poll() is None:
                kill_all(p.pid)
            p.wait()
    assert p.returncode == -signal.SIGKILL, p.returncode
    assert not (out / "final.safetensors").exists(), "the job trained to the end before the kill"
    return log.read_text()


def final(out: Path) -> "tuple[Dict[str, bytes], Dict[str, object]]":
    """A finished run's final state: each tensor's dtype, shape and bytes, and its info."""
    import torch
    from safetensors import safe_open

    tensors: Dict[str, bytes] = {}
    with safe_open(str(out / "final.safetensors"), framework="pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            tensors[k] = f"{t.dtype}{list(t.shape)}".encode() + t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return tensors, json.loads((out / "final.json").read_text())


def assert_same_end(reference: Path, resumed: Path) -> None:
    """The killed and resumed run ended where the uninterrupted one did, bit for bit."""
    ref, ref_info = final(reference)
    got, got_info = final(resumed)
    assert any(k.startswith("optim") for k in ref), sorted(ref)
    assert sorted(got) == sorted(ref)
    differ = [k for k in ref if got[k] != ref[k]]
    assert not differ, f"not bitwise equal after the resume: {differ}"
    assert got_info == ref_info
