# limit: 360
# The expert lists built in the token gather's launch (cute_sm90.DEFAULT_LISTS = "fused", off until measured):
# the lists and operand against the torch ones at up to 256 pairs, the op's bits either way; then the rank at
# 8k, B = 1 and 4, T = 1 and 8, the list kernel (today's default) against the fused launch.
python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$REPO/tests/gpu/test_triton_kernels_gpu.py" \
  "$REPO/tests/gpu/test_moe_gpu.py" -k "lists" 2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -4
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1,4 --context 8192 --tokens 1,8 \
  --steps 20 --eager-steps 1 --setting '' --setting moe_lists=fused \
  --out "$JOB_OUT/step_bench_rank_lists.json" 2>&1 | grep -E "^B=|step_bench:|Error"
