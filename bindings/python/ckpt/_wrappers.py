"""A module saved through a wrapper and restored without it, or the other way
round.

A wrapper module prefixes every key of its state dict: ``torch.compile``'s
``OptimizedModule`` with ``_orig_mod.``, ``DistributedDataParallel`` and
``DataParallel`` with ``module.``, both where one wraps the other. A job
trained compiled and evaluated eagerly, or restarted with DDP after a run
without it, found its checkpoint's keys one prefix off its model's, and
``load_latest`` failed with torch's ``Error(s) in loading state_dict``
(missing and unexpected keys, all of them).

:func:`fit` renames the stored keys of a module's state dict to the live
module's where the two differ only by such leading prefixes: the names left
once those are taken off are the same on both sides. The checkpoint is not
changed, and the restore then goes as any other (in place, shapes and dtypes
checked against the live tensors). Keys that differ otherwise are left as
they are, for ``load_state_dict`` to report as before.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Optional

from .tree import TAG

__all__ = ["PREFIXES", "fit"]

#: Leading key prefixes that wrapper modules add: torch.compile's, then DDP's
#: and DataParallel's.
PREFIXES = ("_orig_mod.", "module.")


def fit(stored: Any, target: Any, state: Mapping[str, Any]) -> Any:
    """``stored`` (the saved tree of one entry) with its keys renamed to
    those of ``state`` (``target.state_dict()``) where ``target`` is a module
    whose state dict differs from it by wrapper prefixes alone
    (:data:`PREFIXES`); else ``stored`` itself."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(target, torch.nn.Module) or not isinstance(state, Mapping):
        return stored
    if type(stored) is not dict or stored.get(TAG) != "odict" or type(stored.get("items")) is not dict:
        return stored
    have = list(stored["items"])
    live = list(state)
    if not have or not live or set(have) == set(live) or not all(isinstance(k, str) for k in have + live):
        return stored
    old, new = _lead(have), _lead(live)
    if old == new or {k[len(old):] for k in have} != {k[len(new):] for k in live}:
        return stored

    def rename(key: str) -> str:
        return new + key[len(old):]

    out = dict(stored)
    out["items"] = {rename(k): v for k, v in stored["items"].items()}
    out["metadata"] = _metadata(stored.get("metadata"), old, new)
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


def _metadata(meta: Any, old: str, new: str) -> Any:
    """A state dict's ``_metadata`` (module versions by module prefix: ``""``
    for the root, ``"_orig_mod.0"``, ...) renamed as its keys were: entries of
    the wrappers left behind are dropped (``load_state_dict`` looks up only
    the live modules' prefixes)."""
    if type(meta) is not dict:
        return meta
    odict = meta.get(TAG) == "odict"
    items = meta.get("items") if odict else meta
    if type(items) is not dict:
        return meta

    def rename(prefix: Any) -> Optional[str]:
        if not isinstance(prefix, str):
            return None
        full = prefix + "." if prefix else ""
        if not full.startswith(old):
            return None
        return (new + full[len(old):]).removesuffix(".")

    renamed: Dict[Any, Any] = {}
    for k, v in items.items():
        r = rename(k)
        if r is not None:
            renamed[r] = v
    return {**meta, "items": renamed} if odict else renamed
