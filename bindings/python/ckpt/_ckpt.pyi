"""Type stubs of the native module ``ckpt._ckpt`` (a thin layer over the Rust engine).

Checked against the built extension by ``python -m mypy.stubtest ckpt._ckpt``
(``scripts/test.sh``); what it cannot check is in ``bindings/stubtest-allowlist.txt``.
"""

from os import PathLike
from pathlib import Path
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple, TypedDict, Union, final

from typing_extensions import Buffer, Self

from ckpt.distributed import Coordinator
from ckpt.errors import CheckpointError

__version__: str
__all__ = [
    "Checkpointer",
    "TensorSpec",
    "LoadTarget",
    "Shard",
    "TensorInfo",
    "GcReport",
    "SaveHandle",
    "TensorBuffer",
    "TensorRef",
    "HostSlab",
    "SlabSlot",
    "SnapshotBytes",
    "HostRun",
    "HostSpan",
    "MemoryRoot",
    "_after_fork_child",
    "_mimalloc_purge_delay",
    "dtypes",
    "set_cpu_threads",
    "cpu_threads",
    "encode_tree",
    "decode_tree",
    "merge_manifests",
    "meta",
    "read_meta",
    "own_name",
    "own_rank",
    "encode_own",
    "decode_own",
    "META_VERSION",
    "TYPE_TAG",
    "ODICT_TAG",
    "NP_SCALAR_TAG",
    "error_to_wire",
    "error_from_wire",
    "is_damage",
    "verdict",
    "export",
    "cli_main",
    "__version__",
    "STAGING_LEAD",
]

#: ``(dtype, shape, buffer)``: one loaded tensor.
_LoadedTensor = Tuple[str, List[int], TensorBuffer]
#: ``(step, attempt, tensors, meta, skipped)``; ``skipped`` lists the newer
#: checkpoints found damaged, as ``(step, attempt, error)``.
_Loaded = Tuple[int, str, Dict[str, _LoadedTensor], object, List[Tuple[int, str, CheckpointError]]]

class _SaveReport(TypedDict):
    """What :meth:`SaveHandle.wait` returns: seconds, then bytes and counts."""

    step: int
    attempt: str
    stall: float
    snapshot: float
    persist: float
    commit: float
    total: float
    hash_cpu: float
    encode_cpu: float
    write_io: float
    raw_bytes: int
    copied_bytes: int
    stored_bytes: int
    reused_bytes: int
    objects: int

class _Listed(TypedDict):
    """One row of :meth:`Checkpointer.list`."""

    step: int
    attempt: str
    status: str
    epoch: Optional[int]
    reason: Optional[str]
    bytes: int
    tensors: int
    format: Optional[str]

class _Exported(TypedDict):
    """What :func:`export` wrote."""

    step: int
    tensors: int
    bytes: int
    files: List[str]

class _Storage(Protocol):
    """Memory a :class:`HostSpan` lies in (torch's ``UntypedStorage``)."""

    def data_ptr(self) -> int: ...
    def nbytes(self) -> int: ...


@final
class TensorRef:
    """The place of a tensor inside a state tree, by name."""

    @property
    def name(self) -> str: ...
    def __new__(cls, name: str) -> Self: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Shard:
    """Where a piece sits in its global tensor."""

    @property
    def global_shape(self) -> List[int]: ...
    @property
    def offsets(self) -> List[int]: ...
    def __new__(cls, global_shape: Sequence[int], offsets: Sequence[int]) -> Self: ...

@final
class TensorSpec:
    """One tensor handed to :meth:`Checkpointer.save`: ``data`` is a
    C-contiguous buffer of exactly its bytes or a :class:`SlabSlot`."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> List[int]: ...
    @property
    def data(self) -> object: ...
    @property
    def copy_now(self) -> bool: ...
    @property
    def shard(self) -> Optional[Shard]: ...
    def __new__(
        cls,
        *,
        name: str,
        dtype: str,
        shape: Sequence[int],
        data: object,
        copy_now: bool = False,
        shard: Optional[Shard] = None,
    ) -> Self: ...
    def replace(self, *, data: object = None, copy_now: Optional[bool] = None) -> TensorSpec: ...

@final
class LoadTarget:
    """One destination of :meth:`Checkpointer.load_into`: ``dest`` is a
    writable C-contiguous buffer of exactly the box's bytes."""

    @property
    def name(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> List[int]: ...
    @property
    def dest(self) -> Buffer: ...
    @property
    def shard(self) -> Optional[Shard]: ...
    def __new__(
        cls, *, name: str, dtype: str, shape: Sequence[int], dest: Buffer, shard: Optional[Shard] = None
    ) -> Self: ...

@final
class TensorInfo:
    """One tensor of a checkpoint's table (:meth:`Checkpointer.contents`)."""

    @property
    def dtype(self) -> str: ...
    @property
    def global_shape(self) -> List[int]: ...
    @property
    def pieces(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

@final
class GcReport:
    """What :meth:`Checkpointer.gc` removed."""

    @property
    def retired(self) -> List[Tuple[int, str]]: ...
    @property
    def incomplete_removed(self) -> List[Tuple[int, str]]: ...
    @property
    def chunks_deleted(self) -> int: ...
    @property
    def chunk_sweep_skipped(self) -> bool: ...
    def __new__(cls) -> Self: ...

@final
class TensorBuffer:
    """Loaded tensor bytes, exported as a writable 1-D byte buffer (buffer protocol)."""

    def __len__(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class HostSlab:
    """Page-mapped host memory with one slot per tensor, filled by device-to-host
    copies and saved without a copy (writable buffer protocol)."""

    def __new__(cls, lens: Sequence[int]) -> Self: ...
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def slots(self) -> List[Tuple[int, int]]: ...
    @property
    def charged(self) -> int: ...
    def discharge(self) -> None: ...
    def fits(self, lens: Sequence[int]) -> bool: ...
    def relayout(self, lens: Sequence[int]) -> Optional[HostSlab]: ...
    def in_use(self) -> bool: ...
    def on_release(self, callback: Optional[Callable[[], object]]) -> None: ...
    def populate(self, threads: int = 8) -> None: ...
    def populate_beside_writes(self, threads: int = 8) -> bool: ...
    def slot(self, index: int) -> SlabSlot: ...
    def slot_list(self, indices: Sequence[int]) -> List[SlabSlot]: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

@final
class SlabSlot:
    """One slot of a :class:`HostSlab`, handed to ``save`` as a tensor's bytes."""

    @property
    def index(self) -> int: ...

@final
class SnapshotBytes:
    """Bytes of another save's snapshot, handed to ``save`` as a tensor's bytes
    without a copy (see :meth:`SaveHandle.snapshot_specs`)."""

    def __len__(self) -> int: ...

@final
class HostRun:
    """The specs of a run of CPU tensors that a loop saves again and again,
    less their bytes: made once from the specs of the save that walked them,
    it makes a later save's specs in one call, over the tensors' storages."""

    def __new__(cls, specs: Sequence[TensorSpec]) -> Self: ...
    def __len__(self) -> int: ...
    def specs(self, storages: Sequence[_Storage], ptrs: Sequence[int], copy_now: Sequence[bool]) -> List[TensorSpec]:
        """One spec per tensor, over ``ptrs[i]`` in the memory of
        ``storages[i]`` (objects with ``data_ptr()`` and ``nbytes()``, as
        torch's ``UntypedStorage``). :class:`~ckpt.InvalidInputError` where
        the lengths differ from the run's, or a tensor's bytes do not lie
        inside its storage's memory."""
        ...

@final
class HostSpan:
    """A CPU tensor's bytes inside its storage, which it holds: a read-only
    buffer made by :meth:`HostRun.specs`, or a writable one made by
    :meth:`writable` (a load's destination)."""

    @staticmethod
    def writable(storage: _Storage, ptr: int, len: int) -> HostSpan:
        """The ``len`` bytes at ``ptr`` of ``storage`` (an ``UntypedStorage``)
        as a writable buffer; ``InvalidInputError`` unless they lie inside it."""
        ...
    def __len__(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

#: A directory, as ``MemoryRoot`` takes one.
_Dir = Union[str, "PathLike[str]"]

@final
class MemoryRoot:
    """A checkpoint root on a local directory as the memory tier handles it:
    keys, step names and the manifest schema stay in the engine."""

    def __new__(cls, path: _Dir, incoming: _Dir) -> Self: ...
    @property
    def path(self) -> Path: ...
    @property
    def incoming(self) -> Path: ...
    @property
    def url(self) -> str: ...
    def committed(self) -> Dict[int, str]: ...
    @staticmethod
    def manifest_key(step: int, attempt: str) -> str: ...
    def identity(self, step: int, attempt: str) -> Optional[Tuple[int, int]]: ...
    def objects(self, step: int, attempt: str) -> List[Tuple[str, int]]: ...
    @staticmethod
    def references(manifest: bytes) -> List[Tuple[str, Optional[int]]]: ...
    def pin(self, step: int, attempt: str, into: _Dir) -> Optional[List[Tuple[str, int]]]: ...
    def size(self, key: str) -> Optional[int]: ...
    def has(self, key: str, size: int) -> bool: ...
    def read(self, key: str) -> Optional[bytes]: ...
    def read_into(self, key: str, out: Buffer) -> bool: ...
    def write(self, key: str, data: Buffer) -> None: ...
    def write_manifest(self, manifest: bytes) -> Tuple[int, str]: ...
    def link_from(self, other: MemoryRoot, key: str) -> None: ...
    def drop(self, step: int, attempt: str) -> None: ...
    def drop_newer(self, step: int) -> None: ...
    def gc(self, keep: int) -> None: ...

@final
class SaveHandle:
    """A save in progress."""

    @property
    def step(self) -> int: ...
    @property
    def attempt(self) -> str: ...
    @property
    def stall(self) -> float: ...
    def snapshot_done(self) -> bool: ...
    def done(self) -> bool: ...
    def wait_snapshot(self, timeout: Optional[float] = None) -> None: ...
    def wait(self, timeout: Optional[float] = None) -> _SaveReport: ...
    def snapshot_specs(self) -> Optional[List[TensorSpec]]: ...

@final
class Checkpointer:
    """Saves and loads checkpoints under one root URL."""

    def __new__(
        cls,
        url: str,
        *,
        keep_last: Optional[int] = None,
        keep_every: Optional[int] = None,
        compression: Optional[str] = None,
        level: int = 3,
        lazy: bool = False,
        staging_budget: Optional[int] = None,
        busy: str = "wait",
        format: str = "native",
        coordinator: Optional[Coordinator] = None,
        collective_timeout: float = 600.0,
        read_only: bool = False,
        fencing: bool = True,
        gc_grace: float = 60.0,
        direct_io: Optional[bool] = None,
    ) -> Self: ...
    @property
    def url(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def lazy(self) -> bool: ...
    def save(
        self,
        step: int,
        tensors: Sequence[TensorSpec],
        meta: object,
        ready: Optional[Callable[[], None]] = None,
        share: bool = False,
    ) -> SaveHandle: ...
    def save_after(self, step: int, first: SaveHandle, meta: object) -> SaveHandle: ...
    def ready_staging(self, tensors: List[TensorSpec], also: Sequence[int] = ...) -> int: ...
    def staging_idle_bytes(self) -> int: ...
    def new_slab(
        self, lens: Sequence[int], step: int, since: Optional[int] = None, timeout: Optional[float] = None
    ) -> Optional[HostSlab]: ...
    def staging_returns(self) -> int: ...
    def staging_nudge(self) -> None: ...
    def flush(self, timeout: Optional[float] = None) -> None: ...
    def load_latest(self) -> Optional[_Loaded]: ...
    def load(self, step: int, attempt: Optional[str] = None) -> _Loaded: ...
    def load_tensors(
        self, step: int, names: Sequence[str], attempt: Optional[str] = None
    ) -> Dict[str, _LoadedTensor]: ...
    def load_into(self, step: int, attempt: str, targets: Sequence[LoadTarget]) -> None: ...
    def contents(self, step: int, attempt: str) -> Tuple[object, Dict[str, TensorInfo]]: ...
    def io_counts(self) -> Dict[str, int]: ...
    def note_damaged(self, step: int, attempt: str) -> None: ...
    def meta(self, step: int, attempt: Optional[str] = None) -> object: ...
    def claim(self) -> Optional[int]: ...
    def committed(self) -> List[Tuple[int, str]]: ...
    def list(self, verify: bool = False) -> List[_Listed]: ...
    def gc(self) -> GcReport: ...
    def discard_after(self, step: int) -> GcReport: ...

#: Bytes between a page boundary and the data of a large staging buffer or
#: slab slot (the native chunk header's length).
STAGING_LEAD: int

def dtypes() -> List[str]: ...
def set_cpu_threads(n: int) -> int: ...
def cpu_threads() -> int: ...
def encode_tree(tree: object) -> bytes: ...
def decode_tree(data: bytes) -> object: ...
def merge_manifests(parts: Sequence[bytes]) -> bytes: ...
def meta(
    state: object, numpy: Sequence[str], ranks: Optional[int] = None, memory: Optional[Tuple[int, int]] = None
) -> Dict[str, object]: ...
def read_meta(meta: object) -> Tuple[Dict[str, object], List[str], Optional[int]]: ...
def own_name(rank: int) -> str: ...
def own_rank(name: str) -> Optional[int]: ...
def encode_own(tree: object, numpy: Sequence[str]) -> bytes: ...
def decode_own(data: bytes, rank: int) -> Tuple[object, List[str]]: ...

META_VERSION: int
TYPE_TAG: str
ODICT_TAG: str
NP_SCALAR_TAG: str

def error_to_wire(exc: BaseException) -> bytes: ...
def error_from_wire(data: bytes, context: str = "") -> CheckpointError: ...
def is_damage(exc: BaseException) -> bool: ...
def verdict(outcomes: Sequence[bytes]) -> Optional[Tuple[int, bool]]: ...
def _after_fork_child() -> None: ...
def _mimalloc_purge_delay() -> int: ...
def export(
    url: str,
    out: str,
    entry: str,
    format: str = "safetensors",
    dtype: Optional[str] = None,
    hf: bool = False,
    step: Optional[int] = None,
    max_shard_bytes: int = ...,
    config: Optional[str] = None,
) -> _Exported: ...
def cli_main(argv: List[str]) -> int: ...
