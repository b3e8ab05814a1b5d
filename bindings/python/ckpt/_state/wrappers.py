"""A module saved through wrappers and restored without them, or the other
way round.

A wrapper module prefixes the keys of its state dict: ``torch.compile``'s
``OptimizedModule`` with ``_orig_mod.``, ``DistributedDataParallel`` and
``DataParallel`` with ``module.``, in any nesting; a block compiled on its
own (regional compilation, one ``torch.compile`` per transformer block) puts
``_orig_mod`` inside the keys (``layers.0._orig_mod.attn.weight``). A job
trained compiled and evaluated eagerly, or restarted with DDP after a run
without it, found its checkpoint's keys off its model's, and
``load_latest`` failed with torch's ``Error(s) in loading state_dict``.

:func:`fit` renames the stored keys of a module's state dict to the live
module's where both come to the same names once the wrappers' parts are
taken off (the leading prefixes that every key has, and every ``_orig_mod``
segment), one to one. The checkpoint is not changed, and the restore then
goes as any other (in place, shapes and dtypes checked against the live
tensors). Keys that differ otherwise are left as they are, for
``load_state_dict`` to report as before.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Dict, Iterable, List, Optional, Union, cast

from ckpt._state.tree import ODICT, TAG, Tree

__all__ = ["PREFIXES", "fit"]

#: Leading key prefixes that wrapper modules add: torch.compile's, then DDP's
#: and DataParallel's.
PREFIXES = ("_orig_mod.", "module.")
#: The key segment of a module compiled on its own.
_COMPILED = "_orig_mod"


def fit(stored: Tree, target: object, state: object) -> Tree:
    """``stored`` (the saved tree of one entry) with its keys renamed to
    those of ``state`` (``target.state_dict()``) where ``target`` is a module
    and the two differ by wrappers alone (see the module docs); else
    ``stored`` itself."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(target, torch.nn.Module) or not isinstance(state, Mapping):
        return stored
    if type(stored) is not dict or stored.get(TAG) != ODICT or type(stored.get("items")) is not dict:
        return stored
    items = cast(Dict[Union[str, int], Tree], stored["items"])
    keys: List[object] = list(items)
    names: List[object] = list(state)
    if not keys or not names or set(keys) == set(names) or not all(isinstance(k, str) for k in keys + names):
        return stored
    have, live = cast(List[str], keys), cast(List[str], names)
    old, new = _lead(have), _lead(live)
    canon = {k: _canon(k[len(old):]) for k in have}
    to_live = {_canon(k[len(new):]): k for k in live}
    if len(to_live) != len(live) or len(set(canon.values())) != len(have) or set(canon.values()) != set(to_live):
        return stored
    out = dict(stored)
    out["items"] = {to_live[canon[cast(str, k)]]: v for k, v in items.items()}
    out["metadata"] = _metadata(stored.get("metadata"), old, new, getattr(state, "_metadata", None))
    return out


def _lead(keys: Iterable[str]) -> str:
    """The wrapper prefixes every one of ``keys`` starts with, in order."""
    keys = list(keys)
    lead = ""
    while keys:
        for p in PREFIXES:
            if all(k.startswith(lead + p) for k in keys):
                lead += p
                break
        else:
            break
    return lead


def _canon(path: str) -> str:
    """``path`` without its ``_orig_mod`` segments."""
    if _COMPILED not in path:
        return path
    return ".".join(s for s in path.split(".") if s != _COMPILED)


def _module(prefix: object, lead: str) -> Optional[str]:
    """A module's prefix in a state dict's ``_metadata`` (``""`` for the
    root) without the wrappers' parts; None for a wrapper above ``lead``."""
    if not isinstance(prefix, str):
        return None
    full = prefix + "." if prefix else ""
    if not full.startswith(lead):
        return None
    return _canon(full[len(lead):].removesuffix("."))


def _metadata(meta: Tree, old: str, new: str, live: object) -> Tree:
    """A stored state dict's ``_metadata`` (module versions by module
    prefix) renamed to the live modules' prefixes (those of ``live``, the
    live state dict's, where it has one; else the names without wrappers).
    Of a wrapper and the module it wraps, which come to one name, the
    module's entry is kept."""
    if type(meta) is not dict:
        return meta
    odict = meta.get(TAG) == ODICT
    items = meta.get("items") if odict else meta
    if type(items) is not dict:
        return meta
    by_name: Dict[Union[str, int], Tree] = {}
    for k in sorted((k for k in items if isinstance(k, str)), key=len):  # (the wrapped module last)
        name = _module(k, old)
        if name is not None:
            by_name[name] = items[k]
    if isinstance(live, Mapping):
        renamed: Dict[Union[str, int], Tree] = {}
        for k in live:
            name = _module(k, new)
            if name is not None and name in by_name:
                renamed[k] = by_name[name]
    else:
        renamed = by_name
    return {**meta, "items": renamed} if odict else renamed
