# limit: 300
# From /tmp: the checkout's dspark/ lacks the device layout's links.
T="$REPO/tests/gpu"
python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$T/test_triton_kernels_gpu.py" "$T/test_k3_rank_gpu.py" \
  "$T/test_step_bench_rank_gpu.py" "$T/test_moe_gpu.py" "$T/test_linear_gpu.py" \
  -k "partials or dispatch or tail or rank or block_on_cuda or lists or gather" \
  2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -12
