# limit: 240
# The GPU tests of what this round changed: the Triton kernels (silu_mul of partials, the markov stage on a
# bf16 base, the confidence head), the MLA cache rows with the q norm, the drafter's graphed and eager
# drafts, the rank and the graphed steps, and the SmolLM2 target's graphed verify.
# From /tmp (gpu_round.sh's cwd): the checkout's dspark/ lacks the device layout's links.
T="$REPO/tests/gpu"
python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$T/test_triton_kernels_gpu.py" "$T/test_k3_kernels_gpu.py" \
  "$T/test_dspark_drafter_gpu.py" "$T/test_k3_rank_gpu.py" "$T/test_graph_step_gpu.py" \
  "$T/test_engine_graphs_gpu.py" "$T/test_llama_target_gpu.py" \
  2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -15
