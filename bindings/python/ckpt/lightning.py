"""Lightning's checkpoints in a ckpt root: a ``CheckpointIO`` plugin.

>>> import ckpt.lightning
>>> trainer = lightning.Trainer(plugins=[ckpt.lightning.CheckpointIO("file:///ckpt/run")])   # doctest: +SKIP
>>> trainer.fit(model, ckpt_path="checkpoints/last.ckpt")                           # doctest: +SKIP

Each checkpoint Lightning saves (its whole dict: ``state_dict``, optimizer
and scheduler states, loops, callbacks) becomes one ckpt checkpoint of the
root, committed by ckpt's engine: tensors in verified, deduplicated chunks
(a second checkpoint of the same weights, such as ``last.ckpt`` beside
``epoch=1-step=20.ckpt``, stores nothing new), the rest as plain data, and
nothing pickled. The file Lightning names (``path``) is a small JSON pointer
``{"format": "ckpt.lightning", "url": ..., "step": N}`` to it, so Lightning's
own file handling (``ckpt_path=``, ``"last"``, top-k bookkeeping) works as
with its own files. ckpt steps count the saves (Lightning's ``global_step``
is in the checkpoint itself).

A value that is neither a tensor nor plain data (a ``Path`` or an object in
``hyper_parameters``, say) is refused with :class:`~ckpt.InvalidInputError`
naming it, before anything is written: store it as plain data.

``remove_checkpoint`` removes the pointer; which checkpoints the root keeps
is ckpt's retention (``keep_last``, ``keep_every``). Lightning saves from
the global-zero rank only, so this checkpointer saves alone
(``coordinate="none"``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from ckpt.checkpointer import Checkpointer
from ckpt.errors import CorruptError, InvalidInputError, UnsupportedError

__all__ = ["CheckpointIO", "CkptCheckpointIO", "FORMAT"]

#: The ``"format"`` of a pointer file.
FORMAT = "ckpt.lightning"
#: Largest pointer file read (it is a few dozen bytes).
_POINTER_MAX = 1 << 16

_Path = Union[str, Path]


class CkptCheckpointIO(_CheckpointIO):
    """Saves Lightning's checkpoints into the ckpt root ``url``.

    Args:
        url: the ckpt root (``file:///abs/dir``, a plain path, ``s3://...``).
        keep_last, keep_every, compression, level: as for :class:`ckpt.Checkpointer`.
    """

    def __init__(
        self,
        url: str,
        *,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        compression: Optional[str] = None,
        level: int = 3,
    ) -> None:
        super().__init__()
        self.url = url
        self._options: Dict[str, Any] = dict(keep_last=keep_last, keep_every=keep_every, compression=compression, level=level)
        self._cp: Optional[Checkpointer] = None

    def _checkpointer(self) -> Checkpointer:
        if self._cp is None:
            self._cp = Checkpointer(self.url, coordinate="none", rng=False, **self._options)
        return self._cp

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _Path, storage_options: Optional[Any] = None) -> None:
        """Save ``checkpoint`` as the root's next step, wait for its commit,
        then write the pointer at ``path``."""
        if storage_options is not None:
            raise UnsupportedError(f"CkptCheckpointIO takes no storage_options (got {storage_options!r})")
        cp = self._checkpointer()
        steps = cp.steps()
        step = steps[-1] + 1 if steps else 0
        cp.save(step, checkpoint).wait()
        fs = get_filesystem(path)
        parent = str(Path(str(path)).parent)
        fs.makedirs(parent, exist_ok=True)
        with fs.open(str(path), "w") as f:
            f.write(json.dumps({"format": FORMAT, "url": self.url, "step": step}))

    def load_checkpoint(
        self, path: _Path, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> Dict[str, Any]:
        """The checkpoint the pointer at ``path`` names, as Lightning saved it.
        ``map_location``: ``None`` (CPU), a device or a device name; nothing
        is unpickled, so ``weights_only`` changes nothing."""
        url, step = _pointer(path)
        device = _device(map_location)
        cp = self._checkpointer() if url == self.url else Checkpointer(url, read_only=True, coordinate="none", rng=False)
        state = cp.read(step, framework="pt").state
        if device is not None and device != torch.device("cpu"):
            state = _to(state, device)
        if not isinstance(state, dict):
            raise CorruptError(f"the checkpoint of step {step} under {url} is not a Lightning checkpoint")
        return state

    def remove_checkpoint(self, path: _Path) -> None:
        """Remove the pointer at ``path`` (the root's retention decides what it keeps)."""
        fs = get_filesystem(path)
        if fs.exists(str(path)):
            fs.rm(str(path))

    def teardown(self) -> None:
        if self._cp is not None:
            self._cp.close()
            self._cp = None


def _pointer(path: _Path) -> "tuple[str, int]":
    fs = get_filesystem(path)
    with fs.open(str(path), "rb") as f:
        raw = f.read(_POINTER_MAX + 1)
    try:
        doc = json.loads(raw) if len(raw) <= _POINTER_MAX else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UnsupportedError(f"{path} is not a checkpoint pointer written by ckpt.lightning")
    url, step = doc.get("url"), doc.get("step")
    if not isinstance(url, str) or type(step) is not int or step < 0:
        raise CorruptError(f"{path}: a malformed ckpt.lightning pointer")
    return url, step


def _device(map_location: Optional[Any]) -> Optional[torch.device]:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise InvalidInputError(
        f"map_location must be None, a torch.device or a device name for ckpt checkpoints, not {type(map_location).__name__}"
    )


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return type(value)((k, _to(v, device)) for k, v in value.items())
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value


#: The plugin by the name Lightning gives its own kind: ``ckpt.lightning.CheckpointIO(url)``.
CheckpointIO = CkptCheckpointIO
