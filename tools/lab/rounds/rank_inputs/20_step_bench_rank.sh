# limit: 270
# The rank (65 layers: what an H100 holds) at 8k, B = 1, T = 1 and 8: the defaults first, then each setting.
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1 --context 8192 --tokens 1,8 \
  --steps 10 --eager-steps 1 --setting '' --setting rank_inputs_gemm=0 --setting triton_pdl=1 --setting moe_lists=fused \
  --out "$JOB_OUT/step_bench_rank_inputs.json" 2>&1 | grep -E "^B=|step_bench:|Error"
