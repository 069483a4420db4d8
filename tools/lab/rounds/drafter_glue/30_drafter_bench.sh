# limit: 150
python3 "$REPO/experiments/drafter_bench.py" --contexts 8192 --out "$JOB_OUT/drafter_bench.json"
