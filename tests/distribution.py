"""The distribution test shared by the engine and drafter tests: short sequences from a small
vocabulary against their closed-form probabilities under the toy Markov target."""
import itertools

import numpy as np
import torch
from scipy import stats

from dspark.config import SamplingParams, SpecConfig
from dspark.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel
from dspark.engine import Engine
from dspark.sampling import SamplingTensors, processed_probs, rejection_sample
from dspark.targets.toy import MarkovTarget

V = 5
PROMPT = [0, 3]
GEN = 3  # generated tokens per sequence: 125 possible sequences
SAMPLES = 20_000  # sequences per distribution test
PARAMS = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=GEN)


def exact_sequence_probs(target: MarkovTarget, params: SamplingParams) -> dict[tuple, float]:
    """Closed-form distribution of the first GEN tokens under plain sampling."""
    st = SamplingTensors.from_params([params], "cpu")
    probs = {}
    for seq in itertools.product(range(V), repeat=GEN):
        ctx, p = list(PROMPT), 1.0
        for t in seq:
            row = processed_probs(target.next_logits(torch.tensor([ctx[-2]]), torch.tensor([ctx[-1]])), st)[0]
            p *= float(row[t].double())
            ctx.append(t)
        probs[seq] = p
    return probs


def broken_sampler(logits, drafts, num_drafts, q, sampling, u, noise):
    """Resamples from p instead of the residual max(p - q, 0) after a rejection."""
    acc, nxt = rejection_sample(logits, drafts, num_drafts, q, sampling, u, noise)
    p = processed_probs(logits[torch.arange(len(acc)), acc], sampling)
    rejected = acc < num_drafts
    return acc, torch.where(rejected, (p / noise).argmax(-1), nxt)


def chi2_pvalue(outputs, expected_probs):
    counts = {}
    for o in outputs:
        key = tuple(o.token_ids[:GEN])
        counts[key] = counts.get(key, 0) + 1
    n = len(outputs)
    keys = sorted(expected_probs)
    exp = np.array([expected_probs[k] * n for k in keys])
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    small = exp < 5  # merge sparse bins into one so the chi-square approximation holds
    exp = np.append(exp[~small], exp[small].sum())
    obs = np.append(obs[~small], obs[small].sum())
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def toy_dspark(target: MarkovTarget, slots: int, method: str = "greedy") -> DSparkDrafter:
    """A random one-layer DSpark drafter over the toy Markov target's vocabulary (its taps: the
    embedding, layer -1), for the drafter tests that run the distribution test or greedy identity."""
    vocab = target.vocab_size
    cfg = DSparkConfig(name="toy_dspark", vocab_size=vocab, hidden_size=target.hidden_size, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=4, intermediate_size=16, attention_type="gqa", rope_interleaved=False,
                       max_position_embeddings=256, target_hidden_size=target.hidden_size, target_num_layers=1,
                       target_layer_ids=(-1,), block_size=2, mask_token_id=vocab - 1, markov_rank=4).validate()
    return DSparkDrafter(DSparkModel(cfg, *target.embedding_weights()), slots, max_seq_len=target.max_seq_len,
                         draft_sample_method=method)


def sampled_run(make_drafter, sampler=None, **spec) -> tuple[Engine, float]:
    """The distribution test's run: SAMPLES sequences of GEN tokens after PROMPT at PARAMS, through
    an engine on the toy Markov target with make_drafter(target) drafting 2 tokens a step (`spec`:
    more SpecConfig fields) and `sampler` (None: the engine's own) -> (the engine, the chi-square
    p-value of the sequences against their closed-form probabilities)."""
    target = MarkovTarget(V, seed=11, scale=1.2, max_slots=SAMPLES, max_seq_len=16)
    engine = Engine(target, make_drafter(target), SpecConfig(num_speculative_tokens=2, **spec), sampler=sampler)
    outputs = engine.generate([PROMPT] * SAMPLES, PARAMS)
    assert all(len(o.token_ids) == GEN for o in outputs)
    return engine, chi2_pvalue(outputs, exact_sequence_probs(target, PARAMS))
