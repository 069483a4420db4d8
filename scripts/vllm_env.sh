#!/usr/bin/env bash
# Create or update a separate virtual environment with vLLM for the tests in tests/vllm/.
# Usage: scripts/vllm_env.sh VENV_PATH
# Then: VENV_PATH/bin/python -m pytest tests/vllm   (about 2 minutes to build from scratch here)
#
# Why these steps (docs/vllm-integration.md §5):
#  - torch 2.13.0 first, so pip takes the local CPU wheel and vLLM's `torch==2.13.0` pin is met by it;
#  - vllm 0.32.0: 0.30-0.32 pin torch 2.13.0 and install beside the CPU torch; 0.33 pulls a CUDA torch;
#  - vLLM itself without its dependencies, then its requirements less GPU_ONLY: the GPU kernel
#    libraries (with the CUDA runtimes they pull) and the media decoders. Nothing the tests import
#    needs them; torchvision/torchaudio/torchcodec would even break `from vllm.config import ...`
#    on a CPU torch;
#  - xgrammar without its dependencies (NO_DEPS below), which keeps triton out: ~1 GB less;
#  - no byte-code compiled at install (--no-compile): ~0.4 GB of __pycache__ for modules that the
#    tests never import (an import compiles what it uses). The environment is ~2.6 GB (~6 GB with
#    everything);
#  - dspark itself without its dependencies (torch is already there), then the ones the tests use
#    plus matplotlib (a declared dspark dependency).
# pip's conflict report is switched off: it would list GPU_ONLY as missing on every install.
# Idempotent: a venv where that install completed skips it.
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: $0 VENV_PATH" >&2
    exit 2
fi
venv="$1"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
vllm_version=0.32.0
# vLLM requirements left out (canonical names); see above.
GPU_ONLY="torchvision torchaudio torchcodec pynvvideocodec flashinfer-python tilelang tokenspeed-mla
nvidia-cutlass-dsl humming-kernels quack-kernels nvidia-cudnn-frontend fastsafetensors instanttensor nvtx"
# Installed without their own dependencies: xgrammar's are vLLM's too (apache-tvm-ffi among them,
# which xgrammar imports), but for triton (1 GB, only for its GPU kernels; the tests import vLLM
# without it). The CI machine's disk once ran out while this environment was built.
NO_DEPS="xgrammar"

# Quiet pip; drop the warnings about missing local index directories that this machine's global pip
# configuration produces for every package.
pip_quiet() {
    "$venv/bin/python" -m pip --quiet "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"

# Written last, once vLLM's requirements are in: its presence marks a complete install.
requirements="$venv/vllm-requirements.txt"
if ! { [ -f "$requirements" ] && "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$vllm_version')" 2>/dev/null; }; then
    pip_quiet install --no-compile torch==2.13.0
    pip_quiet install --no-compile --no-deps "vllm==$vllm_version"
    "$venv/bin/python" - "$GPU_ONLY" "$NO_DEPS" "$requirements.no-deps" > "$requirements.partial" <<'PY'
import importlib.metadata, sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
left_out, no_deps = set(sys.argv[1].split()), set(sys.argv[2].split())
with open(sys.argv[3], "w") as without_deps:
    for line in importlib.metadata.requires("vllm"):
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name not in left_out:
            requirement.marker = None
            print(requirement, file=without_deps if name in no_deps else sys.stdout)
PY
    pip_quiet install --no-compile --no-warn-conflicts -r "$requirements.partial"
    pip_quiet install --no-compile --no-warn-conflicts --no-deps -r "$requirements.no-deps"
    mv "$requirements.partial" "$requirements"
fi
pip_quiet install --no-warn-conflicts --no-deps -e "$repo"
pip_quiet install --no-warn-conflicts numpy scipy safetensors tqdm pytest matplotlib
