#!/usr/bin/env bash
# The CUDA checks in one run, for a machine with an NVIDIA GPU, Python and
# PyTorch but no Rust toolchain. The ckpt extension comes as a wheel built
# elsewhere (on the stable ABI, so one wheel serves any Python from 3.11):
#
#   scripts/wheel.sh                                        # where Rust is
#   scripts/gpu-check.sh wheels/ckpt-*.whl OUT [--quick|--ckpt|--lazy|--restore]   # on the GPU machine
#
# It installs the wheel into a private directory (no network, no other
# package; with the peers' pure-Python wheels wheel.sh put in peers/ beside
# it), then runs, each bounded in time and logged under OUT:
#   1. the CUDA tests, bindings/tests/test_cuda.py (they skip without a GPU),
#      then the stall of a save by phase (evaluator/python/gpu_stall.py, 24
#      layers of width 256: the tensors of step 2's model, in little memory)
#      with fused AdamW and with PyTorch's default (foreach: each step count
#      a CPU tensor), in OUT/stall-{fused,foreach}.json;
#   2. the `gpu` experiment's benchmark, evaluator/python/gpu_bench.py, at its
#      default size (a GPT-style model with about 4 GiB of model and optimizer
#      state) with every method, its JSON in OUT/gpu-4g.json (plain lazy also
#      restores with its host slab locked after the read and during it, the
#      other ways);
#   3. the memory tier's restore and restart benchmark,
#      evaluator/python/memtier_bench.py (1 GiB per rank: memory against local
#      disk with the page cache dropped, on this host's cores), in
#      OUT/memtier.json;
#   4. unless --quick, the same as 2 with about 15 GiB of state (24 layers of
#      2048), ckpt lazy (plain and with device staging) beside the control,
#      without restores (about 25 s each at this size; step 2 measures them),
#      in OUT/gpu-15g.json.
# --ckpt is for a short lent machine once the peers were measured: step 2 with
# ckpt's methods and the control only, no step 3, then step 4. --lazy is
# shorter still: step 2 with lazy mode (plain, with device staging for all of
# the state and for half of it) and plain eager beside the control, over 5
# rounds, then step 4. --restore is for where a restore's time goes: the
# CUDA tests, then step 2 with plain lazy alone (one short round) restoring 3
# times each way (its slab locked during the read, the default; in the
# background once copied; after the read), each
# restore's phases in the JSON; nothing else.
# The JSONs are what `ckpt-eval gpu` renders as the report's tables where it
# runs the benchmark itself; the run ends with a few lines per method of what
# they say (scripts/gpu_summary.py). With GPU_CHECK_BUDGET=SECONDS the whole run ends
# within that time: each step gets what is left (at most its own limit) and
# a step with under 30 s left is not started, so a lent machine's time is
# never overrun. Checkpoints go to $CKPT_GPU_SCRATCH (default:
# runs/gpu-scratch, on the disk of the repository), removed afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 2 ]; then
  sed -n '2,43p' "$0" >&2
  exit 2
fi
wheel=$1 out=$2 quick=${3:-}
py=${PYTHON:-python3}
mkdir -p "$out"
site=$(mktemp -d)
scratch=$(realpath -m "${CKPT_GPU_SCRATCH:-runs/gpu-scratch}")
trap 'rm -rf "$site" "$scratch"' EXIT
peers=("$(dirname "$wheel")"/peers/*.whl)
[ -e "${peers[0]}" ] || peers=()
"$py" -m pip install -q --no-index --no-deps --target "$site" "$wheel" "${peers[@]}"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'EOF' | tee "$out/versions.txt"
import ckpt, torch
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(f"ckpt {ckpt.__version__}, torch {torch.__version__}, {dev}")
import importlib.metadata as md
for peer in ("torch-checkpointing",):
    try:
        print(f"{peer} {md.version(peer)}")
    except md.PackageNotFoundError:
        print(f"{peer}: not installed (its rows are left out)")
import os
def first(path):
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError as e:
        return f"unreadable ({e.strerror})"
# What host-side figures depend on: cores, and whether the slabs' memory gets huge pages.
print(f"{os.cpu_count()} cores; transparent huge pages: {first('/sys/kernel/mm/transparent_hugepage/enabled')}, "
      f"defrag: {first('/sys/kernel/mm/transparent_hugepage/defrag')}")
EOF
cuda=$("$py" -c "import torch; print(int(torch.cuda.is_available()))")
status=0
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-100000}))
step() {  # step NAME SECONDS CMD...: run CMD bounded, its output in OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 30 ]; then
    echo "[gpu-check] $name: not run, $left s of the budget left" >&2
    status=1
    return
  fi
  [ "$left" -ge "$limit" ] || limit=$left
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  echo "[gpu-check] $name: exit $rc after $((SECONDS - t0)) s; last lines:" >&2
  tail -4 "$out/$name.log" >&2
  [ "$rc" = 0 ] || status=1
}
step test_cuda 180 "$py" -m pytest -q -p no:cacheprovider bindings/tests/test_cuda.py
if [ "$cuda" != 1 ]; then
  echo "[gpu-check] no CUDA device: the benchmark needs one (the CUDA tests skipped)" >&2
  exit "$status"
fi
[ "$quick" = "--restore" ] || for opt in fused foreach; do
  step "stall-$opt" 120 "$py" evaluator/python/gpu_stall.py --dir "$scratch/stall" --json "$out/stall-$opt.json" \
    --width 256 --saves 5 --optimizer "$opt"
done
methods=()
case "$quick" in
  --ckpt) methods=(--methods "none,ckpt lazy,ckpt lazy (device staging),ckpt eager,ckpt eager (locked ahead),ckpt lazy (memory tier)") ;;
  --lazy) methods=(--methods "none,ckpt lazy,ckpt lazy (device staging),ckpt lazy (half staged),ckpt eager" --rounds 5) ;;
  --restore) methods=(--methods "ckpt lazy" --rounds 1 --every 10 --restore-repeats 3) ;;
esac
step gpu-4g 900 "$py" evaluator/python/gpu_bench.py --dir "$scratch/4g" --json "$out/gpu-4g.json" --restore-ways later,after \
  "${methods[@]}"
if [ "$quick" != "--ckpt" ] && [ "$quick" != "--lazy" ] && [ "$quick" != "--restore" ]; then
  step memtier 300 "$py" evaluator/python/memtier_bench.py --dir "$scratch/memtier" --gib 1 --repeats 3 \
    --json "$out/memtier.json"
fi
if [ "$quick" != "--quick" ] && [ "$quick" != "--restore" ]; then
  step gpu-15g 900 "$py" evaluator/python/gpu_bench.py --dir "$scratch/15g" --json "$out/gpu-15g.json" \
    --layers 24 --width 2048 --rounds 2 --no-restore --methods "none,ckpt lazy,ckpt lazy (device staging)"
fi
"$py" scripts/gpu_summary.py "$out" || true  # the JSONs in a few lines each
exit "$status"
