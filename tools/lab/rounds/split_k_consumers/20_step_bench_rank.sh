# limit: 540
# The rank (65 layers: what an H100 holds, so both cards compare) at B = 1, 8k, T = 1 and 8: the defaults (token
# rows read in place), the copy of strided token rows as before, and the split-K partials into their consumers.
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1 --context 8192 --tokens 1,8 \
  --steps 10 --eager-steps 1 --setting '' --setting linear_strided_tokens=0 --setting split_k_into_consumers=1 \
  --out "$JOB_OUT/step_bench_rank_split_k.json" 2>&1 | grep -E "^B=|step_bench:|Error"
