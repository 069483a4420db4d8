# limit: 240
# The step's, the drafter's and the acceptance op's GPU tests with the Triton kernels launched dependently
# (triton_common.PDL on for the whole session), and the strided q_a norm's test against float64 rounded to bf16.
# From /tmp (gpu_round.sh's cwd): the checkout's dspark/ lacks the device layout's links.
T="$REPO/tests/gpu"
python3 -c "import sys, pytest; from dspark.kernels import triton_common; triton_common.PDL = True; \
sys.exit(pytest.main(sys.argv[1:]))" -q -p no:cacheprovider --rootdir /tmp "$T/test_triton_kernels_gpu.py" \
  "$T/test_k3_rank_gpu.py" "$T/test_graph_step_gpu.py" "$T/test_dspark_drafter_gpu.py" "$T/test_acceptance_gpu.py" \
  2>&1 | tee "$JOB_OUT/gpu_tests_pdl_$DSPARK_GIT_COMMIT.log" | tail -12
