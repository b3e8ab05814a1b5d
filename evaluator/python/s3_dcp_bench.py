"""DCP on S3: s3torchconnector's storage beside ckpt's, on the same server and state.

    python s3_dcp_bench.py --url s3://bucket/prefix --mib 64 --repeats 3

``ckpt-eval s3`` runs it with the ``AWS_*`` variables of its server
(``AWS_ENDPOINT``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``, the key). One process,
a one-rank gloo group (DCP needs one). The state: ``--mib`` MiB of f32 in 64
tensors of random values, every one changed before each save. Per method and
repeat: a save until it returns (each
method's save returns once its objects are stored: durable on S3), then a load
into zeroed tensors of the same shapes, checked equal. Every method writes
under a prefix of its own below ``--url`` (``ckpt-eval`` empties it before and
after). Prints one JSON object.

- ``s3torchconnector dcp.save``: ``dcp.save`` / ``dcp.load`` with
  s3torchconnector's ``S3StorageWriter`` / ``S3StorageReader`` (path-style
  addressing, the server's endpoint);
- ``dcp.save -> ckpt``: ``dcp.save`` / ``dcp.load`` with
  ``ckpt.dcp.StorageWriter`` / ``StorageReader`` on the same URL scheme;
- ``ckpt Checkpointer``: ckpt's own ``save(...).wait()`` and ``load_latest``
  by a fresh checkpointer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

TENSORS = 64


def state(mib: float) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, int(mib * (1 << 20) / 4 / TENSORS))
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(TENSORS)}


def zeros_like(sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def check(sd: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor], name: str) -> None:
    bad = [k for k, v in sd.items() if not torch.equal(got[k], v)]
    if bad:
        raise RuntimeError(f"{name}: {len(bad)} tensors differ after load, e.g. {bad[:3]}")


class S3tc:
    """s3torchconnector's DCP storage, pointed at the server's endpoint."""

    name = "s3torchconnector dcp.save"

    def __init__(self, url: str) -> None:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter
        from s3torchconnector.dcp.s3_file_system import S3FileSystem

        self.url = url
        self.region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        endpoint = os.environ.get("AWS_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
        self.cfg = S3ClientConfig(force_path_style=True)
        # Its writer and reader make a client of their own without an endpoint
        # (AWS's); the file system they use is replaced by one with the server's.
        self.fs = lambda: S3FileSystem(self.region, s3_client=S3Client(self.region, endpoint=endpoint,
                                                                      s3client_config=self.cfg))
        self.writer_cls, self.reader_cls = S3StorageWriter, S3StorageReader

    def save(self, sd: Dict[str, torch.Tensor], step: int) -> None:
        w = self.writer_cls(self.region, f"{self.url}/step-{step}", s3client_config=self.cfg)
        w.fs = self.fs()
        dcp.save(sd, storage_writer=w)

    def load(self, into: Dict[str, torch.Tensor], step: int) -> None:
        r = self.reader_cls(self.region, f"{self.url}/step-{step}", s3client_config=self.cfg)
        r.fs = self.fs()
        dcp.load(into, storage_reader=r)

    def close(self) -> None:
        pass


class DcpCkpt:
    """``dcp.save`` into ckpt's DCP storage (one writer, kept across saves)."""

    name = "dcp.save -> ckpt"

    def __init__(self, url: str) -> None:
        import ckpt.dcp

        self.url = url
        self.writer = ckpt.dcp.StorageWriter(url)

    def save(self, sd: Dict[str, torch.Tensor], step: int) -> None:
        dcp.save(sd, checkpoint_id=f"step-{step}", storage_writer=self.writer)

    def load(self, into: Dict[str, torch.Tensor], step: int) -> None:
        import ckpt.dcp

        dcp.load(into, checkpoint_id=f"step-{step}", storage_reader=ckpt.dcp.StorageReader(self.url))

    def close(self) -> None:
        self.writer.close()


class Ckpt:
    """ckpt's own Checkpointer: ``save(...).wait()``, ``load_latest`` by a fresh one."""

    name = "ckpt Checkpointer"

    def __init__(self, url: str) -> None:
        import ckpt

        self.url = url
        self.cp = ckpt.Checkpointer(url, coordinate="none", rng=False)

    def save(self, sd: Dict[str, torch.Tensor], step: int) -> None:
        self.cp.save(step, sd).wait()

    def load(self, into: Dict[str, torch.Tensor], step: int) -> None:
        import ckpt

        got = ckpt.Checkpointer(self.url, read_only=True, coordinate="none", rng=False).load_latest(into)
        assert got == step, (got, step)

    def close(self) -> None:
        self.cp.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True, help="s3://bucket/prefix: each method writes below it")
    ap.add_argument("--mib", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        sd = state(a.mib)
        out: Dict[str, object] = {
            "torch": torch.__version__, "state_bytes": sum(v.numel() * 4 for v in sd.values()),
            "tensors": len(sd), "repeats": a.repeats, "methods": [],
        }
        makers: List[Callable[[str], object]] = [S3tc, DcpCkpt, Ckpt]
        for make in makers:
            name = getattr(make, "name")
            url = f"{a.url.rstrip('/')}/{name.split()[0].replace('.', '_')}"
            row: Dict[str, object] = {"name": name}
            try:
                m = make(url)  # type: ignore[operator]
            except Exception as e:  # noqa: BLE001 - a peer that cannot start is said
                row["skipped"] = f"{type(e).__name__}: {e}"[:300]
                out["methods"].append(row)  # type: ignore[attr-defined]
                continue
            saves: List[float] = []
            loads: List[float] = []
            try:
                for step in range(a.repeats + 1):  # the first, cold, save and load are not counted
                    with torch.no_grad():
                        for v in sd.values():
                            v.add_(1.0)  # every byte changes, as after a training step: nothing to deduplicate
                    t = time.perf_counter()
                    m.save(sd, step)  # type: ignore[attr-defined]
                    s = time.perf_counter() - t
                    into = zeros_like(sd)
                    t = time.perf_counter()
                    m.load(into, step)  # type: ignore[attr-defined]
                    ld = time.perf_counter() - t
                    check(sd, into, name)
                    if step > 0:
                        saves.append(s)
                        loads.append(ld)
                row.update(save_s=saves, load_s=loads)
            except Exception as e:  # noqa: BLE001 - a method that fails is said, the others go on
                traceback.print_exc()
                row = {"name": name, "skipped": f"failed: {type(e).__name__}: {e}"[:300]}
            finally:
                m.close()  # type: ignore[attr-defined]
            out["methods"].append(row)  # type: ignore[attr-defined]
        dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
