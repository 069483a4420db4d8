# limit: 150
# The TP16 share's propose at 8k: the base (the code before this round's changes, tools/lab/baseline_tree.sh),
# this round's defaults, and the input GEMMs' partials; then the same three in the reverse order.
P="$REPO/tools/lab/rounds/propose_launches/to_baseline.patch"
bench() { python3 "$1/experiments/drafter_bench.py" --world 16 --contexts 8192 --repeats 30 "${@:3}" --out "$JOB_OUT/$2.json" \
  2>&1 | grep -vi warn; }
(source "$REPO/tools/lab/baseline_tree.sh" "$P" && DSPARK_GIT_COMMIT=base bench /tmp/base tp16_base_first)
bench "$REPO" tp16_new_first --setting '' --setting draft_input_partials=1
bench "$REPO" tp16_new_second --setting draft_input_partials=1 --setting ''
(source "$REPO/tools/lab/baseline_tree.sh" "$P" && DSPARK_GIT_COMMIT=base bench /tmp/base tp16_base_second)
