"""`dspark sweep --backend vllm` on a real vLLM engine: a two-layer Qwen3 with dummy weights (no
download), n-gram drafts on repetitive prompts, synthetic acceptance. Needs CUDA and vllm in the
environment (skips otherwise).

Checks what the CPU stand-in (tests/test_vllm_sweep_nodeps.py) cannot: vLLM's real counters move
with the forced acceptance length (dummy weights generate tokens the n-gram drafter may not find,
so short drafts can pull the measured length below the target: it must stay in [1, k + 1] and grow
with the target), real per-request timestamps exist, decode-only speed and TPOT are positive and
finite, and the PNG is written.
"""
import json
import math

import pytest
import torch

from dspark.vllm.validate import vllm_importable

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # not find_spec alone: tests/vllm/ on the path is a namespace package named vllm (validate.py)
    pytest.mark.skipif(not vllm_importable(), reason="vllm is not installed"),
]


def test_vllm_sweep_on_a_tiny_dummy_model(tmp_path):
    from dspark.cli import main
    from dspark.vllm import write_tiny_target

    target = write_tiny_target(tmp_path / "target", vocab_size=4096)
    out = tmp_path / "out"
    args = ["sweep", "--backend", "vllm", "--target", target, "-k", "3", "--al", "1.5,3", "--batch", "1,4",
            "--context", "64", "--max-tokens", "96", "--out", str(out),
            "--engine-args=--load-format dummy --skip-tokenizer-init --enforce-eager --gpu-memory-utilization 0.3"]
    assert main(args) == 0
    data = json.loads((out / "sweep-vllm.json").read_text())
    assert (out / "sweep.png").stat().st_size > 0
    assert len(data["points"]) == 2 * 3
    for p in data["points"]:
        assert math.isfinite(p["tokens_per_s"]) and p["tokens_per_s"] > 0
        assert 0 < p["p50_tpot_ms"] <= p["p90_tpot_ms"] <= p["p99_tpot_ms"]
        if p["k"]:
            assert 1.0 <= p["spec_decode_acceptance_length"] <= 4.0, p
    for batch in (1, 4):
        by_target = {p["al_target"]: p["spec_decode_acceptance_length"] for p in data["points"]
                     if p["batch"] == batch and p["k"]}
        assert by_target[3.0] > by_target[1.5], by_target
