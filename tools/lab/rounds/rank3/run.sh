#!/usr/bin/env bash
# Issue 36, third part: ONE call of <= 9 minutes on an H100 or H200 (tools/lab/rounds/rank3/README.md).
# Usage, from the checkout's root on the GPU machine: bash tools/lab/rounds/rank3/run.sh COMMIT
set -u
source tools/lab/rounds/rank/env.sh "$1"  # the same set-up as the first rank round
cd /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
# 1. the router's selection kernel (one reduction per pick now) against the reference, then its time
timeout 60 python3 -m pytest "$R/tests/gpu/test_triton_kernels_gpu.py" -q -p no:cacheprovider \
  > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
timeout 60 python3 "$R/experiments/router_bench.py" --out "$OUT/router_bench.json" > "$OUT/router_bench.log" 2>&1
echo "router bench rc=$?"; tail -8 "$OUT/router_bench.log"
# 2. the rank at 8k and 32k, B = 1, 2, 4, 8, T = 1 and 8, defaults (rows are written as they finish:
#    a timeout keeps the points done)
timeout 330 python3 "$R/experiments/step_bench.py" --target k3-rank --layers auto --batch 1,2,4,8 \
  --context 8192,32768 --tokens 1,8 --steps 10 --eager-steps 2 --out "$OUT/step_bench_rank.json" \
  > "$OUT/step_bench_rank.log" 2>&1
echo "rank bench rc=$?"; grep -E "^B=|step_bench:|Error" "$OUT/step_bench_rank.log" | tail -20
# 3. the k3-slice (no regression)
timeout 60 python3 "$R/experiments/step_bench.py" --target k3-slice --batch 1 --context 8192 --tokens 1,8 --steps 20 \
  --out "$OUT/step_bench.json" > "$OUT/step_bench_slice.log" 2>&1
echo "slice bench rc=$?"; grep -E "^B=|Error" "$OUT/step_bench_slice.log" | tail -4
# 4. the projection from the rank's measured step, and the table
timeout 15 python3 -m dspark.cli roofline --measured "$OUT/step_bench_rank.json" > "$OUT/projection.txt" 2>&1
tail -12 "$OUT/projection.txt"
python3 "$R/tools/lab/rounds/rank2/summary.py" "$OUT/step_bench_rank.json" "$OUT/step_bench.json" | tee "$OUT/summary.txt"
