# limit: 200
# The fused lists on the whole-model slice (exact routing, 16 experts a token: up to 128 pairs at T = 8), B = 1.
python3 "$REPO/experiments/step_bench.py" --target k3-slice --batch 1 --context 8192 --tokens 1,8 \
  --steps 20 --eager-steps 1 --setting '' --setting moe_lists=fused \
  --out "$JOB_OUT/step_bench_slice_lists.json" 2>&1 | grep -E "^B=|step_bench:|Error"
