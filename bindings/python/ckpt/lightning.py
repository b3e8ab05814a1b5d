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

Asynchronous: ``CheckpointIO(url, asynchronous=True)`` returns from
``save_checkpoint`` once ckpt has its snapshot (the training step goes on
while it is written); the pointer is written once the checkpoint is
committed, in order, so a job killed meanwhile resumes from the last
committed one. ``teardown`` (Lightning calls it when ``fit`` ends) waits for
every save and raises the first failure; a failure also raises at the next
``save_checkpoint``. Lightning's own ``AsyncCheckpointIO`` wrapped around
the synchronous plugin works too, at the cost of a clone of every tensor.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _CheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from ckpt.checkpointer import Checkpointer, SaveHandle
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
        asynchronous: return from ``save_checkpoint`` once the snapshot is
            taken, and write the pointer once the checkpoint is committed.
        keep_last, keep_every, compression, level: as for :class:`ckpt.Checkpointer`.
    """

    def __init__(
        self,
        url: str,
        *,
        asynchronous: bool = False,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        compression: Optional[str] = None,
        level: int = 3,
    ) -> None:
        super().__init__()
        self.url = url
        self._options: Dict[str, Any] = dict(keep_last=keep_last, keep_every=keep_every, compression=compression, level=level)
        self._cp: Optional[Checkpointer] = None
        self.asynchronous = asynchronous
        self._next: Optional[int] = None  # the next ckpt step (saves still pending count)
        self._commits: Optional[ThreadPoolExecutor] = None  # one thread: pointers in save order
        self._failure: Optional[BaseException] = None

    def _checkpointer(self) -> Checkpointer:
        if self._cp is None:
            self._cp = Checkpointer(self.url, coordinate="none", rng=False, **self._options)
        return self._cp

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: _Path, storage_options: Optional[Any] = None) -> None:
        """Save ``checkpoint`` as the root's next step and write the pointer at
        ``path`` once it is committed: before returning, or (``asynchronous``)
        in the background, returning once the snapshot is taken."""
        if storage_options is not None:
            raise UnsupportedError(f"CkptCheckpointIO takes no storage_options (got {storage_options!r})")
        self._raise_failure()
        cp = self._checkpointer()
        if self._next is None:
            steps = cp.steps()
            self._next = steps[-1] + 1 if steps else 0
        step, self._next = self._next, self._next + 1
        handle = cp.save(step, checkpoint)
        if self.asynchronous:
            self._executor().submit(self._in_background, self._commit, handle, str(path), step)
        else:
            self._commit(handle, str(path), step)

    def _commit(self, handle: SaveHandle, path: str, step: int) -> None:
        handle.wait()
        self._publish(path, step)

    def _publish(self, path: str, step: int) -> None:
        """Write the pointer to the committed ``step`` at ``path`` (saves are
        published in the order they were made)."""
        fs = get_filesystem(path)
        fs.makedirs(str(Path(path).parent), exist_ok=True)
        with fs.open(path, "w") as f:
            f.write(json.dumps({"format": FORMAT, "url": self.url, "step": step}))

    def _executor(self) -> ThreadPoolExecutor:
        if self._commits is None:
            self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-lightning")
        return self._commits

    def _in_background(self, fn: Any, *args: Any) -> None:
        if self._failure is not None:
            return  # after a failure nothing later is published
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - raised on the training thread
            self._failure = e

    def _raise_failure(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

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
        """Remove the pointer at ``path`` (the root's retention decides what it
        keeps); asynchronous: after the pending saves' pointers are written."""
        if self._commits is not None:
            self._commits.submit(self._in_background, _remove, str(path))
        else:
            _remove(str(path))

    def teardown(self) -> None:
        """Wait for every save (their pointers written), close the checkpointer,
        and raise the first failure of an asynchronous save."""
        if self._commits is not None:
            self._commits.shutdown(wait=True)
            self._commits = None
        if self._cp is not None:
            self._cp.close()
            self._cp = None
        self._next = None
        self._raise_failure()


def _remove(path: str) -> None:
    fs = get_filesystem(path)
    if fs.exists(path):
        fs.rm(path)


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
