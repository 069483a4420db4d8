"""dspark.vllm without vLLM: SpecConfig -> speculative_config dict, the field/version table, the CLI.

The batch-size schedule is checked against the engine's own Engine.step_k, expanded with vLLM's
documented lookup rule (first range starts at 1, gaps and the tail carry the previous K:
vllm/v1/spec_decode/dynamic/utils.py); tests/vllm/ checks the same against vLLM's real function.
"""
from __future__ import annotations

import argparse
import json
import random
import warnings

import pytest

from dspark.config import Profile, SamplingParams, SpecConfig
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine
from dspark.targets.toy import MarkovTarget
from dspark.vllm import (
    FIELDS,
    NotCarriedOverWarning,
    check_vllm_version,
    configure_parser,
    convert,
    main,
    minimum_vllm_version,
    parse_version,
    read_drafter_block_size,
    sampling_params_not_carried,
    speculative_config,
    vllm_importable,
)

SEED = random.randrange(2**32)


@pytest.fixture
def rng():
    return random.Random(SEED)


def _drafter_dir(tmp_path, block_key="block_size", block=7, arch="K3DSparkModel"):
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "k3_dspark", block_key: block}))
    return str(d)


def vllm_lookup(schedule, max_batch, k):
    """vLLM's dense batch-size -> K table, written from its documented rule (not its code):
    a covered batch size takes its range's K, an uncovered one the K of the last range before it,
    and every K is capped at num_speculative_tokens."""
    assert schedule[0][0] == 1, schedule
    ranges = sorted(schedule)
    table = {}
    for b in range(1, max_batch + 1):
        before = [gk for start, end, gk in ranges if start <= b]
        table[b] = min(k, before[-1])
    return table


def _random_gates(rng, k):
    gates, start = [], rng.randint(1, 3)
    for _ in range(rng.randint(1, 4)):
        end = start + rng.randint(0, 6)
        gates.append((start, end, rng.randint(0, k)))
        start = end + 1 + rng.choice([0, 0, rng.randint(1, 4)])  # sometimes leave a gap
    return tuple(gates)


def test_ngram_config_carries_every_field(rng):
    k = rng.randint(1, 8)
    lo = rng.randint(1, 3)
    hi = lo + rng.randint(0, 3)
    draft = rng.choice(["greedy", "probabilistic"])
    spec = SpecConfig(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi, draft_sample_method=draft)
    result = convert(spec)
    assert result.config == {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
                             "prompt_lookup_max": hi, "draft_sample_method": draft,
                             "rejection_sample_method": "standard"}, SEED
    assert result.not_carried == ()
    assert result.engine_args == {"seed": spec.seed}
    json.dumps(result.config)  # must be plain JSON for --speculative-config


def test_synthetic_length_and_rates_pass_through(rng):
    k = rng.randint(1, 8)
    length = rng.uniform(1.0, k + 1.0)
    cfg = speculative_config(SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                                        synthetic_acceptance_length=length))
    assert cfg["rejection_sample_method"] == "synthetic" and cfg["synthetic_acceptance_length"] == length
    assert "synthetic_acceptance_rates" not in cfg
    rates = tuple(sorted((rng.random() for _ in range(k)), reverse=True))
    cfg = speculative_config(SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                                        synthetic_acceptance_rates=rates))
    assert cfg["synthetic_acceptance_rates"] == list(rates) and "synthetic_acceptance_length" not in cfg
    with pytest.raises(ValueError, match="synthetic_acceptance_rates"):
        convert(SpecConfig(num_speculative_tokens=3, rejection_sample_method="synthetic",
                           synthetic_acceptance_rates=(0.5, 0.9, 0.1)))
    with pytest.raises(ValueError, match="synthetic_acceptance_length"):
        convert(SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                           synthetic_acceptance_length=k + 1.5))


def test_dspark_config_reads_the_block_size_and_refuses_other_k(tmp_path, rng):
    block = rng.randint(2, 8)
    path = _drafter_dir(tmp_path, rng.choice(["block_size", "dspark_block_size"]), block)
    assert read_drafter_block_size(path) == block
    spec = SpecConfig(num_speculative_tokens=block, drafter="dspark", drafter_path=path, verify_policy="scheduler")
    cfg = convert(spec, block_verification=True).config
    assert cfg == {"method": "dspark", "model": path, "num_speculative_tokens": block, "draft_sample_method": "greedy",
                   "rejection_sample_method": "block", "enable_adaptive_verification": True}
    with pytest.raises(ValueError, match=rf"num_speculative_tokens={block - 1}.*below the drafter's trained block size {block}"):
        convert(SpecConfig(num_speculative_tokens=block - 1, drafter="dspark", drafter_path=path))
    with pytest.raises(ValueError, match=rf"num_speculative_tokens={block + 1}.*above"):
        convert(SpecConfig(num_speculative_tokens=block + 1, drafter="dspark"), drafter_path=path)
    # block_size given explicitly, no checkpoint at hand (the target ships its drafter)
    with pytest.raises(ValueError, match="below the drafter's trained block size"):
        convert(SpecConfig(num_speculative_tokens=block - 1, drafter="dspark"), block_size=block, drafter_in_target=True)
    # synthetic acceptance ignores draft quality: a k sweep over one drafter is allowed
    synth = SpecConfig(num_speculative_tokens=block - 1, drafter="dspark", drafter_path=path,
                       rejection_sample_method="synthetic", synthetic_acceptance_length=1.5)
    assert convert(synth).config["num_speculative_tokens"] == block - 1
    # a hub id whose config.json cannot be had: ask for the block size instead of skipping the check
    # (tests/test_vllm_hub_and_warnings.py covers the hub look-up itself)
    assert convert(SpecConfig(num_speculative_tokens=7, drafter="dspark", drafter_path="org/remote-drafter"),
                   block_size=7).config["model"] == "org/remote-drafter"
    # no drafter path: only for a target that ships its drafter (vLLM then drafts from the target), no model key
    assert "model" not in convert(SpecConfig(num_speculative_tokens=5, drafter="dspark"), drafter_in_target=True).config


def test_bad_inputs_name_our_field(tmp_path):
    with pytest.raises(ValueError, match=r"SpecConfig.num_speculative_tokens=0"):
        convert(SpecConfig(num_speculative_tokens=0))
    with pytest.raises(ValueError, match=r"SpecConfig.drafter_path="):
        convert(SpecConfig(num_speculative_tokens=3, drafter="ngram"), drafter_path=str(tmp_path))
    with pytest.raises(ValueError, match=r"SpecConfig.rejection_sample_method='synthetic'"):
        convert(SpecConfig(num_speculative_tokens=3, rejection_sample_method="synthetic", synthetic_acceptance_length=2.0),
                block_verification=True)
    with pytest.raises(ValueError, match="no config.json"):
        read_drafter_block_size(tmp_path)


def test_features_vllm_lacks_are_reported_not_dropped():
    spec = SpecConfig(num_speculative_tokens=4, verify_policy="threshold", confidence_threshold=0.35,
                      max_speculative_seq_len=4096, batch1_profile=Profile(num_speculative_tokens=6, cuda_graphs=False))
    result = convert(spec)
    text = " | ".join(result.not_carried)
    assert "verify_policy='threshold'" in text and "0.35" in text
    assert "max_speculative_seq_len=4096" in text
    assert "batch1_profile.num_speculative_tokens=6" in text and "cuda_graphs=False" in text
    assert "enable_adaptive_verification" not in result.config
    with pytest.warns(NotCarriedOverWarning) as caught:
        speculative_config(spec)
    assert len(caught) == len(result.not_carried) == 4  # threshold, batch-1 k, batch-1 settings, seq len
    scheduler = convert(SpecConfig(num_speculative_tokens=4, verify_policy="scheduler", sps_table_path="sps.json"))
    assert scheduler.config["enable_adaptive_verification"] is True
    assert any("sps_table_path='sps.json'" in note for note in scheduler.not_carried)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        speculative_config(SpecConfig(num_speculative_tokens=4))  # nothing to report, nothing warned
    assert sampling_params_not_carried(SamplingParams()) == []
    assert "speculate=False" in sampling_params_not_carried(SamplingParams(speculate=False))[0]


@pytest.mark.parametrize("trial", range(12))
def test_batch_size_schedule_matches_the_engine(rng, trial):
    k = rng.randint(1, 8)
    gates = _random_gates(rng, k) if trial % 3 else None
    profile = Profile(num_speculative_tokens=rng.randint(0, k - 1)) if trial % 2 else None  # k - 1: it must show
    spec = SpecConfig(num_speculative_tokens=k, num_speculative_tokens_per_batch_size=gates, batch1_profile=profile)
    result = convert(spec)
    schedule = result.config.get("num_speculative_tokens_per_batch_size")
    engine = Engine(MarkovTarget(8), NgramDrafter(), spec)
    max_batch = 80
    expected = {b: engine.step_k(b) for b in range(1, max_batch + 1)}
    assert expected == {b: spec.k_for_batch(b) for b in expected}  # one rule for k
    if schedule is None:
        assert set(expected.values()) == {k}, (SEED, spec)
        return
    assert all(isinstance(x, int) for entry in schedule for x in entry)
    got = vllm_lookup(schedule, max_batch, k)
    if gates and schedule == [list(g) for g in gates]:  # the user's schedule, as given
        differ = [b for b in expected if got[b] != expected[b]]
        if differ:  # vLLM reads it differently: the first batch size where it does is named
            assert len(result.warnings) == 1, (SEED, spec)
            assert f"batch {differ[0]}: dspark k={expected[differ[0]]}, vLLM k={got[differ[0]]}" in result.warnings[0]
        else:
            assert result.warnings == (), (SEED, spec)
    else:  # written out in full: vLLM's reading equals the engine's
        assert got == expected, (SEED, spec, schedule)
        assert result.warnings == ()


def test_version_table_names_field_and_release():
    ngram = convert(SpecConfig(num_speculative_tokens=3)).config
    assert minimum_vllm_version(ngram) == (0, 21, 0)  # draft_sample_method / "standard"
    dspark = convert(SpecConfig(num_speculative_tokens=7, drafter="dspark", verify_policy="scheduler",
                                draft_sample_method="probabilistic"), block_verification=True,
                     drafter_in_target=True).config
    assert minimum_vllm_version(dspark) == (0, 28, 0)
    check_vllm_version(dspark, "0.32.0")
    check_vllm_version(dspark, "0.28.0rc1.dev12+gabc")
    with pytest.raises(ValueError) as err:
        check_vllm_version(dspark, "0.24.1")
    msg = str(err.value)
    assert "SpecConfig.drafter: method='dspark' needs vLLM >= 0.25.0 (installed 0.24.1)" in msg
    assert "rejection_sample_method='block' needs vLLM >= 0.25.0" in msg
    assert "SpecConfig.verify_policy: field enable_adaptive_verification needs vLLM >= 0.28.0" in msg
    assert "SpecConfig.draft_sample_method" not in msg  # probabilistic exists since 0.22
    # adaptive verification with the n-gram drafter: vLLM 0.28-0.29 allowed it for dspark only
    adaptive_ngram = convert(SpecConfig(num_speculative_tokens=3, verify_policy="scheduler")).config
    with pytest.raises(ValueError, match=r"method='ngram' needs vLLM >= 0.30.0 \(installed 0.29.0\)"):
        check_vllm_version(adaptive_ngram, "0.29.0")
    gates = convert(SpecConfig(num_speculative_tokens=3, num_speculative_tokens_per_batch_size=((1, 4, 2),))).config
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size.*needs vLLM >= 0.24.0"):
        check_vllm_version(gates, "0.23.2")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_vllm_version({**ngram, "tensor_parallel_size": 2}, "0.32.0")
    assert parse_version("0.32.0rc1.dev283+g074c83a") == (0, 32, 0) and parse_version("1.2") == (1, 2, 0)
    with pytest.raises(ValueError, match="vllm version='dev'"):
        parse_version("dev")
    assert all(span.since >= (0, 9, 0) for span in FIELDS.values())


def _run_cli(argv, capsys):
    parser = configure_parser(argparse.ArgumentParser())
    code = main(parser.parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_prints_the_json_and_reports(capsys, tmp_path):
    path = _drafter_dir(tmp_path, block=5)
    code, out, err = _run_cli(["-k", "5", "--drafter", "dspark", "--drafter-path", path, "--rejection-sample-method",
                               "block", "--verify-policy", "scheduler", "--draft-sample-method", "probabilistic",
                               "--num-speculative-tokens-per-batch-size", "[[1, 8, 5], [9, 64, 2]]",
                               "--max-speculative-seq-len", "9000", "--seed", "3", "--no-validate"], capsys)
    assert code == 0, err
    cfg = json.loads(out)
    # the user's schedule goes to vLLM as given; vLLM carries K=2 past 64 where our engine goes back to k=5
    assert cfg == {"method": "dspark", "model": path, "num_speculative_tokens": 5, "draft_sample_method": "probabilistic",
                   "rejection_sample_method": "block", "enable_adaptive_verification": True,
                   "num_speculative_tokens_per_batch_size": [[1, 8, 5], [9, 64, 2]]}
    assert "warning: num_speculative_tokens_per_batch_size=[[1, 8, 5], [9, 64, 2]] goes to vLLM as given" in err
    assert "batch 65: dspark k=5, vLLM k=2" in err
    assert "needs vLLM >= 0.28.0" in err and "--seed 3" in err
    assert "not carried over to vLLM: max_speculative_seq_len=9000" in err and "not validated: --no-validate" in err

    code, out, err = _run_cli(["-k", "4", "--rejection-sample-method", "synthetic", "--synthetic-acceptance-rates",
                               "1,1,0.5,0.25", "--no-validate"], capsys)
    assert code == 0 and json.loads(out)["synthetic_acceptance_rates"] == [1.0, 1.0, 0.5, 0.25]

    code, out, err = _run_cli(["-k", "4", "--drafter", "dspark", "--drafter-path", path, "--no-validate"], capsys)
    assert code == 2 and out == "" and "SpecConfig.num_speculative_tokens=4" in err


@pytest.mark.skipif(vllm_importable(), reason="checks the message for an environment without vllm")
def test_cli_says_when_it_did_not_validate(capsys):
    code, out, err = _run_cli(["-k", "3"], capsys)
    assert code == 0 and json.loads(out)["method"] == "ngram"
    assert "not validated: vllm is not importable" in err
