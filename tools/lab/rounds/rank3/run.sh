#!/usr/bin/env bash
# Issue 36, third part: two calls of <= 9 minutes on an H100 or H200 (tools/lab/rounds/rank3/README.md).
# Usage, from the checkout's root on the GPU machine: bash tools/lab/rounds/rank3/run.sh COMMIT 1|2|3
# (3: one call, right after the whole GPU suite has run at COMMIT: tools/lab/rounds/rank3/README.md)
set -u
source tools/lab/rounds/rank/env.sh "$1"  # the same set-up as the first rank round
part=$2
cd /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"
if [ "$part" = 3 ]; then
  # the drafter at a TP16 rank's share and at full width (kernels per propose, floor)
  for world in 16 1; do
    timeout 100 python3 "$R/experiments/drafter_bench.py" --world $world --contexts 8192 --repeats 20 \
      --out "$OUT/drafter_bench_tp$world.json" > "$OUT/drafter_bench_tp$world.log" 2>&1
    echo "drafter bench world $world rc=$?"; tail -3 "$OUT/drafter_bench_tp$world.log"
  done
  # the rank at 8k, B = 1, 2, 4, 8, T = 1 and 8: the defaults, then the skinny GEMM's 32- and 64-row tiles
  timeout 330 python3 "$R/experiments/step_bench.py" --target k3-rank --layers auto --batch 1,2,4,8 --context 8192 \
    --tokens 1,8 --steps 10 --eager-steps 2 --setting '' --setting linear_hopper_rows=64 \
    --out "$OUT/step_bench_rank.json" > "$OUT/step_bench_rank.log" 2>&1
  echo "rank bench rc=$?"; grep -E "^B=|step_bench:|Error" "$OUT/step_bench_rank.log" | tail -20
  timeout 60 python3 "$R/experiments/step_bench.py" --target k3-slice --batch 1 --context 8192 --tokens 1,8 \
    --steps 20 --out "$OUT/step_bench.json" > "$OUT/step_bench_slice.log" 2>&1
  echo "slice bench rc=$?"; grep -E "^B=|Error" "$OUT/step_bench_slice.log" | tail -4
  timeout 15 python3 -m dspark.cli roofline --measured "$OUT/step_bench_rank.json" > "$OUT/projection.txt" 2>&1
  tail -12 "$OUT/projection.txt"
  python3 "$R/tools/lab/rounds/rank2/summary.py" "$OUT/step_bench_rank.json" "$OUT/step_bench.json" | tee "$OUT/summary.txt"
elif [ "$part" = 1 ]; then
  # 1. the skinny GEMM's new 32- and 64-row tiles and the router's selection (one reduction per pick)
  #    against their float64 references
  timeout 170 python3 -m pytest "$R/tests/gpu/test_linear_gpu.py" "$R/tests/gpu/test_triton_kernels_gpu.py" -q \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -4 "$OUT/gpu_tests.log"
  timeout 60 python3 "$R/experiments/router_bench.py" --out "$OUT/router_bench.json" > "$OUT/router_bench.log" 2>&1
  echo "router bench rc=$?"; tail -8 "$OUT/router_bench.log"
  # 2. the rank's 32- and 64-row steps (B = 4 and 8 at T = 8): cuBLAS (the default) against the tiles
  timeout 250 python3 "$R/experiments/step_bench.py" --target k3-rank --layers auto --batch 4,8 --context 8192 \
    --tokens 8 --steps 10 --eager-steps 2 --setting '' --setting linear_hopper_rows=64 \
    --out "$OUT/step_bench_rank_rows.json" > "$OUT/step_bench_rank_rows.log" 2>&1
  echo "rank bench (rows) rc=$?"; grep -E "^B=|step_bench:|Error" "$OUT/step_bench_rank_rows.log" | tail -8
  python3 "$R/tools/lab/rounds/rank2/summary.py" "$OUT/step_bench_rank_rows.json" | tee "$OUT/summary_rows.txt"
else
  # 3. the rank at 8k and 32k, B = 1, 2, 4, 8, T = 1 and 8, defaults (rows are written as they
  #    finish: a timeout keeps the points done)
  timeout 330 python3 "$R/experiments/step_bench.py" --target k3-rank --layers auto --batch 1,2,4,8 \
    --context 8192,32768 --tokens 1,8 --steps 10 --eager-steps 2 --out "$OUT/step_bench_rank.json" \
    > "$OUT/step_bench_rank.log" 2>&1
  echo "rank bench rc=$?"; grep -E "^B=|step_bench:|Error" "$OUT/step_bench_rank.log" | tail -20
  # 4. the k3-slice (no regression), the projection, the table
  timeout 60 python3 "$R/experiments/step_bench.py" --target k3-slice --batch 1 --context 8192 --tokens 1,8 \
    --steps 20 --out "$OUT/step_bench.json" > "$OUT/step_bench_slice.log" 2>&1
  echo "slice bench rc=$?"; grep -E "^B=|Error" "$OUT/step_bench_slice.log" | tail -4
  # 5. the drafter's propose at one TP16 rank's share (config.rank_share), against its floor
  timeout 120 python3 "$R/experiments/drafter_bench.py" --world 16 --contexts 8192 --repeats 20 \
    --out "$OUT/drafter_bench_tp16.json" > "$OUT/drafter_bench_tp16.log" 2>&1
  echo "drafter bench rc=$?"; tail -3 "$OUT/drafter_bench_tp16.log"
  timeout 15 python3 -m dspark.cli roofline --measured "$OUT/step_bench_rank.json" > "$OUT/projection.txt" 2>&1
  tail -12 "$OUT/projection.txt"
  python3 "$R/tools/lab/rounds/rank2/summary.py" "$OUT/step_bench_rank.json" "$OUT/step_bench.json" | tee "$OUT/summary.txt"
fi
