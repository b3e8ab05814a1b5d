"""A fresh start's first save, readied ahead of it: page-locked memory, and
a walk of the state (``Checkpointer._rehearse``, once the state is whole).

A new host slab is mapped and page-locked before its first copies: 0.36-0.46 s
for 4 GiB on an H100 host, in the stall of an eager first save. Where the
state's size is known ahead, ``load_latest`` on a fresh start reserves the
first save's slab in the background (:meth:`ckpt._slabs.SlabPool.reserve`):

- with a ``staging_budget``, half of it (the budget is twice the state);
- without one, the CUDA bytes of the state it was given, counted once each of
  its optimizers has stepped (their state exists only from then on), or at
  once when it was given no optimizer. The count is one walk of the state
  (about a millisecond for a GPT's 1,169 tensors), once per process.

Either way the reservation holds the state and room for the slab's alignment,
so that the first save lays it out anew for its own tensors instead of
mapping and locking more. It is locked in one piece, during which the CUDA
driver takes no other call of the process (0.135 s for 4 GiB): once, among a
job's first steps, in place of the first save's lock.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from .dtensor import local_tensor

__all__ = ["for_budget", "for_state", "cuda_bytes", "optimizers_in", "after_first_step"]


def for_budget(budget: int) -> int:
    """Bytes a fresh start reserves out of a ``staging_budget`` set to twice
    the state: half of it and room for the slab's alignment, which puts each
    tensor of 1 MiB or more on a page of its own (a page per tensor: 0.1 % of
    a GPT's 4 GiB of 1,169 tensors). Exactly half would leave the first save
    without room, mapping and locking its slab in its stall; the reservation
    stays within the budget."""
    half = budget // 2
    return min(budget, half + max(half // 64, 4 << 20))


def for_state(nbytes: int, count: int) -> int:
    """Bytes to reserve for ``count`` tensors of ``nbytes`` in all: the bytes
    and room for the alignment (a page per tensor at most), within the
    default budget of twice the state."""
    return nbytes + min(nbytes, max(nbytes // 64, 4096 * (count + 16)))


def _items(obj: Any) -> Optional[Iterable[Any]]:
    """A mapping's values, a list's or tuple's items; None for anything else."""
    if isinstance(obj, Mapping):
        return obj.values()
    if isinstance(obj, (list, tuple)):
        return obj
    return None


def cuda_bytes(objs: List[Any], device: Any, depth: int = 6) -> Tuple[int, int]:
    """``(bytes, count)`` of the distinct tensors on ``device`` in ``objs``:
    modules' parameters and buffers, optimizers' state, tensors (a DTensor's
    local shard), mappings and sequences of them, and what any other object's
    ``state_dict()`` holds."""
    torch = sys.modules["torch"]
    seen: Set[Tuple[int, int]] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        t = local_tensor(t)
        if not isinstance(t, torch.Tensor) or t.device != device:
            return
        key = (t.data_ptr(), t.nbytes)
        if key not in seen:
            seen.add(key)
            total += t.nbytes

    def visit(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            add(obj)
        elif isinstance(obj, torch.nn.Module):
            for t in obj.parameters():
                add(t)
            for t in obj.buffers():
                add(t)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                visit(state, 1)
        elif depth > 0:
            inner = _items(obj)
            if inner is None and callable(getattr(obj, "state_dict", None)):
                inner = [obj.state_dict()]
            for v in inner or ():
                visit(v, depth - 1)

    for obj in objs:
        visit(obj, depth)
    return total, len(seen)


def optimizers_in(objs: List[Any], depth: int = 3) -> List[Any]:
    """The optimizers among ``objs``: themselves, in mappings and sequences,
    and those other objects with a ``state_dict`` hold as a save's lazy mode
    finds them (DCP's ``AppState``: ``ckpt.torch._held``)."""
    torch = sys.modules["torch"]
    from .torch import _held

    found: List[Any] = []

    def visit(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.optim.Optimizer):
            if all(o is not obj for o in found):
                found.append(obj)
        elif not isinstance(obj, (torch.Tensor, torch.nn.Module)) and depth > 0:
            inner = _items(obj)
            if inner is None and callable(getattr(obj, "state_dict", None)):
                inner = _held(obj)[1]
            for v in inner or ():
                visit(v, depth - 1)

    for obj in objs:
        visit(obj, depth)
    return found


def after_first_step(optimizers: List[Any], then: Callable[[], None]) -> Callable[[], None]:
    """Call ``then`` once, when every one of ``optimizers`` has stepped (a
    step post-hook each); returns what removes the hooks.

    A hook does not remove itself: it runs while the optimizer iterates over
    its post-hooks, and removing one then failed the step (``RuntimeError:
    OrderedDict mutated during iteration``) wherever another post-hook came
    after it (a second checkpointer's, the user's). Once it has fired it does
    nothing; the checkpointer takes the hooks off at its next save or close."""
    handles: Dict[int, Any] = {}
    waiting = {id(opt) for opt in optimizers}

    def remove() -> None:
        for h in handles.values():
            h.remove()
        handles.clear()

    def hook(opt: Any, _args: Any, _kwargs: Any) -> None:
        if id(opt) not in waiting:
            return
        waiting.discard(id(opt))
        if not waiting:
            then()

    for opt in optimizers:
        handles[id(opt)] = opt.register_step_post_hook(hook)
    return remove
