"""What a restart passed over, said once: the damaged checkpoints it skipped
and the saves newer than the one it resumed from that never committed.

A job killed in the middle of a save (say of step 60, after step 40's
committed) restarts from step 40; without a word, the 20 steps it trains
again look like a bug. So :func:`say` logs one record on logger ``"ckpt"``
(``WARNING``: Python prints it on stderr where logging is not set up), on
rank 0 only: every rank skipped the same checkpoints.

Saves that never committed are those with a folder of their own under
``data/`` and no manifest (``_ckpt.Checkpointer.uncommitted``: a listing of
``data/`` by folder and one of ``manifests/``, no object read; a failure to
list is not the restore's). A native save by a single rank keeps nothing
under ``data/`` before its commit (its chunks are named by content), so one
cut off there goes unnamed.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

from ckpt import _ckpt
from ckpt.errors import CheckpointError

__all__ = ["LOG", "say"]

#: ckpt's logger.
LOG = logging.getLogger("ckpt")


def say(
    native: _ckpt.Checkpointer, restored: Optional[int], skipped: List[Tuple[int, str, CheckpointError]]
) -> None:
    """On rank 0, log what the restore that resumed from ``restored`` (None:
    from nothing) passed over: ``skipped`` damaged checkpoints and newer
    saves that never committed."""
    if native.rank != 0:
        return
    try:
        cut = [(s, a) for s, a in native.uncommitted() if restored is None or s > restored]
    except CheckpointError as e:
        LOG.debug("ckpt: could not list the saves that never committed: %s", e)
        cut = []
    if not cut and not skipped:
        return
    what = [f"step {s} (attempt {a}): damaged: {e}" for s, a, e in skipped]
    what += [f"step {s} (attempt {a}): never committed (the save was cut off, or is still being written)" for s, a in cut]
    to = "nothing (a fresh start)" if restored is None else f"step {restored}"
    LOG.warning("ckpt: resumed from %s, passing over %d newer: %s", to, len(what), "; ".join(what))
