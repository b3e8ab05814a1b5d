"""A rank's own state (its random generators, and what the caller passes as
``per_rank``), stored beside the shared state.

Only rank 0's metadata reaches a checkpoint's manifest, so each rank's own
tree travels as a tensor of its own: a ``U8`` tensor (named by
``_ckpt.own_name``) holding the encoded tree, whose tensors are named under
the same prefix. A rank-specific name is never replicated, so
every rank's part is stored. The Rust side knows the layout too
(``formats/src/pylayout.rs``), to leave these tensors out of exports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, cast

from ckpt import _ckpt
from ckpt.errors import InvalidInputError, UnsupportedError
from ckpt.rng import RNGState
from ckpt._state.tree import Tree, tensor_maker, unflatten

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["PER_RANK", "name", "holds", "local", "encode", "check", "decode"]

#: The keyword of ``save`` and ``load_latest`` whose mapping is this rank's
#: own (a data loader, a prefetched batch), and its key in the own tree.
PER_RANK = "per_rank"

#: A tensor as a load hands it over: ``(dtype, shape, buffer)``.
Loaded = Tuple[str, Sequence[int], "Buffer"]


def local(entries: Dict[str, object], rng: bool) -> Optional[Dict[str, object]]:
    """This rank's own part of a save's ``entries``, taken out of them: its
    RNG (with ``rng``) and the mapping given as ``per_rank``; None when neither."""
    per_rank = entries.pop(PER_RANK, None)
    own: Dict[str, object] = {"rng": RNGState()} if rng else {}
    if per_rank is not None:
        if not isinstance(per_rank, Mapping):
            raise InvalidInputError(f"per_rank must be a mapping of names to values, not {type(per_rank).__name__}")
        own[PER_RANK] = per_rank
    return own or None


def name(rank: int) -> str:
    """Name of the tensor holding rank ``rank``'s own tree (and prefix of its tensors)."""
    return _ckpt.own_name(rank)


def holds(tensor: str, rank: int) -> bool:
    """True for the tensors of rank ``rank``'s own state (its tree and the tensors in it)."""
    return _ckpt.own_rank(tensor) == rank


def encode(tree: Tree, numpy_names: List[str], rank: int) -> _ckpt.TensorSpec:
    """The tensor that carries rank ``rank``'s own tree (its tensors are saved apart)."""
    blob = _ckpt.encode_own(tree, numpy_names)
    return _ckpt.TensorSpec(name=name(rank), dtype="U8", shape=(len(blob),), data=blob, copy_now=True)


def check(dtype: str, shape: Sequence[int], rank: int) -> None:
    """Raise unless ``(dtype, shape)`` is that of an encoded tree (a 1-D ``U8`` tensor)."""
    if dtype != "U8" or len(shape) != 1:
        raise UnsupportedError(f"tensor {name(rank)!r} is {dtype}, not the U8 of a rank's own state")


def decode(tensors: Mapping[str, Loaded], rank: int, framework: Optional[str] = None) -> Optional[Dict[str, object]]:
    """Rank ``rank``'s own state (``{"rng": ..., "per_rank": ...}``) from loaded tensors, or None
    when the checkpoint holds none for it."""
    entry = tensors.get(name(rank))
    if entry is None:
        return None
    dtype, shape, buf = entry
    check(dtype, shape, rank)
    tree, numpy_names = _ckpt.decode_own(bytes(memoryview(buf)), rank)
    own = unflatten(cast(Tree, tree), tensor_maker(tensors, set(numpy_names), framework))
    if not isinstance(own, dict):
        raise UnsupportedError(f"tensor {name(rank)!r} does not hold a rank's own state")
    return own
