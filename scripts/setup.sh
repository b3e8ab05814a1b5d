#!/usr/bin/env bash
# Idempotent setup of everything ckpt's commands need on a fresh Debian machine
# (run as root). A second run only checks and returns.
#   - Debian packages: libhdf5, OpenMPI, libclang (for the mpi crate), pkg-config
#   - the Python venv in .venv with PyTorch, safetensors, h5py, pytest, maturin
#   - the ckpt Python package (bindings/) built and installed into .venv
#   - Garage (S3-compatible server) from crates.io, cached in ~/.cargo/bin
# CKPT_SKIP_GARAGE=1 leaves Garage out (only the S3 tests use it; eval.sh skips it),
# CKPT_SKIP_APT=1 the Debian packages (eval.sh makes the venv while another
# setup.sh installs them), CKPT_SKIP_BINDINGS=1 the Python package, CKPT_SKIP_PYTHON=1 the venv and the
# package (eval.sh builds ckpt-eval, which needs neither, while the venv is made).
# Each step says what it does, how long it usually takes the first time on a
# 2-core machine, and how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup] %s\n' "$*" >&2; }
_step_start=0
# begin WHAT USUAL: announce a step; done_step: say how long it took.
begin() { _step_start=$SECONDS; log "$1 (usually $2 the first time) ..."; }
done_step() { log "  done in $((SECONDS - _step_start)) s"; }

# --- Debian packages ---------------------------------------------------------
# g++: torch-sys (the torch feature) compiles its C++ wrapper of libtorch.
# libzstd-dev: zstd-sys links it instead of compiling zstd (scripts/env.sh).
APT_PACKAGES=(libhdf5-dev hdf5-tools libopenmpi-dev openmpi-bin libclang-dev clang pkg-config g++ libzstd-dev)
missing=()
[ "${CKPT_SKIP_APT:-0}" = 1 ] && APT_PACKAGES=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  begin "installing Debian packages: ${missing[*]}" "1-2 min"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  done_step
fi

# --- Rust ----------------------------------------------------------------------
if ! command -v cargo >/dev/null; then
  [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
fi
command -v cargo >/dev/null || { log "cargo not found: install Rust (rustup) first"; exit 1; }

if [ "${CKPT_SKIP_PYTHON:-0}" = 1 ]; then
  CKPT_SKIP_BINDINGS=1
else
# --- Python venv ---------------------------------------------------------------
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
req_hash=$(sha256sum scripts/requirements.txt | cut -c1-16)
if [ "$(cat .venv/.requirements 2>/dev/null)" != "$req_hash" ]; then
  begin "installing Python packages (PyTorch, transformers, ...; PyTorch is large)" "10-60 s"
  # uv (from PyPI) downloads and unpacks in parallel; bytecode is compiled
  # at install, as pip does (a process run with PYTHONDONTWRITEBYTECODE would
  # otherwise compile torch at every import). Measured on 2 cores with empty
  # caches: pip 65 s and 63 s of CPU; uv about half the CPU, which eval.sh's
  # Rust build, running beside it, gets back. pip is the fallback.
  if .venv/bin/pip install -q "uv>=0.5,<1" && \
      .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python -r scripts/requirements.txt; then
    :
  else
    log "  uv failed; installing with pip"
    .venv/bin/pip install -q --upgrade pip >/dev/null
    .venv/bin/pip install -q -r scripts/requirements.txt
  fi
  echo "$req_hash" > .venv/.requirements
  done_step
fi
fi

# --- The ckpt Python package (bindings/, PyO3 built by maturin) -----------------
# Rebuilt and reinstalled into .venv only when a source it is made of changed.
bindings_hash=$(find bindings/src bindings/python core/src formats/src cli/src -type f \
    \( -name '*.rs' -o -name '*.py' -o -name '*.pyi' -o -name 'py.typed' \) | LC_ALL=C sort \
  | xargs cat Cargo.lock bindings/Cargo.toml bindings/pyproject.toml core/Cargo.toml formats/Cargo.toml cli/Cargo.toml \
  | sha256sum | cut -c1-16)
if [ "${CKPT_SKIP_BINDINGS:-0}" != 1 ] && [ "$(cat .venv/.ckpt-bindings 2>/dev/null)" != "$bindings_hash" ]; then
  begin "building and installing the ckpt Python package and its ckpt command (release build)" "4-6 min"
  # The wheel is stripped (pyproject.toml), so the release profile's line
  # tables would be compiled for nothing (they cost ckpt-eval's release
  # build 15% of its CPU time).
  # CKPT_MATURIN_FEATURES: extra cargo features of the extension (eval.sh's
  # `eval-build`, see bindings/Cargo.toml).
  extra=${CKPT_MATURIN_FEATURES:+--features $CKPT_MATURIN_FEATURES}
  # The same build environment as every other build of the scripts (zstd).
  source scripts/env.sh
  CARGO_PROFILE_RELEASE_DEBUG=0 MATURIN_PEP517_ARGS="${MATURIN_PEP517_ARGS:-} $extra" \
    .venv/bin/pip install -q --no-deps --no-build-isolation --force-reinstall ./bindings
  echo "$bindings_hash" > .venv/.ckpt-bindings
  done_step
fi

# --- Garage (S3-compatible server for the S3 tests) ----------------------------
if [ "${CKPT_SKIP_GARAGE:-0}" != 1 ] && ! command -v garage >/dev/null && [ ! -x "$HOME/.cargo/bin/garage" ]; then
  begin "building Garage 2.5 from crates.io for the S3 tests (once per machine)" "9 min"
  cargo install garage --locked --version 2.5.0 >/dev/null 2>&1
  done_step
fi
log "ready"
