#!/usr/bin/env bash
# Issue 36, call 1 (<= 9.5 min): the k3-rank step bench (batch 1 first; on an 80 GB H100 the most
# layers that fit, per-layer figures labelled), the k3-slice bench for the no-regression check,
# and the projection from the rank's measured step. Usage: bash tools/lab/rounds/rank/10_bench.sh COMMIT
set -u
source tools/lab/rounds/rank/env.sh "$1"
cd /tmp
timeout 330 python3 $R/experiments/step_bench.py --target k3-rank --layers auto --batch 1,2,4,8 --context 8192,32768 \
  --tokens 1,8 --steps 20 --eager-steps 3 --out $OUT/step_bench_rank.json > $OUT/step_bench_rank.log 2>&1
tail -25 $OUT/step_bench_rank.log
timeout 120 python3 $R/experiments/step_bench.py --target k3-slice --batch 1 --context 8192 --tokens 1,8 --steps 30 \
  --out $OUT/step_bench.json > $OUT/step_bench_slice.log 2>&1
tail -12 $OUT/step_bench_slice.log
python3 -m dspark.cli roofline --measured $OUT/step_bench_rank.json 2>&1 | tee $OUT/projection.txt | tail -40
python3 -m dspark.cli roofline --json --measured $OUT/step_bench_rank.json > $OUT/projection.json 2>&1
