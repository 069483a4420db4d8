# limit: 200
# linear_partials against the two-kernel GEMM (bit for bit) and float64; the mix norm and the tail inputs adding
# partials; the rank's 4 layers with and without them (bit for bit). From /tmp: the checkout's dspark/ lacks the links.
python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$REPO/tests/gpu/test_linear_gpu.py" \
  "$REPO/tests/gpu/test_triton_kernels_gpu.py" "$REPO/tests/gpu/test_k3_kernels_gpu.py" \
  "$REPO/tests/gpu/test_k3_rank_gpu.py" -k "partials or mix_norm or tail or in_place" \
  2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -12
