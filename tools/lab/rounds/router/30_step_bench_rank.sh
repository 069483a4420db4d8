# limit: 330
# The rank at B = 1, 8k: the defaults (the one-row router logits in one launch), then cuBLAS's logits again
# (router_gemv_rows=0). The one-warp selection this round first timed lost and is gone.
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers auto --batch 1 --context 8192 --tokens 1,8 \
  --steps 10 --eager-steps 2 --setting '' --setting router_gemv_rows=0 \
  --out "$JOB_OUT/step_bench_rank_router.json" 2>&1 | grep -E "^B=|step_bench:|Error"
