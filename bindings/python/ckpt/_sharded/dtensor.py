"""Sharded tensors (``torch.distributed.tensor.DTensor``) as pieces of global tensors.

A DTensor's placements on its device mesh say which part of the global tensor
each rank holds: ``Shard(d)`` splits dimension ``d`` (unevenly where it does not
divide: the last ranks hold less, or nothing), ``Replicate()`` copies it, and the
``_StridedShard`` that FSDP2 and tensor parallelism produce together on a 2-D
mesh interleaves the split. ckpt stores each rank's local tensor as one or more
*pieces*: boxes of the global tensor, each with its global shape and offsets.
A piece several ranks hold (a mesh dimension with ``Replicate()``) is the same
data and is written once; on load, each rank asks for the boxes its own local
tensor covers, whatever the mesh was at save, and reads only the stored pieces
that overlap them.

``Partial`` placements (pending reductions) have no global value to store and
are refused with :class:`~ckpt.UnsupportedError`.

This module never imports torch by itself: a value is a DTensor only if
``torch.distributed.tensor`` is already imported.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple, Type, TypeGuard, cast

from ckpt.errors import UnsupportedError

if TYPE_CHECKING:
    from torch import Size, Tensor
    from torch.distributed.tensor import DTensor

__all__ = ["Piece", "is_dtensor", "local_pieces", "local_tensor"]

#: Most boxes one rank's local tensor may split into (interleaved shards).
MAX_PIECES = 4096


@dataclass(frozen=True)
class Piece:
    """A box of the global tensor held by this rank.

    ``local`` gives, per dimension, ``(start, length)`` in the local tensor;
    ``offsets`` where the box starts in the global tensor; its extent is the
    lengths.
    """

    local: Tuple[Tuple[int, int], ...]
    offsets: Tuple[int, ...]
    #: The box's extent (its lengths), worked out once: saves ask for it every time.
    shape: Tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(n for _, n in self.local))

    def view(self, t: Tensor) -> Tensor:
        """The part of local tensor ``t`` this piece covers (a view)."""
        for d, (start, n) in enumerate(self.local):
            if start != 0 or n != t.shape[d]:
                t = t.narrow(d, start, n)
        return t


def _dtensor_type() -> Optional[Type[DTensor]]:
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(obj: object) -> TypeGuard[DTensor]:
    """True for a ``torch.distributed.tensor.DTensor``."""
    dt = _dtensor_type()
    return dt is not None and isinstance(obj, dt)


def local_tensor(obj: Tensor) -> Tensor:
    """The rank-local tensor of a DTensor (no copy), or ``obj`` itself."""
    return local_of(obj) if is_dtensor(obj) else obj


def local_of(dtensor: DTensor) -> Tensor:
    """The local tensor of a DTensor, the same memory ``to_local()`` views.

    ``to_local()`` is an autograd function (several calls per DTensor in a
    save), which a checkpoint does not need: it reads the bytes or writes
    them in place.
    """
    t: Optional[Tensor] = getattr(dtensor, "_local_tensor", None)
    return t if t is not None else dtensor.to_local()


def _runs(index: Sequence[int]) -> List[Tuple[int, int, int]]:
    """Split global indices into runs of consecutive ones: ``(local_start, global_start, length)``."""
    if not index:
        return []
    first = index[0]
    if index[-1] - first + 1 == len(index) and list(index) == list(range(first, first + len(index))):
        return [(0, first, len(index))]  # one run: the common case, without a Python loop
    runs: List[Tuple[int, int, int]] = []
    for i, g in enumerate(index):
        if runs and runs[-1][1] + runs[-1][2] == g:
            ls, gs, n = runs[-1]
            runs[-1] = (ls, gs, n + 1)
        else:
            runs.append((i, g, 1))
    return runs


def _index_sets(obj: DTensor, where: object) -> Optional[List[Optional[List[int]]]]:
    """Per dimension, the global indices this rank holds (``None``: all of them),
    or ``None`` when this rank is not part of the mesh."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard

        sharded: Tuple[type, ...] = (Shard, _StridedShard)
    except ImportError:  # pragma: no cover - older torch
        sharded = (Shard,)
    placements = tuple(obj.placements)
    for p in placements:
        if isinstance(p, Partial) or (not isinstance(p, (Replicate, *sharded)) and getattr(p, "is_partial", lambda: False)()):
            raise UnsupportedError(
                f"{where}: DTensor placement {type(p).__name__} ({p}) cannot be stored (a partial value pending a reduction); "
                "redistribute it to Shard or Replicate first"
            )
        if not isinstance(p, (Replicate, *sharded)):
            raise UnsupportedError(
                f"{where}: DTensor placement {type(p).__name__} ({p}) is not supported (Shard and Replicate are)"
            )
    mesh = obj.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    shape = [int(s) for s in obj.shape]
    if all(isinstance(p, Replicate) for p in placements):
        return [None] * len(shape)
    import torch.distributed.tensor._utils as dt_utils

    # Private, and not in every PyTorch version: the index set of every shard.
    shard_indices: Optional[Callable[..., Tuple[int, Tensor]]] = getattr(dt_utils, "_get_shard_size_and_offsets", None)
    if shard_indices is None:  # pragma: no cover - other torch versions
        # Public API: the first offset only, which is exact for plain shards.
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(type(p).__name__ == "_StridedShard" for p in placements):
            raise UnsupportedError(f"{where}: strided DTensor shards need a newer PyTorch")
        local, offsets = compute_local_shape_and_global_offset(obj.shape, mesh, placements)
        return [
            None if (o == 0 and n == g) else list(range(o, o + n)) for o, n, g in zip(offsets, local, shape)
        ]
    local_shape = list(shape)
    sets: Dict[int, Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        d = cast("Shard", p).dim  # (Shard or _StridedShard: Replicate was passed over)
        size, index = shard_indices(
            local_shape[d], mesh.size(mesh_dim), coord[mesh_dim], p, sets.get(d), shape[d], False
        )
        local_shape[d] = int(size)
        sets[d] = index  # a tensor: the next placement on this dimension indexes into it
    out: List[Optional[List[int]]] = []
    for d in range(len(shape)):
        idx = sets.get(d)
        out.append(None if idx is None else [int(i) for i in idx.tolist()][: local_shape[d]])
    return out


#: Pieces by layout (global shape, placements, mesh, local shape): the same
#: parameters are saved and loaded again and again with the same layout, and
#: working the boxes out is most of a save call's time for a sharded model.
_LAYOUTS: Dict[_LayoutKey, Tuple[Piece, ...]] = {}
_LAYOUTS_MAX = 1 << 16
#: (Its key: the global shape, the placements, the mesh and the local shape.)
_LayoutKey = Tuple[Tuple[int, ...], Tuple[object, ...], object, Tuple[int, ...]]
#: The same by ``id`` of the DTensor's spec object: ``id -> (spec, its
#: placements, mesh and tensor metadata, local shape, global shape, pieces)``.
#: Tensors of one layout share a spec, so there are about as many as layouts;
#: the entries keep their specs alive, hence the smaller cap.
_BY_SPEC: Dict[int, Tuple[object, object, object, object, Size, Tuple[int, ...], Tuple[Piece, ...]]] = {}
_BY_SPEC_MAX = 1 << 12


def local_pieces(obj: DTensor, where: object) -> Tuple[Tuple[int, ...], List[Piece]]:
    """The global shape of DTensor ``obj`` and the boxes its local tensor covers.

    An empty list means this rank holds nothing of it (an uneven split, or a
    rank outside the mesh). A local tensor that is the whole global tensor (all
    placements ``Replicate``) is one piece at offset zero.
    """
    local = local_of(obj)
    spec = getattr(obj, "_spec", None)
    if spec is not None:
        # Fast path: the same spec object (FSDP2 and TP keep one per parameter
        # and optimizer state), so the same layout; no hashing of placements and mesh.
        # The spec's fields are checked by identity too, in case one is reassigned.
        hit = _BY_SPEC.get(id(spec))
        if (
            hit is not None
            and hit[0] is spec
            and hit[1] is getattr(spec, "placements", None)
            and hit[2] is getattr(spec, "mesh", None)
            and hit[3] is getattr(spec, "tensor_meta", None)
            and hit[4] == local.shape
        ):
            return hit[5], list(hit[6])
    shape = tuple(int(s) for s in obj.shape)
    try:
        key: Optional[_LayoutKey] = (shape, tuple(obj.placements), obj.device_mesh, tuple(local.shape))
        hash(key)
    except TypeError:  # pragma: no cover - an unhashable mesh or placement
        key = None
    if key is not None:
        known = _LAYOUTS.get(key)
        if known is not None:
            _remember(spec, local, shape, known)
            return shape, list(known)
    pieces = _pieces(obj, where, shape, local)
    if key is not None:
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[key] = tuple(pieces)
        _remember(spec, local, shape, _LAYOUTS[key])
    return shape, pieces


def _remember(spec: object, local: Tensor, shape: Tuple[int, ...], pieces: Tuple[Piece, ...]) -> None:
    """Cache a layout by spec object. The entry holds the spec, so its ``id``
    is not reused by another object while the entry exists."""
    if spec is None:
        return
    if len(_BY_SPEC) >= _BY_SPEC_MAX:
        _BY_SPEC.clear()
    _BY_SPEC[id(spec)] = (
        spec,
        getattr(spec, "placements", None),
        getattr(spec, "mesh", None),
        getattr(spec, "tensor_meta", None),
        local.shape,
        shape,
        pieces,
    )


def _pieces(obj: DTensor, where: object, shape: Tuple[int, ...], local: Tensor) -> List[Piece]:
    sets = _index_sets(obj, where)
    if sets is None:
        return []
    per_dim: List[List[Tuple[int, int, int]]] = []
    for d, idx in enumerate(sets):
        runs = [(0, 0, shape[d])] if idx is None else _runs(idx)
        held = sum(n for _, _, n in runs)
        if held != int(local.shape[d]):
            raise UnsupportedError(
                f"{where}: DTensor local shard has {int(local.shape[d])} entries in dimension {d}, "
                f"its placements {tuple(obj.placements)} say {held}"
            )
        if held == 0:
            return []
        per_dim.append(runs)
    count = 1
    for runs in per_dim:
        count *= len(runs)
    if count > MAX_PIECES:
        raise UnsupportedError(f"{where}: DTensor local shard splits into {count} boxes (at most {MAX_PIECES})")
    return [
        Piece(local=tuple((ls, n) for ls, _, n in combo), offsets=tuple(gs for _, gs, _ in combo))
        for combo in itertools.product(*per_dim)
    ]
