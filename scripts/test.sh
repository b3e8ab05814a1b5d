#!/usr/bin/env bash
# Runs every test of ckpt: Rust unit, integration, doc tests (all features),
# S3 tests against a Garage node on loopback, and the Python suites.
# Installs what it needs first (scripts/setup.sh is idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export PATH="$PWD/.venv/bin:$HOME/.cargo/bin:$PATH"
export CKPT_PYTHON="$PWD/.venv/bin/python"
# What the `torch` feature (tch on the venv's libtorch) needs to build and run.
source scripts/env.sh

# A Garage node on loopback for the S3 tests; stopped on exit, whatever happens.
if [ "${CKPT_SKIP_GARAGE:-0}" != 1 ]; then
  echo "== starting Garage (S3) on loopback"
  trap './scripts/garage.sh stop' EXIT
  # Assigned first: `eval "$(cmd)"` would hide a failed start (eval of nothing
  # succeeds) and the S3 tests would then fail for want of credentials.
  garage_env=$(./scripts/garage.sh start)
  eval "$garage_env"
  [ -n "${AWS_ENDPOINT:-}" ] || { echo "Garage started but printed no AWS_ENDPOINT" >&2; exit 1; }
fi

# The ckpt command as its default build makes it (no libtorch: a workspace build
# with every feature links ckpt-core with `torch` into every binary).
echo "== cargo test -p ckpt-cli (default features)"
cargo test -p ckpt-cli

echo "== cargo test (workspace, all features)"
cargo test --workspace --all-features --no-fail-fast

echo "== Python types (mypy on the package, stubtest of the native module's stub)"
python -m mypy --config-file bindings/pyproject.toml bindings/python/ckpt
# From the repository root, so it checks the installed extension against the
# stub installed beside it (setup.sh reinstalls both whenever a source changed).
python -m mypy.stubtest ckpt._ckpt --allowlist bindings/stubtest-allowlist.txt

echo "== Python import graph (import-linter: no cycle, no import up the layers)"
PYTHONPATH="$PWD/bindings/python" lint-imports bindings/.importlinter

echo "== Python tests (bindings, examples)"
python -m pytest -q bindings/tests

echo "== all tests passed"
