# limit: 570
# The rank (65 layers: what an H100 holds, so both cards compare) at 8k, B = 1, 2, 4, 8, T = 1 and 8: today's
# defaults (the router | latent-down GEMM, DISPATCH_IN_ONE_GEMM) and the five launches it replaces.
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1,2,4,8 --context 8192 --tokens 1,8 \
  --steps 10 --eager-steps 1 --setting '' --setting rank_dispatch_gemm=0 \
  --out "$JOB_OUT/step_bench_rank.json" 2>&1 | grep -E "^B=|step_bench:|Error"
