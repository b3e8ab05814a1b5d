"""Reference-reader side of the HDF5 interop tests (tests/tests/interop_hdf5.rs).

    describe-h5 FILE         what h5py sees: every dataset and the root's ckpt_meta
    make-h5 FILE             h5py writes nested groups of every numpy dtype it has,
                             a bf16 by the ckpt_dtype convention and a big-endian
                             array; prints what it wrote (bytes little-endian)
    make-bad-h5 FILE KIND    a file with something ckpt refuses (string, soft,
                             external, enum, vlen)

Datasets are described as {"dtype": numpy name, "shape": [...], "hex": bytes,
"attrs": {ckpt_*}}, and for the ckpt_dtype convention also "torch_hex": the bytes
of torch.from_numpy(a).view(<torch dtype>), the recipe the format documents.
"""

import json
import sys

import h5py
import numpy as np

TORCH_VIEW = {
    "BF16": "bfloat16", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E8M0": "float8_e8m0fnu",
}


def le_bytes(a):
    a = np.ascontiguousarray(a)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return a.tobytes()


def attr(v):
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray):
        return [int(x) for x in v]
    if isinstance(v, np.integer):
        return int(v)
    return v


def describe(path):
    out = {"datasets": {}, "meta": None}
    with h5py.File(path, "r") as f:
        if "ckpt_meta" in f.attrs:
            out["meta"] = attr(f.attrs["ckpt_meta"])

        def visit(name, obj):
            if not isinstance(obj, h5py.Dataset):
                return
            a = obj[()]
            d = {"dtype": str(obj.dtype), "shape": list(obj.shape), "hex": le_bytes(a).hex(),
                 "attrs": {k: attr(v) for k, v in obj.attrs.items()}}
            view = TORCH_VIEW.get(d["attrs"].get("ckpt_dtype"))
            if view is not None:
                import torch
                t = torch.from_numpy(np.ascontiguousarray(a)).view(getattr(torch, view))
                d["torch_dtype"] = str(t.dtype).removeprefix("torch.")
                d["torch_hex"] = t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()
            out["datasets"][name] = d

        f.visititems(visit)
    return out


def seeded(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    raw = rng.integers(0, 256, n * np.dtype(dtype).itemsize, dtype=np.uint8)
    if np.dtype(dtype) == np.bool_:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def make(path):
    wrote = {}
    with h5py.File(path, "w") as f:
        names = ["float16", "float32", "float64", "int8", "int16", "int32", "int64",
                 "uint8", "uint16", "uint32", "uint64", "bool", "complex64"]
        for i, n in enumerate(names):
            a = seeded(np.dtype(n), (3, 2), 200 + i)
            f.create_dataset(f"model/layers/{i}/{n}", data=a)
            wrote[f"model.layers.{i}.{n}"] = a
        f.create_dataset("empty", data=np.zeros((0, 3), dtype=np.float32))
        wrote["empty"] = np.zeros((0, 3), dtype=np.float32)
        f.create_dataset("scalar", data=np.float64(2.5))
        wrote["scalar"] = np.float64(2.5)
        bf = seeded(np.uint16, (4,), 300)
        f.create_dataset("opt/bf16", data=bf).attrs["ckpt_dtype"] = "BF16"
        wrote["opt.bf16"] = bf
        be = seeded(np.dtype(">f4"), (5,), 301)
        f.create_dataset("opt/big_endian", data=be)
        wrote["opt.big_endian"] = be
        chunked = seeded(np.int32, (64, 3), 302)
        f.create_dataset("opt/gzip", data=chunked, chunks=(16, 3), compression="gzip")
        wrote["opt.gzip"] = chunked
        f.attrs["note"] = "attributes other than ckpt_meta are ignored"
    return {name: {"dtype": "bf16" if name == "opt.bf16" else str(a.dtype.newbyteorder("=")),
                   "shape": list(np.shape(a)), "hex": le_bytes(a).hex()}
            for name, a in wrote.items()}


def make_bad(path, kind):
    with h5py.File(path, "w") as f:
        f["ok"] = np.arange(3)
        if kind == "string":
            f["s"] = "a string"
        elif kind == "soft":
            f["alias"] = h5py.SoftLink("/ok")
        elif kind == "external":
            f["ext"] = h5py.ExternalLink("other.h5", "/x")
        elif kind == "enum":
            f.create_dataset("e", data=np.array([0, 1], dtype=np.int8),
                             dtype=h5py.enum_dtype({"RED": 0, "GREEN": 1}, basetype="i1"))
        elif kind == "vlen":
            f.create_dataset("v", (2,), dtype=h5py.vlen_dtype(np.int32))
        else:
            raise SystemExit(f"unknown kind {kind}")


def main():
    cmd, path = sys.argv[1], sys.argv[2]
    if cmd == "describe-h5":
        out = describe(path)
    elif cmd == "make-h5":
        out = make(path)
    elif cmd == "make-bad-h5":
        make_bad(path, sys.argv[3])
        out = None
    else:
        raise SystemExit(f"unknown command {cmd}")
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
