#!/usr/bin/env bash
# Session call A (carry experiments/stage/smollm2.gguf.part1 and its manifest): keep part 1, the
# training path's GPU tests, the step before and after (random weights at SmolLM2's shapes, the
# recipe's first batch). Usage: bash tools/lab/rounds/smollm2_fast/a_keep_test_profile.sh COMMIT
set -u
R=$PWD
source tools/lab/device_env.sh
export DSPARK_GIT_COMMIT=$1
python3 experiments/smollm2_dspark.py keep --keep-dir /tmp/smollm2 || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(cd /tmp && timeout 200 python3 -m pytest $R/tests/gpu/test_dspark_train_gpu.py -q -x -p no:cacheprovider \
  > $OUT/gpu_tests_train.log 2>&1; echo "tests rc $?"); tail -4 $OUT/gpu_tests_train.log
timeout 250 python3 experiments/smollm2_profile.py --pieces train --held-out-prompts 0 \
  --out /tmp/smollm2/profile_train.json > $OUT/profile.log 2>&1; echo "profile rc $?"
cp /tmp/smollm2/profile_train.json $OUT/ 2>/dev/null; tail -25 $OUT/profile.log
