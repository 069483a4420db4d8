# limit: 110
python3 -m dspark.cli sweep --target k3-slice --device cuda --batch 1 -k 7 --al 1,2,3,4,5,6,7,8 --context 8192 \
  --phase-steps 8 --warmup-steps 2 --repeats 2 --out "$JOB_OUT/sweep-k3-slice-gpu"
