"""The memory tier's restart into a job of another shape (N ranks saved, M
load): the N per-rank checkpoints of one step merged into one, on every rank.

Each rank of the N-rank job kept its state as a checkpoint of its own (its
root ``rank<r>``, and the replica ``replica<r>`` on the next node), recording
which rank of how many saved it. The restarted job of M ranks (any M, any
ranks per node):

1. gathers what every node holds (:func:`inventory`), and takes the newest
   step whose every old rank has a copy on some node, unless the durable tier
   has a newer one;
2. gathers the N manifests (each from one rank that holds it) and merges
   them (``ckpt._ckpt.merge_manifests``: every part verified; pieces of
   sharded tensors with their offsets, one copy of each replica, the old
   ranks' own states side by side). A step whose manifests cannot be merged
   is skipped, on every rank alike (they merge the same bytes);
3. on every rank, links the objects its own node holds into a merged root
   (``<memory_dir>/.merged<rank>``), and fetches the others over the tier's
   link, each from one rank that holds it: a ring of M-1 shifts, one object
   each way per round, chunks that some old rank shares with another (data
   parallel replicas) only once;
4. writes the merged manifest last, and loads it as any checkpoint: each rank
   reads the pieces that overlap its shards, verified (blake3), and its own
   RNG state when the old job had its rank;
5. agrees with every rank: if one could not, all go on to the next older step,
   then to the durable tier. After a merged restart, the old job's roots on
   this node are removed (their shape is not this job's).

Every rank fetches what its node lacks, so a merged restart moves up to the
whole state to every node: it is for restarts after the shape changed, not
the common case (same shape, own copy in memory).
"""

from __future__ import annotations

import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, NotRequired, Optional, Protocol, Set, Tuple, TypedDict

from ckpt import _ckpt
from ckpt._memtier import wire as wire
from ckpt._memtier.root import MemoryRoot, Topology, load_outcome, message
from ckpt.errors import CheckpointError

if TYPE_CHECKING:
    from ckpt.checkpointer import Checkpointer, LiveState
    from ckpt.distributed import Link

#: ``(old rank, old world size, step, root name)``; the saver ``None`` for a
#: checkpoint saved before the tier recorded it.
Entry = Tuple[Optional[int], Optional[int], int, str]

_ROOT = re.compile(r"^(rank|replica)[0-9]+$")


class Holdings(TypedDict):
    """What a rank can restore, as it tells the others at a load
    (:meth:`ckpt.memory.MemoryCheckpointer._holdings`)."""

    own: List[int]
    held: List[int]
    durable: Optional[int]
    inventory: List[Entry]
    has_step: NotRequired[bool]


class Tier(Protocol):
    """What a merged restore uses of the memory tier (a
    :class:`ckpt.memory.MemoryCheckpointer`, which sits above this module)."""

    topology: Topology
    node_dir: Path
    own: MemoryRoot
    replica: Optional[MemoryRoot]
    memory: Checkpointer
    _link: Optional[Link]

    def _gather(self, obj: object) -> List[Any]: ...
    def _agree(self, mine: Dict[str, Any]) -> List[Dict[str, Any]]: ...
    def _open_memory(self, root: Optional[MemoryRoot] = None, read_only: bool = False) -> Checkpointer: ...


def inventory(node_dir: Path, incoming: Path) -> List[Entry]:
    """Every memory checkpoint this node holds, with its saver."""
    out: List[Entry] = []
    try:
        names = sorted(p.name for p in node_dir.iterdir() if _ROOT.match(p.name))
    except FileNotFoundError:
        return out
    for name in names:
        root = MemoryRoot(node_dir / name, incoming)
        for step, attempt in sorted(root.committed().items()):
            r, n = root.identity(step, attempt) or (None, None)
            out.append((r, n, step, name))
    return out


def load(
    mc: Tier, state: Optional[LiveState], named: Dict[str, object], everyone: List[Holdings], newest_durable: Optional[int]
) -> Optional[int]:
    """Restore the newest merged checkpoint into ``mc``'s job (see the module
    docs); its step on every rank, or ``None``. ``mc`` is the
    :class:`~ckpt.memory.MemoryCheckpointer`, ``everyone`` what each rank
    told at its ``load_latest``."""
    topo = mc.topology
    # (step, old world size, old rank) -> the ranks whose node holds a copy, and in which root
    held: Dict[Tuple[int, int, int], Dict[int, str]] = {}
    for q, e in enumerate(everyone):
        for r, n, step, root in e["inventory"]:
            if r is None or n is None:
                continue  # its saver unknown: not for merging
            held.setdefault((int(step), int(n), int(r)), {})[q] = str(root)
    shapes = {(s, n) for s, n, _ in held}
    complete = sorted((s, n) for s, n in shapes if all((s, n, r) in held for r in range(n)))
    for step, n in reversed(complete):
        if newest_durable is not None and step < newest_durable:
            break
        if n == topo.world_size and all(_same_shape(topo, held[(step, n, r)], r) for r in range(n)):
            continue  # the job's own shape: the plain path tried it already
        if _merge_and_load(mc, step, n, held, state, named):
            return step
    return None


def _same_shape(topo: Topology, holders: Dict[int, str], r: int) -> bool:
    """True when old rank ``r``'s copy is where this job keeps rank ``r``'s."""
    return holders.get(r) == f"rank{r}" or holders.get(topo.holder(r)) == f"replica{r}"


def _merge_and_load(
    mc: Tier, step: int, n: int, held: Dict[Tuple[int, int, int], Dict[int, str]], state: Optional[LiveState],
    named: Dict[str, object],
) -> bool:
    topo = mc.topology
    me, world = topo.rank, topo.world_size
    server = {r: min(held[(step, n, r)]) for r in range(n)}
    # The manifests, each sent by its server.
    mine = {}
    for r in range(n):
        if server[r] == me:
            root = MemoryRoot(mc.node_dir / held[(step, n, r)][me], mc.own.incoming)
            attempt = root.committed()[step]
            mine[str(r)] = (root.read(root.manifest_key(step, attempt)) or b"").hex()
    manifests: Dict[int, bytes] = {}
    for part in mc._gather(mine):
        manifests.update({int(r): bytes.fromhex(h) for r, h in part.items()})
    # The same bytes on every rank: every rank merges, or fails, alike.
    try:
        merged_manifest = _ckpt.merge_manifests([manifests[r] for r in range(n)])
    except CheckpointError as e:
        warnings.warn(f"ckpt: the memory checkpoints of step {step} cannot be merged ({e}); trying older ones",
                      stacklevel=4)
        return False
    refs = {r: MemoryRoot.references(manifests[r]) for r in range(n)}  # verified by the merge
    # What each object is and who serves it; what this node lacks.
    here = topo.node()
    local_roots = [MemoryRoot(mc.node_dir / name, mc.own.incoming) for name in
                   sorted({name for r in range(n) for q, name in held[(step, n, r)].items() if topo.node(q) == here})]
    wants: Dict[int, List[Tuple[str, Optional[int]]]] = {}
    links: Dict[str, MemoryRoot] = {}
    taken: Set[str] = set()
    for r in range(n):
        for key, size in refs[r]:
            if key in taken:
                continue
            taken.add(key)
            holder = _find(local_roots, key)  # this old rank's copy, or another's
            if holder is not None:
                links[key] = holder
                continue
            if server[r] != me:  # else it is lost here too: the load finds it damaged
                wants.setdefault(server[r], []).append((key, size))
    gathered = mc._gather({str(q): w for q, w in wants.items()})
    everyone_wants = [{int(q): [(str(k), None if z is None else int(z)) for k, z in w] for q, w in d.items()}
                      for d in gathered]
    merged = MemoryRoot(mc.node_dir / f".merged{me}", mc.own.incoming)
    shutil.rmtree(merged.path, ignore_errors=True)
    try:
        failure = _build(mc, merged, links, everyone_wants, merged_manifest, step, local_roots)
        outcome: Dict[str, Any] = {"status": "damaged"} if failure else _load_merged(mc, merged, step, state, named)
        if failure:
            warnings.warn(f"ckpt: merging the memory checkpoints of step {step} failed ({failure}); trying older ones", stacklevel=4)
        if any(o["status"] != "ok" for o in mc._agree(outcome)):
            return False
    finally:
        shutil.rmtree(merged.path, ignore_errors=True)
    # The old job's roots on this node: another shape, of no use to this job.
    # The memory checkpointer listed its root's chunks when it opened: it is
    # opened again on the emptied root, or its next save would count on
    # chunks that are gone.
    mc.memory.close()
    for kept in (mc.own, mc.replica):
        if kept is not None:
            shutil.rmtree(kept.path, ignore_errors=True)
            kept.path.mkdir(parents=True, exist_ok=True)
    mc.memory = mc._open_memory()
    return True


def _find(roots: List[MemoryRoot], key: str) -> Optional[MemoryRoot]:
    """The first of ``roots`` that holds ``key``."""
    return next((root for root in roots if root.size(key) is not None), None)


def _build(mc: Tier, merged: MemoryRoot, links: Dict[str, MemoryRoot],
           everyone_wants: List[Dict[int, List[Tuple[str, Optional[int]]]]],
           manifest: bytes, step: int, local_roots: List[MemoryRoot]) -> Optional[str]:
    """Fill ``merged`` (links, then fetched objects, the manifest last); the
    failure, described, or ``None``. The ring runs to its end on every rank,
    whatever fails here, so the ranks stay in step on the link."""
    topo = mc.topology
    me, world = topo.rank, topo.world_size
    failure: Optional[str] = None
    merged.path.mkdir(parents=True, exist_ok=True)
    for key, holder in links.items():
        try:
            merged.link_from(holder, key)
        except CheckpointError as e:
            failure = failure or f"{key}: {e}"
    for k in range(1, world):
        link = mc._link
        assert link is not None  # (a job of several ranks has one)
        dst, src = (me + k) % world, (me - k) % world
        outgoing = everyone_wants[dst].get(me, [])
        incoming = everyone_wants[me].get(src, [])
        rounds = max((len(everyone_wants[q].get((q - k) % world, [])) for q in range(world)), default=0)
        # Buffers reused, each object written while the next one arrives (ckpt._memtier.wire).
        sending = wire.Outgoing([(_find(local_roots, key), key) for key, _ in outgoing])
        receiving = wire.Incoming()
        try:
            for i in range(rounds):
                got = receiving.swap(link, sending.next(), dst, src)
                if i >= len(incoming) or failure is not None:
                    continue
                key, size = incoming[i]
                if size is not None and len(got) != size:
                    failure = f"{key}: {len(got)} bytes arrived from rank {src}, {size} expected"
                    continue
                err = receiving.write(merged, key, got)
                if err is not None:
                    failure = message(err)
        finally:
            err = receiving.close()
            if err is not None and failure is None:
                failure = message(err)
    if failure is not None:
        return failure
    try:
        merged.write_manifest(manifest)
    except CheckpointError as e:
        return str(e)
    return None


def _load_merged(
    mc: Tier, merged: MemoryRoot, step: int, state: Optional[LiveState], named: Dict[str, object]
) -> Dict[str, Any]:
    """Load the merged checkpoint as this rank of the job (its shards, its own
    state); the outcome as :meth:`MemoryCheckpointer._agree` takes it."""
    outcome, damage = load_outcome(lambda: mc._open_memory(merged, read_only=True).load(step, state, **named))
    if damage is not None:
        warnings.warn(f"ckpt: the merged memory checkpoint of step {step} is damaged ({damage})", stacklevel=4)
    return outcome
