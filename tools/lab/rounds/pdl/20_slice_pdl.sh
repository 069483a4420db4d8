# limit: 150
# The slice at B = 1, T = 1 and 8: the defaults and triton_pdl=1, then again in the other order.
for first in default pdl; do
  if [ $first = default ]; then set -- '' triton_pdl=1; else set -- triton_pdl=1 ''; fi
  python3 "$REPO/experiments/step_bench.py" --target k3-slice --batch 1 --context 8192 --tokens 1,8 \
    --steps 20 --eager-steps 1 --setting "$1" --setting "$2" \
    --out "$JOB_OUT/step_bench_slice_pdl_${first}_first.json" 2>&1 | grep -E "^B=|step_bench:|Error"
done
