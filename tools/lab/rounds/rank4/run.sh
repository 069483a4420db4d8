#!/usr/bin/env bash
# Issue 36, fourth part: pass 2's K split of the MXFP4 expert kernel, in one call of <= 9 minutes on an H100 or
# H200 (tools/lab/rounds/rank4/README.md). From the checkout's root on the GPU machine, carrying .gpu:
#   source .gpu/env.sh && bash tools/lab/rounds/rank4/run.sh COMMIT
set -u
source tools/lab/rounds/rank/env.sh "$1"  # CuTe DSL, apache-tvm-ffi, the package layout, the commit
cd /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
# 1. the split against float64 (per pair and through the op), and the combine that adds the splits
timeout 150 python3 -m pytest "$R/tests/gpu/test_moe_gpu.py" "$R/tests/gpu/test_triton_kernels_gpu.py" -q \
  -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
# 2. the rank at 8k, B = 1 and 2, T = 1 and 8: unsplit (the default), auto, and 2 and 4 splits everywhere
timeout 270 python3 "$R/experiments/step_bench.py" --target k3-rank --layers auto --batch 1,2 --context 8192 \
  --tokens 1,8 --steps 10 --eager-steps 2 --setting '' --setting moe_pass2_splits=auto \
  --setting moe_pass2_splits=2 --setting moe_pass2_splits=4 \
  --out "$OUT/step_bench_rank_splits.json" > "$OUT/step_bench_rank_splits.log" 2>&1
echo "rank bench rc=$?"; grep -E "^B=|step_bench:|Error" "$OUT/step_bench_rank_splits.log" | tail -20
# 3. the k3-slice, unsplit and auto (its 8 slots a layer at batch 1)
timeout 90 python3 "$R/experiments/step_bench.py" --target k3-slice --batch 1 --context 8192 --tokens 1,8 \
  --steps 20 --setting '' --setting moe_pass2_splits=auto \
  --out "$OUT/step_bench_slice_splits.json" > "$OUT/step_bench_slice_splits.log" 2>&1
echo "slice bench rc=$?"; grep -E "^B=|Error" "$OUT/step_bench_slice_splits.log" | tail -6
python3 "$R/tools/lab/rounds/rank2/summary.py" "$OUT/step_bench_rank_splits.json" "$OUT/step_bench_slice_splits.json" \
  | tee "$OUT/summary.txt"
