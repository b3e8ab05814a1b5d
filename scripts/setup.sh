#!/usr/bin/env bash
# Idempotent setup of everything ckpt's commands need on a fresh Debian machine
# (run as root). A second run only checks and returns.
#   - Debian packages: libhdf5, OpenMPI, libclang (for the mpi crate), pkg-config
#   - the Python venv in .venv with PyTorch, safetensors, h5py, pytest, maturin
#   - the ckpt Python package (bindings/) built and installed into .venv
#   - Garage (S3-compatible server) from crates.io, cached in ~/.cargo/bin
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '[setup] %s\n' "$*" >&2; }

# --- Debian packages ---------------------------------------------------------
# g++: torch-sys (the torch feature) compiles its C++ wrapper of libtorch.
APT_PACKAGES=(libhdf5-dev hdf5-tools libopenmpi-dev openmpi-bin libclang-dev clang pkg-config g++)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- Rust ----------------------------------------------------------------------
if ! command -v cargo >/dev/null; then
  [ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
fi
command -v cargo >/dev/null || { log "cargo not found: install Rust (rustup) first"; exit 1; }

# --- Python venv ---------------------------------------------------------------
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  "$PY" -m venv .venv
fi
req_hash=$(sha256sum scripts/requirements.txt | cut -c1-16)
if [ "$(cat .venv/.requirements 2>/dev/null)" != "$req_hash" ]; then
  log "installing Python packages (PyTorch is large; the first time takes a minute or two)"
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -r scripts/requirements.txt
  echo "$req_hash" > .venv/.requirements
fi

# --- The ckpt Python package (bindings/, PyO3 built by maturin) -----------------
# Rebuilt and reinstalled into .venv only when a source it is made of changed.
bindings_hash=$(find bindings/src bindings/python core/src formats/src -type f \
    \( -name '*.rs' -o -name '*.py' -o -name '*.pyi' -o -name 'py.typed' \) | LC_ALL=C sort \
  | xargs cat Cargo.lock bindings/Cargo.toml bindings/pyproject.toml core/Cargo.toml formats/Cargo.toml \
  | sha256sum | cut -c1-16)
if [ "$(cat .venv/.ckpt-bindings 2>/dev/null)" != "$bindings_hash" ]; then
  log "building and installing the ckpt Python package (release build; a few minutes the first time)"
  .venv/bin/pip install -q --no-deps --no-build-isolation --force-reinstall ./bindings
  echo "$bindings_hash" > .venv/.ckpt-bindings
fi

# --- Garage (S3-compatible server for the S3 tests) ----------------------------
if [ "${CKPT_SKIP_GARAGE:-0}" != 1 ] && ! command -v garage >/dev/null && [ ! -x "$HOME/.cargo/bin/garage" ]; then
  log "building Garage 2.5 from crates.io (once per machine, about 9 minutes on 2 cores)"
  cargo install garage --locked --version 2.5.0 >/dev/null 2>&1
fi
log "ready"
