# limit: 120
# The router's two decode-time options against float64 and the reference's experts (and the rest of the
# Triton glue: the file runs whole). From /tmp: the checkout's dspark/ lacks the device layout's links.
python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$REPO/tests/gpu/test_triton_kernels_gpu.py" \
  2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -20
