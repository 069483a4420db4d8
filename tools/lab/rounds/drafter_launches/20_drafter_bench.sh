# limit: 120
python3 "$REPO/experiments/drafter_bench.py" --out "$JOB_OUT/drafter_bench.json"
