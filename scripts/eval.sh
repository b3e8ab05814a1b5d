#!/usr/bin/env bash
# Runs ckpt-eval's default suite on local disk (the scratch directory is under
# runs/, on the same disk as the repo). Installs what it needs first.
# Extra arguments go to ckpt-eval, e.g. `./scripts/eval.sh --repeats 5`.
# The ckpt Python package (the `python` and `sharded` experiments' ckpt rows)
# is built alongside ckpt-eval, in its own target directory so that neither
# build waits for the other's lock, and both are done before the suite starts
# (a build running beside a benchmark would skew it). Garage (S3 tests only) is
# never built here.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
CKPT_SKIP_GARAGE=1 CKPT_SKIP_BINDINGS=1 ./scripts/setup.sh
export PATH="$PWD/.venv/bin:$HOME/.cargo/bin:$PATH"
export CKPT_PYTHON="$PWD/.venv/bin/python"
# What the `torch` feature (tch on the venv's libtorch) needs to build and run.
source scripts/env.sh
help=0
case " $* " in
  *" -h "*|*" --help "*|*" help "*) help=1 ;;
esac
bindings_pid=
mkdir -p runs
if [ "$help" = 0 ]; then
  # A no-op when the package in .venv is current.
  CARGO_TARGET_DIR="$PWD/target/py" CKPT_SKIP_GARAGE=1 ./scripts/setup.sh >runs/setup-python-package.log 2>&1 &
  bindings_pid=$!
fi
if [ ! -x target/release/ckpt-eval ]; then
  echo "[eval] building ckpt-eval and the ckpt Python package side by side (release; usually 5-6 min the first time on 2 cores) ..." >&2
fi
# S3 support (the `s3` experiment) only when asked for: it adds the AWS client to the build.
features=mpi,hdf5
case " $* " in
  *" s3 "*|*" --s3-url"*) features=$features,s3 ;;
esac
if [ -n "${CKPT_EVAL_S3_URL:-}" ]; then features=$features,s3; fi
cargo build --release -q -p ckpt-eval --features "$features"
if [ -n "$bindings_pid" ]; then
  if wait "$bindings_pid"; then
    echo "[eval] ckpt Python package ready" >&2
  else
    # The Python experiments then say at the top of the report that they did not run, and why.
    echo "[eval] building the ckpt Python package failed (runs/setup-python-package.log):" >&2
    tail -5 runs/setup-python-package.log >&2 || true
  fi
fi
echo "[eval] ready after $((SECONDS - start)) s; running the suite" >&2
status=0
./target/release/ckpt-eval "$@" || status=$?
[ "$help" = 1 ] || echo "[eval] finished $((SECONDS - start)) s after starting" >&2
exit "$status"
