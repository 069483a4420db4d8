#!/usr/bin/env bash
# tools/lab/rounds/smollm2_10k/README.md. Usage, from the checkout's root on the GPU machine:
#   bash tools/lab/rounds/smollm2_10k/run.sh COMMIT keep          # calls A and B: keep the part carried
#   bash tools/lab/rounds/smollm2_10k/run.sh COMMIT keep-pack     # session 2: keep a GGUF part and/or pack parts
#   bash tools/lab/rounds/smollm2_10k/run.sh COMMIT join          # call C: keep part 3, join, then run
#   bash tools/lab/rounds/smollm2_10k/run.sh COMMIT               # later calls: resume the run
# VARIANTS (dspark or dflash_ablation) picks the drafter this session trains; FINISHED, the other's pack;
# STOP_AT, the step of the 10,000-step schedule its training ends at (where the packed one stopped);
# CACHE_GIB, the capture store's GiB (default auto: what the GPU holds; 1: a small store that fills in seconds);
# EXTRA_ARGS, more options of smollm2_dspark.py run (e.g. --no-compiled-capture);
# CHECKS=0, call A without the training path's GPU tests and the profile (when both ran at this commit).
set -u
R=$PWD
source tools/lab/device_env.sh
export DSPARK_GIT_COMMIT=$1
mode=${2:-run}
if [ "$mode" != run ]; then
  # a keep-pack call may carry pack parts alone (a GGUF part and two pack parts exceed a call's 64 MiB)
  if [ "$mode" != keep-pack ] || ls experiments/stage/smollm2.gguf.part* > /dev/null 2>&1; then
    python3 experiments/smollm2_dspark.py keep --keep-dir /tmp/smollm2 || exit 1
  fi
  if [ "$mode" = keep-pack ]; then
    mkdir -p /tmp/smollm2/pack
    if [ -d experiments/stage/pack ]; then cp experiments/stage/pack/* /tmp/smollm2/pack/ || exit 1; fi
    echo "pack parts kept: $(ls /tmp/smollm2/pack/drafters.safetensors.part* 2> /dev/null | wc -l)"; exit 0
  fi
  if [ "$mode" = keep ] && [ ! -f /tmp/smollm2/.tested ] && [ "${CHECKS:-1}" = 1 ]; then  # call A: the training path's GPU tests
    (cd /tmp && timeout 150 python3 -m pytest "$R/tests/gpu/test_dspark_train_gpu.py" \
      "$R/tests/gpu/test_transfer_gpu.py" -q -p no:cacheprovider > "$OUT/gpu_tests_train.log" 2>&1
     echo "gpu tests rc $?"; tail -4 "$OUT/gpu_tests_train.log"); touch /tmp/smollm2/.tested
    # and the step and the capture as this commit runs them (the run copies them into its results)
    timeout 200 python3 experiments/smollm2_profile.py --pieces capture,train --held-out-prompts 0 \
      --out /tmp/smollm2/smollm2_profile.json > "$OUT/profile.log" 2>&1
    echo "profile rc $?"; tail -6 "$OUT/profile.log"; cp /tmp/smollm2/smollm2_profile.json "$OUT/" 2>/dev/null
  fi
  [ "$mode" = keep ] && exit 0
  python3 experiments/smollm2_dspark.py join --keep-dir /tmp/smollm2 || exit 1
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/site experiments/stage/gguf-0.19.0-py3-none-any.whl 2>/dev/null
export PYTHONPATH=/tmp/site:$PYTHONPATH
extra=()
[ "${VARIANTS:-dspark}" = dspark ] && extra=(--only-train)
if [ -n "${FINISHED:-}" ]; then
  [ -f "$FINISHED" ] || python3 experiments/smollm2_dspark.py join --keep-dir /tmp/smollm2/pack \
    --file drafters.safetensors || exit 1
  extra=(--finished "$FINISHED")
fi
# The step's profile from call A on this machine, else the committed ones (each names its device)
profile=()
if [ -f /tmp/smollm2/smollm2_profile.json ]; then profile=(--profile-json /tmp/smollm2/smollm2_profile.json)
else
  for f in experiments/results/*/smollm2_profile_train.json; do
    [ -f "$f" ] && profile+=(--profile-json "$f")
  done
fi
timeout $((575 - SECONDS)) python3 experiments/smollm2_dspark.py run --gguf /tmp/smollm2/smollm2.gguf \
  --work-dir /tmp/smollm2/work --variants "${VARIANTS:-dspark}" "${extra[@]}" \
  --init-layers 25,26,27,28,29 --lr 1.2e-3 --steps 10000 ${STOP_AT:+--stop-at "$STOP_AT"} --eval-every 2500 \
  --cache-gib "${CACHE_GIB:-auto}" ${EXTRA_ARGS:-} \
  --speed-prompts 2 --capture-file '' "${profile[@]}" --time-limit $((555 - SECONDS)) --out "$OUT/smollm2_dspark.json" > "$OUT/run.log" 2>&1
echo "run rc $?"
grep -E "capture store|step [0-9]+|held-out|phase" "$OUT/run.log" | tail -12
tail -3 "$OUT/run.log"
