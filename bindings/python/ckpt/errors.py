"""Exceptions raised by ckpt.

Every error of the Rust engine arrives as one of these classes (the native
module raises them directly, so the type survives the boundary). All derive
from :class:`CheckpointError`; where a built-in exception means the same thing
they derive from it too, so ``except ValueError`` or ``except OSError`` also work.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = [
    "CheckpointError",
    "NotFoundError",
    "CorruptError",
    "ConflictError",
    "FencedError",
    "InvalidInputError",
    "UnsupportedError",
    "StorageError",
    "CheckpointIOError",
    "CheckpointTimeoutError",
    "StragglerError",
    "SkippedError",
    "InternalError",
]


class CheckpointError(Exception):
    """Base class of every ckpt error."""


class NotFoundError(CheckpointError, LookupError):
    """No checkpoint, object or tensor where one was asked for."""


class CorruptError(CheckpointError):
    """Stored data failed verification (hash mismatch, truncated object, bad manifest).

    Attributes:
        object: the damaged stored object (key relative to the checkpoint root).
        tensor: the tensor it belongs to, or ``None`` when unknown.
        reason: what was wrong.
    """

    def __init__(
        self,
        message: str,
        object: str = "",  # noqa: A002 - the engine's name for it
        tensor: Optional[str] = None,
        reason: str = "",
    ) -> None:
        super().__init__(message)
        self.object = object
        self.tensor = tensor
        self.reason = reason


class ConflictError(CheckpointError):
    """A save would overwrite something already committed (e.g. the same step twice)."""


class FencedError(CheckpointError):
    """This process's writer epoch is over: a newer incarnation of the job
    claimed the checkpoint root (it restarted while this one was still
    running). The save published nothing that loads would pick and deleted
    nothing; this process should stop. ``epoch`` is the epoch it held,
    ``current`` the newest one claimed."""

    def __init__(self, message: str = "", epoch: int = 0, current: int = 0) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.current = current


class InvalidInputError(CheckpointError, ValueError):
    """The caller passed something ckpt cannot use (bad shape, type, URL or option)."""


class UnsupportedError(CheckpointError):
    """A format, dtype or storage scheme this build does not understand."""


class StorageError(CheckpointError, OSError):
    """The storage backend failed."""


class CheckpointIOError(CheckpointError, OSError):
    """A local I/O error outside the storage backend."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """A wait did not finish in time."""


class StragglerError(CheckpointTimeoutError):
    """A collective of a save or a load did not complete within
    ``collective_timeout`` because some ranks were not taking part: they
    arrived too late, never came (a dead or hung process) or were busy
    elsewhere. Every rank that waited raises it, naming the same ranks.

    Attributes:
        ranks: the ranks that were not waiting in a collective when it timed out.
        world_size: the job's number of ranks.
        what: the collective, and the step of the save or load it belongs to.
        timeout: the collective timeout, in seconds.
    """

    def __init__(
        self, message: str = "", ranks: Sequence[int] = (), world_size: int = 0, what: str = "", timeout: float = 0.0
    ) -> None:
        super().__init__(message)
        self.ranks = list(ranks)
        self.world_size = world_size
        self.what = what
        self.timeout = timeout


class SkippedError(CheckpointError):
    """A save was refused: the staging budget was in use and the busy policy is ``"skip"``.

    Attributes:
        step: the step that was not saved.
    """

    def __init__(self, message: str, step: int = -1) -> None:
        super().__init__(message)
        self.step = step


class InternalError(CheckpointError):
    """A background task failed without a more specific error."""
