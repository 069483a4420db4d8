# limit: 60
# The UniformDrafter's AL 6 launch without the two copies of the drafts and uniforms (47.1 us
# launch + 4.7 us readback at a7cdf4d, goal 50 us), and the graph's device time with the mirror's
# in-graph reads (4034 us per AL 6 step at a7cdf4d).
python3 "$REPO/experiments/engine_host_profile.py" --target k3-slice --context 2048 --steps 30 \
  --out "$JOB_OUT/engine_host_profile.json"
