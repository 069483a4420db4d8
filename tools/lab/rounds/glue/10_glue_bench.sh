# limit: 200
python3 "$REPO/experiments/glue_bench.py" --out "$JOB_OUT/glue_bench.json" 2>&1 | tail -60
