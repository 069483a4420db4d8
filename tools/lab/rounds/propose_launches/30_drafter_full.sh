# limit: 150
# The full-width propose at 8k: the base, this round's defaults and the input GEMMs' partials, then reversed.
P="$REPO/tools/lab/rounds/propose_launches/to_baseline.patch"
bench() { python3 "$1/experiments/drafter_bench.py" --contexts 8192 --repeats 30 "${@:3}" --out "$JOB_OUT/$2.json" \
  2>&1 | grep -vi warn; }
(source "$REPO/tools/lab/baseline_tree.sh" "$P" && DSPARK_GIT_COMMIT=base bench /tmp/base full_base_first)
bench "$REPO" full_new_first --setting '' --setting draft_input_partials=1
bench "$REPO" full_new_second --setting draft_input_partials=1 --setting ''
(source "$REPO/tools/lab/baseline_tree.sh" "$P" && DSPARK_GIT_COMMIT=base bench /tmp/base full_base_second)
