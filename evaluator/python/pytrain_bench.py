"""A real PyTorch training state checkpointed from Python: ckpt's public API beside
``torch.save``, ``safetensors.torch``, ``torch.distributed.checkpoint`` and
``torch-checkpointing``, in one process on CPU. ``ckpt-eval python`` runs it:

    python pytrain_bench.py --dir D [--layers 6] [--width 384] [--seq 128] [--repeats 3] [--rounds 3] [--every 4]
                            [--experts E]

The model is GPT-2-shaped: ``transformers.GPT2LMHeadModel`` from a
``GPT2Config`` (GPT-2's vocabulary, tied embedding and head, fewer and narrower
layers than gpt2 by default so the run fits the time budget; random init, no
download), or, without transformers, a GPT-2-style module of the same shapes
defined here. With ``--experts E``, a mixture of experts of as many layers
and that width (:class:`Experts`): thousands of small tensors, where the
time each method spends per tensor shows. AdamW, one real training step before anything is saved, so
optimizer state exists. The context is the sequence length, so every position
embedding is trained, and every saved tensor changes with each step (nothing is
deduplicated between saves).

Per method, first, a job's first save right after its first step (``first
stall``): a new saver opened as a job starts (ckpt: ``load_latest``, finding
nothing), one training step, the save; then (a saver kept across saves, as in
training): a cold save (pools,
stagers, writer processes start) and, after a training step, a warm one and a
load, all sampled for memory (below); then ``--repeats`` times, unsampled: a
training step, then

- save: ``stall`` is how long the call blocks the training loop; ``snapshot``
  until the state may be mutated again; ``durable`` until the data is on disk.
  ckpt and ``dcp`` (``FileSystemWriter(sync_files=True)``) fsync their files
  themselves; after ``torch.save`` and ``safetensors.torch.save_file`` the file
  is fsynced; ``torch-checkpointing`` 0.1.1 does not fsync, so its
  ``pre_finalize_callback`` does it in its writer process before it finalizes.
- disk: ckpt keeps the last two checkpoints (``keep_last=2``); the other
  methods' older checkpoints are removed after each save is durable, untimed
  here, and in the training loop (below) by the waiter thread, within the
  loop's time, as ckpt's retention deletes within the save.
- load, for one method per file format: the live model and optimizer are
  overwritten with other values, the page cache is dropped
  (``/proc/sys/vm/drop_caches``, else ``posix_fadvise(DONTNEED)`` on the files;
  reported), and the checkpoint is loaded back into the same live model and
  optimizer: ckpt ``load_latest`` (in place), ``torch.load(weights_only=True)``
  + ``load_state_dict``, ``safetensors.torch.load_file`` + ``load_state_dict``,
  ``dcp.load`` into the live state dict + ``set_state_dict``, and
  ``CheckpointManager.load``. Every tensor of model and optimizer is then
  checked equal (``torch.equal``) to the saved state.
- peak extra host memory: proportional set size (Pss, ``smaps_rollup``) of this
  process and its children, sampled every 10 ms during the two sampled saves
  (from before the cold one, so staging pools kept between saves count, minus
  the reference copy the benchmark holds) and during the sampled load, over the
  value before. Garbage is collected and freed heap handed back
  (``malloc_trim``) before each window. One Pss reading of this process takes
  tens of milliseconds of a core, so the timed saves and loads run without the
  sampler.

Training-loop interference, both ways, with real compute: ``--rounds`` rounds
per method of ``--every`` real training steps (forward, backward, AdamW step of
the model on CPU, on the same cores as any background work) without
checkpointing, then a save and training steps until at least ``--every`` are
done and the save is durable. Asynchronous methods are waited for only where
training needs it: the next optimizer step waits for the snapshot (ckpt lazy's
own step pre-hook; for ``dcp.async_save`` its staging future, for
torch-checkpointing its staging future). The time a checkpoint costs the loop
is the second part's time minus as many steps at the first part's pace; over
the first part's time it is the slowdown of a loop that checkpoints every
``--every`` steps. Alternating the two parts at this grain keeps a shared
machine's load out of the comparison. Each save's time until durable in the
loop is taken by a waiter thread, and compared to the same method's when idle
(the save figures above): checkpointing slowed by training.

Floors, same run, same bytes, the fastest of their repeats at the start and at
the end: copy of the state into preallocated (touched) buffers, write + fsync of
the bytes to one file, and the read of that file with the page cache dropped.
One JSON object is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import threading
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

from peers import MAKERS, Ckpt, DcpAsync, Method, Peak, drop_cache, floors, settle, timed_save

# ---------------------------------------------------------------- the model


class Block(nn.Module):
    """A GPT-2 block (pre-norm attention and MLP), used when transformers is absent."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.c_fc = nn.Linear(width, 4 * width)
        self.mlp_proj = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class MiniGPT(nn.Module):
    """GPT-2's shapes without transformers: token and position embeddings, blocks,
    final norm, a head tied to the token embedding."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def loss(self, x):
        h = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
        for b in self.h:
            h = b(h)
        logits = self.lm_head(self.ln_f(h))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


class Expert(nn.Module):
    """One expert: a gated MLP of three bias-free projections, hidden twice the width."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, 2 * width, bias=False)
        self.up = nn.Linear(width, 2 * width, bias=False)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class MoeLayer(nn.Module):
    """A norm, a router and ``experts`` experts; each token goes to its top 2."""

    def __init__(self, width: int, experts: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Expert(width) for _ in range(experts))

    def forward(self, h):
        x = self.norm(h).reshape(-1, h.shape[-1])
        weights, chosen = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return h + out.view_as(h)


class Experts(nn.Module):
    """A mixture-of-experts language model laid out as per-expert
    implementations lay theirs out (transformers' Mixtral and Qwen-MoE):
    token embedding, ``layers`` MoE layers, a final norm and a head tied to
    the embedding. Every parameter gets a gradient each step (zero where no
    token was routed to its expert), so the optimizer holds state for every
    one from the first step on, as in a balanced run."""

    def __init__(self, layers: int, width: int, experts: int, vocab: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(MoeLayer(width, experts) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def loss(self, x):
        h = self.wte(x)
        for layer in self.layers:
            h = layer(h)
        logits = self.lm_head(self.ln_f(h))
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        return ce + 0.0 * sum(p.sum() for p in self.parameters())


def build(a):
    """The model (GPT-2-shaped, or experts), its loss function and a description."""
    torch.manual_seed(0)
    if a.experts > 0:
        model = Experts(a.layers, a.width, a.experts, a.vocab)
        return model, model.loss, f"mixture of experts ({a.experts} experts of width {a.width} per layer, top 2)"
    heads = max(1, a.width // 64)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        cfg = transformers.GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=heads, vocab_size=a.vocab,
                                      n_positions=a.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
        return model, (lambda x: model(x, labels=x).loss), f"transformers {transformers.__version__} GPT2LMHeadModel"
    except ImportError:
        model = MiniGPT(a.layers, a.width, heads, a.vocab, a.seq)
        return model, model.loss, "GPT-2-style module (transformers not installed)"


class Trainer:
    """The model, AdamW, and real training steps on a fixed stream of token batches."""

    def __init__(self, a) -> None:
        self.model, self.loss, self.desc = build(a)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.a = a
        self.n = 0
        self.step()  # optimizer state exists from here on

    def step(self) -> None:
        g = torch.Generator().manual_seed(1000 + self.n)
        self.n += 1
        x = torch.randint(0, self.a.vocab, (self.a.batch, self.a.seq), generator=g)
        self.loss(x).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def tensors(model, opt) -> dict:
    """Every tensor of model and optimizer state, by name (not copied)."""
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            if torch.is_tensor(v):
                out[f"optim.{names[id(p)]}.{k}"] = v
    return out


def unique_bytes(ts: dict) -> int:
    seen, n = set(), 0
    for t in ts.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            n += t.numel() * t.element_size()
    return n


def reference(tr: Trainer) -> dict:
    """A copy of every tensor, tied ones (GPT-2's embedding and head) sharing
    one copy as they share one storage: it holds ``unique_bytes``, which the
    memory figures subtract as the benchmark's own."""
    out, copies = {}, {}
    for k, v in tensors(tr.model, tr.opt).items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), v.dtype, tuple(v.shape), tuple(v.stride()))
        if key not in copies:
            copies[key] = v.detach().clone()
        out[k] = copies[key]
    return out


def scramble(tr: Trainer) -> None:
    """Other values in every live tensor, so a load has to write them all."""
    with torch.no_grad():
        seen = set()
        for t in tensors(tr.model, tr.opt).values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                t.add_(1)


def check(tr: Trainer, ref: dict, name: str) -> None:
    got = tensors(tr.model, tr.opt)
    bad = [k for k, v in ref.items() if k not in got or not torch.equal(got[k], v)]
    if bad or len(got) != len(ref):
        raise RuntimeError(f"{name}: {len(bad)} of {len(ref)} tensors differ after load, e.g. {bad[:3]}")


# ---------------------------------------------------------------- measurements

def checked_load(m: Method, tr: Trainer, ref: dict, step: int, peak: "Peak | None" = None):
    """Scramble the live state, drop the page cache, load ``step`` into it (in a
    window of ``peak`` if given), check it equals ``ref``; (seconds, cache drop)."""
    scramble(tr)
    how = drop_cache(m.dir)
    t = time.perf_counter()
    if peak is None:
        m.load(step)
    else:
        with peak.active():
            m.load(step)
    took = time.perf_counter() - t
    check(tr, ref, m.name)
    return took, how


def save_and_load(m: Method, tr: Trainer, a, state_bytes: int) -> dict:
    """Two saves (and a load) sampled for memory, then ``a.repeats`` timed ones.
    A Pss reading of this process takes tens of milliseconds, so the sampler
    would slow what it samples: timed saves and loads run without it."""
    rows = {"stall_s": [], "snapshot_s": [], "durable_s": [], "load_s": [], "written_bytes": []}
    with Peak() as p:  # from before the first save: staging pools and writer processes count
        with p.active():
            m.open()
            timed_save(m, 0)  # cold: pools, stagers, writer processes start
        tr.step()  # every value changes
        ref = reference(tr)
        p.own = state_bytes
        with p.active():
            timed_save(m, 1)  # warm
    if m.loads:
        with Peak() as lp:
            checked_load(m, tr, ref, 1, lp)
        rows["peak_load_extra_bytes"] = lp.extra
    rows["peak_save_extra_bytes"] = p.extra
    del ref
    m.prune(1)
    for rep in range(a.repeats):
        step = rep + 2
        tr.step()
        ref = reference(tr)
        settle()
        stall, snap, durable = timed_save(m, step)
        m.measure_written(step)
        for k, v in (("stall_s", stall), ("snapshot_s", snap), ("durable_s", durable),
                     ("written_bytes", m.written)):
            rows[k].append(v)
        if m.loads:
            took, rows["cache_drop"] = checked_load(m, tr, ref, step)
            rows["load_s"].append(took)
        del ref
        m.prune(step)
    return rows


def first_save(make, work: str, tr: Trainer) -> float:
    """The stall of a job's first save right after its first step: a new saver
    opened as a job starts (``Method.begin``: ckpt's ``load_latest``, finding
    nothing), one training step, then the save. Waited for; then the saver is
    closed and its files removed."""
    m = make(work).bind(tr.model, tr.opt)
    m.prepare()
    m.open()
    try:
        m.begin()
        tr.step()
        stall, _, _ = timed_save(m, 0)
    finally:
        m.close()
        shutil.rmtree(m.dir, ignore_errors=True)
    return stall


def train_rounds(tr: Trainer, m: Method, a, first_step: int) -> dict:
    """``a.rounds`` rounds of: ``a.every`` training steps without checkpointing,
    then a save and training steps until at least ``a.every`` are done and the
    save is durable. Per round: both parts' times and steps, the save's stall
    and its time until durable (taken by a waiter thread)."""
    out: dict = {"plain_s": [], "plain_steps": [], "ckpt_s": [], "ckpt_steps": [], "stall_s": [], "durable_s": []}
    for r in range(a.rounds):
        t = time.perf_counter()
        for _ in range(a.every):
            tr.step()
        out["plain_s"].append(time.perf_counter() - t)
        out["plain_steps"].append(a.every)
        t = time.perf_counter()
        wait = m.start(first_step + r)
        out["stall_s"].append(time.perf_counter() - t)
        durable: list = []

        def waiter(wait=wait, t=t, step=first_step + r):
            wait()
            durable.append(time.perf_counter() - t)
            # Keeping the disk bounded is part of checkpointing in a loop: the
            # older checkpoint goes once this one is durable, in the loop's time
            # (ckpt's retention does the same inside the save).
            m.prune(step)

        w = threading.Thread(target=waiter, daemon=True)
        w.start()
        n = 0
        while n < a.every or w.is_alive():
            m.snapshot_wait()  # no-op once the snapshot is done (ckpt lazy has its own hook)
            tr.step()
            n += 1
        out["ckpt_s"].append(time.perf_counter() - t)
        out["ckpt_steps"].append(n)
        w.join()
        if not durable:
            raise RuntimeError(f"{m.name}: a save in the training loop failed")
        out["durable_s"].append(durable[0])
    return out


# ---------------------------------------------------------------- main

def init_dist(work: str) -> None:
    """A one-rank gloo group: ``dcp.async_save`` and torch-checkpointing need one."""
    import torch.distributed as dist

    store = os.path.abspath(os.path.join(work, "store"))  # (relative: a URL host)
    if os.path.exists(store):
        os.remove(store)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (also the context length)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--every", type=int, default=4, help="training steps between checkpoints in the loop")
    ap.add_argument("--rounds", type=int, default=3, help="checkpoints per method in the training loop")
    ap.add_argument("--experts", type=int, default=0, help="experts per layer: a mixture of experts (0: GPT-2)")
    ap.add_argument("--methods",
                    default="ckpt eager,ckpt lazy,torch.save,safetensors,dcp.save,dcp.async_save,torch-checkpointing")
    ap.add_argument("--loop-methods", default="ckpt eager,ckpt lazy,torch.save,dcp.async_save")
    a = ap.parse_args()
    work = os.path.abspath(a.dir)
    os.makedirs(work, exist_ok=True)
    init_dist(work)
    t_all = time.perf_counter()
    tr = Trainer(a)
    live = tensors(tr.model, tr.opt)
    state_bytes = unique_bytes(live)
    params = sum(p.numel() for p in tr.model.parameters())
    fl = floors(reference(tr), work, a.repeats)
    del live
    out = {
        "torch": torch.__version__, "model": tr.desc, "layers": a.layers, "width": a.width, "vocab": a.vocab,
        "experts": a.experts,
        "seq": a.seq, "batch": a.batch, "params": params, "state_bytes": state_bytes,
        "tensors": len(tensors(tr.model, tr.opt)), "repeats": a.repeats, "rounds": a.rounds, "every": a.every,
        "threads": torch.get_num_threads(), "cores": os.cpu_count(), "floors": fl, "methods": [], "loops": [],
    }
    makers = {
        **MAKERS,
        # Retention as a training run sets it (the disk holds two checkpoints).
        "ckpt eager": lambda work: Ckpt(work, lazy=False, keep_last=2),
        "ckpt lazy": lambda work: Ckpt(work, lazy=True, keep_last=2),
        "dcp.async_save": lambda work: DcpAsync(work, loads=False),  # dcp.save's files and load
    }
    loop_methods = [s.strip() for s in a.loop_methods.split(",") if s.strip()]
    for _ in range(2):
        tr.step()  # warm: the first steps of a process are slower
    for name in [s.strip() for s in a.methods.split(",") if s.strip()]:
        row: dict = {"name": name}
        m = makers[name](work).bind(tr.model, tr.opt)
        try:
            m.prepare()
        except Exception as e:  # noqa: BLE001 - any import failure skips the method
            row["skipped"] = f"{type(e).__name__}: {e}"
            out["methods"].append(row)
            continue
        t = time.perf_counter()
        try:
            row["first_stall_s"] = [first_save(makers[name], work, tr)]
            row.update(save_and_load(m, tr, a, state_bytes))
            t1 = time.perf_counter()
            if name in loop_methods:
                out["loops"].append({"name": name, **train_rounds(tr, m, a, 100)})
            print(f"{name}: saves and loads {t1 - t:.1f} s, loop {time.perf_counter() - t1:.1f} s",
                  file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - a method that fails at this size is said, the others go on
            # (torch-checkpointing sends each tensor's storage to its writer
            # process as a file descriptor: thousands of tensors run out of them.)
            traceback.print_exc()
            row = {"name": name, "skipped": f"failed: {type(e).__name__}: {e}"[:300]}
        out["methods"].append(row)
        try:
            m.close()
        except Exception:  # noqa: BLE001 - after a failure above
            traceback.print_exc()
        shutil.rmtree(m.dir, ignore_errors=True)
    # The floors again at the end, and the lower of the two (the machine is shared).
    try:
        fl2 = floors(reference(tr), work, a.repeats)
    except OSError:  # (a method that failed above may hold all of the process's file descriptors)
        traceback.print_exc()
        fl2 = fl
    for k in ("memcpy_s", "write_fsync_s", "read_cold_s"):
        fl[k] = min(fl[k], fl2[k])
    out["total_s"] = time.perf_counter() - t_all
    print(json.dumps(out), flush=True)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        raise
