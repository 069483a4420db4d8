#!/usr/bin/env bash
# Issue 36, second part: ONE call of <= 9 minutes on an H100 (tools/lab/rounds/rank2/README.md).
# Usage, from the checkout's root on the GPU machine: bash tools/lab/rounds/rank2/run.sh COMMIT
set -u
source tools/lab/rounds/rank/env.sh "$1"  # the same set-up as the first rank round
cd /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
# 1. (skipped with RANK2_SKIP_TESTS=1, when the whole suite ran in the call before)
#    the GPU tests of this work: the new kernels (MoE tail input, MLA cache write, the rank's split
#    GEMMs with either reduction, Triton PDL in a graph), the rank's first 4 layers at B = 1, 2, 4
#    against the reference kernels, the rank bench's rows and its launch accounting
if [ "${RANK2_SKIP_TESTS:-0}" != 1 ]; then
timeout 170 python3 -m pytest "$R/tests/gpu/test_k3_kernels_gpu.py" "$R/tests/gpu/test_k3_rank_gpu.py" \
  "$R/tests/gpu/test_step_bench_rank_gpu.py" -q -s -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -12 "$OUT/gpu_tests.log"
#    and what the changes touch elsewhere: the MoE block (one output GEMM) on CUDA against the CPU,
#    the Triton glue kernels (now with a PDL prologue, compiled out by default), the K3 target
timeout 60 python3 -m pytest "$R/tests/gpu/test_moe_gpu.py" "$R/tests/gpu/test_triton_kernels_gpu.py" \
  "$R/tests/gpu/test_k3_target_gpu.py" -k "block_on_cuda or triton_kernels_gpu or tiny_cuda_logits" -q \
  -p no:cacheprovider > "$OUT/gpu_tests_regression.log" 2>&1
echo "regression gpu tests rc=$?"; tail -6 "$OUT/gpu_tests_regression.log"
fi
# 2. the rank at 8k, batch 1, 2, 4, T = 1 and 8: the defaults, then the fused split-K reduction, then
#    it with Triton PDL (rows are written as they finish: a timeout keeps the points done)
timeout 220 python3 "$R/experiments/step_bench.py" --target k3-rank --layers auto --batch 1,2,4 --context 8192 \
  --tokens 1,8 --steps 10 --eager-steps 2 --setting '' --setting linear_fused_reduce=1 \
  --setting linear_fused_reduce=1,triton_pdl=1 --out "$OUT/step_bench_rank.json" > "$OUT/step_bench_rank.log" 2>&1
echo "rank bench rc=$?"; grep -E "^B=|step_bench:|Error" "$OUT/step_bench_rank.log" | tail -20
# 3. the k3-slice (no regression: 1.17x / 1.15x of its floor on the H100)
timeout 60 python3 "$R/experiments/step_bench.py" --target k3-slice --batch 1 --context 8192 --tokens 1,8 --steps 20 \
  --out "$OUT/step_bench.json" > "$OUT/step_bench_slice.log" 2>&1
echo "slice bench rc=$?"; grep -E "^B=|Error" "$OUT/step_bench_slice.log" | tail -4
# 4. the projection from the rank's measured step
timeout 15 python3 -m dspark.cli roofline --measured "$OUT/step_bench_rank.json" > "$OUT/projection.txt" 2>&1
tail -12 "$OUT/projection.txt"
# 5. the table
python3 "$R/tools/lab/rounds/rank2/summary.py" "$OUT/step_bench_rank.json" "$OUT/step_bench.json" | tee "$OUT/summary.txt"
