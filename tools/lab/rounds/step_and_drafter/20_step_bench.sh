# limit: 240
python3 "$REPO/experiments/step_bench.py" --batch 1 --context 8192 --tokens 1,8 --steps 30 \
  --setting "" --setting moe_combine=torch --setting token_gather=torch --out "$JOB_OUT/step_bench.json"
