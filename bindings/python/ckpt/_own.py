"""A rank's own state (its random generators), stored beside the shared state.

Only rank 0's metadata reaches a checkpoint's manifest, so each rank's own
tree travels as a tensor of its own: a ``U8`` tensor named ``__rank{r}__``
holding the encoded tree, whose tensors are named under the same prefix
(``__rank{r}__.rng.torch``). A rank-specific name is never replicated, so
every rank's part is stored. The Rust side knows the layout too
(``formats/src/pylayout.rs``), to leave these tensors out of exports.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from . import _ckpt
from .errors import UnsupportedError
from .tree import Tree, tensor_maker, unflatten

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["name", "holds", "encode", "check", "decode"]

#: A tensor as a load hands it over: ``(dtype, shape, buffer)``.
Loaded = Tuple[str, Sequence[int], "Buffer"]


def name(rank: int) -> str:
    """Name of the tensor holding rank ``rank``'s own tree (and prefix of its tensors)."""
    return f"__rank{rank}__"


def holds(tensor: str, rank: int) -> bool:
    """True for the tensors of rank ``rank``'s own state (its tree and the tensors in it)."""
    own = name(rank)
    return tensor == own or tensor.startswith(own + ".")


def encode(tree: Tree, numpy_names: List[str], rank: int) -> _ckpt.TensorSpec:
    """The tensor that carries rank ``rank``'s own tree (its tensors are saved apart)."""
    blob = _ckpt.encode_tree({"tree": tree, "numpy": numpy_names})
    return _ckpt.TensorSpec(name=name(rank), dtype="U8", shape=(len(blob),), data=blob, copy_now=True)


def check(dtype: str, shape: Sequence[int], rank: int) -> None:
    """Raise unless ``(dtype, shape)`` is that of an encoded tree (a 1-D ``U8`` tensor)."""
    if dtype != "U8" or len(shape) != 1:
        raise UnsupportedError(f"tensor {name(rank)!r} is {dtype}, not the U8 of a rank's own state")


def decode(tensors: Mapping[str, Loaded], rank: int, framework: Optional[str] = None) -> Optional[Dict[str, object]]:
    """Rank ``rank``'s own state (``{"rng": ...}``) from loaded tensors, or None
    when the checkpoint holds none for it."""
    entry = tensors.get(name(rank))
    if entry is None:
        return None
    dtype, shape, buf = entry
    check(dtype, shape, rank)
    tree = _ckpt.decode_tree(bytes(memoryview(buf)))
    if not isinstance(tree, dict) or "tree" not in tree:
        raise UnsupportedError(f"tensor {name(rank)!r} does not hold a rank's own state")
    own = unflatten(tree["tree"], tensor_maker(tensors, set(tree.get("numpy", [])), framework))
    if not isinstance(own, dict):
        raise UnsupportedError(f"tensor {name(rank)!r} does not hold a rank's own state")
    return own
