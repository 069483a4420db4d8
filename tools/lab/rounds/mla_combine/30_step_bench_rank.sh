# limit: 200
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers auto --batch 1 --context 8192 --tokens 1,8 \
  --steps 10 --eager-steps 2 --out "$JOB_OUT/step_bench_rank.json" 2>&1 | grep -E "^B=|step_bench:|Error"
