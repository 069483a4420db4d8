#!/usr/bin/env bash
# Session 1's last calls (tools/lab/rounds/smollm2_10k/README.md): pack the trained DSpark and bring its parts
# back. A call returns at most 8 files and 64 MiB, and the pack is larger, so:
#   bash tools/lab/rounds/smollm2_10k/pack.sh        # packs; returns the results, the manifest and the first parts
#   bash tools/lab/rounds/smollm2_10k/pack.sh more   # the next parts (repeat until it prints "all parts returned")
set -u
source tools/lab/device_env.sh
keep=/tmp/smollm2/pack
if [ "${1:-}" != more ]; then
  python3 experiments/smollm2_dspark.py pack --work-dir /tmp/smollm2/work --keep-dir "$keep" > "$OUT/pack.json" || exit 1
  cp "$keep/drafters.safetensors.manifest.json" "$OUT/"
  cp /tmp/smollm2/work/results.json "$OUT/smollm2_dspark_train.json"
  : > "$keep/.returned"
fi
files=$(ls "$OUT" | wc -l); bytes=$(du -cb "$OUT"/* 2>/dev/null | tail -1 | cut -f1)
for part in $(ls "$keep"/drafters.safetensors.part* | sort -V); do
  name=$(basename "$part"); size=$(stat -c %s "$part")
  grep -qx "$name" "$keep/.returned" && continue
  [ $((files + 1)) -le 8 ] && [ $((bytes + size)) -le $((60 * 1024 * 1024)) ] || break
  cp "$part" "$OUT/" && echo "$name" >> "$keep/.returned"
  files=$((files + 1)); bytes=$((bytes + size))
done
left=$(( $(ls "$keep"/drafters.safetensors.part* | wc -l) - $(wc -l < "$keep/.returned") ))
ls -la "$OUT"
if [ "$left" -gt 0 ]; then echo "$left parts left: pack.sh more"; else echo "all parts returned"; fi
