"""dspark.vllm without vLLM: the configs that look valid and are not (refused or warned), hub-id
drafters, the --extra pass-through, the vLLM -> SpecConfig direction, the release table against
pyproject and the README, and the vLLM sweep's decode-only timing."""
from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

from dspark.config import SpecConfig
from dspark.vllm import (
    SUPPORTED_VLLM,
    VllmDiffersWarning,
    check_vllm_version,
    configure_parser,
    convert,
    from_vllm_config,
    main,
    speculative_config,
)
from dspark.vllm.convert import vllm_schedule_k
from dspark.vllm.sweep import decode_timing
from dspark.vllm.versions import version_problems

ROOT = Path(__file__).resolve().parents[1]
SEED = random.randrange(2**32)


@pytest.fixture
def rng():
    return random.Random(SEED)


def _run_cli(argv, capsys):
    code = main(configure_parser(argparse.ArgumentParser()).parse_args(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _fake_hub(monkeypatch, download, *, reachable: bool = True):
    """huggingface_hub with `download` as hf_hub_download, nothing in its cache, and the hub
    reachable (or not) for the one connection dspark makes before asking it."""
    convert_module = sys.modules["dspark.vllm.convert"]  # the package's `convert` is the function

    constants = types.SimpleNamespace(ENDPOINT="https://huggingface.co", HF_HUB_OFFLINE=False)
    hub = types.SimpleNamespace(hf_hub_download=download, try_to_load_from_cache=lambda repo_id, filename: None,
                                constants=constants)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    monkeypatch.setattr(convert_module, "hub_unreachable",
                        lambda endpoint: None if reachable else "huggingface.co:443: Name or service not known")


def test_dspark_without_a_drafter_path_is_refused(capsys):
    with pytest.raises(ValueError, match=r"SpecConfig.drafter_path=None: .*Inferact/Kimi-K3-DSpark.*DeepSeek-V4"):
        convert(SpecConfig(num_speculative_tokens=7, drafter="dspark"))
    code, out, err = _run_cli(["-k", "7", "--drafter", "dspark", "--no-validate"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1 and "--drafter-path" in err
    assert err.startswith("dspark vllm-config: error: ")
    code, out, err = _run_cli(["-k", "7", "--drafter", "dspark", "--drafter-in-target", "--no-validate"], capsys)
    assert code == 0 and json.loads(out) == {"method": "dspark", "num_speculative_tokens": 7,
                                             "draft_sample_method": "greedy", "rejection_sample_method": "standard"}


def test_hub_id_drafter_reads_config_through_huggingface_hub(tmp_path, monkeypatch, rng):
    block = rng.randint(2, 8)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["K3DSparkModel"], "block_size": block}))
    asked = []

    def download(repo_id, filename, **options):
        asked.append((repo_id, filename))
        return str(tmp_path / filename)

    _fake_hub(monkeypatch, download)
    hub = "Inferact/Kimi-K3-DSpark"
    cfg = convert(SpecConfig(num_speculative_tokens=block, drafter="dspark", drafter_path=hub)).config
    assert cfg["model"] == hub and asked == [(hub, "config.json")]
    with pytest.raises(ValueError, match=rf"num_speculative_tokens={block + 1}.*above the drafter's trained block size {block}"):
        convert(SpecConfig(num_speculative_tokens=block + 1, drafter="dspark", drafter_path=hub))


def test_hub_id_offline_or_without_huggingface_hub_says_so(monkeypatch, capsys):
    def offline(repo_id, filename, **options):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load this file")

    _fake_hub(monkeypatch, offline)
    spec = SpecConfig(num_speculative_tokens=7, drafter="dspark", drafter_path="Inferact/Kimi-K3-DSpark")
    with pytest.raises(ValueError, match=r"drafter_path='Inferact/Kimi-K3-DSpark': could not get its config.json "
                                         r"from the Hugging Face hub \(OSError: We couldn't connect.*--block-size"):
        convert(spec)
    _fake_hub(monkeypatch, offline, reachable=False)  # found offline first: the hub client is never asked
    with pytest.raises(ValueError, match=r"the hub cannot be reached from here \(huggingface.co:443: Name or service "
                                         r"not known\); pass --block-size"):
        convert(spec)
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    with pytest.raises(ValueError, match="huggingface_hub is not installed.*--block-size"):
        convert(spec)
    with pytest.raises(ValueError, match="drafter_path='/no/such/dir': neither a local directory nor a Hugging Face"):
        convert(SpecConfig(num_speculative_tokens=7, drafter="dspark", drafter_path="/no/such/dir"))
    # with the block size given, the config is printed; validation needs the config.json, so it says why not
    code, out, err = _run_cli(["-k", "7", "--drafter", "dspark", "--drafter-path", "Inferact/Kimi-K3-DSpark",
                               "--block-size", "7"], capsys)
    assert code == 0 and json.loads(out)["model"] == "Inferact/Kimi-K3-DSpark"
    assert "not validated: " in err


def test_ngram_settings_vllm_ignores_are_warned(capsys):
    result = convert(SpecConfig(num_speculative_tokens=3, verify_policy="scheduler", draft_sample_method="probabilistic"))
    assert result.config["enable_adaptive_verification"] is True  # still emitted: it is what the user asked for
    text = " | ".join(result.warnings)
    assert "verify_policy='scheduler' with drafter='ngram'" in text
    assert "draft_sample_method='probabilistic' with drafter='ngram'" in text
    with pytest.warns(VllmDiffersWarning) as caught:
        speculative_config(SpecConfig(num_speculative_tokens=3, verify_policy="scheduler"))
    assert len(caught) == 1
    code, out, err = _run_cli(["-k", "3", "--draft-sample-method", "probabilistic", "--no-validate"], capsys)
    assert code == 0 and "warning: draft_sample_method='probabilistic' with drafter='ngram'" in err
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        speculative_config(SpecConfig(num_speculative_tokens=3))  # nothing to warn about


def test_extra_fields_pass_through_and_clashes_are_refused(capsys):
    extra = {"draft_tensor_parallel_size": 1, "max_model_len": 32768, "some_future_field": True}
    result = convert(SpecConfig(num_speculative_tokens=3), extra=extra)
    assert {name: result.config[name] for name in extra} == extra
    assert result.passed_through == tuple(extra)
    with pytest.raises(ValueError, match=r"--extra fields \['num_speculative_tokens'\].*SpecConfig.num_speculative_tokens"):
        convert(SpecConfig(num_speculative_tokens=3), extra={"num_speculative_tokens": 5})
    # the release table checks the fields it knows; the rest is left to the installed vLLM
    check_vllm_version(result.config, "0.32.0", passed_through=result.passed_through)
    with pytest.raises(ValueError, match="some_future_field"):
        check_vllm_version(result.config, "0.32.0")
    code, out, err = _run_cli(["-k", "3", "--extra", '{"enforce_eager": true}', "--no-validate"], capsys)
    assert code == 0 and json.loads(out)["enforce_eager"] is True
    assert "passed through to vLLM, its value unchecked by dspark: enforce_eager=true" in err
    with pytest.raises(SystemExit):
        configure_parser(argparse.ArgumentParser()).parse_args(["--extra", "[1, 2]"])


def test_release_table_knows_0_34():
    # 0.34 dropped custom_class and disable_padded_drafter_batch, added speculator_options
    assert version_problems({"method": "custom_class"}, "0.33.0") == []
    [(name, why)] = version_problems({"method": "custom_class"}, "0.34.0")
    assert name == "method" and "removed after vLLM 0.33.0" in why
    assert version_problems({"disable_padded_drafter_batch": True}, "0.34.0")
    assert version_problems({"speculator_options": {}}, "0.34.0") == []
    assert "needs vLLM >= 0.34.0" in version_problems({"speculator_options": {}}, "0.33.0")[0][1]
    with pytest.raises(ValueError, match="--extra disable_padded_drafter_batch: field .* removed after vLLM 0.33.0"):
        check_vllm_version({"disable_padded_drafter_batch": True}, "0.34.0")


def test_supported_range_is_stated_once():
    """pyproject's vllm extra and the README follow SUPPORTED_VLLM; the CuTe DSL range admits the
    cutlass-dsl release vLLM pins (==4.8.0 in 0.30-0.34)."""
    from packaging.requirements import Requirement

    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = {name: re.findall(r'"([^"]+)"', deps)
              for name, deps in re.findall(r"^(\w+) = \[(.*)\]$", pyproject, re.MULTILINE)}
    (vllm_req,) = [Requirement(r) for r in extras["vllm"]]
    low, high = SUPPORTED_VLLM
    assert str(vllm_req.specifier) == f"<0.{high[1] + 1},>=0.{low[1]}" or set(map(str, vllm_req.specifier)) == {
        f">=0.{low[1]}", f"<0.{high[1] + 1}"}
    (cutlass,) = [Requirement(r) for r in extras["gpu"] if r.startswith("nvidia-cutlass-dsl")]
    assert "4.8.0" in cutlass.specifier and "4.8.1" in cutlass.specifier
    readme = (ROOT / "README.md").read_text()
    assert f"now {low[0]}.{low[1]}-{high[0]}.{high[1]}" in readme and "SUPPORTED_VLLM" in readme
    assert "vLLM 0.30-0.32" not in readme  # the old, second statement of the range


def test_vllm_config_round_trips_into_a_spec_config(rng):
    for _ in range(20):
        k = rng.randint(1, 8)
        synthetic = rng.random() < 0.5
        spec = SpecConfig(num_speculative_tokens=k, prompt_lookup_min=rng.randint(1, 3), prompt_lookup_max=4,
                          draft_sample_method=rng.choice(["greedy", "probabilistic"]),
                          rejection_sample_method="synthetic" if synthetic else "standard",
                          synthetic_acceptance_length=rng.uniform(1, k + 1) if synthetic else None,
                          verify_policy=rng.choice(["fixed", "scheduler"]), seed=0)
        back, block = from_vllm_config(json.dumps(convert(spec).config))
        assert (back, block) == (spec, False), SEED
    # vLLM's schedule reading (gaps and the tail carry the previous K) becomes our exact gates
    schedule = [[1, 2, 5], [5, 8, 3], [12, 20, 1]]
    back, _ = from_vllm_config({"method": "ngram", "num_speculative_tokens": 5,
                                "num_speculative_tokens_per_batch_size": schedule})
    assert all(back.k_for_batch(b) == vllm_schedule_k(schedule, b, 5) for b in range(1, 200))
    assert from_vllm_config({"method": "dspark", "model": "/d", "num_speculative_tokens": 7,
                             "rejection_sample_method": "block"})[1] is True


def test_vllm_configs_dspark_cannot_run_are_refused_by_name():
    with pytest.raises(ValueError, match=r"fields \['quantization'\]: dspark's engine has no equivalent"):
        from_vllm_config({"method": "ngram", "num_speculative_tokens": 3, "quantization": "fp8"})
    with pytest.raises(ValueError, match="method='eagle3'"):
        from_vllm_config({"method": "eagle3", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="not JSON"):
        from_vllm_config("{method: ngram}")
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        from_vllm_config({"method": "ngram"})


def test_decode_timing_leaves_the_first_token_out(rng):
    import numpy as np

    batch = rng.randint(2, 6)
    requests = []
    for _ in range(batch):
        first = rng.uniform(1.0, 1.5)  # prefill and time to first token end here
        n = rng.randint(2, 50)
        requests.append((first, first + (n - 1) * rng.uniform(0.01, 0.03), n))
    got = decode_timing(requests, batch)
    decode_tokens = sum(n - 1 for _, _, n in requests)
    window = max(r[1] for r in requests) - min(r[0] for r in requests)
    assert got["tokens_per_s"] == pytest.approx(decode_tokens / window, rel=1e-12)
    tpots = [1e3 * (last - first) / (n - 1) for first, last, n in requests]
    for q in (50, 90, 99):
        assert got[f"p{q}_tpot_ms"] == pytest.approx(float(np.percentile(tpots, q)), rel=1e-12)
    assert got["mean_tpot_ms"] == pytest.approx(float(np.mean(tpots)), rel=1e-12)
    with pytest.raises(ValueError, match="max_tokens"):
        decode_timing([(1.0, 1.0, 1)], 1)


README_CONFIG_LINES = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                       if line.strip().startswith("dspark vllm-config") and "runs/" not in line]


@pytest.mark.parametrize("line", README_CONFIG_LINES)
def test_readme_vllm_config_examples_work_as_printed(line):
    """Offline, as CI runs them (the drafter's hub look-up fails: --block-size covers it)."""
    import shlex

    env = {"HF_HUB_OFFLINE": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    done = subprocess.run(shlex.split(line), capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["num_speculative_tokens"] == 7
    assert "Traceback" not in done.stderr


def test_readme_serve_recipe_fails_loudly():
    """The README's `spec=$(dspark vllm-config ...) && vllm serve ...` line never starts vLLM on a
    bad config; it does start it with the config when the config is good."""
    (recipe,) = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
                 if line.strip().startswith("spec=$(dspark vllm-config") and "vllm serve" in line]
    stub = 'vllm() { echo "SERVED $*"; }; '
    env = {"HF_HUB_OFFLINE": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    good = subprocess.run(["bash", "-c", stub + recipe], capture_output=True, text=True, env=env, timeout=300)
    assert good.returncode == 0 and good.stdout.startswith("SERVED serve moonshotai/Kimi-K3 --speculative-config {")
    bad = subprocess.run(["bash", "-c", stub + recipe.replace("-k 7", "-k 5")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert bad.returncode == 2 and "SERVED" not in bad.stdout
    assert "dspark vllm-config: error: SpecConfig.num_speculative_tokens=5" in bad.stderr


def test_missing_drafter_directory_names_the_flag(capsys):
    code, out, err = _run_cli(["-k", "7", "--drafter", "dspark", "--drafter-path", "/ckpt/k3-dspark", "--no-validate"],
                              capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "drafter_path='/ckpt/k3-dspark': neither a local directory" in err and "pass --block-size" in err
    code, out, err = _run_cli(["-k", "7", "--drafter", "dspark", "--drafter-path", "/ckpt/k3-dspark", "--block-size", "7",
                               "--no-validate"], capsys)
    assert code == 0 and json.loads(out)["model"] == "/ckpt/k3-dspark"
