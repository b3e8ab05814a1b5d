"""DCP's ``Metadata`` as plain data, and back: what :mod:`ckpt.dcp` stores in a checkpoint.

A checkpoint written through :class:`ckpt.dcp.StorageWriter` has the state

* ``"dcp"``: a ``uint8`` tensor named :data:`METADATA` holding DCP's
  metadata as plain data (:func:`encode`, in the engine's encoding of plain
  data, ``_ckpt.encode_tree``): per tensor its dtype (ckpt's name), global
  size, chunks (offsets and sizes) and properties; the names of the byte
  items; the planner's data and the storage meta. A tensor, written by rank 0
  alone, since only rank 0 learns the metadata (at DCP's ``finish``), after
  every rank handed its tensors and the state to the engine;
* ``"tensors"``: ``{fqn: TensorRef(fqn)}``, the tensors (global ones: a
  sharded tensor's pieces are assembled by a plain ckpt read);
* ``"bytes"``: ``{fqn: TensorRef(fqn)}``, DCP's byte items, as ``uint8`` tensors.

Every rank saves the same state (the engine insists): the coordinator names
every item of the global plan (:func:`names`) in each rank's plan.
Everything is ints, strings, lists and dicts, and the load rebuilds DCP's
dataclasses from it, with no pickle. The planner's data (the default
planner's: each flattened key's path in the state dict, tuples of strings
and ints) must be plain data too.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Set

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint import planner as _planner

from ckpt import _ckpt
from ckpt._ckpt import TensorRef
from ckpt._state.tensors import dtype_name, torch_dtype
from ckpt.errors import CorruptError, UnsupportedError

__all__ = ["FORMAT", "METADATA", "Names", "check", "names", "tree", "pack", "unpack", "encode", "decode"]

#: The ``"format"`` of the encoded metadata, and its version.
FORMAT = "ckpt.dcp"
VERSION = 1
#: The name of the tensor holding DCP's metadata.
METADATA = "__dcp_metadata__"

#: The names of a save's items: ``{"tensors": [fqn, ...], "bytes": [fqn, ...]}``.
Names = Dict[str, List[str]]

_MEMORY_FORMATS = {
    "contiguous": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "preserve": torch.preserve_format,
}
_MEMORY_NAMES = {v: k for k, v in _MEMORY_FORMATS.items()}

#: Deepest nesting of the planner's data accepted.
_DEPTH = 64


def _plain(value: object, where: str, depth: int = 0) -> None:
    """Refuse anything the checkpoint's plain data cannot hold exactly."""
    if depth > _DEPTH:
        raise UnsupportedError(f"{where}: nested deeper than {_DEPTH}")
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _plain(v, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise UnsupportedError(f"{where}: key {k!r} is not a str or int")
            _plain(v, f"{where}[{k!r}]", depth + 1)
        return
    raise UnsupportedError(f"{where}: {type(value).__name__} is not plain data (ckpt stores DCP's metadata without pickle)")


def encode(md: _md.Metadata) -> Dict[str, Any]:
    """DCP's metadata as plain data (``storage_data`` is not kept: ckpt's
    tensors are named by their fqns)."""
    tensors: Dict[str, Any] = {}
    byte_items: List[str] = []
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, _md.BytesStorageMetadata):
            byte_items.append(fqn)
            continue
        if not isinstance(m, _md.TensorStorageMetadata):
            raise UnsupportedError(f"{fqn}: DCP storage metadata {type(m).__name__} is not supported")
        p = m.properties
        if p.layout != torch.strided:
            raise UnsupportedError(f"{fqn}: tensor layout {p.layout} is not supported (strided is)")
        tensors[fqn] = {
            "dtype": dtype_name(p.dtype),
            "size": [int(s) for s in m.size],
            "chunks": [[[int(o) for o in c.offsets], [int(s) for s in c.sizes]] for c in m.chunks],
            "requires_grad": bool(p.requires_grad),
            "pin_memory": bool(p.pin_memory),
            "memory_format": _MEMORY_NAMES.get(p.memory_format, "contiguous"),
        }
    _plain(md.planner_data, "DCP planner_data")
    sm = md.storage_meta
    storage_meta = None
    if sm is not None:
        cid = sm.checkpoint_id
        storage_meta = {
            "checkpoint_id": None if cid is None else str(cid),
            "save_id": sm.save_id,
            "modules": [str(m) for m in sm.modules],
        }
    return {
        "format": FORMAT,
        "version": VERSION,
        "dcp_version": md.version,
        "tensors": tensors,
        "bytes": byte_items,
        "planner_data": md.planner_data,
        "storage_meta": storage_meta,
    }


def names(plans: Sequence[_planner.SavePlan]) -> Names:
    """The names of every item of a global plan, tensors and byte items apart."""
    tensors: Set[str] = set()
    byte_items: Set[str] = set()
    for plan in plans:
        for item in plan.items:
            (byte_items if item.type == _planner.WriteItemType.BYTE_IO else tensors).add(item.index.fqn)
    clash = tensors & byte_items
    if clash or METADATA in tensors | byte_items:
        raise UnsupportedError(f"DCP items named both as tensors and bytes, or named {METADATA!r}: {sorted(clash)[:5]}")
    return {"tensors": sorted(tensors), "bytes": sorted(byte_items)}


def check(plans: Sequence[_planner.SavePlan]) -> None:
    """Refuse, before anything is written, what :func:`encode` would refuse
    of the metadata these plans make: a dtype or layout ckpt does not store,
    planner data that is not plain."""
    for plan in plans:
        _plain(plan.planner_data, "DCP planner_data")
        for item in plan.items:
            td = item.tensor_data
            if td is None:
                continue
            dtype_name(td.properties.dtype)
            if td.properties.layout != torch.strided:
                raise UnsupportedError(f"{item.index.fqn}: tensor layout {td.properties.layout} is not supported (strided is)")


def tree(names: Names) -> Dict[str, Any]:
    """The checkpoint's state: the places of the metadata, the tensors and the byte items."""
    return {
        "dcp": TensorRef(METADATA),
        "tensors": {fqn: TensorRef(fqn) for fqn in names["tensors"]},
        "bytes": {fqn: TensorRef(fqn) for fqn in names["bytes"]},
    }


def pack(md: _md.Metadata) -> bytes:
    """DCP's metadata as the bytes of the :data:`METADATA` tensor."""
    return _ckpt.encode_tree(encode(md))


def unpack(data: bytes) -> _md.Metadata:
    """DCP's metadata from the bytes of the :data:`METADATA` tensor."""
    enc = _ckpt.decode_tree(data)
    if not isinstance(enc, dict):
        raise CorruptError("DCP metadata: not a mapping")
    return decode(enc)


def _field(d: object, key: str, kind: type, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CorruptError(f"{where}: no {key!r}")
    v = d[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise CorruptError(f"{where}: {key!r} is {type(v).__name__}, not {kind.__name__}")
    return v


def _ints(v: object, where: str) -> List[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise CorruptError(f"{where}: not a list of non-negative ints")
    return list(v)


def decode(enc: Dict[Any, object]) -> _md.Metadata:
    """DCP's metadata from :func:`encode`'s plain data; raises
    :class:`~ckpt.CorruptError` for malformed data, :class:`~ckpt.UnsupportedError`
    for another format or version."""
    if enc.get("format") != FORMAT:
        raise UnsupportedError(f"DCP metadata of format {enc.get('format')!r}, not {FORMAT!r}")
    if enc.get("version") != VERSION:
        raise UnsupportedError(f"DCP metadata version {enc.get('version')!r} (this build reads {VERSION})")
    out: Dict[str, _md.TensorStorageMetadata | _md.BytesStorageMetadata] = {}
    for fqn, t in _field(enc, "tensors", dict, "DCP metadata").items():
        where = f"DCP metadata of {fqn!r}"
        size = _ints(_field(t, "size", list, where), where)
        chunks = []
        for c in _field(t, "chunks", list, where):
            if not isinstance(c, list) or len(c) != 2:
                raise CorruptError(f"{where}: a chunk is not [offsets, sizes]")
            offsets, sizes = _ints(c[0], where), _ints(c[1], where)
            if len(offsets) != len(size) or len(sizes) != len(size):
                raise CorruptError(f"{where}: a chunk of rank {len(offsets)} in a tensor of rank {len(size)}")
            chunks.append(_md.ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        fmt = _MEMORY_FORMATS.get(_field(t, "memory_format", str, where))
        if fmt is None:
            raise CorruptError(f"{where}: unknown memory format {t['memory_format']!r}")
        props = _md.TensorProperties(
            dtype=torch_dtype(_field(t, "dtype", str, where)),
            layout=torch.strided,
            requires_grad=_field(t, "requires_grad", bool, where),
            memory_format=fmt,
            pin_memory=_field(t, "pin_memory", bool, where),
        )
        out[fqn] = _md.TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)
    for fqn in _field(enc, "bytes", list, "DCP metadata"):
        if not isinstance(fqn, str):
            raise CorruptError("DCP metadata: a byte item's name is not a str")
        out[fqn] = _md.BytesStorageMetadata()
    storage_meta: Optional[_md.StorageMeta] = None
    sm = enc.get("storage_meta")
    if isinstance(sm, dict):
        storage_meta = _md.StorageMeta(
            checkpoint_id=sm.get("checkpoint_id"), save_id=sm.get("save_id"), modules=list(sm.get("modules") or [])
        )
    version = enc.get("dcp_version")
    return _md.Metadata(
        state_dict_metadata=out,
        planner_data=enc.get("planner_data"),
        storage_data={_md.MetadataIndex(fqn): fqn for fqn in out},
        storage_meta=storage_meta,
        version=version if isinstance(version, str) else None,
    )
