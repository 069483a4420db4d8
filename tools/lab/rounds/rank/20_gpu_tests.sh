#!/usr/bin/env bash
# Issue 36, call 2 (~5 min): the rank's GPU tests and the K3 target's. Usage: bash .../20_gpu_tests.sh COMMIT
set -u
source tools/lab/rounds/rank/env.sh "$1"
cd /tmp
timeout 560 python3 -m pytest $R/tests/gpu/test_k3_rank_gpu.py $R/tests/gpu/test_step_bench_rank_gpu.py \
  $R/tests/gpu/test_k3_target_gpu.py -q -s -p no:cacheprovider > $OUT/gpu_tests_rank.log 2>&1
tail -30 $OUT/gpu_tests_rank.log
