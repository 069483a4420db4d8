"""`dspark sweep --backend vllm` against the real vLLM package, on a machine without a GPU: it stops
with a clear message before any model loads; its configs are ones vLLM accepts; vLLM's own metric
records are summed and differenced into acceptance length and per-position acceptance."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    from vllm.v1.metrics.reader import Counter, Gauge, Vector
except Exception as exc:
    pytest.skip(f"vllm is not importable here ({exc!r}); build the venv with scripts/vllm_env.sh",
                allow_module_level=True)

from dspark.cli import main as cli_main
from dspark.config import SpecConfig
from dspark.vllm import convert, validate_with_vllm, write_tiny_target
from dspark.vllm.sweep import acceptance_summary, count_difference, engine_kwargs, spec_decode_counts, sweep_points


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU stop")
def test_stops_without_a_gpu_before_loading_anything(tmp_path, capsys):
    target = write_tiny_target(tmp_path / "target")  # config.json only: loading weights would fail loudly
    out = tmp_path / "out"
    status = cli_main(["sweep", "--backend", "vllm", "--target", target, "--k", "3", "--al", "1,2.5",
                       "--out", str(out)])
    err = capsys.readouterr().err
    assert status == 2
    assert "needs a CUDA GPU" in err and "No model was loaded" in err
    assert not out.exists()


def test_every_grid_config_is_one_vllm_accepts():
    ks, als = [1, 3, 7], [1, 1.5, 2, 3, 4.25, 8]
    points = sweep_points(ks, als)
    assert points[0] == (0, None) and all(al <= k + 1 for k, al in points[1:])
    for k, al in points[1:]:
        config = convert(SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                                    synthetic_acceptance_length=al)).config
        checked = validate_with_vllm(config)
        assert checked.num_speculative_tokens == k
        # vLLM's minimum-variance schedule (docs/vllm-integration.md §1.3) has expected length al
        assert 1 + sum(checked.synthetic_acceptance_rates) == pytest.approx(al)


def test_metric_records_give_acceptance_and_per_position_counts():
    rng = random.Random()
    k, drafts = 4, rng.randrange(50, 500)
    # per draft: accepted prefix length; counted per engine like vLLM's labelled counters
    lengths = [[rng.randrange(0, k + 1) for _ in range(drafts)] for _engine in range(2)]

    def snapshot(lengths_so_far):
        records = [Gauge(name="vllm:num_requests_running", labels={}, value=3.0)]
        for engine, seq in enumerate(lengths_so_far):
            labels = {"engine": str(engine)}
            records += [
                Counter(name="vllm:spec_decode_num_drafts", labels=labels, value=len(seq)),
                Counter(name="vllm:spec_decode_num_draft_tokens", labels=labels, value=k * len(seq)),
                Counter(name="vllm:spec_decode_num_accepted_tokens", labels=labels, value=sum(seq)),
                Vector(name="vllm:spec_decode_num_accepted_tokens_per_pos", labels=labels,
                       values=[sum(n > i for n in seq) for i in range(k)]),
            ]
        return records

    half = drafts // 2
    before = spec_decode_counts(snapshot([seq[:half] for seq in lengths]))
    after = spec_decode_counts(snapshot(lengths))
    counts = count_difference(after, before)
    window = [n for seq in lengths for n in seq[half:]]
    assert counts["num_drafts"] == len(window)
    assert counts["num_accepted_tokens"] == sum(window)
    summary = acceptance_summary(counts)
    assert summary["al_measured"] == pytest.approx(1 + sum(window) / len(window), rel=1e-12)
    assert summary["draft_tokens_per_draft"] == k
    assert summary["acceptance_rate"] == pytest.approx(sum(window) / (k * len(window)), rel=1e-12)
    expected = [sum(n > i for n in window) / len(window) for i in range(k)]
    assert summary["per_position_acceptance"] == pytest.approx(expected, rel=1e-12)
    # the per-position rates add up to the accepted tokens per draft
    assert sum(summary["per_position_acceptance"]) == pytest.approx(summary["al_measured"] - 1, rel=1e-12)
    json.dumps(summary)  # goes into sweep-vllm.json


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
