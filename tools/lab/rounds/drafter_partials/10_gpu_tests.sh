# limit: 240
# From /tmp (gpu_round.sh's cwd): the checkout's dspark/ lacks the device layout's links.
T="$REPO/tests/gpu"
python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$T/test_triton_kernels_gpu.py" "$T/test_dspark_drafter_gpu.py" \
  "$T/test_linear_gpu.py" "$T/test_k3_kernels_gpu.py" 2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -30
