# limit: 300
# The router | latent-down GEMM's partials (fp32 at every split count, unsplit too), the kernel that adds,
# splits and gathers them (bit for bit against sum_partials), the consumers of partials, the rank's 4 layers
# against the float32 twin and bit for bit with and without split-K into consumers, the rank's step bench
# test (graphs), the MoE block against the CPU. From /tmp: the checkout's dspark/ lacks the links.
python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$REPO/tests/gpu/test_linear_gpu.py" \
  "$REPO/tests/gpu/test_triton_kernels_gpu.py" "$REPO/tests/gpu/test_k3_kernels_gpu.py" \
  "$REPO/tests/gpu/test_k3_rank_gpu.py" "$REPO/tests/gpu/test_step_bench_rank_gpu.py" "$REPO/tests/gpu/test_moe_gpu.py" \
  -k "partials or dispatch or mix_norm or tail or rank or block_on_cuda" \
  2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -12
