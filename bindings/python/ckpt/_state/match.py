"""What a restore is asked for, checked against the checkpoint before
anything is read or written.

A restore that asks for what the checkpoint does not hold is the caller's
mistake, not damage: an entry name the save did not use (``optimizr=opt``,
or an entry added to the job since that save), a module whose state dict has
other keys than the stored one (a layer added or removed, a new head), an
optimizer with other parameter groups. Taken for damage, such a mismatch made
``load_latest`` skip every checkpoint and start the job afresh, whose saves
then took the old steps' places and retention removed the old checkpoints.
Left to ``load_state_dict``, it raised torch's ``RuntimeError`` or
``ValueError`` after the other tensors had been written in place.

So :func:`entries` and :func:`fits` raise :class:`~ckpt.InvalidInputError`
first, on every rank (each rank checks the same checkpoint; the ranks then
agree on the outcome), and no checkpoint is passed over for it.

A module is checked only where torch's strict loading is known to refuse
what differs: no class in it loads its state its own way (a
``_load_from_state_dict`` or ``load_state_dict`` not from torch, or torch's
own version fix-ups with no stored module versions to go by) and no load
hook outside torch is registered on it (a hook may rename or drop keys). Every
other module gets the stored state dict as before, and its own
``load_state_dict`` decides. To load part of a checkpoint into a changed
model, read it (``read_latest()``) and call ``load_state_dict(...,
strict=False)``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Dict, Iterable, Optional, Sequence, Union

from ckpt.errors import InvalidInputError
from ckpt._state.tree import ODICT, TAG, Tree

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.optim import Optimizer

__all__ = ["entries", "fits"]

#: Keys named in a message, at most, of each kind.
_SHOWN = 8


def entries(step: int, stored: Mapping[str, object], asked: Sequence[str]) -> None:
    """Raise unless the checkpoint of ``step`` (its entries ``stored``) has
    every entry of ``asked``."""
    missing = [k for k in asked if k not in stored]
    if missing:
        raise InvalidInputError(
            f"the checkpoint of step {step} has no entry {_names(missing)} (it has {_names(sorted(stored)) or 'none'}): "
            "restore the entries under the names they were saved with; nothing of it was restored"
        )


def fits(key: str, stored: Tree, target: object, live: object) -> None:
    """Raise where ``target``'s ``load_state_dict`` would refuse ``stored``
    (the saved tree of entry ``key``, its keys already fitted to the live
    wrappers) for the keys of a module or the parameter groups of an
    optimizer; ``live`` is ``target.state_dict()``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if isinstance(target, torch.nn.Module):
        _module(torch, key, stored, target, live)
    elif isinstance(target, torch.optim.Optimizer):
        _optimizer(torch, key, stored, target, live)


def _module(torch: ModuleType, key: str, stored: Tree, target: Module, live: object) -> None:
    items = _items(stored)
    if items is None or not isinstance(live, Mapping):
        return
    missing = [k for k in live if k not in items]
    unexpected = [k for k in items if k not in live]
    versions = type(stored) is dict and stored.get(TAG) == ODICT and _items(stored.get("metadata")) is not None
    if not (missing or unexpected) or not _strict(torch, target, versions):
        return
    said = []
    if missing:
        said.append(f"missing {len(missing)} of this module's keys ({_names(missing)})")
    if unexpected:
        said.append(f"{len(unexpected)} keys this module does not have ({_names(unexpected)})")
    raise InvalidInputError(
        f"{key!r}: the checkpoint's state dict does not fit this {type(target).__name__}: "
        f"{'; '.join(said)}; nothing of it was restored (to load part of it, read it with read_latest() "
        "and call load_state_dict(..., strict=False))"
    )


def _optimizer(torch: ModuleType, key: str, stored: Tree, target: Optimizer, live: object) -> None:
    if type(target).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return  # (an optimizer that loads its own way)
    items = _items(stored)
    groups = items.get("param_groups") if items is not None else None
    if not isinstance(groups, list) or not isinstance(live, Mapping):
        return
    have = [_count(g) for g in groups]
    want = [len(g["params"]) for g in live.get("param_groups", [])]
    if None in have or have == want:
        return
    raise InvalidInputError(
        f"{key!r}: the checkpoint's optimizer state has {_groups(have)}, this {type(target).__name__} "
        f"{_groups(want)}; nothing of it was restored (make the optimizer over the same parameters, grouped as at the save)"
    )


def _strict(torch: ModuleType, module: Module, versions: bool) -> bool:
    """Whether torch's strict loading decides ``module``'s keys alone: no
    class in it loads its own way and no load hook outside torch is on it.
    Torch's own classes that do (normalization layers) take missing keys
    only for state dicts older than their module version: with the stored
    versions at hand (``versions``) they are strict too."""
    base = torch.nn.Module
    if not _torchs(type(module).load_state_dict) and type(module).load_state_dict is not base.load_state_dict:
        return False
    for m in module.modules():
        own = type(m)._load_from_state_dict
        if own is not base._load_from_state_dict and not (versions and _torchs(own)):
            return False
        for hooks in (getattr(m, "_load_state_dict_pre_hooks", None), getattr(m, "_load_state_dict_post_hooks", None)):
            if hooks and not all(_torchs(getattr(h, "hook", h)) for h in hooks.values()):
                return False
    return True


def _torchs(fn: object) -> bool:
    """Whether ``fn`` is defined in torch itself."""
    mod = getattr(fn, "__module__", None) or ""
    return mod == "torch" or mod.startswith("torch.")


def _items(stored: Tree) -> Optional[Dict[Union[str, int], Tree]]:
    """The mapping of a stored tree's dict (an ordered dict's items), if it is one."""
    if type(stored) is not dict:
        return None
    if stored.get(TAG) == ODICT:
        items = stored.get("items")
        return items if type(items) is dict else None
    return None if TAG in stored else stored


def _count(group: Tree) -> Optional[int]:
    items = _items(group)
    params = items.get("params") if items is not None else None
    return len(params) if isinstance(params, (list, tuple)) else None


def _groups(counts: Sequence[Optional[int]]) -> str:
    n = len(counts)
    return f"{n} parameter group{'s' if n != 1 else ''} of {', '.join(str(c) for c in counts) or 'no'} parameters"


def _names(keys: Iterable[object]) -> str:
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")
