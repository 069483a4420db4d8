# limit: 210
# The rank (65 layers) at 8k, B = 1, T = 1 and 8: the defaults, mix_tiles=1 and tail_block=256, then the reverse order.
for first in default tiles; do
  if [ $first = default ]; then set -- '' mix_tiles=1 tail_block=256; else set -- tail_block=256 mix_tiles=1 ''; fi
  python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1 --context 8192 --tokens 1,8 \
    --steps 10 --eager-steps 1 --setting "$1" --setting "$2" --setting "$3" \
    --out "$JOB_OUT/step_bench_rank_mix_tiles_${first}_first.json" 2>&1 | grep -E "^B=|step_bench:|Error"
done
