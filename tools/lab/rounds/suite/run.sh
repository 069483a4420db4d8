#!/usr/bin/env bash
# The whole GPU suite in one call (issue 34's last goal: it passes after the step refactor).
# Usage, from the checkout's root on the GPU machine, carrying .gpu:
#   bash tools/lab/rounds/suite/run.sh COMMIT [SECONDS]
set -u
source tools/lab/rounds/rank/env.sh "$1"  # CuTe DSL, apache-tvm-ffi, the package layout, the commit
cd /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
timeout "${2:-540}" python3 -m pytest "$R/tests/gpu" -q -rsx --durations=25 -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
echo "gpu suite rc=$?"
grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
