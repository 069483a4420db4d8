# limit: 400
# The A/B again in the other order (the old five launches first), B = 1 and 4, 20 steps a point: the
# machine's run-to-run noise beside the difference.
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1,4 --context 8192 --tokens 1,8 \
  --steps 20 --eager-steps 1 --setting rank_dispatch_gemm=0 --setting '' \
  --out "$JOB_OUT/step_bench_rank_dispatch_repeat.json" 2>&1 | grep -E "^B=|step_bench:|Error"
