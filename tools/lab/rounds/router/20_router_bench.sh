# limit: 150
# moe_route whole at K3's 896 experts, then the logits alone at a rank's 56 router rows and at 896
# (cuBLAS against one launch, 1-4 rows) and the selection with 1, 2 and 4 warps.
python3 "$REPO/experiments/router_bench.py" --rows 1 8 16 --out "$JOB_OUT/router_bench.json" 2>&1 | tail -20
