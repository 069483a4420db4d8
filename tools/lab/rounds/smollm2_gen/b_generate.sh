#!/usr/bin/env bash
# Call B of tools/lab/rounds/smollm2_gen/README.md: join the GGUF, generate for SECONDS, return the work folder.
set -u
commit=$1; seconds=$2
source tools/lab/device_env.sh; export DSPARK_GIT_COMMIT=$commit
python3 experiments/smollm2_dspark.py keep --keep-dir /tmp/smollm2 && \
  python3 experiments/smollm2_dspark.py join --keep-dir /tmp/smollm2 || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site experiments/stage/gguf-0.19.0-py3-none-any.whl
export PYTHONPATH=/tmp/site:$PYTHONPATH
mkdir -p /tmp/gen
if ls experiments/stage/gen_work/gen_work.tgz.a? > /dev/null 2>&1; then  # an earlier session's waves
  cat experiments/stage/gen_work/gen_work.tgz.a? | tar xzf - -C /tmp/gen
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
timeout $((seconds + 60)) python3 experiments/smollm2_generate.py --gguf /tmp/smollm2/smollm2.gguf \
  --out /tmp/gen/smollm2_selfdistil.npz --work-dir /tmp/gen/work --time-limit "$seconds" \
  --parts-dir "$OUT/selfdistil" > "$OUT/gen.log" 2>&1
echo "generate rc=$?"
tail -c 1500 "$OUT/gen.log"
tar czf /tmp/gen_work.tgz -C /tmp/gen work && split -b 15M /tmp/gen_work.tgz "$OUT/gen_work.tgz."
ls -la "$OUT" /tmp/gen/work | tail -8
