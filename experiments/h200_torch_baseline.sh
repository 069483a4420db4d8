#!/usr/bin/env bash
# The torch baseline on the H200 (issue 3, item 7): k3-slice at real dimensions (layers 0-3 of
# Kimi K3: three KDA layers, the first with the dense FFN, one gated-MLA layer, three latent-MoE
# layers with MXFP4 experts dequantised in torch for the touched experts only), every op forced to
# its plain-torch reference, batch 1, k = 7, forced AL 1..8 and plain decoding, 8k context.
# This is the "before" the kernels must beat; each point records its fraction of the H200
# bandwidth floor of the same step. A torch-reference prefill of 8k tokens takes minutes, so all
# points share one prefill (the sweep's default phases mode). Usage on the GPU machine:
#   OUT=/some/dir DSPARK_GIT_COMMIT=<commit> bash experiments/h200_torch_baseline.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/tools/lab/device_env.sh"
cd /tmp  # not the checkout: its dspark/ folder (without kernels/) would shadow the laid-out package
export DSPARK_KERNELS="linear=reference,kda_verify=reference,kda_commit=reference"
timeout "${SWEEP_SECONDS:-520}" python3 -m dspark.cli sweep --target k3-slice --device cuda --batch 1 --k 7 \
  --al 1,2,3,4,5,6,7,8 --context 8192 --warmup-steps 1 --phase-steps 5 --out "$OUT/sweep-k3-slice-torch"
