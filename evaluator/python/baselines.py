"""The Python baselines of ckpt-eval, run on exactly the tensors ckpt saves.

The Rust side writes the state as a spec (JSON: name, dtype, shape, offset and
length of each tensor) and one binary blob; this script rebuilds the same
tensors with torch and times the usual ways to checkpoint them, printing one
JSON object on stdout. Every save is made durable (fsync) before the clock
stops, as ckpt's saves are; loads read files whose page cache was dropped
(``peers.drop_cache``: ``/proc/sys/vm/drop_caches`` where allowed, else
posix_fadvise DONTNEED after fsync), as in every Python benchmark.

    baselines.py formats  --spec S --blob B --dir D --repeats N
    baselines.py overhead --spec S --blob B --dir D --mode {torch_save,dcp_async_save}
                          --steps N --every K --compute-ms MS
    baselines.py resume   --spec S --blob B --dir D --phase {first,second}
                          --steps N --stop-at K
"""

import argparse
import json
import os
import resource
import shutil
import sys
import time

import torch

# The page cache is dropped and files fsynced as in every Python benchmark.
from peers import drop_cache, fsync_tree
from peers import fsync_path as fsync_file

DTYPES = {
    "F32": torch.float32,
    "F64": torch.float64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def load_state(spec_path, blob_path):
    """The state as an ordered dict of fresh, contiguous tensors."""
    with open(spec_path) as f:
        spec = json.load(f)
    state = {}
    # Read each tensor straight into its own buffer (no second copy of the
    # state, so the peak memory of the loop is not the loading's).
    with open(blob_path, "rb") as f:
        for t in spec["tensors"]:
            raw = torch.empty(t["nbytes"], dtype=torch.uint8)
            f.seek(t["offset"])
            if f.readinto(memoryview(raw.numpy())) != t["nbytes"]:
                raise SystemExit(f"short blob at tensor {t['name']}")
            state[t["name"]] = raw.view(DTYPES[t["dtype"]]).reshape(t["shape"])
    return state


def fsync_path(path):
    """fsync a file, or every file of a directory tree and the directories."""
    if os.path.isdir(path):
        fsync_tree(path)
    else:
        fsync_file(path)


def size_of(path):
    if os.path.isdir(path):
        return sum(
            os.path.getsize(os.path.join(r, n)) for r, _d, fs in os.walk(path) for n in fs
        )
    return os.path.getsize(path)


def fresh(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def check_equal(state, loaded, what):
    for k, v in state.items():
        a, b = v.reshape(-1).view(torch.uint8), loaded[k].reshape(-1).view(torch.uint8)
        if v.shape != loaded[k].shape or not torch.equal(a, b):  # bitwise (NaNs too)
            raise SystemExit(f"{what}: tensor {k} differs after load")


_pg_ready = False


def init_pg(workdir):
    """A one-process gloo group (needed by torch.distributed.checkpoint async_save)."""
    global _pg_ready
    import torch.distributed as dist

    if not _pg_ready:
        store = os.path.abspath(os.path.join(workdir, "pg-store"))  # (relative: a URL host)
        fresh(store)
        dist.init_process_group(
            "gloo", init_method=f"file://{store}", rank=0, world_size=1
        )
        _pg_ready = True


# ---- one save and one load per baseline -------------------------------------


def torch_save(state, path):
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(path, _template):
    return torch.load(path, weights_only=True)


def st_save(state, path):
    import safetensors.torch

    safetensors.torch.save_file(state, path)
    fsync_path(path)


def st_load(path, _template):
    import safetensors.torch

    return safetensors.torch.load_file(path)


def dcp_save(state, path):
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path)
    fsync_path(path)


def dcp_load(path, template):
    import torch.distributed.checkpoint as dcp

    target = {k: torch.empty_like(v) for k, v in template.items()}
    dcp.load(target, checkpoint_id=path)
    return target


def dcp_async_save(state, path):
    """Returns (stall, total): the time async_save blocked, and until durable."""
    import torch.distributed.checkpoint as dcp

    t0 = time.perf_counter()
    fut = dcp.async_save(state, checkpoint_id=path)
    stall = time.perf_counter() - t0
    fut.result()
    fsync_path(path)
    return stall, time.perf_counter() - t0


def h5_save(state, path):
    import h5py

    with h5py.File(path, "w") as f:
        for k, v in state.items():
            if v.dtype == torch.bfloat16:  # h5py has no bfloat16: keep the bits
                f.create_dataset(k, data=v.view(torch.int16).numpy()).attrs["bf16"] = 1
            else:
                f.create_dataset(k, data=v.numpy())
    fsync_path(path)


def h5_load(path, _template):
    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        for k in f:
            t = torch.from_numpy(f[k][()])
            out[k] = t.view(torch.bfloat16) if f[k].attrs.get("bf16", 0) else t
    return out


BASELINES = [
    # name, save, load, directory-shaped output
    ("torch.save", torch_save, torch_load, False),
    ("safetensors.torch", st_save, st_load, False),
    ("dcp.save", dcp_save, dcp_load, True),
    ("dcp.async_save", None, dcp_load, True),
    ("h5py", h5_save, h5_load, False),
]


def run_formats(args):
    state = load_state(args.spec, args.blob)
    results = []
    for name, save, load, _is_dir in BASELINES:
        if name.startswith("dcp"):
            init_pg(args.dir)
        path = os.path.join(args.dir, name.replace(".", "_"))
        # Warm-up on a tiny state: imports and first-call set-up are not timed.
        fresh(path)
        tiny = {"w": torch.zeros(4)}
        dcp_async_save(tiny, path) if save is None else save(tiny, path)
        load(path, tiny)
        r = {"name": name, "save_s": [], "stall_s": [], "load_s": [], "bytes": 0}
        cache_dropped, how = True, "none"
        for _ in range(args.repeats):
            fresh(path)
            if save is None:
                stall, total = dcp_async_save(state, path)
                r["stall_s"].append(stall)
                r["save_s"].append(total)
            else:
                t0 = time.perf_counter()
                save(state, path)
                dt = time.perf_counter() - t0
                r["save_s"].append(dt)
                r["stall_s"].append(dt)
            r["bytes"] = size_of(path)
            how = drop_cache(path)
            cache_dropped &= how != "none"
            t0 = time.perf_counter()
            loaded = load(path, state)
            r["load_s"].append(time.perf_counter() - t0)
            check_equal(state, loaded, name)
            del loaded
        r["cache_dropped"] = cache_dropped
        r["cache_drop"] = how
        fresh(path)
        results.append(r)
    return {"baselines": results}


def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def train_loop(state, args, mode, dcp=None):
    """One run of the loop; returns (loop seconds, total seconds, stalls)."""
    stalls = []
    pending = None
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        time.sleep(args.compute_ms / 1000.0)  # forward + backward
        for v in state.values():  # optimizer step
            v.view(-1)[:: 1 << 18].add_(1)
        if mode == "none" or step % args.every:
            continue
        path = os.path.join(args.dir, f"ovh-{mode}-{step}")
        fresh(path)
        t0 = time.perf_counter()
        if mode == "torch_save":
            torch_save(state, path)
        elif mode == "dcp_async_save":
            if pending is not None:  # one async save at a time, as DCP requires
                pending.result()
            pending = dcp.async_save(state, checkpoint_id=path)
        else:
            raise SystemExit(f"unknown mode {mode}")
        stalls.append(time.perf_counter() - t0)
    loop_s = time.perf_counter() - t_start
    if pending is not None:
        pending.result()
    total_s = time.perf_counter() - t_start
    for name in os.listdir(args.dir):
        if name.startswith(f"ovh-{mode}-"):
            fresh(os.path.join(args.dir, name))
    return loop_s, total_s, stalls


def run_overhead(args):
    """A training loop with emulated accelerator compute (the host sleeps), an
    optimizer step that mutates every tensor, and a checkpoint every k steps;
    each repeat runs it once without checkpoints and once with them."""
    state = load_state(args.spec, args.blob)
    dcp = None
    if args.mode == "dcp_async_save":
        init_pg(args.dir)
        import torch.distributed.checkpoint as dcp
    rss_start = rss_now()
    out = {"mode": args.mode, "none_loop_s": [], "loop_s": [], "total_s": [], "stalls_s": []}
    for _ in range(args.repeats):
        out["none_loop_s"].append(train_loop(state, args, "none")[0])
        loop_s, total_s, stalls = train_loop(state, args, args.mode, dcp)
        out["loop_s"].append(loop_s)
        out["total_s"].append(total_s)
        out["stalls_s"] += stalls
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["peak_extra_bytes"] = max(0, peak - rss_start)
    return out


# ---- bitwise resume of a real PyTorch model through a ckpt checkpoint ---------


def resume_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.Tanh(),
        torch.nn.Dropout(0.1),  # uses the global RNG: its state must round-trip
        torch.nn.Linear(64, 1),
    )


def resume_train(model, opt, start, end):
    for _ in range(start, end):
        x = torch.randn(16, 32)
        y = x.sum(1, keepdim=True).tanh()
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def resume_flat(model, opt, step):
    """Parameters, Adam state, the global RNG state and the step, as flat tensors."""
    st = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for idx, s in opt.state_dict()["state"].items():
        for name, t in s.items():
            st[f"optim.{idx}.{name}"] = t.detach().clone().reshape(-1)
    st["rng"] = torch.get_rng_state()
    st["step"] = torch.tensor([step], dtype=torch.int64)
    return st


def resume_restore(flat):
    model = resume_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.load_state_dict(
        {k[len("model.") :]: v for k, v in flat.items() if k.startswith("model.")}
    )
    sd = opt.state_dict()
    state = {}
    for k, v in flat.items():
        if k.startswith("optim."):
            _, idx, name = k.split(".", 2)
            state.setdefault(int(idx), {})[name] = v.reshape(()) if name == "step" else v
    for idx, s in state.items():
        shape = list(model.parameters())[idx].shape
        for name in ("exp_avg", "exp_avg_sq"):
            s[name] = s[name].reshape(shape)
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    torch.set_rng_state(flat["rng"])
    return model, opt, int(flat["step"][0])


def write_flat(flat, prefix):
    names = {v: k for k, v in DTYPES.items()}
    tensors, offset = [], 0
    with open(prefix + ".bin", "wb") as f:
        for name, t in flat.items():
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            f.write(raw)
            tensors.append(
                {
                    "name": name,
                    "dtype": names[t.dtype],
                    "shape": list(t.shape),
                    "offset": offset,
                    "nbytes": len(raw),
                }
            )
            offset += len(raw)
    with open(prefix + ".json", "w") as f:
        json.dump({"tensors": tensors}, f)


def run_resume(args):
    """`--phase first`: train `steps` uninterrupted (written as `straight`) and,
    from scratch again, `stop_at` steps (written as `mid`). `--phase second`:
    restore the state in --spec/--blob (what ckpt loaded back), finish to
    `steps`, write `resumed`."""
    torch.set_num_threads(1)
    if args.phase == "first":
        model = resume_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        resume_train(model, opt, 0, args.steps)
        write_flat(resume_flat(model, opt, args.steps), os.path.join(args.dir, "straight"))
        model = resume_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        resume_train(model, opt, 0, args.stop_at)
        write_flat(resume_flat(model, opt, args.stop_at), os.path.join(args.dir, "mid"))
    else:
        model, opt, step = resume_restore(load_state(args.spec, args.blob))
        resume_train(model, opt, step, args.steps)
        write_flat(resume_flat(model, opt, args.steps), os.path.join(args.dir, "resumed"))
    return {"phase": args.phase}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["formats", "overhead", "resume"])
    p.add_argument("--spec", required=True)
    p.add_argument("--blob", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mode", default="torch_save")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--compute-ms", type=float, default=200.0)
    p.add_argument("--phase", choices=["first", "second"], default="first")
    p.add_argument("--stop-at", type=int, default=10)
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    run = {"formats": run_formats, "overhead": run_overhead, "resume": run_resume}
    out = run[args.what](args)
    out["versions"] = {"python": sys.version.split()[0], "torch": torch.__version__}
    if _pg_ready:
        import torch.distributed as dist

        dist.destroy_process_group()
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
