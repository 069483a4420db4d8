"""experiments/smollm2_generate.py on the CPU, float32, with a tiny random Llama built here: its greedy output
equals greedy decoding with dspark's LlamaTarget (per_query reference) token for token, across waves with
padding, chunked prefill, rows ending at EOS and the batch shrinking; its top-p set is exactly the smallest
set whose mass reaches top_p (against a float64 reference), and its draws follow the renormalised
probabilities; a run stopped and resumed writes what an unbroken run writes."""
import importlib.util
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from dspark.targets.llama import LlamaConfig, LlamaLayerWeights, LlamaTarget, LlamaWeights

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("smollm2_generate", REPO / "experiments" / "smollm2_generate.py")
gen = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gen  # dataclasses look their module up there
spec.loader.exec_module(gen)

SEED = random.randrange(2**32)  # fresh every run, in every assertion message; the run's seed repeats it
VOCAB = 97
# Float32 logits of the decoder and of LlamaTarget, summed in different orders through two strong layers,
# differ by 2-6e-6 of the largest logit (41 seeds measured); the tests allow 2e-5 of it.
LOGIT_TOLERANCE = 2e-5


def tiny_model(seed: int) -> tuple[LlamaConfig, LlamaWeights]:
    """Two layers, GQA (4 query heads on 2 kv heads): every path of the real model, small. The head is
    not tied and the layers are strong, so the next token depends on the context through attention
    (a tied head over a strong embedding would mostly repeat the last token, whatever attention does)."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                         intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-5, context_length=1024,
                         tie_word_embeddings=False, eos_token_id=None)
    g = torch.Generator().manual_seed(seed)

    def matrix(rows, cols, gain=2.0):
        return gain * torch.randn(rows, cols, generator=g) / cols ** 0.5

    def norm(d):
        return 1.0 + 0.1 * torch.randn(d, generator=g)

    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    layers = [LlamaLayerWeights(attn_norm=norm(d), qkv=matrix((config.num_heads + 2 * config.num_kv_heads) * hd, d),
                                attn_output=matrix(d, d), ffn_norm=norm(d), gate_up=matrix(2 * f, d), ffn_down=matrix(d, f))
              for _ in range(config.num_layers)]
    return config, LlamaWeights(torch.randn(VOCAB, d, generator=g), layers, norm(d), matrix(VOCAB, d, gain=8.0))


def reference_greedy(config, weights, prompt: torch.Tensor, max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain greedy decoding on LlamaTarget's per_query path (no EOS): the tokens and each step's logits."""
    target = LlamaTarget(config, weights, max_slots=1, max_seq_len=len(prompt) + max_new)
    logits = target.prefill([0], [prompt]).logits[0, -1]
    tokens, steps = [], []
    for _ in range(max_new):
        steps.append(logits)
        tokens.append(int(logits.argmax()))
        logits = target.verify([0], torch.tensor([[tokens[-1]]]), [1]).logits[0, 0]
        target.commit([0], [1])
    return tokens, steps


def random_prompts(rng: np.random.Generator, count: int, longest: int) -> list[np.ndarray]:
    return [rng.integers(0, VOCAB, size=int(rng.integers(1, longest + 1))).astype(np.uint16) for _ in range(count)]


def poisoned_decoder(config, weights, rows: int, width: int):
    """A float32 CPU decoder whose cache and logits hold 1e4 before the run: stale rows must never be
    read as if they were this run's."""
    decoder = gen.BatchDecoder(config, weights, rows, width, "cpu", torch.float32)
    for buffer in (decoder.k_cache, decoder.v_cache, decoder.logits):
        buffer.fill_(1e4)
    return decoder


def run_generator(config, weights, prompts, settings, eos, work_dir: Path, max_waves=None, compactions=None):
    width = -(-(max(len(p) for p in prompts) + settings.max_new_tokens) // settings.width_step) * settings.width_step
    decoder = poisoned_decoder(config, weights, settings.batch, width)
    if compactions is not None:  # count the times a wave shrinks
        compact = decoder.compact
        decoder.compact = lambda keep: (compactions.append(len(keep)), compact(keep))
    done = gen.generate(decoder, prompts, settings, eos, work_dir, max_waves=max_waves, progress=False)
    return done, (gen.assemble(prompts, settings, work_dir) if done else None)


def test_decoder_logits_follow_the_reference_step_by_step():
    """Teacher-forced: three prompts of different lengths prefilled together (padding), then each
    reference token fed at its position with the width the generator attends to, the first row
    moved away half-way (compaction). Every step's logits agree with LlamaTarget's per_query path
    within LOGIT_TOLERANCE of the largest logit; a wrong position, mask or cache row moves logits by a
    whole unit."""
    config, weights = tiny_model(SEED)
    rng = np.random.default_rng(SEED)
    prompts = [torch.from_numpy(p.astype(np.int64)) for p in random_prompts(rng, 3, 30)]
    steps = 12
    references = [reference_greedy(config, weights, p, steps) for p in prompts]
    longest = max(len(p) for p in prompts)
    decoder = poisoned_decoder(config, weights, 4, longest + steps + 8)
    decoder.logits[:3] = decoder.prefill(0, prompts)
    rows, live = 4, [0, 1, 2]  # row r holds prompt live[r]
    for step in range(steps):
        if step:
            decoder.tokens[: len(live)] = torch.tensor([references[i][0][step - 1] for i in live])
            decoder.positions[: len(live)] = torch.tensor([len(prompts[i]) + step - 1 for i in live])
            decoder.decode(rows, gen.attended_width(longest, step, 8, decoder.width))
        for r, i in enumerate(live):
            reference = references[i][1][step]
            difference = float((decoder.logits[r] - reference).abs().max())
            tolerance = LOGIT_TOLERANCE * float(reference.abs().max())
            assert difference < tolerance, f"seed {SEED}: prompt {i}, step {step}: {difference} (tolerance {tolerance})"
        if step == steps // 2:
            decoder.compact(torch.tensor([1, 2]))
            rows, live = 2, [1, 2]


def responses_of(arrays) -> list[np.ndarray]:
    offsets, lengths = arrays["offsets"], arrays["prompt_lengths"]
    return [arrays["tokens"][offsets[i] + lengths[i] : offsets[i + 1]].astype(np.int64) for i in range(len(lengths))]


def test_greedy_equals_the_llama_target_reference(tmp_path):
    """Eleven prompts of 1-40 tokens, waves of 4 rows (the last one padded with spare rows), prefill in
    chunks of 2 prompts, EOS the token the references emit most in their first steps, so rows end at
    different steps and a wave shrinks row by row as they end (checked after every step). Float32 on
    both sides, different reduction orders: a first divergence is accepted only where the reference's
    top two logits are within twice LOGIT_TOLERANCE of the largest logit (a near-tie: each of the two
    may move by that much; none is expected), and never in more than one prompt."""
    config, weights = tiny_model(SEED)
    rng = np.random.default_rng(SEED)
    prompts = random_prompts(rng, 11, 40)
    max_new = 32
    references = [reference_greedy(config, weights, torch.from_numpy(p.astype(np.int64)), max_new) for p in prompts]
    early = np.concatenate([r[0][:12] for r in references])
    eos = int(np.bincount(early, minlength=VOCAB).argmax())
    settings = gen.Settings(max_new_tokens=max_new, seed=SEED, greedy_fraction=1.0, batch=4, row_step=1,
                            width_step=8, prefill_tokens=80, check_every=1)
    compactions = []
    done, arrays = run_generator(config, weights, prompts, settings, eos, tmp_path, compactions=compactions)
    assert done and compactions, f"seed {SEED}: no wave shrank"
    ended, near_ties = [], 0
    for i, (response, (tokens, steps)) in enumerate(zip(responses_of(arrays), references)):
        expected = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
        ended.append(eos in tokens)
        if response.tolist() == expected:
            assert bool(arrays["ended_at_eos"][i]) == (eos in expected), f"seed {SEED}, prompt {i}"
            continue
        first = next(t for t, (a, b) in enumerate(zip(response.tolist(), expected)) if a != b)
        top2 = steps[first].topk(2).values
        gap, near = float(top2[0] - top2[1]), 2 * LOGIT_TOLERANCE * float(steps[first].abs().max())
        assert gap < near, f"seed {SEED}, prompt {i}: diverges at step {first}, top-two gap {gap} (a near-tie is < {near})"
        near_ties += 1
    assert near_ties <= 1, f"seed {SEED}: {near_ties} near-ties"
    assert any(ended), f"seed {SEED}: EOS {eos} ends none of the references"
    assert np.array_equal(arrays["prompt_index"], np.arange(len(prompts)))
    for i, p in enumerate(prompts):
        start = arrays["offsets"][i]
        assert np.array_equal(arrays["tokens"][start : start + len(p)], p)


def float64_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> tuple[list[set[int]], torch.Tensor]:
    """Per row: the smallest set of tokens whose probability mass reaches top_p, and the sorted
    cumulative masses (to find rows too close to the boundary for float32 to settle)."""
    probs = (logits.double() / temperature).softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    sizes = (cumulative < top_p).sum(dim=-1) + 1
    return [set(order[r, : int(n)].tolist()) for r, n in enumerate(sizes)], cumulative


@pytest.mark.parametrize("spread, candidates", [(4.0, 500), (4.0, 64), (0.3, 8)])
def test_top_p_keeps_the_smallest_set_reaching_top_p(spread, candidates):
    """Fixed random logits [64, 500]: peaked rows (spread 4) with all tokens ranked or the top 64 only,
    and flat rows (spread 0.3) where the top 8 fall short of 0.8, so the full-sort fallback decides.
    Rows whose float64 cumulative mass lies within 1e-5 of 0.8 at the set's edge are left out: float32
    (relative error ~1e-7 per term over up to 500 terms) cannot settle them."""
    g = torch.Generator().manual_seed(SEED)
    logits = spread * torch.randn(64, 500, generator=g)
    expected, cumulative = float64_top_p(logits, 0.7, 0.8)
    ids, _, _, kept = gen.top_p_kept(logits.float(), 0.7, 0.8, candidates)
    checked = 0
    for r in range(len(expected)):
        n = len(expected[r])
        edges = cumulative[r, max(n - 2, 0) : n]
        if bool(((edges - 0.8).abs() < 1e-5).any()):
            continue
        checked += 1
        assert set(ids[r][kept[r]].tolist()) == expected[r], f"seed {SEED}, row {r}"
    assert checked >= 60, f"seed {SEED}: only {checked} rows away from the boundary"
    if spread < 1:
        assert kept.shape[-1] == 500, "the flat rows must have taken the full-sort fallback"


def test_top_p_draws_follow_the_renormalised_probabilities():
    """40,000 draws from one row of 60 logits: no token outside the top-p set, and the counts inside it
    pass a chi-square test against the float64 renormalised probabilities at p = 1e-6 (so a correct
    sampler fails one run in a million)."""
    g = torch.Generator().manual_seed(SEED)
    row = 1.5 * torch.randn(60, generator=g)
    draws = 40_000
    uniforms = torch.rand(draws, generator=g, dtype=torch.float64)
    tokens = gen.top_p_sample(row.expand(draws, -1).contiguous(), 0.7, 0.8, uniforms, candidates=16)
    (kept,), _ = float64_top_p(row[None], 0.7, 0.8)
    counts = np.bincount(tokens.numpy(), minlength=60)
    assert set(np.flatnonzero(counts)) <= kept, f"seed {SEED}: drew outside the top-p set"
    probs = (row.double() / 0.7).softmax(dim=-1).numpy()
    members = sorted(kept)
    expected = probs[members] / probs[members].sum() * draws
    statistic = float(((counts[members] - expected) ** 2 / expected).sum())
    assert statistic < chi2.ppf(1 - 1e-6, df=max(len(members) - 1, 1)), f"seed {SEED}: chi-square {statistic:.1f}"


def test_a_resumed_run_writes_what_an_unbroken_run_writes(tmp_path):
    """Half greedy, half sampled (T 0.7, top-p 0.8), waves of 4: stopped after one wave and rerun, the
    final arrays equal an unbroken run's; a work folder of other settings is refused by name."""
    config, weights = tiny_model(SEED)
    prompts = random_prompts(np.random.default_rng(SEED), 13, 30)
    settings = gen.Settings(max_new_tokens=20, seed=SEED, batch=4, row_step=1, width_step=8, prefill_tokens=64)
    eos = int(prompts[0][0])
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    gen.check_plan(whole, dict(settings.__dict__))
    done, unbroken = run_generator(config, weights, prompts, settings, eos, whole)
    assert done
    assert run_generator(config, weights, prompts, settings, eos, broken, max_waves=1) == (False, None)
    assert len(list(broken.glob("wave_*.npz"))) == 1
    done, resumed = run_generator(config, weights, prompts, settings, eos, broken)
    assert done
    assert set(resumed) == set(unbroken)
    for name in unbroken:
        assert np.array_equal(resumed[name], unbroken[name]), f"seed {SEED}: {name}"
    assert (unbroken["temperature"] == 0).sum() == round(len(prompts) * 0.5)
    assert set(unbroken["top_p"][unbroken["temperature"] > 0].tolist()) == {np.float32(0.8)}
    with pytest.raises(ValueError, match="with max_new_tokens=20, this one has 21"):
        gen.check_plan(whole, dict(settings.__dict__, max_new_tokens=21))


def test_waves_cover_every_prompt_once_in_one_mode():
    rng = np.random.default_rng(SEED)
    lengths = rng.integers(1, 500, size=1000)
    temperature, _ = gen.sampling_plan(1000, gen.Settings(seed=SEED))
    waves = gen.make_waves(lengths, temperature == 0, 64)
    assert sorted(np.concatenate(waves).tolist()) == list(range(1000))
    assert all(len(w) <= 64 and len(set((temperature[w] == 0).tolist())) == 1 for w in waves)
    assert (temperature == 0).sum() == 500


def test_cli_refuses_bad_settings_in_one_line(tmp_path):
    script = REPO / "experiments" / "smollm2_generate.py"
    result = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "o.npz"), "--work-dir", str(tmp_path / "w"),
                             "--top-p", "1.5", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["smollm2_generate: error: top_p=1.5: must be in (0, 1]"]


def _finished_work_dir(work_dir: Path, prompts: list[np.ndarray], settings, rng: np.random.Generator,
                       complete: bool = True) -> None:
    """A work folder as a GPU call leaves it: plan.json, calls.json and every wave (random answers)."""
    import json
    from dataclasses import asdict

    plan = {**asdict(settings), "prompts": len(prompts), "prompts_sha256": gen.prompts_digest(prompts),
            "data": "smollm2_prompts.npz", "split": "train", "gguf_sha256": "0" * 64, "dtype": "torch.bfloat16",
            "device": "cuda"}
    gen.check_plan(work_dir, plan)
    temperature, _ = gen.sampling_plan(len(prompts), settings)
    waves = gen.make_waves(np.array([len(p) for p in prompts]), temperature == 0, settings.batch)
    for index, wave in enumerate(waves):
        answers = [(rng.integers(0, 49152, size=int(rng.integers(1, 20))), bool(rng.integers(0, 2))) for _ in wave]
        gen.save_wave(gen.wave_path(work_dir, index), wave, answers)
    (work_dir / "calls.json").write_text(json.dumps([{"seconds": 9.0, "generate_seconds": 8.0, "complete": complete,
                                                       "device": "NVIDIA H100 80GB HBM3"}]))


def test_assemble_only_writes_a_finished_work_folder_without_the_model(tmp_path):
    """The first 13 training prompts of the committed prompt set, answered at random in waves of 4 as a
    GPU call would leave them: --assemble-only (no GGUF read) writes what assemble() gives, with the
    run's calls in its meta; a folder of other settings, or one whose run did not finish, is refused
    in one line."""
    import json

    from make_smollm2_data import load_prompts

    data = REPO / "experiments" / "data" / "smollm2_prompts.npz"
    prompts = load_prompts(data)["train"][:13]
    settings = gen.Settings(batch=4, row_step=1)
    rng = np.random.default_rng(SEED)
    work, out = tmp_path / "work", tmp_path / "final.npz"
    _finished_work_dir(work, prompts, settings, rng)
    script = REPO / "experiments" / "smollm2_generate.py"
    base = [sys.executable, str(script), "--assemble-only", "--work-dir", str(work), "--out", str(out), "--limit", "13",
            "--batch", "4", "--row-step", "1", "--gguf", str(tmp_path / "absent.gguf")]
    result = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    want = gen.assemble(prompts, settings, work)
    with np.load(out) as got:
        for name, value in want.items():
            assert np.array_equal(got[name], value), f"seed {SEED}: {name}"
        meta = json.loads(str(got["meta"]))
    assert meta["calls"][0]["device"] == "NVIDIA H100 80GB HBM3" and meta["assembled_apart"] is True
    assert meta["plan"]["device"] == "cuda" and meta["sequences"] == 13

    other = subprocess.run(base[:-6] + ["--batch", "8", "--row-step", "1"], capture_output=True, text=True, timeout=300)
    assert other.returncode == 2
    assert other.stderr.strip().splitlines() == [
        f"smollm2_generate: error: --work-dir={str(work)!r} holds a run with batch=4, this command has 8"]
    unfinished = tmp_path / "unfinished"
    _finished_work_dir(unfinished, prompts, settings, rng, complete=False)
    stopped = subprocess.run(base[:4] + [str(unfinished)] + base[5:], capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 2
    assert stopped.stderr.strip().splitlines() == [
        f"smollm2_generate: error: --work-dir={str(unfinished)!r}: the run has not generated every wave; rerun it "
        "without --assemble-only"]
