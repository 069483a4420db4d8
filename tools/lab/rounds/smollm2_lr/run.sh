#!/usr/bin/env bash
# tools/lab/rounds/smollm2_lr/README.md. Usage, from the checkout's root on the GPU machine:
#   bash tools/lab/rounds/smollm2_lr/run.sh COMMIT profile   # call A: keep part 1, profile the step
#   bash tools/lab/rounds/smollm2_lr/run.sh COMMIT keep      # call B: keep part 2
#   bash tools/lab/rounds/smollm2_lr/run.sh COMMIT join      # call C: keep part 3, join, run the A/B
#   bash tools/lab/rounds/smollm2_lr/run.sh COMMIT           # later calls: resume the A/B
set -u
source tools/lab/device_env.sh
export DSPARK_GIT_COMMIT=$1
mode=${2:-run}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$mode" != run ]; then
  python3 experiments/smollm2_dspark.py keep --keep-dir /tmp/smollm2 || exit 1
fi
if [ "$mode" = profile ]; then
  timeout $((560 - SECONDS)) python3 experiments/smollm2_profile.py --pieces train --held-out-prompts 0 \
    --out "$OUT/smollm2_profile_train.json" > "$OUT/profile.log" 2>&1
  echo "profile rc $?"; tail -25 "$OUT/profile.log"; exit 0
fi
[ "$mode" = keep ] && exit 0
if [ "$mode" = join ]; then
  python3 experiments/smollm2_dspark.py join --keep-dir /tmp/smollm2 || exit 1
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/site experiments/stage/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PYTHONPATH
# Each peak a whole WSD schedule of 1,000 steps from the same start, batches and anchors; every batch
# captured per step (--cache-gib 0: the A/B's 48k sequences are not worth a store of a third of them).
timeout $((575 - SECONDS)) python3 experiments/smollm2_dspark.py run --gguf /tmp/smollm2/smollm2.gguf \
  --work-dir /tmp/smollm2/work --variants dspark --init-layers 25,26,27,28,29 \
  --lr-ab 6e-4,1.2e-3,2e-3 --lr-ab-steps 1000 --only-lr-ab --only-train --cache-gib 0 \
  --capture-file '' --time-limit $((555 - SECONDS)) --out "$OUT/smollm2_lr_ab.json" > "$OUT/run.log" 2>&1
echo "run rc $? (3: stopped early; done once the log names the best peak)"
grep -E "step [0-9]+|held-out|phase|best" "$OUT/run.log" | tail -16
tail -3 "$OUT/run.log"
