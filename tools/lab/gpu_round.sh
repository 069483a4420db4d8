#!/usr/bin/env bash
# Run a batch of GPU jobs in one device call (one machine start for several people's work).
# Each job is a bash script in $ROUND_JOBS (default .round/jobs/, ignored by git and carried to the
# device; a round planned ahead is committed, e.g. tools/lab/rounds/step_and_drafter/) whose first
# lines may hold "# limit: SECONDS" (default 120). A job runs from /tmp with REPO (the checkout)
# and JOB_OUT (its output folder) set; its log and files come back in $OUT/round.tgz, one folder
# per job. Jobs run in name order and a job that would outrun the call's budget is skipped.
# Usage on the device: bash tools/lab/gpu_round.sh [TOTAL_SECONDS [JOB ...]] (default: every job)
# The tree that travels with .gpu carried must stay under the device's 64 MiB: since the SmolLM2 data
# grew (experiments/data, ~4.8 MB) it does not, so move experiments/data/*.npz aside for a CuTe round
# and back after the call (no job here reads them).
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
TOTAL=${1:-540}
shift $(( $# > 0 ? 1 : 0 ))
JOB_DIR=$(cd "$REPO" && cd "${ROUND_JOBS:-.round/jobs}" && pwd)
if (( $# > 0 )); then JOBS=("$@"); else JOBS=(); for j in "$JOB_DIR"/*.sh; do JOBS+=("$(basename "$j" .sh)"); done; fi
START=$(date +%s)
source "$REPO/.gpu/env.sh"
pip install -q --no-deps --target /tmp/extra "$REPO"/.gpu/wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/extra:${PYTHONPATH:-}
source "$REPO/tools/lab/device_env.sh"
export DSPARK_GIT_COMMIT=${DSPARK_GIT_COMMIT:-$(cat "$REPO/.round/commit" 2>/dev/null || echo unknown)}
WORK=/tmp/round_out
rm -rf "$WORK" && mkdir -p "$WORK"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv > "$WORK/nvidia-smi.txt" 2>&1
for name in "${JOBS[@]}"; do
  job="$JOB_DIR/$name.sh"
  limit=$(sed -n 's/^# limit: *\([0-9]*\).*/\1/p' "$job" | head -1)
  limit=${limit:-120}
  left=$(( TOTAL - ($(date +%s) - START) ))
  mkdir -p "$WORK/$name"
  if (( limit > left )); then
    echo "$name: skipped (limit ${limit}s > ${left}s left)" | tee -a "$WORK/summary.txt"
    continue
  fi
  t0=$(date +%s)
  (cd /tmp && REPO="$REPO" JOB_OUT="$WORK/$name" timeout "$limit" bash "$job") > "$WORK/$name/log" 2>&1
  rc=$?
  echo "$name: rc=$rc in $(( $(date +%s) - t0 ))s (limit ${limit}s)" | tee -a "$WORK/summary.txt"
  tail -3 "$WORK/$name/log"
  # after every job: a call cut short (its device time spent) still returns the jobs that finished
  tar czf "$OUT/round.tgz.part" -C "$WORK" . && mv "$OUT/round.tgz.part" "$OUT/round.tgz"
done
tar czf "$OUT/round.tgz" -C "$WORK" .
cat "$WORK/summary.txt"
