# limit: 120
# The TP16 share's propose at 8k: the partials off first this time (drafter_partials/ ran the default first),
# then the defaults, then triton_pdl=1.
python3 "$REPO/experiments/drafter_bench.py" --world 16 --contexts 8192 --setting draft_output_partials=0 \
  --setting '' --setting triton_pdl=1 --out "$JOB_OUT/drafter_bench_tp16_pdl.json" 2>&1 | grep -vi warn
