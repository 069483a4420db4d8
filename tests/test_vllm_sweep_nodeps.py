"""`dspark sweep --backend vllm` end to end on a stand-in for vllm.LLM (the real engine needs a GPU):
one engine per (k, AL) with vLLM's synthetic config, decode-only tokens/s and TPOT from the
per-request timestamps (the prefill time stays out), vLLM bench's key names, the PNG of the dspark
backend, results written whole."""
from __future__ import annotations

import json
import random
import sys
import types

import pytest
import torch

from dspark.cli import main as cli_main

SEED = random.randrange(2**32)
PREFILL_S = 0.5  # every request's time to first token in the stand-in: must not count


class FakeLLM:
    """Emits max_tokens per request in steps of AL tokens (the forced acceptance length), 10 ms per
    step after a PREFILL_S prefill, and counts drafts/accepted tokens as vLLM's metrics do."""

    made: list[dict] = []

    def __init__(self, model, speculative_config=None, seed=0, **settings):
        FakeLLM.made.append({"model": model, "speculative_config": speculative_config, **settings})
        self.config = speculative_config
        self.model_config = types.SimpleNamespace(get_vocab_size=lambda: 1000)
        self.counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.clock = 100.0

    def generate(self, prompts, sampling, use_tqdm=False):
        k = self.config["num_speculative_tokens"] if self.config else 0
        al = self.config["synthetic_acceptance_length"] if self.config else 1.0
        outputs = []
        steps = max(1, round((sampling.max_tokens - 1) / al))
        for _ in prompts:
            first = self.clock + PREFILL_S
            outputs.append(types.SimpleNamespace(
                outputs=[types.SimpleNamespace(token_ids=list(range(sampling.max_tokens)))],
                metrics=types.SimpleNamespace(first_token_ts=first, last_token_ts=first + 0.01 * steps)))
            if k:
                self.counts["num_drafts"] += steps
                self.counts["num_draft_tokens"] += steps * k
                self.counts["num_accepted_tokens"] += round(steps * (al - 1))
        self.clock += PREFILL_S + 0.01 * steps + 1.0
        return outputs

    def get_metrics(self):
        return [types.SimpleNamespace(name=f"vllm:spec_decode_{name}", value=value)
                for name, value in self.counts.items()] + [
            types.SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[0])]


@pytest.fixture
def fake_vllm(monkeypatch):
    import dspark.sweep
    import dspark.vllm.sweep as vllm_sweep

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.34.0"
    fake.LLM = FakeLLM
    fake.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(vllm_sweep, "vllm_importable", lambda: True)
    monkeypatch.setattr(vllm_sweep, "engine_kwargs", lambda target, flags: {"tensor_parallel_size": 2} if flags else {})
    real_meta = dspark.sweep.run_meta
    monkeypatch.setattr(dspark.sweep, "run_meta", lambda device, **extra: real_meta("cpu", **extra))
    FakeLLM.made = []
    return FakeLLM


def test_vllm_sweep_reports_decode_only_speed_and_vllm_bench_keys(fake_vllm, tmp_path):
    rng = random.Random(SEED)
    max_tokens = rng.randint(20, 40)
    k = rng.randint(3, 6)
    als = sorted({1.0, round(rng.uniform(1.5, k + 1), 2)})
    args = ["sweep", "--backend", "vllm", "--target", "org/model", "-k", str(k), "--batch", "1,3",
            "--al", ",".join(map(str, als)), "--max-tokens", str(max_tokens), "--context", "64",
            "--out", str(tmp_path), "--engine-args=--tensor-parallel-size 2"]
    assert cli_main(args) == 0
    data = json.loads((tmp_path / "sweep-vllm.json").read_text())
    assert (tmp_path / "sweep.png").stat().st_size > 0 and (tmp_path / "sweep-vllm.csv").exists()
    assert len(fake_vllm.made) == 1 + len(als)  # plain decoding, then one engine per AL
    assert data["meta"]["engine_args"] == "--tensor-parallel-size 2" and data["meta"]["backend"] == "vllm"
    assert all(made["tensor_parallel_size"] == 2 for made in fake_vllm.made)
    for made, al in zip(fake_vllm.made[1:], als):
        assert made["speculative_config"]["rejection_sample_method"] == "synthetic"
        assert made["speculative_config"]["synthetic_acceptance_length"] == al
    assert len(data["points"]) == 2 * (1 + len(als))
    for p in data["points"]:
        steps = max(1, round((max_tokens - 1) / (p["al_target"] or 1.0)))
        decode_s = 0.01 * steps  # the 0.5 s prefill is not in it
        assert p["tokens_per_s"] == pytest.approx(p["batch"] * (max_tokens - 1) / decode_s, rel=1e-9), SEED
        for q in (50, 90, 99):
            assert p[f"p{q}_tpot_ms"] == pytest.approx(1e3 * decode_s / (max_tokens - 1), rel=1e-9)
        if p["k"]:
            assert p["spec_decode_acceptance_length"] == pytest.approx(p["al_measured"])
            assert p["spec_decode_acceptance_rate"] == pytest.approx(100 * p["acceptance_rate"])
            assert p["al_measured"] == pytest.approx(1 + round(steps * (p["al_target"] - 1)) / steps)
        else:
            assert p["al_measured"] == 1.0 and p["spec_decode_acceptance_length"] is None


def test_vllm_sweep_refuses_before_loading(fake_vllm, tmp_path, capsys):
    base = ["sweep", "--backend", "vllm", "--target", "org/model", "--out", str(tmp_path)]
    assert cli_main(base + ["-k", "0"]) == 2
    assert "--k 0: each k must be in [1, 64]" in capsys.readouterr().err
    config = '{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_paralel_size": 1}'
    assert cli_main(base + ["--speculative-config", config]) == 2
    assert "fields ['draft_tensor_paralel_size']" in capsys.readouterr().err  # a field no vLLM has
    assert cli_main(base + ["--k", "4", "--speculative-config", config.replace("_paralel", "_parallel")]) == 2
    assert "--k 4 and --speculative-config (which sets it to 3)" in capsys.readouterr().err
    assert fake_vllm.made == [] and not (tmp_path / "sweep-vllm.json").exists()


def test_vllm_sweep_keeps_the_settings_of_a_speculative_config(fake_vllm, tmp_path, capsys):
    config = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3, '
              '"draft_sample_method": "probabilistic", "rejection_sample_method": "synthetic", '
              '"synthetic_acceptance_length": 2.5}')
    args = ["sweep", "--target", "org/model", "--batch", "1", "--max-tokens", "12", "--out", str(tmp_path),
            "--speculative-config", config]
    assert cli_main(args + ["--backend", "vllm"]) == 0
    (made,) = [m["speculative_config"] for m in fake_vllm.made if m["speculative_config"]]
    assert made == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3,
                    "draft_sample_method": "probabilistic", "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_length": 2.5}
    # the dspark backend has no drafter to give these settings to: it takes the config and says so
    capsys.readouterr()
    assert cli_main(args + ["--target", "toy", "--device", "cpu", "--context", "8", "--phase-steps", "2",
                            "--repeats", "1"]) == 0
    (note,) = [line for line in capsys.readouterr().err.splitlines() if "--speculative-config" in line]
    assert note.startswith("dspark sweep: note: --speculative-config: a forced-AL sweep ignores method=\"ngram\", "
                           "prompt_lookup_min=2, prompt_lookup_max=3, draft_sample_method=\"probabilistic\"")


def test_vllm_config_output_round_trips_into_both_sweep_backends(fake_vllm, tmp_path, capsys):
    """The production config `dspark vllm-config` prints (block verification, a vLLM-only field from
    --extra) is taken by either sweep backend, with one line naming the fields a forced-AL sweep
    ignores; the vLLM backend passes vLLM's own fields on."""
    assert cli_main(["vllm-config", "-k", "3", "--draft-sample-method", "probabilistic", "--rejection-sample-method",
                     "block", "--extra", '{"max_model_len": 4096}', "--no-validate"]) == 0
    config = capsys.readouterr().out.strip()
    base = ["sweep", "--batch", "1", "--al", "1,2.5", "--max-tokens", "12", "--speculative-config", config]
    assert cli_main(base + ["--target", "toy", "--device", "cpu", "--context", "8", "--phase-steps", "2",
                            "--repeats", "1", "--out", str(tmp_path / "dspark")]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "ignores" in line]
    assert len(notes) == 1 and all(f in notes[0] for f in ('rejection_sample_method="block"', "max_model_len=4096",
                                                           'draft_sample_method="probabilistic"')), notes
    points = json.loads((tmp_path / "dspark" / "sweep.json").read_text())["points"]
    assert sorted((p["k"], p["al_target"]) for p in points if p["k"]) == [(3, 1.0), (3, 2.5)]
    assert cli_main(base + ["--backend", "vllm", "--target", "org/model", "--out", str(tmp_path / "vllm")]) == 0
    made = [m["speculative_config"] for m in fake_vllm.made if m["speculative_config"]]
    assert made and all(m["max_model_len"] == 4096 and m["rejection_sample_method"] == "synthetic"
                        and m["draft_sample_method"] == "probabilistic" for m in made)
    (note,) = [line for line in capsys.readouterr().err.splitlines() if "ignores" in line]
    assert 'rejection_sample_method="block"' in note and "max_model_len" not in note
