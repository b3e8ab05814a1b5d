#!/usr/bin/env bash
# Runs ckpt-eval's default suite on local disk (the scratch directory is under
# runs/, on the same disk as the repo). Installs what it needs first.
# Extra arguments go to ckpt-eval, e.g. `./scripts/eval.sh --repeats 5`.
# The suite needs neither Garage (S3 tests only) nor the ckpt Python package, so
# the first report comes before they are built; the Python package (and its
# `ckpt` command) is built once the suite is done, Garage by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
CKPT_SKIP_GARAGE=1 CKPT_SKIP_BINDINGS=1 ./scripts/setup.sh
export PATH="$PWD/.venv/bin:$HOME/.cargo/bin:$PATH"
export CKPT_PYTHON="$PWD/.venv/bin/python"
# What the `torch` feature (tch on the venv's libtorch) needs to build and run.
source scripts/env.sh
if [ ! -x target/release/ckpt-eval ]; then
  echo "[eval] building ckpt-eval (release; usually 4-5 min the first time on 2 cores) ..." >&2
fi
start=$SECONDS
# S3 support (the `s3` experiment) only when asked for: it adds the AWS client to the build.
features=mpi,hdf5
case " $* " in
  *" s3 "*|*" --s3-url"*) features=$features,s3 ;;
esac
if [ -n "${CKPT_EVAL_S3_URL:-}" ]; then features=$features,s3; fi
cargo build --release -q -p ckpt-eval --features "$features"
echo "[eval] ckpt-eval ready after $((SECONDS - start)) s; running the suite" >&2
status=0
./target/release/ckpt-eval "$@" || status=$?
# Afterwards (not for --help): the Python package and the `ckpt` command in .venv
# (a no-op when current).
case " $* " in
  *" -h "*|*" --help "*) ;;
  *) CKPT_SKIP_GARAGE=1 ./scripts/setup.sh || true ;;
esac
exit "$status"
