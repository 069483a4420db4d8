#!/usr/bin/env bash
# Session 1's last call (tools/lab/rounds/smollm2_10k/README.md): pack the trained DSpark, return its parts.
set -u
source tools/lab/device_env.sh
python3 experiments/smollm2_dspark.py pack --work-dir /tmp/smollm2/work --keep-dir /tmp/smollm2/pack > "$OUT/pack.json" || exit 1
cp /tmp/smollm2/pack/drafters.safetensors.part* /tmp/smollm2/pack/drafters.safetensors.manifest.json "$OUT/"
cp /tmp/smollm2/work/results.json "$OUT/smollm2_dspark_train.json"
ls -la "$OUT"
