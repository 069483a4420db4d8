# limit: 220
# The rank at B = 1, 8k, its defaults (the combine unrolled; the paired mix this round first timed lost and is gone).
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers auto --batch 1 --context 8192 --tokens 1,8 \
  --steps 10 --eager-steps 2 --setting '' \
  --out "$JOB_OUT/step_bench_rank.json" 2>&1 | grep -E "^B=|step_bench:|Error"
