"""transformers' ``Trainer`` checkpointing into a ckpt root: :class:`CkptTrainer`.

>>> from ckpt.hf import CkptTrainer
>>> trainer = CkptTrainer(model=model, args=args, train_dataset=ds, ckpt_url="file:///ckpt/run")   # doctest: +SKIP
>>> trainer.train(resume_from_checkpoint=trainer.last_checkpoint())                              # doctest: +SKIP

A ``Trainer`` whose checkpoints (at ``save_steps``, ``save_strategy`` as
usual) are ckpt checkpoints of the root ``ckpt_url``, one per global step:
the model, optimizer, learning-rate scheduler and gradient scaler, the
``TrainerState`` (as its JSON), and each rank's random generators, in
verified, deduplicated chunks with the manifest written last, nothing
pickled. The ``checkpoint-N`` folder the Trainer knows is then a small
pointer: ``trainer_state.json`` (the Trainer reads it to skip the data
already trained on) and ``ckpt.json`` (``{"format": "ckpt.hf", "url": ...,
"step": N}``). It appears, by a rename, only once step N is committed, so
``resume_from_checkpoint=True`` (or :meth:`CkptTrainer.last_checkpoint`,
which is ``None`` for a fresh start) never picks a half-written one. Resuming
restores everything in place where the Trainer would load its own files, and
continues bit for bit. A ``checkpoint-N`` folder of the Trainer's own files
(no ``ckpt.json``) resumes as with ``Trainer``.

Resuming from a checkpoint older than the root's newest (a job killed after a
commit but before its folder's rename, or a rollback) discards the newer ones
(:meth:`ckpt.Checkpointer.discard_after`), so the run saves those steps anew.
``save_total_limit`` removes folders; which checkpoints the root keeps is
``ckpt_keep_last``/``ckpt_keep_every``. The model weights are not written as
``model.safetensors`` into the folder: ``trainer.save_model()`` or
``ckpt export`` makes a Hugging Face folder. DeepSpeed, FSDP, XLA and
SageMaker model parallelism keep their own checkpoints, and
``load_best_model_at_end`` needs the Trainer's own: those raise
:class:`~ckpt.UnsupportedError`. To combine with another ``Trainer``
subclass: ``class T(CkptTrainer, OtherTrainer)``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from typing import Any, Dict, Optional, Tuple, cast

from transformers import Trainer
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

from ckpt.checkpointer import Checkpointer
from ckpt.errors import CorruptError, UnsupportedError

__all__ = ["CkptTrainer", "FORMAT", "POINTER"]

#: The ``"format"`` of a pointer.
FORMAT = "ckpt.hf"
#: The pointer's file name in a ``checkpoint-N`` folder.
POINTER = "ckpt.json"
_STATE = "trainer_state.json"
_POINTER_MAX = 1 << 16


class CkptTrainer(Trainer):
    """A ``Trainer`` that checkpoints into the ckpt root ``ckpt_url``.

    Args:
        ckpt_url: the ckpt root (``file:///abs/dir``, a plain path, ``s3://...``).
        ckpt_keep_last, ckpt_keep_every, ckpt_compression: the root's
            ``keep_last``, ``keep_every`` and ``compression`` (:class:`ckpt.Checkpointer`).
        The other arguments are ``Trainer``'s.
    """

    def __init__(
        self,
        *args: Any,
        ckpt_url: str,
        ckpt_keep_last: Optional[int] = None,
        ckpt_keep_every: Optional[int] = None,
        ckpt_compression: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        own = [name for name, on in (("DeepSpeed", self.is_deepspeed_enabled), ("FSDP", self.is_fsdp_enabled),
                                     ("load_best_model_at_end", self.args.load_best_model_at_end)) if on]
        if own:
            raise UnsupportedError(f"CkptTrainer does not checkpoint with {', '.join(own)} (they need the Trainer's own files)")
        self.ckpt_url = ckpt_url
        self._ckpt_options: Dict[str, Any] = dict(keep_last=ckpt_keep_last, keep_every=ckpt_keep_every,
                                                  compression=ckpt_compression)
        self._ckpt: Optional[Checkpointer] = None

    def last_checkpoint(self) -> Optional[str]:
        """The newest ``checkpoint-N`` folder under ``args.output_dir``
        (``None``: none, a fresh start), for ``train(resume_from_checkpoint=...)``."""
        out = self.args.output_dir
        return get_last_checkpoint(out) if out is not None and os.path.isdir(out) else None

    def _checkpointer(self) -> Checkpointer:
        if self._ckpt is None:
            self._ckpt = Checkpointer(self.ckpt_url, **self._ckpt_options)
        return self._ckpt

    def _entries(self, everything: bool) -> Dict[str, object]:
        """The live objects a checkpoint holds (the model alone unless ``everything``)."""
        entries: Dict[str, object] = {"model": self.model}
        if everything:
            # The torch objects, not Accelerate's wrappers (their state dicts are the same).
            entries["optimizer"] = getattr(self.optimizer, "optimizer", self.optimizer)
            entries["scheduler"] = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                entries["scaler"] = scaler
        return entries

    # --------------------------------------------------------------- saving

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        step = self.state.global_step
        # As the Trainer does: the callbacks' state into the Trainer's state, then the state.
        kept = cast(Dict[str, Any], self.state.stateful_callbacks)  # (a dict, whatever its annotation says)
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(kept[name], list):
                kept[name].append(cb.state())
            else:
                kept[name] = cb.state()
        entries = self._entries(not self.args.save_only_model)
        entries["trainer"] = {"state": json.dumps(dataclasses.asdict(self.state), sort_keys=True)}
        cp = self._checkpointer()
        cp.save(step, entries).wait()
        if not self.args.should_save:
            return
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        tmp = os.path.join(run_dir, f".{PREFIX_CHECKPOINT_DIR}-{step}.{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        self.state.save_to_json(os.path.join(tmp, _STATE))
        with open(os.path.join(tmp, POINTER), "w") as f:
            json.dump({"format": FORMAT, "url": self.ckpt_url, "step": step}, f)
        if os.path.isdir(folder):  # a folder of an earlier run's step N, whose commit was discarded
            shutil.rmtree(folder)
        os.rename(tmp, folder)
        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    # ------------------------------------------------------------- resuming

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        at = _pointer(resume_from_checkpoint)
        if at is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        url, step = at
        if url == self.ckpt_url:
            cp = self._checkpointer()
            committed = cp.steps()
            if committed and committed[-1] > step:
                cp.discard_after(step)
        Checkpointer(url, read_only=True, rng=False).load(step, model=self.model if model is None else model)

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        at = None if checkpoint is None else _pointer(checkpoint)
        if at is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        entries = self._entries(True)
        del entries["model"]
        Checkpointer(at[0], read_only=True, rng=False).load(at[1], entries)

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None or _pointer(checkpoint) is None:
            super()._load_scaler(checkpoint)
        # (else restored with the optimizer)

    def _load_rng_state(self, checkpoint: Optional[str]) -> None:
        at = None if checkpoint is None else _pointer(checkpoint)
        if at is None:
            super()._load_rng_state(checkpoint)
            return
        Checkpointer(at[0], read_only=True).load(at[1])  # nothing but this rank's random generators


def _pointer(folder: str) -> Optional[Tuple[str, int]]:
    """The ``(url, step)`` of the pointer in ``folder``; ``None`` without one."""
    path = os.path.join(folder, POINTER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(_POINTER_MAX + 1)
    try:
        doc = json.loads(raw) if len(raw) <= _POINTER_MAX else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UnsupportedError(f"{path} is not a checkpoint pointer written by ckpt.hf")
    url, step = doc.get("url"), doc.get("step")
    if not isinstance(url, str) or type(step) is not int or step < 0:
        raise CorruptError(f"{path}: a malformed ckpt.hf pointer")
    return url, step
