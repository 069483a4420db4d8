#!/usr/bin/env bash
# The whole GPU suite in one call (issue 34's last goal: it passes after the step refactor).
# Usage, from the checkout's root on the GPU machine, carrying .gpu:
#   bash tools/lab/rounds/suite/run.sh COMMIT [SECONDS [TEST_FILE...]]   (test files: relative to tests/gpu)
set -u
commit=$1; limit=${2:-540}; shift; shift
source tools/lab/rounds/rank/env.sh "$commit"  # CuTe DSL, apache-tvm-ffi, the package layout, the commit
cd /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
tests=("$R/tests/gpu"); [ $# -gt 0 ] && tests=("${@/#/$R/tests/gpu/}")
timeout "$limit" python3 -m pytest "${tests[@]}" -q -rsxP --durations=25 -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
echo "gpu suite rc=$?"
grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
