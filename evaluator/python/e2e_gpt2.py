"""GPT-2 (124M, random init, no download) + AdamW after one step, one process,
CPU: time until durable and the restore into the live model and optimizer, ckpt
beside torch.save/torch.load+load_state_dict and DCP, in one run; medians and
ratios to torch. Also ckpt's stall and time until durable with a long-lived
saver (staging pool warm, every tensor changed between saves, so nothing is
deduplicated). The page cache is dropped before each load where permitted.

    python evaluator/python/e2e_gpt2.py SCRATCH_DIR
"""
import os, shutil, statistics, sys, time
import torch, transformers, ckpt
import torch.distributed.checkpoint as dcp

root = sys.argv[1]
reps = 3
torch.manual_seed(0)
cfg = transformers.GPT2Config()  # gpt2 (124M); no download
model = transformers.GPT2LMHeadModel(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randint(0, cfg.vocab_size, (1, 32))
model(x, labels=x).loss.backward(); opt.step(); opt.zero_grad()
state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
state_bytes += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))

COLD = True


def drop():
    global COLD
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        COLD = False  # not permitted: loads are from a warm cache, and the output says so

res = {}
def run(name, save, load):
    sv, ld = [], []
    for i in range(reps):
        d = os.path.join(root, name.replace(" ", "_"), str(i)); shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
        t = time.perf_counter(); save(d); sv.append(time.perf_counter() - t)
        drop()
        t = time.perf_counter(); load(d); ld.append(time.perf_counter() - t)
        shutil.rmtree(d, ignore_errors=True)
    res[name] = (statistics.median(sv), statistics.median(ld))

def ck_save(d):
    cp = ckpt.Checkpointer("file://" + d, rng=False); cp.save(1, model=model, optimizer=opt).wait(); cp.close()
def ck_load(d):
    cp = ckpt.Checkpointer("file://" + d, rng=False); assert cp.load_latest(model=model, optimizer=opt) == 1; cp.close()
def pt_save(d):
    p = os.path.join(d, "c.pt")
    with open(p, "wb") as f:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f); f.flush(); os.fsync(f.fileno())
def pt_load(d):
    s = torch.load(os.path.join(d, "c.pt"), weights_only=True)
    model.load_state_dict(s["model"]); opt.load_state_dict(s["optimizer"])
def dcp_save(d):
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, storage_writer=dcp.FileSystemWriter(d, sync_files=True))
def dcp_load(d):
    sd = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    dcp.load(sd, checkpoint_id=d); model.load_state_dict(sd["model"]); opt.load_state_dict(sd["optimizer"])

def perturb():
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0001)
        for st in opt.state.values():
            for v in st.values():
                if torch.is_tensor(v) and v.is_floating_point():
                    v.mul_(1.0001)

def run_warm(name):
    d = os.path.join(root, "warm"); shutil.rmtree(d, ignore_errors=True); os.makedirs(d)
    cp = ckpt.Checkpointer("file://" + d, rng=False)
    cp.save(0, model=model, optimizer=opt).wait()  # staging pool warm, as in a training loop
    sv, st = [], []
    for i in range(1, reps + 1):
        perturb()  # every tensor changes: nothing is deduplicated
        t = time.perf_counter(); h = cp.save(i, model=model, optimizer=opt); st.append(time.perf_counter() - t)
        h.wait(); sv.append(time.perf_counter() - t)
    cp.close(); shutil.rmtree(d, ignore_errors=True)
    res[name] = (statistics.median(sv), float("nan"))
    print(f"{name}: stall median {statistics.median(st) * 1e3:.0f} ms", flush=True)

ref = {k: v.clone() for k, v in model.state_dict().items()}
run("ckpt", ck_save, ck_load)
assert all(torch.equal(ref[k], v) for k, v in model.state_dict().items())
run("torch.save/load", pt_save, pt_load)
run("dcp", dcp_save, dcp_load)
run_warm("ckpt warm saver")
base = res["torch.save/load"]
cache = "page cache dropped" if COLD else "page cache NOT dropped (no permission)"
print(f"GPT-2 124M + AdamW: {state_bytes / 2**20:.0f} MiB of state, {reps} repeats, medians; load in place, {cache}")
print(f"{'method':18} {'save s':>8} {'load s':>8} {'save/torch':>11} {'load/torch':>11}")
for k, (s, l) in res.items():
    print(f"{k:18} {s:8.3f} {l:8.3f} {s / base[0]:11.2f} {l / base[1]:11.2f}")
