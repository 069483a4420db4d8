# limit: 360
# Every GPU test (the last full run was a7cdf4d's): the mirrored draws' tests among them.
# From /tmp (gpu_round.sh's cwd): the checkout's dspark/ lacks the device layout's links.
python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$REPO/tests/gpu" \
  2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -30
