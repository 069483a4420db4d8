#!/usr/bin/env bash
# tools/lab/rounds/capture_flex/README.md. Usage, from the checkout's root on the GPU machine (no .gpu carried:
# the profile reads experiments/data/smollm2_selfdistil_58278.npz, which a CuTe call leaves aside):
#   bash tools/lab/rounds/capture_flex/run.sh COMMIT
set -u
R=$PWD
source tools/lab/device_env.sh
export DSPARK_GIT_COMMIT=$1
(cd /tmp && timeout 240 python3 -m pytest "$R/tests/gpu/test_dspark_train_gpu.py" "$R/tests/gpu/test_draft_loss_gpu.py" -q -p no:cacheprovider \
  > "$OUT/gpu_tests_train.log" 2>&1; echo "gpu tests rc $?"; tail -4 "$OUT/gpu_tests_train.log")
timeout 330 python3 experiments/smollm2_profile.py --pieces capture,train --held-out-prompts 0 \
  --out "$OUT/smollm2_profile.json" > "$OUT/profile.log" 2>&1
echo "profile rc $?"; tail -9 "$OUT/profile.log"
# The train step again with anchor buckets of 128 (three compiled shapes) in place of the data's one 384-anchor shape.
timeout $((585 - SECONDS)) python3 experiments/smollm2_profile.py --pieces train --anchor-bucket 128 --held-out-prompts 0 \
  --out "$OUT/smollm2_profile_anchor128.json" > "$OUT/profile_anchor128.log" 2>&1
echo "profile anchor128 rc $?"; tail -4 "$OUT/profile_anchor128.log"
