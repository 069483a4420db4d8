# limit: 330
# The rank at B = 1, 8k: the defaults, then the selection in one warp, then the logits of up to 4 rows
# in one launch (T = 1 has 1 row, T = 8 has 8: the second setting changes T = 1 only).
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers auto --batch 1 --context 8192 --tokens 1,8 \
  --steps 10 --eager-steps 2 --setting '' --setting route_warps=1 --setting router_gemv_rows=4 \
  --out "$JOB_OUT/step_bench_rank_router.json" 2>&1 | grep -E "^B=|step_bench:|Error"
