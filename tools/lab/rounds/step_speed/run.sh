#!/usr/bin/env bash
# tools/lab/rounds/step_speed/README.md. Usage, from the checkout's root on the GPU machine (nothing carried):
#   [LIMIT=SECONDS] [PIECES=capture] bash tools/lab/rounds/step_speed/run.sh COMMIT
#   (LIMIT: the call's seconds, default 585; PIECES: the profile's, default capture,train)
set -u
LIMIT=${LIMIT:-585}
R=$PWD
source tools/lab/device_env.sh
export DSPARK_GIT_COMMIT=$1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
(cd /tmp && timeout 200 python3 -m pytest "$R/tests/gpu/test_dspark_train_gpu.py" "$R/tests/gpu/test_draft_loss_gpu.py" -q -p no:cacheprovider \
  > "$OUT/gpu_tests_train.log" 2>&1; echo "gpu tests rc $?"; tail -4 "$OUT/gpu_tests_train.log")
timeout 150 python3 experiments/draft_loss_bench.py --out "$OUT/draft_loss_bench.json" > "$OUT/draft_loss_bench.log" 2>&1
echo "draft_loss_bench rc $?"; tail -12 "$OUT/draft_loss_bench.log"
timeout $((LIMIT - SECONDS)) python3 experiments/smollm2_profile.py --pieces "${PIECES:-capture,train}" --anchor-bucket 128 \
  --held-out-prompts 0 --out "$OUT/smollm2_profile.json" > "$OUT/profile.log" 2>&1
echo "profile rc $?"; tail -11 "$OUT/profile.log"
