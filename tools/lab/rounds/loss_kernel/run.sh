#!/usr/bin/env bash
# The fused draft_head_loss op's first GPU round (issue 33): the environment the training round
# will rely on (torch, triton, flex attention, torch.compile), the op's GPU test, and its bench.
# Run from the checkout's root on the GPU machine; results under $OUT.
set -u
R=$PWD
source tools/lab/device_env.sh
cd /tmp
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 - <<'PY' 2>&1 | tee -a "$OUT/device.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
from torch.nn.attention.flex_attention import flex_attention, create_block_mask  # noqa: F401
print("flex_attention importable")
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
print("host TensorDescriptor importable")
PY
timeout 240 python3 -m pytest -q -p no:cacheprovider "$R/tests/gpu/test_draft_loss_gpu.py" 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
dev=$(python3 -c "import torch; print('h200' if 'H200' in torch.cuda.get_device_name() else 'h100')")
timeout 240 python3 "$R/experiments/draft_loss_bench.py" --out "$OUT/draft_loss_bench.json" 2>&1 | tail -40 | tee "$OUT/bench.txt"
echo "device $dev"
