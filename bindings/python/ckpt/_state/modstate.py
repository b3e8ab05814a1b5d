"""A module's state dict, made in bulk while its module tree is as before.

``nn.Module.state_dict()`` is a Python recursion over every submodule: a
frame, a metadata dict, two hook loops and a ``_save_to_state_dict`` call
each. A model of many small modules (a mixture of experts: 16 layers of 64
experts is 4,161 modules and 3,120 parameters) spends more time there than
ckpt spends on the rest of a lazy save's walk, in the stall.

:func:`state_dict` returns what ``module.state_dict()`` returns, the same
keys, values (each parameter and persistent buffer detached), order and
``_metadata``, without the recursion where it can. The first call walks the
tree as ``state_dict`` does and records it (:class:`_Tree`): the modules in
the recursion's order, their children, parameters and buffers, which of
them are stored, and each module's version. A later call checks, with a
handful of calls that each run over all modules in C (``map`` of attribute
getters, list comparisons), that the tree is the one recorded, then makes
the state dict from the live parameters and buffers:

- the same module objects under the same names, of the same classes;
- the same parameter and buffer names, each a tensor or None as before
  (the tensors themselves are read anew and detached, whatever their data
  is now), the same non-persistent buffer names, the same ``_version``;
- no state dict hooks on any module, no override of ``state_dict``,
  ``_save_to_state_dict`` or ``get_extra_state`` on its class or the
  instance (those run their own code: the module's own ``state_dict()``
  is called).

Anything else calls ``module.state_dict()`` and records the tree again. A
record holds its modules weakly (a module it lists that has gone, a child
replaced, makes the tree another), and is dropped with the root module: it
keeps no module, and so no parameter, alive.
"""

from __future__ import annotations

import operator
import weakref
from collections import OrderedDict
from itertools import chain, repeat
from typing import Dict, FrozenSet, List, Optional, Sequence, Set, Tuple, cast

import torch

__all__ = ["state_dict", "loaded_already"]

_Module = torch.nn.Module
_PARAMS = operator.attrgetter("_parameters")
_BUFFERS = operator.attrgetter("_buffers")
_CHILDREN = operator.attrgetter("_modules")
_TRANSIENT = operator.attrgetter("_non_persistent_buffers_set")
_VERSION = operator.attrgetter("_version")
_HOOKS = operator.attrgetter("_state_dict_pre_hooks", "_state_dict_hooks")
_DETACH = operator.methodcaller("detach")
_DEREF = weakref.ref.__call__
_NONE: FrozenSet[str] = frozenset()
_VALUES = dict.values
_KEYS = dict.keys
#: What a module's own ``__dict__`` may not hold: its state dict would run them.
_OWN = ("state_dict", "_save_to_state_dict", "get_extra_state")
_LOAD_HOOKS = operator.attrgetter("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
#: The same for ``load_state_dict``.
_OWN_LOAD = ("load_state_dict", "_load_from_state_dict", "set_extra_state")

#: Trees recorded, by root module.
_trees: "weakref.WeakKeyDictionary[_Module, _Tree]" = weakref.WeakKeyDictionary()


def state_dict(module: _Module) -> Dict[str, torch.Tensor]:
    """``module.state_dict()`` (see the module docs)."""
    tree = _trees.get(module)
    if tree is not None:
        out = tree.make()
        if out is not None:
            return out
    out = module.state_dict()
    try:
        _trees[module] = _Tree(module)
    except TypeError:  # (not weakly referenceable: a module with __slots__)
        pass
    return out


def loaded_already(module: _Module, value: object, live: object) -> bool:
    """Whether ``module.load_state_dict(value)`` would change nothing, so a
    restore need not call it: ``value`` holds, key for key, the very tensors
    of ``live`` (the module's state dict, which the restore filled in place:
    torch would copy each onto itself), and no module of the tree runs code
    of its own when loading (no load hooks; ``load_state_dict``,
    ``_load_from_state_dict`` and ``set_extra_state`` are ``nn.Module``'s).
    That call recurses over every submodule in Python and filters the state
    dict once per child: most of a restore's time for a model of thousands
    of small modules."""
    if not isinstance(value, dict) or not isinstance(live, dict) or len(value) != len(live):
        return False
    if list(value) != list(live) or not all(map(operator.is_, value.values(), live.values())):
        return False
    mods = list(module.modules())
    if not all(map(_loads_plainly, set(map(type, mods)))):
        return False
    if any(map(len, chain.from_iterable(map(_LOAD_HOOKS, mods)))):
        return False
    own = [vars(m) for m in mods]
    return not any(any(map(operator.contains, own, repeat(name))) for name in _OWN_LOAD)


def _loads_plainly(cls: type) -> bool:
    """Whether ``cls`` loads its state dict as ``nn.Module`` does."""
    return (
        getattr(cls, "load_state_dict", None) is _Module.load_state_dict
        and getattr(cls, "_load_from_state_dict", None) is _Module._load_from_state_dict
        and getattr(cls, "set_extra_state", _Module.set_extra_state) is _Module.set_extra_state
    )


def _plain(cls: type) -> bool:
    """Whether ``cls`` makes its state dict as ``nn.Module`` does."""
    return (
        getattr(cls, "state_dict", None) is _Module.state_dict
        and getattr(cls, "_save_to_state_dict", None) is _Module._save_to_state_dict
        and getattr(cls, "get_extra_state", _Module.get_extra_state) is _Module.get_extra_state
    )


class _Tree:
    """One module tree as its state dict walks it (see the module docs)."""

    __slots__ = (
        "refs", "types", "classes", "child_ids", "child_keys", "tensor_ids", "tensor_keys", "transient",
        "versions", "taken", "keys", "meta_keys", "plain",
    )

    def __init__(self, root: _Module) -> None:
        mods: List[_Module] = []
        prefixes: List[str] = []
        _preorder(root, "", mods, prefixes)
        #: The modules in the recursion's order, weakly.
        self.refs = [weakref.ref(m) for m in mods]
        #: The ``_metadata`` keys: each module's prefix, less its dot.
        self.meta_keys = [p[:-1] for p in prefixes]
        self.types = list(map(type, mods))
        self.classes: Set[type] = set(self.types)
        self.child_ids, self.child_keys = _children(mods)
        tensors, self.tensor_ids, self.tensor_keys = _tensors(mods)
        # (A shared empty set for the modules without non-persistent buffers,
        # nearly all: no object per module for the collector to track.)
        self.transient = [frozenset(s) if s else _NONE for s in map(_TRANSIENT, mods)]
        self.versions = list(map(_VERSION, mods))
        # Which of the modules' tensors the state dict holds, under which key.
        self.taken: List[int] = []
        self.keys: List[str] = []
        i = 0
        for m, prefix in zip(mods, prefixes):
            skip = m._non_persistent_buffers_set
            for name, p in m._parameters.items():
                if p is not None:
                    self.taken.append(i)
                    self.keys.append(prefix + name)
                i += 1
            for name, b in m._buffers.items():
                if b is not None and name not in skip:
                    self.taken.append(i)
                    self.keys.append(prefix + name)
                i += 1
        assert i == len(tensors)
        self.plain = self._plain(mods)

    def _plain(self, mods: List[_Module]) -> bool:
        """No module of the tree runs code of its own in its state dict."""
        if not all(map(_plain, self.classes)):
            return False
        if any(map(len, chain.from_iterable(map(_HOOKS, mods)))):
            return False
        own = [vars(m) for m in mods]
        return not any(any(map(operator.contains, own, repeat(name))) for name in _OWN)

    def make(self) -> Optional[Dict[str, torch.Tensor]]:
        """The root's state dict if the tree is as recorded and plain; else None."""
        if not self.plain:
            return None
        refs: List[Optional[_Module]] = list(map(_DEREF, self.refs))
        if None in refs:  # (a module of the tree has gone: a child was replaced)
            return None
        mods = cast(List[_Module], refs)
        if list(map(type, mods)) != self.types or not self._plain(mods):
            return None
        ids, keys = _children(mods)
        if ids != self.child_ids or keys != self.child_keys:
            return None
        tensors, ids, keys = _tensors(mods)
        if ids != self.tensor_ids or keys != self.tensor_keys:
            return None
        if list(map(_TRANSIENT, mods)) != self.transient or list(map(_VERSION, mods)) != self.versions:
            return None
        taken = self.taken
        if len(taken) == len(tensors):
            chosen: Sequence[Optional[torch.Tensor]] = tensors
        elif len(taken) == 1:
            chosen = [tensors[taken[0]]]
        elif taken:
            chosen = operator.itemgetter(*taken)(tensors)
        else:
            chosen = ()
        out: OrderedDict[str, torch.Tensor] = OrderedDict(zip(self.keys, map(_DETACH, chosen)))
        setattr(out, "_metadata", OrderedDict(zip(self.meta_keys, map(dict.fromkeys, repeat(("version",)), self.versions))))
        return out


def _preorder(m: _Module, prefix: str, mods: List[_Module], prefixes: List[str]) -> None:
    """The modules in the order ``state_dict`` visits them, with their key prefixes."""
    mods.append(m)
    prefixes.append(prefix)
    for name, child in m._modules.items():
        if child is not None:
            _preorder(child, prefix + name + ".", mods, prefixes)


def _children(mods: List[_Module]) -> Tuple[List[int], List[str]]:
    """The ids and names of every module's children (None included), in order."""
    dicts = list(map(_CHILDREN, mods))
    return list(map(id, chain.from_iterable(map(_VALUES, dicts)))), list(chain.from_iterable(map(_KEYS, dicts)))


def _tensors(mods: List[_Module]) -> Tuple[List[Optional[torch.Tensor]], List[int], List[str]]:
    """Every module's parameters then buffers (None included), in order, their ids and names."""
    dicts = list(chain.from_iterable(zip(map(_PARAMS, mods), map(_BUFFERS, mods))))
    tensors = list(chain.from_iterable(map(_VALUES, dicts)))
    return tensors, list(map(id, tensors)), list(chain.from_iterable(map(_KEYS, dicts)))
