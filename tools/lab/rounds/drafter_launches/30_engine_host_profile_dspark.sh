# limit: 180
python3 "$REPO/experiments/engine_host_profile.py" --target k3-slice --context 2048 --steps 30 --drafter dspark \
  --out "$JOB_OUT/engine_host_profile_dspark.json"
