#!/usr/bin/env bash
# Create or update a separate virtual environment with vLLM for the tests in tests/vllm/.
# Usage: scripts/vllm_env.sh VENV_PATH
# Then: VENV_PATH/bin/python -m pytest tests/vllm   (about 2 minutes to build from scratch here)
#
# Why these steps (docs/vllm-integration.md §5):
#  - torch 2.13.0 first, so pip takes the local CPU wheel and vLLM's `torch==2.13.0` pin is met by it;
#  - vllm 0.32.0: 0.30-0.32 pin torch 2.13.0 and install beside the CPU torch; 0.33 pulls a CUDA torch;
#  - torchvision/torchaudio/torchcodec come as CUDA builds and break `from vllm.config import ...`
#    on a CPU torch; nothing we run needs them, so they are removed;
#  - dspark itself without its dependencies (torch is already there), then the ones the tests use
#    plus matplotlib (a declared dspark dependency; without it pip reports a broken environment).
# Idempotent: an existing venv with vllm 0.32.0 skips the vLLM install (pip would otherwise bring
# torchvision/torchaudio/torchcodec back on every run).
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: $0 VENV_PATH" >&2
    exit 2
fi
venv="$1"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vllm_version=0.32.0

# Quiet pip; drop the warnings about missing local index directories that this machine's global pip
# configuration produces for every package.
pip_quiet() {
    "$venv/bin/python" -m pip --quiet "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"

if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$vllm_version')" 2>/dev/null; then
    pip_quiet install torch==2.13.0
    pip_quiet install "vllm==$vllm_version"
    pip_quiet uninstall -y torchvision torchaudio torchcodec
fi
pip_quiet install --no-deps -e "$repo"
pip_quiet install numpy scipy safetensors tqdm pytest matplotlib
