"""torchtitan's checkpoints through ckpt: a checkpoint manager its trainer builds.

>>> import ckpt.torchtitan
>>> config.checkpoint = ckpt.torchtitan.CheckpointManager.Config(enable=True, interval=100)   # doctest: +SKIP

torchtitan (0.3) builds whatever ``config.checkpoint`` names
(``config.checkpoint.build(dataloader=..., model_parts=..., optimizers=...,
lr_schedulers=..., states=...)``), and its trainer calls ``load`` before the
first step, ``maybe_wait_for_staging`` before each optimizer step, ``save``
after each step, and ``close``. This manager does that with a
:class:`ckpt.Checkpointer` on ``url`` (default: the ``file://`` URL of
torchtitan's checkpoint folder): the model (its ``ModelWrapper``), the
optimizers and schedulers (torchtitan's containers) and the trainer's own
state are saved as replicas or DTensor shards, so N ranks save and M load; the
data loader's state differs per rank and is saved in each rank's own part
(``per_rank``), restored to the same rank.

Saves happen every ``interval`` steps and at the last step, lazily by default
(the step goes on while the snapshot is copied; the trainer's
``maybe_wait_for_staging`` before the optimizer step waits for it). The last
step's save, with ``last_save_model_only`` (torchtitan's default), holds the
model alone, as torchtitan's own does. ``keep_latest_k`` is ckpt's
``keep_last``. Loading resumes from the newest committed checkpoint (or
``load_step``); a fresh root starts from scratch. ``exclude_from_loading``
names states to leave as they are. What this manager does not do is a typed
error at build time: ``initial_load_path``, Hugging Face formats and seed
checkpoints are torchtitan's DCP manager's.

torchtitan's data loader keeps its state as ``pickle`` bytes; ckpt stores them
as bytes and never unpickles them, but torchtitan's loader does when it
loads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from torch import nn
from torchtitan.components.checkpointer import (  # type: ignore[import-untyped]
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    BaseCheckpointManager,
    ModelWrapper,
)
from torchtitan.tools import filesystem  # type: ignore[import-untyped]

from ckpt.checkpointer import Checkpointer
from ckpt.errors import UnsupportedError
from ckpt.handles import SaveHandle

__all__ = ["CheckpointManager"]


class CheckpointManager(BaseCheckpointManager):  # type: ignore[misc]
    """A torchtitan checkpoint manager on a ckpt root (see the module)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        url: Optional[str] = None
        """The ckpt root (``file://``, ``s3://``, a tiered URL); default: the
        ``file://`` URL of ``folder`` under the trainer's dump folder."""

        lazy: bool = True
        """Copy the snapshot in the background (see :class:`ckpt.Checkpointer`)."""

        compression: Optional[str] = None
        """``"zstd"`` or None, as for :class:`ckpt.Checkpointer`."""

    def __init__(
        self,
        config: "CheckpointManager.Config",
        *,
        dataloader: Any,
        model_parts: List[nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: Dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.save_future: Optional[SaveHandle] = None
        for field, what in (
            ("initial_load_path", "an initial checkpoint from another path"),
            ("initial_load_in_hf", "Hugging Face checkpoints"),
            ("last_save_in_hf", "Hugging Face checkpoints"),
            ("create_seed_checkpoint", "seed checkpoints"),
        ):
            if getattr(config, field):
                raise UnsupportedError(
                    f"ckpt.torchtitan.CheckpointManager does not do {what} (checkpoint.{field}); "
                    "torchtitan's own CheckpointManager does"
                )
        self.config = config
        self.states = states
        self.states.update(
            {MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers, DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers}
        )
        folder = filesystem.join(base_folder, config.folder)
        url = config.url or ("file://" + os.path.abspath(folder))
        self.url = url
        self.cp: Optional[Checkpointer] = Checkpointer(
            url, lazy=config.lazy, compression=config.compression, keep_last=config.keep_latest_k or None
        )

    def __del__(self) -> None:
        self.close()

    def _shared(self, model_only: bool) -> Dict[str, object]:
        if model_only:
            return {MODEL: self.states[MODEL]}
        return {k: v for k, v in self.states.items() if v is not None and k != DATALOADER}

    def _per_rank(self, loading: bool) -> Dict[str, object]:
        loader = self.states.get(DATALOADER)
        if loader is None or (loading and DATALOADER in self.config.exclude_from_loading):
            return {}
        return {DATALOADER: loader}

    def _open(self) -> Checkpointer:
        if self.cp is None:
            raise UnsupportedError("this ckpt.torchtitan.CheckpointManager is closed")
        return self.cp

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        c = self.config
        first = c.enable_first_step_checkpoint and curr_step == 1
        if c.load_only or not (last_step or first or curr_step % c.interval == 0):
            return False
        if self.save_future is not None:
            self._wait_for_saving()  # one save in flight, as torchtitan's own manager keeps
        model_only = last_step and c.last_save_model_only
        handle = self._open().save(curr_step, per_rank=self._per_rank(False) if not model_only else {},
                              **self._shared(model_only))
        self.save_future = handle
        if last_step:
            self._wait_for_saving()
        return True

    def _wait_for_saving(self) -> None:
        handle, self.save_future = self.save_future, None
        if handle is not None:
            handle.wait()

    def _maybe_wait_for_staging(self) -> None:
        self._open().wait_snapshot()

    def _load(self, step: int = -1) -> bool:
        states = {k: v for k, v in self._shared(False).items() if k not in self.config.exclude_from_loading}
        per_rank = self._per_rank(True)
        cp = self._open()
        if step == -1:
            return cp.load_latest(per_rank=per_rank, **states) is not None
        cp.load(step, per_rank=per_rank, **states)
        return True

    def _close(self) -> None:
        cp = getattr(self, "cp", None)
        if cp is not None:
            self.cp = None
            cp.close()
