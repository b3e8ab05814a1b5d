"""The steps of restoring one checkpoint in place, and of reading one as data.

:meth:`ckpt.Checkpointer.load_latest` restores a checkpoint in three steps:

1. :func:`plan`: read the checkpoint's metadata and tensor table (no tensor
   data), check them against the live objects, and choose a destination for
   every tensor (:class:`~ckpt._restore.plan.RestorePlan`). Nothing is written yet.
2. the load (``load_into`` of the native module) fills the destinations; the
   ranks then agree on the outcome (a checkpoint is intact only if every rank
   read its part intact);
3. :func:`apply`: hand the values to the live objects (``load_state_dict``,
   in-place copies) and restore this rank's random generators.

What passes from step 1 to step 3 is a :class:`Restore`.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple, cast

from ckpt import _ckpt
from ckpt._state import match as _match
from ckpt._state import own as _own
from ckpt._state import wrappers as _wrappers
from ckpt.errors import CheckpointError, InvalidInputError
from ckpt._restore.plan import RestorePlan, live_state, restore_into
from ckpt.rng import RNGState
from ckpt._state.tree import Tree, tensor_maker, unflatten

if TYPE_CHECKING:
    from ckpt._device.hoststage import HostStage

__all__ = ["Layout", "Restore", "Loaded", "plan", "apply", "read"]

#: ckpt's logger (where a rank says it has no ``per_rank`` state to restore).
LOG = logging.getLogger("ckpt")

@dataclass(frozen=True)
class Layout:
    """The ckpt package's part of a checkpoint's metadata, checked (:meth:`of`)."""

    #: The saved tree, one entry per key given to ``save``.
    state: Dict[str, Tree]
    #: Tensors saved as numpy arrays.
    numpy_names: Set[str]
    #: How many ranks saved their own state (None: written before per-rank state).
    ranks: Optional[int]

    @staticmethod
    def of(meta: object) -> "Layout":
        """The layout of metadata written by this package (its schema is
        ckpt-core's: ``_ckpt.read_meta``); raises :class:`~ckpt.UnsupportedError`
        for any other metadata or version."""
        state, numpy_names, ranks = _ckpt.read_meta(meta)
        return Layout(cast(Dict[str, Tree], state), set(numpy_names), ranks)

@dataclass
class Restore:
    """What :func:`plan` hands, through the load, to :func:`apply`."""

    step: int
    layout: Layout
    #: The destinations the load fills.
    plan: RestorePlan
    #: Each target's value, its tensors placed in or beside the live ones.
    values: Dict[str, object]
    #: Each target's live state as the plan walked it (:func:`~ckpt._restore.plan.live_state`).
    lives: Dict[str, object]
    #: This rank's own tensors (its tree and RNG), read in the same load into
    #: fresh buffers, as ``{name: (dtype, shape, buffer)}``; None when the
    #: checkpoint holds none for this rank or neither RNGs nor ``per_rank`` are restored.
    own: Optional[Dict[str, _own.Loaded]]
    #: The live mapping given as ``per_rank``, restored from this rank's own state.
    per_rank: Optional[object] = None

    @property
    def writes(self) -> bool:
        """Whether the load writes into memory (live tensors included)."""
        return bool(self.plan.requests)


def plan(
    native: _ckpt.Checkpointer,
    step: int,
    attempt: str,
    targets: List[Tuple[str, object]],
    rng: bool,
    stage: Optional[HostStage] = None,
    rank: Optional[int] = None,
) -> Restore:
    """Step 1: destinations for every tensor the targets (and, with ``rng``,
    this rank's own state) need, checked against the checkpoint's table.

    ``stage``: where CUDA tensors land on the host (:class:`ckpt._device.cuda.HostStage`);
    ``rank``: whose own state to read (default: the checkpointer's rank)."""
    meta, table = native.contents(step, attempt)
    layout = Layout.of(meta)
    rp = RestorePlan(table, layout.numpy_names, stage)
    values: Dict[str, object] = {}
    lives: Dict[str, object] = {}
    per_rank = next((t for k, t in targets if k == _own.PER_RANK), None)
    targets = [(k, t) for k, t in targets if k != _own.PER_RANK]
    if per_rank is not None and not isinstance(per_rank, MutableMapping):
        raise InvalidInputError(
            f"per_rank must be a dict to restore in place (its values are restored or replaced), not {type(per_rank).__name__}"
        )
    _match.entries(step, layout.state, [key for key, _ in targets])
    for key, target in targets:
        live, hint = live_state(target)
        lives[key] = live
        stored = _wrappers.fit(layout.state[key], target, live)
        _match.fits(key, stored, target, live)
        values[key] = rp.value(stored, live, key, hint)
    own: Optional[Dict[str, _own.Loaded]] = None
    rank = native.rank if rank is None else rank
    if (rng or per_rank is not None) and _own.name(rank) in table:
        own = {}
        for name, info in table.items():
            if _own.holds(name, rank):
                buf = bytearray(info.nbytes)
                if info.nbytes:
                    rp.read_whole(name, buf)
                own[name] = (info.dtype, tuple(info.global_shape), buf)
        dtype, shape, _ = own[_own.name(rank)]
        _own.check(dtype, shape, rank)
    elif rng and "rng" in layout.state:  # written before RNG states were kept per rank
        values.setdefault("rng", rp.value(layout.state["rng"], None, "rng"))
    rp.place()
    return Restore(step, layout, rp, values, lives, own, per_rank)


def apply(
    restore: Restore, state: Optional[MutableMapping[str, object]], targets: List[Tuple[str, object]], rank: int, rng: bool
) -> Optional[Dict[str, object]]:
    """Step 3, once every rank read its part intact: hand the values to the live
    objects (replacing, in ``state``, those that cannot be restored in place),
    and restore this rank's random generators and ``per_rank`` state.

    Returns this rank's per-rank state as stored (None when the checkpoint
    holds none for it, or none was asked for)."""
    values = restore.plan.finish(restore.values)
    for key, target in targets:
        if key == _own.PER_RANK:
            continue
        if not restore_into(target, values[key], key, restore.lives.get(key)):
            if state is not None and key in state:
                state[key] = values[key]
            else:
                raise InvalidInputError(
                    f"{key!r}: a {type(target).__name__} cannot be restored in place; pass it inside a "
                    "dict (load_latest(state)) or read it with read_latest()"
                )
    own = _own.decode(restore.own, rank) if restore.own is not None else None
    per_rank = None if own is None else own.get(_own.PER_RANK)
    if restore.per_rank is not None and per_rank is not None:
        restore_into(restore.per_rank, per_rank, _own.PER_RANK)  # (a mutable mapping: see plan)
    saved = "" if restore.layout.ranks is None else f" was saved by {restore.layout.ranks} rank(s) and"
    if rng and own is not None and "rng" in own:
        RNGState().load_state_dict(cast(Mapping[str, object], own["rng"]))
    elif rng and own is None and "rng" in values:  # written before RNG states were kept per rank
        if rank == 0:
            RNGState().load_state_dict(cast(Mapping[str, object], values["rng"]))
    elif rng and restore.layout.ranks is not None:
        warnings.warn(
            f"ckpt: the checkpoint of step {restore.step}{saved} holds no RNG state for rank {rank}; this rank "
            "keeps its current random generators",
            stacklevel=4,  # apply, Checkpointer._attempt, Checkpointer.load_latest/load, the caller
        )
    if restore.per_rank is not None and per_rank is None:
        LOG.warning(
            "ckpt: the checkpoint of step %d%s holds no per_rank state for rank %d; its per_rank dict stays as it was",
            restore.step, saved, rank,
        )
    return cast(Optional[Dict[str, object]], per_rank) if restore.per_rank is not None else None


#: A checkpoint as the native ``load``/``load_latest`` return it:
#: ``(step, attempt, {name: (dtype, shape, buffer)}, meta, skipped)``.
Loaded = Tuple[int, str, Dict[str, Tuple[str, List[int], _ckpt.TensorBuffer]], object, List[Tuple[int, str, CheckpointError]]]


def read(loaded: Loaded, framework: Optional[str], rank: int) -> Tuple[Dict[str, object], List[Tuple[int, str, CheckpointError]]]:
    """A loaded checkpoint as data: its state (with this rank's RNG state
    under ``"rng"``, as saved) and the damaged checkpoints skipped for it."""
    _, _, tensors, meta, skipped = loaded
    layout = Layout.of(meta)
    # (a dict: the layout's state is one)
    state = cast(Dict[str, object], unflatten(layout.state, tensor_maker(tensors, layout.numpy_names, framework)))
    own = _own.decode(tensors, rank, framework)
    if own:
        state.update(own)
    return state, list(skipped)

