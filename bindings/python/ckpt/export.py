"""Export one entry of a checkpoint for inference: :func:`export`."""

from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Optional, Union

from ckpt import _ckpt
from ckpt.errors import InvalidInputError

if TYPE_CHECKING:
    from ckpt._ckpt import _Exported

__all__ = ["export"]


def export(
    url: str,
    out: Union[str, "os.PathLike[str]"],
    entry: str = "model",
    *,
    format: str = "safetensors",  # noqa: A002 - matches the command's option
    dtype: Optional[str] = None,
    hf: bool = False,
    step: Optional[int] = None,
    max_shard_bytes: int = 5_000_000_000,
    config: object = None,
) -> _Exported:
    """Write the tensors of ``entry`` (e.g. ``"model"`` of ``cp.save(step, model=m)``)
    of the checkpoint under ``url`` (the newest, or ``step``) for inference.

    The tensors are unsharded, named by their state-dict keys (``fc.weight``),
    without ckpt's own state (RNG), so ``model.load_state_dict(safetensors.torch.load_file(out))``
    takes them as they are. ``format`` is ``"safetensors"`` (streamed) or ``"pt"``
    (a ``torch.load``-able dict); ``dtype`` (``"bf16"``, ``"f16"``, ``"f32"``) casts
    floating-point tensors. With ``hf=True``, ``out`` is a directory in Hugging
    Face's layout (``model.safetensors``, or shards of at most ``max_shard_bytes``
    with ``model.safetensors.index.json``); ``config`` (a ``transformers`` config,
    a dict, or the path of a ``config.json``) is written beside it, so
    ``from_pretrained(out)`` loads it. Nothing existing is overwritten.

    Returns ``{"step", "tensors", "bytes", "files"}``. An entry that does not
    exist raises :class:`~ckpt.NotFoundError` listing the entries that do.
    """
    if config is not None and not hf:
        raise InvalidInputError("config= is written only with hf=True")
    with tempfile.TemporaryDirectory(prefix="ckpt-export-") as tmp:
        config_path = _config_file(config, tmp)
        return _ckpt.export(
            url,
            os.fspath(out),
            entry,
            format=format,
            dtype=dtype,
            hf=hf,
            step=step,
            max_shard_bytes=max_shard_bytes,
            config=config_path,
        )


def _config_file(config: object, tmp: str) -> Optional[str]:
    """The path of a ``config.json`` holding ``config``, or None."""
    if config is None:
        return None
    if isinstance(config, (str, os.PathLike)):
        return os.fspath(config)
    path = os.path.join(tmp, "config.json")
    to_json_file = getattr(config, "to_json_file", None)
    if callable(to_json_file):
        to_json_file(path)  # a transformers PretrainedConfig
    elif isinstance(config, dict):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    else:
        raise InvalidInputError(
            f"config must be a transformers config, a dict or a path, not {type(config).__name__}"
        )
    return path
