"""Reference-reader side of the format interop tests (tests/tests/interop_*.rs).

Each command prints one JSON description of what a reference library sees in a
file (or of what it wrote), so the Rust test can compare it bit for bit:

    describe-pt FILE        torch.load(FILE, weights_only=True)
    describe-st FILE        safetensors.torch.load_file(FILE) and its __metadata__
    make-pt FILE            torch.save a nested model + optimizer state, describe it
    make-st FILE            safetensors.torch.save_file a state, describe it
    make-evil-pt FILE       torch.save an object whose unpickling calls os.system

A description node is {"t": kind, ...}: tensors carry dtype, shape and the hex of
their bytes; floats carry their IEEE bits, so comparisons are exact.
"""

import collections
import json
import os
import struct
import sys

import torch

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e5m2, torch.float8_e4m3fn, torch.float8_e5m2fnuz, torch.float8_e4m3fnuz,
    torch.float8_e8m0fnu,
]


def tensor_bytes(t):
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def describe(o):
    if isinstance(o, torch.Tensor):
        return {"t": "tensor", "dtype": str(o.dtype).removeprefix("torch."),
                "shape": list(o.shape), "hex": tensor_bytes(o).hex()}
    if o is None:
        return {"t": "none"}
    if isinstance(o, bool):
        return {"t": "bool", "v": o}
    if isinstance(o, int):
        return {"t": "int", "v": o}
    if isinstance(o, float):
        return {"t": "float", "bits": struct.unpack("<Q", struct.pack("<d", o))[0]}
    if isinstance(o, str):
        return {"t": "str", "v": o}
    if isinstance(o, (bytes, bytearray)):
        return {"t": "bytes", "hex": bytes(o).hex()}
    if isinstance(o, tuple):
        return {"t": "tuple", "items": [describe(x) for x in o]}
    if isinstance(o, list):
        return {"t": "list", "items": [describe(x) for x in o]}
    if isinstance(o, dict):
        return {"t": "dict", "items": [[describe(k), describe(v)] for k, v in o.items()]}
    raise TypeError(f"cannot describe {type(o)}")


def seeded(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),),
                        generator=g, dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def nested_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    extra = collections.OrderedDict()
    for i, d in enumerate(DTYPES):
        extra[f"dtype.{str(d).removeprefix('torch.')}"] = seeded(d, (2, 3), i)
    extra["empty"] = torch.zeros(0, 5)
    extra["scalar"] = torch.tensor(3.25, dtype=torch.float64)
    extra["transposed"] = base.t()  # a non-contiguous view of a shared storage
    extra["row"] = base[1]          # a view at a storage offset
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": extra,
            "epoch": 7, "note": "hi", "blob": b"\x00\xff", "pair": (1.5, None)}


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > " + sys.argv[2] + ".pwned",))


def main():
    cmd, path = sys.argv[1], sys.argv[2]
    if cmd == "describe-pt":
        out = describe(torch.load(path, weights_only=True))
    elif cmd == "describe-st":
        from safetensors import safe_open
        from safetensors.torch import load_file
        with safe_open(path, framework="pt") as f:
            meta = f.metadata()
        out = {"tensors": describe(dict(load_file(path))), "metadata": meta}
    elif cmd == "make-pt":
        state = nested_state()
        torch.save(state, path)
        out = describe(state)
    elif cmd == "make-st":
        from safetensors.torch import save_file
        flat = {}
        for i, d in enumerate(DTYPES[:-1]):
            flat[f"a.{i}.{str(d).removeprefix('torch.')}"] = seeded(d, (3, 2), 100 + i)
        flat["empty"] = torch.zeros(0, 2, dtype=torch.float16)
        flat["scalar"] = torch.tensor(-1, dtype=torch.int64)
        save_file(flat, path, metadata={"format": "pt", "origin": "python"})
        out = {"tensors": describe(flat)}
    elif cmd == "make-evil-pt":
        torch.save({"w": torch.ones(2), "payload": Evil()}, path)
        out = {"t": "none"}
    else:
        raise SystemExit(f"unknown command {cmd}")
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
