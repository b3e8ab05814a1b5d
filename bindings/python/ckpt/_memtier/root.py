"""The memory tier's pieces that know nothing of ranks talking: where each
rank's replica lives (:class:`Topology`), a memory-tier checkpoint root seen
as files (:class:`MemoryRoot`, the engine's: its keys, step names and
manifests are the engine's layout), and errors as they cross ranks.
(:mod:`ckpt.memory` puts them together.)"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from ckpt import _ckpt
from ckpt import errors as errs
from ckpt._ckpt import MemoryRoot as MemoryRoot
from ckpt.errors import CheckpointError, InvalidInputError

if TYPE_CHECKING:
    from typing_extensions import Buffer


@dataclass(frozen=True)
class Topology:
    """Which ranks share a node, and where each rank's replica lives.

    Nodes are groups of ``ranks_per_node`` consecutive ranks (the launchers'
    default placement). With one node there is nowhere to replicate to.
    """

    rank: int
    world_size: int
    ranks_per_node: int

    @staticmethod
    def from_env(rank: int, world_size: int, ranks_per_node: Optional[int] = None) -> "Topology":
        if ranks_per_node is None:
            for var in ("CKPT_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
                v = os.environ.get(var, "")
                if v.isdigit() and int(v) > 0:
                    ranks_per_node = int(v)
                    break
            else:
                ranks_per_node = world_size
        if type(ranks_per_node) is not int or ranks_per_node < 1 or world_size % ranks_per_node:
            raise InvalidInputError(
                f"ranks_per_node must divide the world size {world_size}, not {ranks_per_node!r}"
            )
        return Topology(rank, world_size, ranks_per_node)

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node(self, rank: Optional[int] = None) -> int:
        return (self.rank if rank is None else rank) // self.ranks_per_node

    def _shift(self, rank: int, by: int) -> int:
        local = rank % self.ranks_per_node
        return ((self.node(rank) + by) % self.nodes) * self.ranks_per_node + local

    def holder(self, rank: Optional[int] = None) -> int:
        """The rank that keeps ``rank``'s replica (on the next node)."""
        return self._shift(self.rank if rank is None else rank, 1)

    def source(self, rank: Optional[int] = None) -> int:
        """The rank whose replica ``rank`` keeps (on the previous node)."""
        return self._shift(self.rank if rank is None else rank, -1)


def load_outcome(load: Callable[[], Any]) -> Tuple[Dict[str, Any], Optional[CheckpointError]]:
    """Run a load from a memory root; its outcome as every rank must learn it
    (``ok``, ``damaged`` or ``error``, described), and the damage if damaged."""
    try:
        load()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        if isinstance(e, CheckpointError) and _ckpt.is_damage(e):
            return {"status": "damaged"}, e
        return {"status": "error", "error": describe(e)}, None
    return {"status": "ok"}, None


def write_object(root: MemoryRoot, key: str, data: Buffer) -> Optional[Dict[str, object]]:
    """Write ``key`` of ``root``; its failure, described, or ``None``."""
    try:
        root.write(key, data)
    except CheckpointError as e:
        return describe(e)
    return None


def describe(e: BaseException) -> Dict[str, object]:
    """A failure as every rank rebuilds it: ckpt-core's wire form of errors
    (``_ckpt.error_to_wire``), as JSON data to send inside a message."""
    d: Dict[str, object] = json.loads(_ckpt.error_to_wire(e))
    return d


def rebuild(rank: int, d: Dict[str, object], what: str) -> CheckpointError:
    """The exception a failure described on ``rank`` stands for, the same class."""
    e: CheckpointError = _ckpt.error_from_wire(json.dumps(d).encode(), f"memory tier, rank {rank}, {what}: ")
    return e


def message(d: Dict[str, object]) -> str:
    """A described failure's message."""
    return str(_ckpt.error_from_wire(json.dumps(d).encode()))
