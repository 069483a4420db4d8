# limit: 250
# The rank (65 layers) at 8k, B = 1, T = 1 and 8: the base, then this round's code (the q_a norm in the MLA
# layers' cache-row launch), 10 steps a point, then the new first with 10 more.
P="$REPO/tools/lab/rounds/propose_launches/to_baseline.patch"
bench() { python3 "$1/experiments/step_bench.py" --target k3-rank --layers 65 --batch 1 --context 8192 --tokens 1,8 \
  --steps 10 --eager-steps 1 --out "$JOB_OUT/$2.json" 2>&1 | grep -E "^B=|step_bench:|Error"; }
(source "$REPO/tools/lab/baseline_tree.sh" "$P" && DSPARK_GIT_COMMIT=base bench /tmp/base rank_base_first)
bench "$REPO" rank_new_first
bench "$REPO" rank_new_second
(source "$REPO/tools/lab/baseline_tree.sh" "$P" && DSPARK_GIT_COMMIT=base bench /tmp/base rank_base_second)
