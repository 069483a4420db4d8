# limit: 200
# Job 50's A/B again in the other order (the fused launch first), B = 1: the machine's noise beside the difference.
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1 --context 8192 --tokens 1,8 \
  --steps 20 --eager-steps 1 --setting moe_lists=fused --setting '' \
  --out "$JOB_OUT/step_bench_rank_lists_repeat.json" 2>&1 | grep -E "^B=|step_bench:|Error"
