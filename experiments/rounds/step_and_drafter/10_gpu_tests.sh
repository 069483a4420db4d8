# limit: 300
cd "$REPO" && python3 -m pytest -v -p no:cacheprovider --rootdir /tmp \
  tests/gpu/test_moe_gpu.py tests/gpu/test_engine_graphs_gpu.py tests/gpu/test_graph_step_gpu.py \
  tests/gpu/test_transfer_gpu.py tests/gpu/test_k3_target_gpu.py tests/gpu/test_dspark_drafter_gpu.py \
  2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -40
