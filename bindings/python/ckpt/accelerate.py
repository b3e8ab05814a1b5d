"""Hugging Face Accelerate's ``save_state``/``load_state``, into a ckpt root.

>>> import ckpt, ckpt.accelerate
>>> cp = ckpt.Checkpointer("file:///ckpt/run", keep_last=3)                  # doctest: +SKIP
>>> start = ckpt.accelerate.load_state(accelerator, cp) or 0                # doctest: +SKIP
>>> ckpt.accelerate.save_state(accelerator, cp, step)                       # doctest: +SKIP

:func:`save_state` saves what ``Accelerator.save_state`` saves, as the
checkpoint of ``step`` of the ckpt root: every prepared model (unwrapped, so
a DDP job's checkpoint loads into one process), optimizer, scheduler and
gradient scaler, every object given to ``register_for_checkpointing``, the
state of stateful data loaders (``use_stateful_dataloader``), the
accelerator's ``step`` (its gradient-accumulation counter), and the random
generators of each rank (Python, numpy, torch, CUDA: the checkpointer's
``rng``). Tensors go into ckpt's verified, deduplicated chunks and the
manifest is written last; nothing is pickled. :func:`load_state` restores all
of it in place and returns the step (``None``: nothing to resume).

Why not Accelerate's own ``register_save_state_pre_hook``: ``save_state``
runs such a hook before it writes, but a hook can only take over the model
weights; the optimizers, schedulers, RNG states and registered objects are
then written with ``torch.save`` whatever the hook does, and ``load_state``
unpickles them. So the whole state goes through these two functions instead,
called where ``accelerator.save_state(dir)``/``load_state(dir)`` would be;
Accelerate's save/load pre-hooks (which are given a directory) are not run.

Supported: one process, and ``torchrun``/``accelerate launch`` data parallel
jobs (``MULTI_CPU``, ``MULTI_GPU``; every rank calls both functions, as with
Accelerate's). FSDP, DeepSpeed, Megatron-LM and XLA keep their own checkpoint
formats and raise :class:`~ckpt.UnsupportedError` (for FSDP2, see
:mod:`ckpt.dcp`). A sampler's position in its data is not state Accelerate
saves either: skip the batches already seen (``accelerator.skip_first_batches``)
or use a stateful data loader.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

from accelerate.utils import DistributedType  # type: ignore[import-untyped]

from ckpt.checkpointer import Checkpointer
from ckpt.errors import InvalidInputError, UnsupportedError
from ckpt.handles import SaveHandle

if TYPE_CHECKING:
    from accelerate import Accelerator  # type: ignore[import-untyped]

__all__ = ["save_state", "load_state", "KEY"]

#: The entry of the checkpoint holding the accelerator's own counters and counts.
KEY = "accelerate"

_SUPPORTED = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU}


def save_state(accelerator: Accelerator, cp: Checkpointer, step: int) -> SaveHandle:
    """Start saving ``accelerator``'s whole training state as the checkpoint
    of ``step`` of ``cp``'s root; returns the save's handle (``cp.save``'s:
    persisting goes on in the background, ``handle.wait()`` or ``cp.wait()``
    waits for the commit)."""
    entries, _ = _entries(accelerator, cp)
    return cp.save(step, entries)


def load_state(accelerator: Accelerator, cp: Checkpointer, step: Optional[int] = None) -> Optional[int]:
    """Restore ``accelerator``'s training state in place from the checkpoint
    of ``step`` (default: the newest intact one); returns its step, or
    ``None`` when the root has no checkpoint (a fresh start).

    The accelerator must hold what it held at the save (as many models,
    optimizers, schedulers and registered objects, in the same order):
    otherwise :class:`~ckpt.InvalidInputError` (before anything is restored
    when the checkpoint lacks one of them)."""
    entries, counts = _entries(accelerator, cp)
    got = cp.load_latest(entries) if step is None else cp.load(step, entries)
    if got is None:
        return None
    saved = entries[KEY]
    assert isinstance(saved, dict)
    if saved.get("counts") != counts:
        raise InvalidInputError(
            f"the checkpoint of step {got} was saved from an accelerator holding {saved.get('counts')}, "
            f"this one holds {counts}"
        )
    accelerator.step = int(saved["step"])
    return got


def _entries(accelerator: Accelerator, cp: Checkpointer) -> "tuple[Dict[str, object], Dict[str, int]]":
    """The checkpoint's entries (the live objects, by name) and how many of each kind."""
    kind = accelerator.distributed_type
    if kind not in _SUPPORTED:
        raise UnsupportedError(
            f"ckpt.accelerate saves data parallel and single-process accelerators, not {kind.value} ones "
            "(which keep their own checkpoint format; for FSDP2 see ckpt.dcp)"
        )
    if not cp._rng:
        raise InvalidInputError(
            "ckpt.accelerate saves and restores the random generators through the checkpointer: "
            "open it with rng=True (the default)"
        )
    entries: Dict[str, object] = {}
    models = [accelerator.unwrap_model(m) for m in accelerator._models]
    # The torch objects themselves, not Accelerate's wrappers (whose state
    # dicts are theirs): so a lazy checkpointer's step hook guards the real step.
    optimizers = [getattr(o, "optimizer", o) for o in accelerator._optimizers]
    schedulers = [getattr(s, "scheduler", s) for s in accelerator._schedulers]
    custom: List[Any] = list(accelerator._custom_objects)
    loaders = [d for d in accelerator._dataloaders if getattr(d, "use_stateful_dataloader", False)]
    for name, objs in (("model", models), ("optimizer", optimizers), ("scheduler", schedulers),
                       ("custom", custom), ("dataloader", loaders)):
        for i, obj in enumerate(objs):
            entries[name if i == 0 and name != "custom" else f"{name}_{i}"] = obj
    if accelerator.scaler is not None:
        entries["scaler"] = accelerator.scaler
    counts = {"models": len(models), "optimizers": len(optimizers), "schedulers": len(schedulers),
              "custom": len(custom), "dataloaders": len(loaders), "scaler": int(accelerator.scaler is not None)}
    entries[KEY] = {"step": int(accelerator.step), "counts": dict(counts)}  # (a copy: a load updates it in place)
    return entries, counts
