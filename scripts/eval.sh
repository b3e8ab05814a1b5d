#!/usr/bin/env bash
# Runs ckpt-eval's default suite on local disk (the scratch directory is under
# runs/, on the same disk as the repo). Installs what it needs first.
# Extra arguments go to ckpt-eval, e.g. `./scripts/eval.sh --repeats 5`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$PWD/.venv/bin:$HOME/.cargo/bin:$PATH"
export CKPT_PYTHON="$PWD/.venv/bin/python"
# What the `torch` feature (tch on the venv's libtorch) needs to build and run.
source scripts/env.sh
cargo build --release -q -p ckpt-eval --features mpi,hdf5
exec ./target/release/ckpt-eval "$@"
