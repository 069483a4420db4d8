# limit: 330
# Job 20's settings in the reverse order, 20 steps a point.
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1 --context 8192 --tokens 1,8 \
  --steps 20 --eager-steps 1 --setting moe_lists=fused --setting triton_pdl=1 --setting rank_inputs_gemm=0 --setting '' \
  --out "$JOB_OUT/step_bench_rank_inputs_repeat.json" 2>&1 | grep -E "^B=|step_bench:|Error"
