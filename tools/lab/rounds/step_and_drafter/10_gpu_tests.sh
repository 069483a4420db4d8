# limit: 300
# From /tmp (gpu_round.sh's cwd): run from the checkout, python would import its dspark/ folder,
# which lacks the kernels/ and drafters/ links that tools/lab/device_env.sh lays out.
T="$REPO/tests/gpu"
python3 -m pytest -v -p no:cacheprovider --rootdir /tmp \
  "$T/test_moe_gpu.py" "$T/test_engine_graphs_gpu.py" "$T/test_graph_step_gpu.py" "$T/test_transfer_gpu.py" \
  "$T/test_k3_target_gpu.py" "$T/test_dspark_drafter_gpu.py" "$T/test_triton_kernels_gpu.py" \
  2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -40
