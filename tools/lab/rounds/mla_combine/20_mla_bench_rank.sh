# limit: 150
# A TP16 rank's 6 heads: the attention and its split combine per call, over a split sweep.
python3 "$REPO/experiments/mla_bench.py" --heads 6 --tokens 1 8 --contexts 8192 32768 --split-sweep 8 16 32 44 64 \
  --variants no_cluster --out "$JOB_OUT/mla_bench_tp16.json" | grep -v "^  T="
