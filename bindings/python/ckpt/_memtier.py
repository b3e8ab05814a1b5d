"""The memory tier's pieces that know nothing of ranks talking: where each
rank's replica lives (:class:`Topology`), a memory-tier checkpoint root seen
as files (:class:`MemoryRoot`), and errors as they cross ranks.
(:mod:`ckpt.memory` puts them together.)"""

from __future__ import annotations

import errno as _errno
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _ckpt
from . import errors as errs
from .errors import CheckpointError, InvalidInputError, StorageError

MANIFESTS = "manifests"
MANIFEST_EXT = ".manifest"


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


class MemoryRoot:
    """A checkpoint root on the memory tier, seen as files: what is committed,
    what a checkpoint references, and atomic writes (manifest last)."""

    def __init__(self, path: Path, incoming: Path) -> None:
        self.path = path
        self.incoming = incoming
        path.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return self.path.as_uri()

    def committed(self) -> Dict[int, str]:
        """Committed checkpoints: step -> attempt (a step has one: the engine
        refuses a committed step, and a restart uncommits newer ones)."""
        out: Dict[int, str] = {}
        try:
            names = sorted(os.listdir(self.path / MANIFESTS))
        except FileNotFoundError:
            return out
        for n in names:
            if not n.endswith(MANIFEST_EXT):
                continue
            step, _, attempt = n[: -len(MANIFEST_EXT)].partition("-")
            if step.isdigit() and attempt:
                out[int(step)] = attempt
        return out

    @staticmethod
    def manifest_key(step: int, attempt: str) -> str:
        return f"{MANIFESTS}/{step:020}-{attempt}{MANIFEST_EXT}"

    def body(self, step: int, attempt: str) -> Dict[str, Any]:
        """A checkpoint's manifest body, unverified."""
        return manifest_body((self.path / self.manifest_key(step, attempt)).read_bytes())

    def identity(self, step: int, attempt: str) -> Optional[Tuple[int, int]]:
        """Which rank of how many saved a checkpoint (recorded by the memory
        tier's saves); ``None`` when unreadable or not recorded."""
        try:
            info = _tagged(_tagged(self.body(step, attempt).get("meta"), "ckpt"), "memory")
            rank, ranks = _tagged(info, "rank"), _tagged(info, "ranks")
        except (OSError, ValueError):
            return None
        if isinstance(rank, dict) and isinstance(ranks, dict):
            r, n = rank.get("v"), ranks.get("v")
            if type(r) is int and type(n) is int and 0 <= r < n:
                return r, n
        return None

    def objects(self, step: int, attempt: str) -> List[Tuple[str, int]]:
        """Every object of a checkpoint with its length, the manifest last.
        Raises ``OSError``/``ValueError`` when it cannot."""
        keys = self.referenced(step, attempt) + [self.manifest_key(step, attempt)]
        return [(k, (self.path / k).stat().st_size) for k in keys]

    def referenced(self, step: int, attempt: str) -> List[str]:
        """The objects a checkpoint's manifest references, from its JSON body
        (after the header line): the chunks of chunked tensors, then the
        per-checkpoint objects it lists."""
        return [k for k, _ in chunk_objects(self.body(step, attempt))]

    def pin(self, step: int, attempt: str, into: Path) -> Optional[List[Tuple[str, int]]]:
        """Hard-link every object of a checkpoint under ``into`` (same keys), so
        that the retention of later saves cannot remove what a replication is
        still sending; ``None`` when the checkpoint is already retired."""
        shutil.rmtree(into, ignore_errors=True)
        try:
            key = self.manifest_key(step, attempt)
            (into / MANIFESTS).mkdir(parents=True)
            os.link(self.path / key, into / key)  # first: the rest exists while it does
            pinned = MemoryRoot(into, self.incoming)
            for k in pinned.referenced(step, attempt):
                (into / k).parent.mkdir(parents=True, exist_ok=True)
                os.link(self.path / k, into / k)
            return pinned.objects(step, attempt)
        except FileNotFoundError:
            shutil.rmtree(into, ignore_errors=True)
            return None

    def has(self, key: str, size: int) -> bool:
        try:
            return (self.path / key).stat().st_size == size
        except OSError:
            return False

    def read(self, key: str) -> bytearray:
        try:
            with open(self.path / key, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                if f.readinto(buf) != size:
                    return bytearray()
                return buf
        except OSError:
            return bytearray()  # vanished: the receiver sees the wrong length

    def write(self, key: str, data: Any) -> None:
        """Write ``key`` whole or not at all (a temporary file renamed into place)."""
        if ".." in key.split("/") or key.startswith("/"):
            raise InvalidInputError(f"refusing replica key {key!r}")
        self.incoming.mkdir(parents=True, exist_ok=True)
        tmp = self.incoming / f"{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
        dst = self.path / key
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dst)

    def drop_newer(self, step: int) -> None:
        """Uncommit every checkpoint newer than ``step`` (its manifest goes)."""
        for s, a in self.committed().items():
            if s > step:
                try:
                    os.unlink(self.path / self.manifest_key(s, a))
                except FileNotFoundError:
                    pass

    def drop(self, step: int, attempt: str) -> None:
        try:
            os.unlink(self.path / self.manifest_key(step, attempt))
        except FileNotFoundError:
            pass

    def gc(self, keep: int) -> None:
        """Retention by the engine's own GC: the newest ``keep``, and no chunk
        or leftover that no kept manifest references."""
        _ckpt.Checkpointer(self.url, keep_last=keep, fencing=False).gc()


def manifest_body(raw: bytes) -> Dict[str, Any]:
    """The JSON body of a stored manifest (after its header line), unverified."""
    body: Dict[str, Any] = json.loads(raw[raw.index(b"\n") + 1 :])
    return body


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


def _tagged(value: Any, key: str) -> Any:
    """``key``'s value in a map as a manifest stores metadata (``{"t": "map",
    "v": [[key, value], ...]}``), or ``None``."""
    if isinstance(value, dict) and value.get("t") == "map" and isinstance(value.get("v"), list):
        for pair in value["v"]:
            if isinstance(pair, list) and len(pair) == 2 and pair[0] == key:
                return pair[1]
    return None


def chunk_objects(body: Dict[str, Any]) -> List[Tuple[str, int]]:
    """The objects a manifest body references with their stored lengths (-1
    for a per-checkpoint object, whose length it does not record)."""
    out: List[Tuple[str, int]] = []
    seen = set()
    for t in body.get("tensors", []):
        layout = t.get("layout", {})
        for c in layout.get("chunks", []) if layout.get("kind") == "chunks" else []:
            k = f"chunks/{c['hash']}"
            if k not in seen:
                seen.add(k)
                out.append((k, int(c["stored"])))
    for k in body.get("objects", []):
        if k not in seen:
            seen.add(k)
            out.append((k, -1))
    return out


def write_object(root: MemoryRoot, key: str, data: Any) -> Optional[Dict[str, Any]]:
    try:
        root.write(key, data)
    except OSError as e:
        return describe(StorageError(e.errno or _errno.EIO, f"writing {key}: {e.strerror or e}"))
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
