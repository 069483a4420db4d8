# limit: 120
python3 "$REPO/experiments/engine_host_profile.py" --target k3-slice --context 2048 --steps 30 \
  --out "$JOB_OUT/engine_host_profile.json"
