# limit: 200
# Every case's kernel three times (--profile-only); ncu replays each launch once per section group.
ncu --clock-control none --target-processes all \
  --kernel-name regex:"attn_res_mix_norm_kernel|route_kernel|rms_norm_kernel" --launch-count 180 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats \
  --csv --page details python3 "$REPO/experiments/glue_bench.py" --profile-only > "$JOB_OUT/ncu_glue.csv" \
  2> "$JOB_OUT/ncu_glue.err"
echo "ncu exit $?"; tail -5 "$JOB_OUT/ncu_glue.err"; wc -l "$JOB_OUT/ncu_glue.csv"
