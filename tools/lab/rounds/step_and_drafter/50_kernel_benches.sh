# limit: 150
python3 "$REPO/experiments/kda_bench.py" --commit "$DSPARK_GIT_COMMIT" --out "$JOB_OUT/kda_bench.json" || true
python3 "$REPO/experiments/kernels_bench.py" --commit "$DSPARK_GIT_COMMIT" \
  --shapes mla_g/shared_gate_up,latent_down,latent_up,shared_down,router --out "$JOB_OUT/kernels_bench_moe.json"
