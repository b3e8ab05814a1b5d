# shellcheck shell=bash
# Environment for building and running ckpt with every feature, sourced by
# scripts/test.sh, scripts/eval.sh and .ci/run (after scripts/setup.sh made the venv).
#
# The `torch` feature links `tch` against the venv's PyTorch: torch-sys asks the
# venv's `python` where libtorch is (LIBTORCH_USE_PYTORCH=1, VIRTUAL_ENV set so it
# runs `python` from PATH), and binaries find libtorch at run time through
# LD_LIBRARY_PATH.
_ckpt_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export VIRTUAL_ENV="$_ckpt_root/.venv"
export PATH="$_ckpt_root/.venv/bin:$HOME/.cargo/bin:$PATH"
export CKPT_PYTHON="$_ckpt_root/.venv/bin/python"
export LIBTORCH_USE_PYTORCH=1
for _ckpt_torch_lib in "$_ckpt_root"/.venv/lib/python3*/site-packages/torch/lib; do
  if [ -d "$_ckpt_torch_lib" ]; then
    case ":${LD_LIBRARY_PATH:-}:" in
      *":$_ckpt_torch_lib:"*) ;;
      *) export LD_LIBRARY_PATH="$_ckpt_torch_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ;;
    esac
  fi
done
unset _ckpt_root _ckpt_torch_lib
# zstd: link Debian's libzstd (libzstd-dev, which setup.sh installs) instead of
# compiling zstd's C sources in every build (25 s of a core in a release build
# of ckpt-eval, 7% of its CPU). Crates built without this environment (a user's
# `cargo add ckpt-core`) keep zstd-sys's own static build. Given here so that
# every build of the repository's scripts agrees: a change would rebuild
# everything above zstd-sys.
if [ -z "${ZSTD_SYS_USE_PKG_CONFIG+x}" ] && pkg-config --exists libzstd 2>/dev/null; then
  export ZSTD_SYS_USE_PKG_CONFIG=1
fi
