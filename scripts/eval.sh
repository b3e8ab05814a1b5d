#!/usr/bin/env bash
# Runs ckpt-eval's default suite on local disk (the scratch directory is under
# runs/, on the same disk as the repo). Installs what it needs first.
# Extra arguments go to ckpt-eval, e.g. `./scripts/eval.sh --repeats 5`.
#
# Order, for the first report's sake on a fresh machine: the venv in the
# background from the start (PyTorch's download needs no Debian package), the
# Debian packages meanwhile (ckpt-eval's build needs libhdf5, OpenMPI,
# libclang and libzstd, not PyTorch: it has no `torch` feature) while
# ckpt-eval's release build compiles what needs none of them, then the rest
# of that build, beside what is left of the venv's making, then the ckpt Python
# package (the Python experiments' ckpt rows) in the same target directory
# with the `eval-build` feature, which
# gives the crates both share the same features: the package's build then
# compiles only its own crates (PyO3, the extension, the ckpt command), about
# 30 crate builds instead of 280. Both are done before the suite starts (a
# build running beside a benchmark would skew it). Garage (S3 tests only) is
# never built here.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
help=0
case " $* " in
  *" -h "*|*" --help "*|*" help "*) help=1 ;;
esac
mkdir -p runs
# The venv (PyTorch's download) needs none of the Debian packages: it is made
# while they install, and while ckpt-eval builds.
CKPT_SKIP_APT=1 CKPT_SKIP_GARAGE=1 CKPT_SKIP_BINDINGS=1 ./scripts/setup.sh &
venv_pid=$!
# The build environment every script shares (scripts/env.sh). zstd comes from
# Debian's libzstd, which setup.sh installs: said now, so that the build that
# starts before it is installed sees what the later one will.
export ZSTD_SYS_USE_PKG_CONFIG=1
source scripts/env.sh
# S3 support is always built (the `s3` experiment runs given an S3 URL): the
# Python package has it anyway, and the two builds share those crates.
features=mpi,hdf5,s3
if [ ! -x target/release/ckpt-eval ]; then
  echo "[eval] building ckpt-eval (release) while the Python venv is made, then the ckpt Python package on top of it (usually 5-7 min the first time on 2 cores) ..." >&2
fi
# Without the release profile's line tables: 15% less CPU for this build
# (measured: 246 s against 288 s of CPU time on 2 cores) and a binary of 11 MB
# instead of 76; a panic's backtrace then names functions without lines.
export CARGO_PROFILE_RELEASE_DEBUG=0
# While the Debian packages install, everything that needs none of them is
# compiled (most of the crates): this build goes on past the crates that need
# them (--keep-going) and fails there, on a fresh machine; the one below,
# once they are installed, waits for it (cargo's lock) and does the rest. Where
# they are installed already, it is the whole build, and the next one finds
# nothing to do.
cargo build --release -q --keep-going -p ckpt-eval --features "$features" >runs/build-before-debian-packages.log 2>&1 &
early_pid=$!
if ! CKPT_SKIP_GARAGE=1 CKPT_SKIP_PYTHON=1 ./scripts/setup.sh; then
  kill "$venv_pid" "$early_pid" 2>/dev/null || true
  exit 1
fi
cargo build --release -q -p ckpt-eval --features "$features" >runs/build-ckpt-eval.log 2>&1 &
build_pid=$!
if ! wait "$venv_pid"; then
  kill "$build_pid" 2>/dev/null || true
  wait "$build_pid" 2>/dev/null || true
  exit 1
fi
# Again, now that the venv exists: libtorch's directory for the `torch` feature.
source scripts/env.sh
bindings_pid=
if [ "$help" = 0 ]; then
  # A no-op when the package in .venv is current. Cargo waits for
  # ckpt-eval's build to finish with the target directory, then reuses it.
  CKPT_MATURIN_FEATURES=eval-build CKPT_SKIP_GARAGE=1 ./scripts/setup.sh >runs/setup-python-package.log 2>&1 &
  bindings_pid=$!
fi
if ! wait "$build_pid"; then
  echo "[eval] building ckpt-eval failed (runs/build-ckpt-eval.log):" >&2
  tail -20 runs/build-ckpt-eval.log >&2 || true
  [ -z "$bindings_pid" ] || kill "$bindings_pid" 2>/dev/null || true
  exit 1
fi
cat runs/build-ckpt-eval.log >&2
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
