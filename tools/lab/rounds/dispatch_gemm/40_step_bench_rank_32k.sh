# limit: 300
# The rank at 32k, B = 1, T = 1 and 8, today's defaults with the old dispatch path beside (the lab queue's item).
python3 "$REPO/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1 --context 32768 --tokens 1,8 \
  --steps 20 --eager-steps 1 --setting '' --setting rank_dispatch_gemm=0 \
  --out "$JOB_OUT/step_bench_rank_32k.json" 2>&1 | grep -E "^B=|step_bench:|Error"
