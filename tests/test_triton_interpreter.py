"""Triton kernels (the fused glue: rms_norm, attn_res_mix_norm and add_attn_res_mix_norm, situ_glu, sigmoid_gate, and the drafter's add_rms_norm and silu_mul; the router selection of moe_route) against their references on the CPU through Triton's interpreter, in a fresh
process (TRITON_INTERPRET must be set before triton is first imported; the checks are in
tests/triton_interpret_checks.py). The interpreter checks indexing, masks, reductions and the
candidate handling; bf16 rounding is checked on the GPU (tests/gpu/test_triton_kernels_gpu.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


@pytest.mark.long
def test_triton_kernels_match_references_under_the_interpreter():
    seed = int(torch.randint(0, 2**31 - 1, ()))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name("triton_interpret_checks.py")
    done = subprocess.run([sys.executable, str(script), str(seed)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"seed {seed}: {done.stderr[-2000:]}"
    assert "all checks passed" in done.stdout
