"""Random number generator state as plain data (no pickle)."""

from __future__ import annotations

import random
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple, cast

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["RNGState"]


class RNGState:
    """The global random generators of this process, as a checkpointable object.

    ``state_dict()`` captures Python's :mod:`random`, numpy's legacy global
    generator (when numpy is imported), PyTorch's CPU generator (when torch is
    imported) and every CUDA device's generator (when CUDA is initialised).
    ``load_state_dict()`` restores whichever of them the state holds.

    A :class:`ckpt.Checkpointer` saves one under the key ``"rng"`` unless it was
    opened with ``rng=False``.
    """

    def state_dict(self) -> Dict[str, object]:
        """The current states."""
        state: Dict[str, object] = {"python": random.getstate()}
        np = sys.modules.get("numpy")
        if np is not None:
            state["numpy"] = np.random.get_state()
        torch = sys.modules.get("torch")
        if torch is not None:
            state["torch"] = torch.get_rng_state()
            # (initialised implies available; is_available asks the driver each time)
            if torch.cuda.is_initialized():
                state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore the generators found in ``state``."""
        if "python" in state:
            version, internal, gauss = cast(Tuple[int, Sequence[int], Optional[float]], state["python"])
            random.setstate((version, tuple(internal), gauss))
        if "numpy" in state:
            import numpy as np

            np.random.set_state(cast(Tuple[str, "np.ndarray[Tuple[int], np.dtype[np.uint32]]", int, int, float], state["numpy"]))
        if "torch" in state or "cuda" in state:
            import torch

            if "torch" in state:
                torch.set_rng_state(_as_byte_tensor(torch, state["torch"]))
            if "cuda" in state and torch.cuda.is_available():
                states = [_as_byte_tensor(torch, s) for s in cast(Sequence[object], state["cuda"])]
                torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])


def _as_byte_tensor(torch: ModuleType, value: object) -> Tensor:
    if isinstance(value, torch.Tensor):
        return cast("Tensor", value.to(dtype=torch.uint8, device="cpu"))
    return cast("Tensor", torch.as_tensor(value, dtype=torch.uint8))
