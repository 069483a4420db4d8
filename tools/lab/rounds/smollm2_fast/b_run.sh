#!/usr/bin/env bash
# Session calls B, C, ... : B carries part 2, its manifest and the gguf wheel, and joins the GGUF
# first; every call then runs (or resumes) the recipe with the same settings until it exits 0.
# Usage: bash tools/lab/rounds/smollm2_fast/b_run.sh COMMIT STEPS [join]
set -u
R=$PWD
source tools/lab/device_env.sh
export DSPARK_GIT_COMMIT=$1
steps=$2
python3 -m pip install -q --no-index --no-deps --target /tmp/site experiments/stage/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PYTHONPATH
if [ "${3:-}" = join ]; then
  python3 experiments/smollm2_dspark.py keep --keep-dir /tmp/smollm2 && \
    python3 experiments/smollm2_dspark.py join --keep-dir /tmp/smollm2 || exit 1
fi
timeout 570 python3 experiments/smollm2_dspark.py run --gguf /tmp/smollm2/smollm2.gguf --work-dir /tmp/smollm2/work \
  --init-layers 25,26,27,28,29 --lr 1.2e-3 --steps $steps --eval-every $steps --speed-prompts 2 \
  --profile-json /tmp/smollm2/profile_train.json --time-limit $((550 - SECONDS)) \
  --out $OUT/smollm2_dspark.json > $OUT/run.log 2>&1
echo "run rc $?"
tail -30 $OUT/run.log
