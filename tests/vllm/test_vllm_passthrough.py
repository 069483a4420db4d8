"""Against the real vLLM: `--extra` fields are validated by vLLM's own SpeculativeConfig and its
errors name the --extra key; `--drafter dspark --drafter-in-target` prints the draft architecture
vLLM resolved; the sweep's --engine-args go through vLLM's own EngineArgs parser."""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    from vllm.config import SpeculativeConfig  # noqa: F401
except Exception as exc:
    pytest.skip(f"vllm is not importable here ({exc!r}); build the venv with scripts/vllm_env.sh",
                allow_module_level=True)

from dspark.config import SpecConfig
from dspark.vllm import configure_parser, convert, main, validate_with_vllm, write_tiny_target
from dspark.vllm.sweep import engine_kwargs


def _run(argv, capsys):
    code = main(configure_parser(argparse.ArgumentParser()).parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_extra_fields_are_validated_by_vllm(capsys):
    result = convert(SpecConfig(num_speculative_tokens=3), extra={"draft_tensor_parallel_size": 1, "max_model_len": 512,
                                                                  "enforce_eager": True})
    checked = validate_with_vllm(result.config, passed_through=result.passed_through)
    assert checked.num_speculative_tokens == 3
    bad = convert(SpecConfig(num_speculative_tokens=3), extra={"draft_tensor_parallel_size": 0})
    with pytest.raises(ValueError, match=r"--extra draft_tensor_parallel_size \(vLLM draft_tensor_parallel_size=0\): "
                                         r"vLLM .* rejects it in SpeculativeConfig"):
        validate_with_vllm(bad.config, passed_through=bad.passed_through)
    code, out, err = _run(["-k", "3", "--extra", '{"no_such_field": 1}'], capsys)
    assert code == 2 and out == "" and "no_such_field" in err and "rejects it" in err


def test_dspark_in_target_prints_the_architecture_vllm_resolved(capsys):
    code, out, err = _run(["-k", "3", "--drafter", "dspark", "--drafter-in-target"], capsys)
    assert code == 0, err
    assert "vLLM resolved the draft model's architecture to ['DSparkDraftModel']" in err, err


def test_engine_args_go_through_vllms_own_parser(tmp_path):
    target = write_tiny_target(tmp_path / "target")
    got = engine_kwargs(target, "--tensor-parallel-size 2 --trust-remote-code --kv-cache-dtype fp8 "
                                "--gpu-memory-utilization 0.8")
    assert got == {"tensor_parallel_size": 2, "trust_remote_code": True, "kv_cache_dtype": "fp8",
                   "gpu_memory_utilization": 0.8}
    assert engine_kwargs(target, "") == {}
    with pytest.raises(ValueError, match="set by the sweep itself"):
        engine_kwargs(target, "--seed 3")
    with pytest.raises(ValueError, match="vLLM's EngineArgs parser rejects it"):
        engine_kwargs(target, "--no-such-engine-flag 1")
