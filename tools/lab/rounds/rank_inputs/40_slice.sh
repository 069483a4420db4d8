# limit: 240
# The slice at B = 1, T = 1 and 8 (exact routing, up to 128 pairs): the defaults, then the per-row fused lists.
python3 "$REPO/experiments/step_bench.py" --target k3-slice --batch 1 --context 8192 --tokens 1,8 \
  --steps 10 --eager-steps 1 --setting '' --setting moe_lists=fused \
  --out "$JOB_OUT/step_bench_slice_lists_per_row.json" 2>&1 | grep -E "^B=|step_bench:|Error"
