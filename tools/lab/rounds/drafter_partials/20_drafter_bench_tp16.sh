# limit: 200
python3 "$REPO/experiments/drafter_bench.py" --world 16 --contexts 8192 --setting '' --setting draft_output_partials=0 \
  --out "$JOB_OUT/drafter_bench_tp16.json"
