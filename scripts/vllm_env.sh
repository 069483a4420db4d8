#!/usr/bin/env bash
# Create or update a separate virtual environment with vLLM for the tests in tests/vllm/.
# Usage: scripts/vllm_env.sh VENV_PATH
# Idempotent: re-running on an existing venv only installs what is missing.
# Why these steps (../shared/spec/vllm-integration.md §5):
#  - torch 2.13.0 first, so pip takes the local CPU wheel and vLLM's `torch==2.13.0` pin is met by it;
#  - vllm 0.32.0: 0.30-0.32 pin torch 2.13.0 and install beside the CPU torch, 0.33 pulls a CUDA torch;
#  - torchvision/torchaudio/torchcodec come as CUDA builds and break `from vllm.config import ...`
#    on a CPU torch, and nothing we run needs them, so they are removed.
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: $0 VENV_PATH" >&2
    exit 2
fi
venv="$1"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet)

"${pip[@]}" install torch==2.13.0
"${pip[@]}" install vllm==0.32.0
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"${pip[@]}" install --no-deps -e "$repo"
"${pip[@]}" install numpy scipy safetensors tqdm pytest
