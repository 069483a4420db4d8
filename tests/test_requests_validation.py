"""Requests: a bad request fails alone with an error naming the field; nothing is silently
converted (truncated floats, flattened nesting, bools as integers, NaN probabilities)."""
import math

import pytest
import torch

from dspark.config import MAX_SPECULATIVE_TOKENS, MIN_TEMPERATURE, Profile, SamplingParams, SpecConfig
from dspark.drafters.ngram import NgramDrafter
from dspark.engine import Engine
from dspark.targets.toy import MarkovTarget

VOCAB = 32


def _engine(k: int = 3, seed: int = 0) -> Engine:
    target = MarkovTarget(VOCAB, seed=seed, max_slots=8, max_seq_len=64)
    drafter = NgramDrafter(1, 3) if k else None
    return Engine(target, drafter, SpecConfig(num_speculative_tokens=k, seed=seed))


def _good_prompt(gen: torch.Generator) -> list[int]:
    return torch.randint(0, VOCAB, (6,), generator=gen).tolist()


BAD_PROMPTS = [
    (None, "prompt=None"),
    ("1 2 3", "prompt='1 2 3'"),
    ([1.5, 2.7, 3.2], "prompt[0]=1.5"),
    ([[1, 2], [3, 4]], "prompt[0]=[1, 2]"),
    ([1, True, 3], "prompt[1]=True"),
    (torch.tensor([[1, 2], [3, 4]]), "1-D integer"),
    (torch.tensor([1.5, 2.0]), "1-D integer"),
]


@pytest.mark.parametrize("prompt,named", BAD_PROMPTS, ids=[repr(p)[:20] for p, _ in BAD_PROMPTS])
def test_bad_prompt_fails_alone(prompt, named):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    good = [_good_prompt(gen), _good_prompt(gen)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reference = _engine().generate(good, params)
    outs = _engine().generate([good[0], prompt, good[1]], params)
    assert outs[1].finish_reason == "error" and named in outs[1].error, outs[1].error
    assert outs[1].token_ids == []
    # The neighbours are untouched: exactly what they produce without the bad request.
    assert [outs[0].token_ids, outs[2].token_ids] == [r.token_ids for r in reference]
    assert all(len(r.token_ids) == 8 for r in reference)


BAD_PARAMS = [
    (dict(stop_token_ids=("a",)), "stop_token_ids=('a',)"),
    (dict(stop_token_ids=5), "stop_token_ids=5"),
    (dict(stop_token_ids=(1.0,)), "stop_token_ids=(1.0,)"),
    (dict(max_tokens=True), "max_tokens=True"),
    (dict(max_tokens=2.0), "max_tokens=2.0"),
    (dict(top_k=False), "top_k=False"),
    (dict(seed=True), "seed=True"),
    (dict(temperature=True), "temperature=True"),
    (dict(temperature=1e-31), "temperature=1e-31"),
    (dict(temperature=MIN_TEMPERATURE / 2), f"temperature={MIN_TEMPERATURE / 2!r}"),
    (dict(temperature=math.nan), "temperature=nan"),
]


@pytest.mark.parametrize("fields,named", BAD_PARAMS, ids=[str(f) for f, _ in BAD_PARAMS])
def test_bad_sampling_params_fail_alone(fields, named):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    prompts = [_good_prompt(gen) for _ in range(3)]
    good = SamplingParams(temperature=0.0, max_tokens=6)
    with pytest.raises(ValueError, match="SamplingParams." + named.split("=")[0]):
        SamplingParams(**fields).validate(VOCAB)
    outs = _engine().generate(prompts, [good, SamplingParams(**fields), good])
    assert outs[1].finish_reason == "error" and named in outs[1].error, outs[1].error
    assert outs[1].prompt_token_ids == prompts[1]
    assert [len(outs[0].token_ids), len(outs[2].token_ids)] == [6, 6]


def test_smallest_allowed_temperature_samples_finite_tokens():
    # At MIN_TEMPERATURE the scaled logits stay finite: sampling equals greedy decoding here
    # (logit gaps of the toy table are far above 1e-5 * log(float32 max)).
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    prompts = [_good_prompt(gen) for _ in range(2)]
    greedy = _engine().generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    cold = _engine().generate(prompts, SamplingParams(temperature=MIN_TEMPERATURE, max_tokens=10, seed=3))
    assert [o.token_ids for o in cold] == [o.token_ids for o in greedy]


def test_params_of_the_wrong_type_fail_alone():
    outs = _engine().generate([[1, 2, 3], [4, 5, 6]], [SamplingParams(max_tokens=4), {"max_tokens": 4}])
    assert outs[0].error is None and "params={'max_tokens': 4}" in outs[1].error


def test_prompts_must_be_a_list():
    with pytest.raises(ValueError, match="prompts=None"):
        _engine().generate(None)


@pytest.mark.parametrize("k", [True, 2.0, -1, MAX_SPECULATIVE_TOKENS + 1])
def test_num_speculative_tokens_refused(k):
    with pytest.raises(ValueError, match=f"SpecConfig.num_speculative_tokens={k!r}"):
        SpecConfig(num_speculative_tokens=k).validate()
    with pytest.raises(ValueError, match=f"batch1_profile.num_speculative_tokens={k!r}"):
        SpecConfig(batch1_profile=Profile(num_speculative_tokens=k)).validate()


def test_largest_k_accepted():
    assert SpecConfig(num_speculative_tokens=MAX_SPECULATIVE_TOKENS).validate().max_k == MAX_SPECULATIVE_TOKENS


class _PoisonedTarget(MarkovTarget):
    """Returns NaN logits for one slot from the n-th verify on (a broken kernel, say)."""

    def __init__(self, *args, poison_slot: int, **kw):
        super().__init__(*args, **kw)
        self.poison_slot = poison_slot

    def verify(self, slots, tokens, lengths, tap_layers=()):
        out = super().verify(slots, tokens, lengths, tap_layers)
        if self.poison_slot in slots:
            out.logits[slots.index(self.poison_slot), 0, 3] = math.nan
        return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_nan_guard_refuses_to_sample_from_nan_logits(temperature):
    target = _PoisonedTarget(VOCAB, seed=1, max_slots=4, max_seq_len=64, poison_slot=0)
    engine = Engine(target, NgramDrafter(1, 3), SpecConfig(num_speculative_tokens=3))
    with pytest.raises(FloatingPointError, match=r"request\(s\) \[0\].*non-finite logits"):
        engine.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(temperature=temperature, max_tokens=8, seed=0))


def test_nan_guard_ignores_padding_beyond_a_requests_verified_positions():
    class PaddedNaN(MarkovTarget):
        def verify(self, slots, tokens, lengths, tap_layers=()):
            out = super().verify(slots, tokens, lengths, tap_layers)
            for row, n in enumerate(lengths.tolist()):
                out.logits[row, n:] = math.nan  # positions no request verified
            return out

    prompts = [[1, 2, 3, 1, 2, 3], [7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    plain = MarkovTarget(VOCAB, seed=2, max_slots=4, max_seq_len=64)
    padded = PaddedNaN(VOCAB, seed=2, max_slots=4, max_seq_len=64)
    want = Engine(plain, NgramDrafter(1, 3), SpecConfig(num_speculative_tokens=4)).generate(prompts, params)
    got = Engine(padded, NgramDrafter(1, 3), SpecConfig(num_speculative_tokens=4)).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


# ---- k against the drafter and the context (checked when the engine is built) -------------


def test_a_dspark_drafter_built_for_a_cpu_target_drafts_eagerly(tmp_path):
    """build_drafter's graphs default follows the target's device: none on the CPU (the CUDA side
    is tests/gpu/test_dspark_drafter_gpu.py), and asking for them there is the drafter's error."""
    from dspark.build import build_drafter
    from dspark.drafters.dspark import DSparkModel, save_checkpoint
    from dspark_fixtures import SyntheticTarget, small_config

    target = SyntheticTarget(seed=4, max_slots=2, max_seq_len=64)
    save_checkpoint(DSparkModel(small_config(target), *target.embedding_weights()), tmp_path)
    spec = SpecConfig(num_speculative_tokens=2, drafter="dspark", drafter_path=str(tmp_path))
    assert build_drafter(spec, target)._graphs is None
    with pytest.raises(ValueError, match="cuda_graphs=True: the model is on cpu"):
        build_drafter(spec, target, cuda_graphs=True)


def test_k_above_the_dspark_block_size_is_refused_at_build(tmp_path):
    from dspark.build import build_engine
    from dspark.drafters.dspark import DSparkModel, save_checkpoint
    from dspark_fixtures import SyntheticTarget, small_config

    target = SyntheticTarget(seed=4, max_slots=2, max_seq_len=64)
    config = small_config(target)
    save_checkpoint(DSparkModel(config, *target.embedding_weights()), tmp_path)
    block = config.block_size
    spec = dict(drafter="dspark", drafter_path=str(tmp_path))
    assert build_engine(SpecConfig(num_speculative_tokens=block, **spec), target).spec.max_k == block
    with pytest.raises(ValueError, match=rf"num_speculative_tokens={block + 1}: the DSpark drafter at {tmp_path} "
                                         rf"drafts at most block_size={block}"):
        build_engine(SpecConfig(num_speculative_tokens=block + 1, **spec), target)
    with pytest.raises(ValueError, match=rf"num_speculative_tokens={block + 2}"):  # the batch-1 profile's k counts too
        build_engine(SpecConfig(num_speculative_tokens=1, batch1_profile=Profile(num_speculative_tokens=block + 2), **spec), target)


@pytest.mark.parametrize("max_seq_len,most", [(8, 6), (40, 38), (4096, MAX_SPECULATIVE_TOKENS)])
def test_k_is_bounded_by_the_targets_context(max_seq_len, most):
    from dspark.build import build_engine

    target = MarkovTarget(VOCAB, seed=0, max_slots=2, max_seq_len=max_seq_len)
    assert build_engine(SpecConfig(num_speculative_tokens=most), target).spec.max_k == most
    with pytest.raises(ValueError, match=rf"num_speculative_tokens={most + 1}: at most {most} .*max_seq_len={max_seq_len}"
                       if most < MAX_SPECULATIVE_TOKENS else rf"num_speculative_tokens={most + 1}: must be an integer in"):
        build_engine(SpecConfig(num_speculative_tokens=most + 1), target)
