"""dspark.vllm against the real vLLM: every SpecConfig the sweeps use converts to a dict that vLLM's
own SpeculativeConfig accepts, and invalid ones fail with OUR errors.

Needs the venv from scripts/vllm_env.sh (vllm 0.32.0 beside the CPU torch):
    scripts/vllm_env.sh VENV && VENV/bin/python -m pytest tests/vllm
Skips (whole module) where vllm is not importable. vLLM is imported once here (~5-12 s).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import typing

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM picks its platform once, on first use
try:
    import vllm
    from vllm.config import SpeculativeConfig
    from vllm.config import speculative as vllm_speculative
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup
except Exception as exc:  # not installed, or a CUDA torchvision/torchaudio beside the CPU torch
    pytest.skip(f"vllm is not importable here ({exc!r}); build the venv with scripts/vllm_env.sh",
                allow_module_level=True)

from dspark.config import Profile, SpecConfig
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine
from dspark.targets.toy import MarkovTarget
from dspark.vllm import (
    FIELDS,
    VALUES,
    check_vllm_version,
    configure_parser,
    convert,
    main,
    parse_version,
    validate_with_vllm,
)
from dspark.vllm.convert import vllm_schedule_k

SEED = random.randrange(2**32)
INSTALLED = vllm.__version__
BLOCK = 7
VOCAB = 1024

# A K3 drafter config in the layout of Inferact/Kimi-K3-DSpark (docs/kimi-k3.md §4), shrunk:
# dense MLA layers, target taps, Markov + confidence heads, mask token.
K3_DRAFTER = {
    "architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "block_size": BLOCK, "vocab_size": VOCAB,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "target_layer_ids": [0, 1], "num_target_layers": 2, "markov_rank": 8,
    "markov_head_type": "vanilla", "enable_confidence_head": True, "mask_token_id": VOCAB - 24,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
}
# The DeepSpec Qwen3 drafter layout (deepseek-ai/dspark_qwen3_*_block7; docs/dspark-algorithm.md §2.7), shrunk.
QWEN3_DRAFTER = {
    "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "block_size": BLOCK, "vocab_size": VOCAB,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "torch_dtype": "bfloat16", "target_layer_ids": [0, 1], "num_target_layers": 2,
    "markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True, "mask_token_id": VOCAB - 24,
}


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    paths = {}
    for name, cfg in [("k3", K3_DRAFTER), ("qwen3", QWEN3_DRAFTER), ("k3-named-dspark", K3_DRAFTER),
                      ("plain-qwen3", {**QWEN3_DRAFTER, "architectures": ["Qwen3ForCausalLM"]})]:
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        paths[name] = str(root / name)
    assert "dspark" not in paths["k3"].lower() and "dspark" not in paths["qwen3"].lower()
    return paths


@pytest.fixture
def rng():
    return random.Random(SEED)


def _check(spec: SpecConfig, **kw):
    result = convert(spec, **kw)
    checked = validate_with_vllm(result.config)
    assert checked.num_speculative_tokens == spec.num_speculative_tokens, (SEED, spec)
    return result, checked


def _expect_vllm_config(checked, needs_model_runner_v2: bool):
    """VllmConfig is built for everything Model Runner V1 runs; V2-only configs (dspark, adaptive
    verification) may skip it, and only where there is no GPU (V2 needs Triton with a driver)."""
    if not needs_model_runner_v2:
        assert checked.vllm_config_built, checked
    elif not checked.vllm_config_built:
        assert not torch.cuda.is_available() and "Triton" in checked.vllm_config_skipped, checked


def _sweep_specs(rng, k, drafter, drafter_path=None):
    """The sweep grid for one k: standard greedy/probabilistic, synthetic lengths (ends and a
    fraction), synthetic rates (a step and a random non-increasing profile)."""
    base = dict(num_speculative_tokens=k, drafter=drafter, drafter_path=drafter_path)
    synth = dict(base, rejection_sample_method="synthetic")
    lengths = {1.0, float(k + 1), round(rng.uniform(1.0, k + 1.0), 3)}
    steps = rng.randint(0, k)
    rates = tuple(sorted((rng.random() for _ in range(k)), reverse=True))
    specs = [SpecConfig(**synth, synthetic_acceptance_length=L) for L in sorted(lengths)]
    specs += [SpecConfig(**synth, synthetic_acceptance_rates=(1.0,) * steps + (0.0,) * (k - steps)),
              SpecConfig(**synth, synthetic_acceptance_rates=rates)]
    if drafter == "ngram" or k == BLOCK:  # a real drafter verifies only its trained block
        specs += [SpecConfig(**base, draft_sample_method=m) for m in ("greedy", "probabilistic")]
    return specs


@pytest.mark.parametrize("drafter", ["ngram", "dspark"])
def test_sweep_configs_are_accepted_by_vllm(drafters, rng, drafter):
    path = drafters["k3"] if drafter == "dspark" else None
    for k in range(1, 9):
        for spec in _sweep_specs(rng, k, drafter, path):
            _, checked = _check(spec)
            assert checked.method == drafter and checked.vllm_version == INSTALLED
            _expect_vllm_config(checked, needs_model_runner_v2=drafter == "dspark")
            if drafter == "dspark":
                assert checked.draft_architectures == ("K3DSparkModel",)  # not rewritten to DeepSeek-V4
            if spec.synthetic_acceptance_length is not None:
                # vLLM resolves a length into unconditional per-position rates; the mean
                # acceptance length they give is 1 + sum(rates) (docs/vllm-integration.md §1.3), in float64.
                rates = checked.synthetic_acceptance_rates
                assert len(rates) == k and rates == sorted(rates, reverse=True)
                assert abs(1.0 + sum(rates) - spec.synthetic_acceptance_length) < 1e-9, (SEED, spec, rates)
            elif spec.synthetic_acceptance_rates is not None:
                assert checked.synthetic_acceptance_rates == list(spec.synthetic_acceptance_rates)
            else:
                assert checked.synthetic_acceptance_rates is None


def test_dspark_verification_options_are_accepted(drafters):
    for path in (drafters["k3"], drafters["qwen3"]):
        for block in (False, True):
            for policy in ("fixed", "scheduler"):
                spec = SpecConfig(num_speculative_tokens=BLOCK, drafter="dspark", drafter_path=path,
                                  draft_sample_method="probabilistic", verify_policy=policy)
                result, checked = _check(spec, block_verification=block)
                assert checked.method == "dspark"
                assert result.config["rejection_sample_method"] == ("block" if block else "standard")
                _expect_vllm_config(checked, needs_model_runner_v2=True)


@pytest.mark.parametrize("trial", range(4))
def test_batch_size_schedule_gives_vllm_the_engine_k(rng, trial):
    k = rng.randint(1, 8)
    gates, start = [], rng.randint(1, 3)
    for _ in range(rng.randint(1, 4)):
        end = start + rng.randint(0, 6)
        gates.append((start, end, rng.randint(0, k)))
        start = end + 1 + rng.choice([0, rng.randint(1, 4)])
    profile = Profile(num_speculative_tokens=rng.randint(0, k - 1)) if trial % 2 else None  # k - 1: it must show
    spec = SpecConfig(num_speculative_tokens=k, num_speculative_tokens_per_batch_size=tuple(gates) if trial != 1 else None,
                      batch1_profile=profile)
    result, checked = _check(spec)
    assert checked.vllm_config_built
    warned = result.warnings
    engine = Engine(MarkovTarget(8), NgramDrafter(), spec)
    schedule = result.config.get("num_speculative_tokens_per_batch_size")
    max_batch = 80
    expected = [engine.step_k(b) for b in range(1, max_batch + 1)]
    if schedule is None:
        assert set(expected) == {k}
        return
    lookup = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=max_batch, vllm_num_speculative_tokens=k)
    # Our model of vLLM's reading (vllm_schedule_k, which the warnings quote) is vLLM's own.
    assert lookup[1:] == [vllm_schedule_k(schedule, b, k) for b in range(1, max_batch + 1)], (SEED, schedule)
    differ = [b for b in range(1, max_batch + 1) if lookup[b] != expected[b - 1]]
    if not differ:
        assert not any("num_speculative_tokens_per_batch_size" in w for w in warned), (SEED, spec, warned)
        return
    # Only the user's own schedule, kept as given, may differ, and then the converter names the first
    # batch size where it does (issue 14: keep the user's schedule when vLLM takes it, warn when ours differs).
    assert schedule == [list(g) for g in gates], (SEED, spec, schedule)
    first = differ[0]
    assert any(f"batch {first}: dspark k={expected[first - 1]}, vLLM k={lookup[first]}" in w for w in warned), \
        (SEED, spec, warned)


def test_invalid_configs_fail_with_our_field_names(drafters):
    ngram = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    cases = [
        ({**ngram, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5, 0.9, 0.1]},
         r"SpecConfig.synthetic_acceptance_rates \(vLLM synthetic_acceptance_rates=\[0.5, 0.9, 0.1\]\).*non-increasing"),
        ({**ngram, "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.5},
         r"SpecConfig.synthetic_acceptance_length \(vLLM synthetic_acceptance_length=4.5\).*\[1, 4\]"),
        ({**ngram, "num_speculative_tokens_per_batch_size": [[2, 4, 1]]},
         r"SpecConfig.num_speculative_tokens_per_batch_size .*must start at 1"),
        ({**ngram, "method": "dspark_ext"}, r"SpecConfig.drafter \(vLLM method='dspark_ext'\)"),
        ({**ngram, "draft_sample_method": "gumbel"}, r"SpecConfig.draft_sample_method \(vLLM draft_sample_method='gumbel'\)"),
    ]
    for config, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            validate_with_vllm(config)
    # The same mistakes made in a SpecConfig are caught before vLLM sees them.
    with pytest.raises(ValueError, match=r"SpecConfig.synthetic_acceptance_rates"):
        convert(SpecConfig(num_speculative_tokens=3, rejection_sample_method="synthetic",
                           synthetic_acceptance_rates=(0.5, 0.9, 0.1)))
    with pytest.raises(ValueError, match=r"SpecConfig.synthetic_acceptance_length=4.5"):
        convert(SpecConfig(num_speculative_tokens=3, rejection_sample_method="synthetic", synthetic_acceptance_length=4.5))


def test_k_below_the_drafter_block_is_our_error_because_vllm_accepts_it(drafters):
    # vLLM 0.32 checks k against the trained block only for Qwen3-Omni drafters ...
    below = validate_with_vllm({"method": "dspark", "model": drafters["k3"], "num_speculative_tokens": BLOCK - 4})
    assert below.num_speculative_tokens == BLOCK - 4
    # ... so the conversion refuses it, naming our field and the block size read from config.json.
    with pytest.raises(ValueError, match=rf"SpecConfig.num_speculative_tokens={BLOCK - 4}: below the drafter's "
                                         rf"trained block size {BLOCK}"):
        convert(SpecConfig(num_speculative_tokens=BLOCK - 4, drafter="dspark", drafter_path=drafters["k3"]))


def test_adaptive_verification_in_vllm_0_32(monkeypatch):
    # 0.32 accepts adaptive verification with any method in SpeculativeConfig (0.28-0.29 allowed
    # dspark only: the version table says so), but only Model Runner V2 runs it.
    config = convert(SpecConfig(num_speculative_tokens=3, verify_policy="scheduler")).config
    checked = validate_with_vllm(config)
    assert checked.method == "ngram"
    _expect_vllm_config(checked, needs_model_runner_v2=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    with pytest.raises(ValueError, match=r"SpecConfig.verify_policy \(vLLM enable_adaptive_verification=True\).*"
                                         r"Model Runner V1 does not support"):
        validate_with_vllm(config)


def test_dspark_needs_model_runner_v2(drafters, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    config = convert(SpecConfig(num_speculative_tokens=BLOCK, drafter="dspark", drafter_path=drafters["k3"])).config
    with pytest.raises(ValueError, match=r"SpecConfig.drafter \(vLLM method='dspark'\).*Model Runner V1"):
        validate_with_vllm(config)


def test_auto_detection_and_why_we_always_emit_the_method(drafters):
    # vLLM picks dspark from a Qwen3DSparkModel architecture or "dspark" in the path ...
    assert validate_with_vllm({"model": drafters["qwen3"], "num_speculative_tokens": BLOCK}).method == "dspark"
    assert validate_with_vllm({"model": drafters["k3-named-dspark"], "num_speculative_tokens": BLOCK}).method == "dspark"
    # ... but not from K3DSparkModel: a K3 drafter in a folder without "dspark" would run as a plain draft model.
    assert validate_with_vllm({"model": drafters["k3"], "num_speculative_tokens": BLOCK}).method == "draft_model"
    config = convert(SpecConfig(num_speculative_tokens=BLOCK, drafter="dspark", drafter_path=drafters["k3"])).config
    assert config["method"] == "dspark"
    # A draft architecture vLLM does not know as DSpark is rewritten to DeepSeek-V4's: refused.
    with pytest.raises(ValueError, match=r"SpecConfig.drafter_path=.*Qwen3ForCausalLM.*DSparkDraftModel"):
        validate_with_vllm({**config, "model": drafters["plain-qwen3"]})


def test_version_table_agrees_with_the_installed_vllm():
    fields = set(SpeculativeConfig.__dataclass_fields__)
    have = parse_version(INSTALLED)
    def present(span):
        return span.since <= have and (span.until is None or have <= span.until)

    for name, span in FIELDS.items():
        assert (name in fields) == present(span), (name, span, INSTALLED)
    literals = {
        "method": vllm_speculative.SpeculativeMethod,
        "rejection_sample_method": vllm_speculative.RejectionSampleMethod,
        "draft_sample_method": vllm_speculative.DraftSampleMethod,
    }

    def values(tp):
        out = set()
        for arg in typing.get_args(tp):
            out |= values(arg) if typing.get_args(arg) else {arg}
        return out

    for (name, value), span in VALUES.items():
        assert (value in values(literals[name])) == present(span), (name, value, INSTALLED)
    check_vllm_version({"method": "dspark", "rejection_sample_method": "block"}, INSTALLED)


def test_cli_validates_with_the_installed_vllm(drafters, capsys):
    def run(argv):
        code = main(configure_parser(argparse.ArgumentParser()).parse_args(argv))
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, err = run(["-k", "4", "--rejection-sample-method", "synthetic", "--synthetic-acceptance-length", "2.5"])
    assert code == 0 and json.loads(out)["synthetic_acceptance_length"] == 2.5
    assert f"validated with vLLM {INSTALLED}: SpeculativeConfig and VllmConfig accept it" in err
    code, out, err = run(["-k", str(BLOCK), "--drafter", "dspark", "--drafter-path", drafters["k3"]])
    assert code == 0 and json.loads(out)["method"] == "dspark"
    assert f"validated with vLLM {INSTALLED}" in err and "method=dspark" in err
    code, out, err = run(["-k", "3", "--num-speculative-tokens-per-batch-size", "[[1, 4, 2]]", "--drafter", "dspark",
                          "--drafter-path", drafters["plain-qwen3"], "--rejection-sample-method", "synthetic",
                          "--synthetic-acceptance-length", "2"])
    assert code == 2 and "SpecConfig.drafter_path" in err


def _run_cli(argv, capsys):
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
    code, out, err = _run_cli(["-k", "3", "--extra", '{"no_such_field": 1}'], capsys)
    # Refused before vLLM is asked: no release's SpeculativeConfig has the field (dspark/vllm/versions.py).
    assert code == 2 and out == "" and "'no_such_field': not a SpeculativeConfig field of any vLLM release" in err


def test_dspark_in_target_prints_the_architecture_vllm_resolved(capsys):
    code, out, err = _run_cli(["-k", "3", "--drafter", "dspark", "--drafter-in-target"], capsys)
    assert code == 0, err
    assert "vLLM resolved the draft model's architecture to ['DSparkDraftModel']" in err, err
