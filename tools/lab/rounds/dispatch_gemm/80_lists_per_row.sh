# limit: 150
# The fused lists with one program a row (the lists derived once a row, not once a column block): the GPU
# tests, then the rank and the slice at B = 1, 8k, T = 1 and 8, fused first (jobs 60 and 70 ran it second/first).
python3 -m pytest -q -p no:cacheprovider --rootdir /tmp "$REPO/tests/gpu/test_triton_kernels_gpu.py" \
  "$REPO/tests/gpu/test_moe_gpu.py" -k "lists" 2>&1 | tee "$JOB_OUT/gpu_tests_$DSPARK_GIT_COMMIT.log" | tail -2
for target in k3-slice k3-rank; do
  layers=(); [ "$target" = k3-rank ] && layers=(--layers 65)
  python3 "$REPO/experiments/step_bench.py" --target $target "${layers[@]}" --batch 1 --context 8192 --tokens 1,8 \
    --steps 10 --eager-steps 1 --setting moe_lists=fused --setting '' \
    --out "$JOB_OUT/step_bench_${target#k3-}_lists_per_row.json" 2>&1 | grep -E "^B=|step_bench:|Error"
done
