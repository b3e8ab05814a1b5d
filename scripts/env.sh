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
