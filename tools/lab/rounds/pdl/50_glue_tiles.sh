# limit: 170
# The mix alone with its checkpoints scored one at a time and in 2-D tiles (kernels/rmsnorm/triton.py
# MIX_SCORE_TILES), beside the selection and rms_norm, as glue/'s job 10 ran it.
python3 "$REPO/experiments/glue_bench.py" --repeats 10 --out "$JOB_OUT/glue_bench.json" 2>&1 | grep -v -i warn
