"""Drafter checkpoints: exact round trip and the published Kimi K3 DSpark layout (docs/kimi-k3.md §4)."""
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from dspark.config import SamplingParams
from dspark.drafters.dspark import DSparkDrafter, DSparkModel, load_checkpoint, save_checkpoint
from dspark_fixtures import SyntheticTarget, one_thread, small_config  # noqa: F401 (autouse fixture)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.ndim == 1 else 0.0))


def propose(model, target, prompt):
    drafter = DSparkDrafter(model, max_slots=1, max_seq_len=64, draft_sample_method="probabilistic")
    out = target.prefill([0], [prompt], drafter.tap_layers)
    target.release([0])
    drafter.start(0, prompt, {layer: t[0] for layer, t in out.taps.items()})
    return drafter.propose([0], torch.tensor([4]), 7, [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(1)])


@pytest.mark.parametrize("attention_type,markov", [("gqa", "gated"), ("mla", "vanilla")])
def test_round_trip_is_exact(tmp_path, attention_type, markov):
    target = SyntheticTarget(seed=11)
    config = small_config(target, attention_type, markov_head_type=markov,
                          confidence_temperatures=(1.5, 1.2, 1.0, 0.9, 2.0, 1.1, 0.7))
    model = DSparkModel(config, *target.embedding_weights())
    randomize(model, 0)
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path, *target.embedding_weights())
    assert loaded.config == config
    assert loaded.embed_tokens is target.embedding and loaded.lm_head is target.lm_head  # shared, not copied
    before, after = model.state_dict(), loaded.state_dict()
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    prompt = torch.randint(0, 60, (9,))
    p1, p2 = propose(model, target, prompt), propose(loaded, target, prompt)
    assert torch.equal(p1.tokens, p2.tokens) and torch.equal(p1.probs, p2.probs) and torch.equal(p1.confidence, p2.confidence)


# Small dims, published key names: what an exported Inferact/Kimi-K3-DSpark config.json holds.
PUBLISHED_CONFIG = {
    "architectures": ["K3DSparkModel"], "model_type": "k3_dspark",
    "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
    "mla_use_nope": False, "mla_use_output_gate": False,
    "vocab_size": 64, "rms_norm_eps": 1e-05, "max_position_embeddings": 4096, "rope_theta": 50000.0,
    "num_target_layers": 2, "target_hidden_size": 48, "target_num_hidden_layers": 4, "target_layer_ids": [0, 2],
    "mask_token_id": 63, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
    "markov_rank": 32, "markov_head_type": "vanilla", "enable_confidence_head": True,
    "confidence_head_with_markov": True, "tie_word_embeddings": False, "draft_vocab_size": 64,
    "_torchspec_version": "0.1.0", "torch_dtype": "bfloat16",
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                        "rope_theta": 50000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}


def published_tensors(c, seed=0):
    """The published tensor roster (names and shapes), written out independently of the model."""
    d, r, V, H = c["hidden_size"], c["markov_rank"], c["vocab_size"], c["num_attention_heads"]
    nope, rope, v, ql, kvl = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["q_lora_rank"], c["kv_lora_rank"]
    shapes = {
        "embed_tokens.weight": (V, d),  # the unused copy of the target embedding
        "context_proj.weight": (d, c["num_target_layers"] * c["target_hidden_size"]),
        "context_norm.weight": (d,),
        "final_norm.weight": (d,),
        "markov_head.markov_w1.weight": (V, r),
        "markov_head.markov_w2.weight": (V, r),
        "confidence_head.proj.weight": (1, d + r),
        "confidence_head.proj.bias": (1,),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (d,),
            f"{p}.post_attention_layernorm.weight": (d,),
            f"{p}.mlp.gate_proj.weight": (c["intermediate_size"], d),
            f"{p}.mlp.up_proj.weight": (c["intermediate_size"], d),
            f"{p}.mlp.down_proj.weight": (d, c["intermediate_size"]),
            f"{p}.self_attn.q_a_proj.weight": (ql, d),
            f"{p}.self_attn.q_a_layernorm.weight": (ql,),
            f"{p}.self_attn.q_b_proj.weight": (H * (nope + rope), ql),
            f"{p}.self_attn.kv_a_proj_with_mqa.weight": (kvl + rope, d),
            f"{p}.self_attn.kv_a_layernorm.weight": (kvl,),
            f"{p}.self_attn.kv_b_proj.weight": (H * (nope + v), kvl),
            f"{p}.self_attn.o_proj.weight": (d, H * v),
        })
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shape, generator=g) * 0.1).to(torch.bfloat16) for name, shape in shapes.items()}


def write_published(directory, tensors, config=PUBLISHED_CONFIG, shards=1):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / file))
        weight_map.update({n: file for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 2])
def test_loads_the_published_k3_layout(tmp_path, shards):
    target = SyntheticTarget(seed=12)
    tensors = published_tensors(PUBLISHED_CONFIG)
    assert len(tensors) == 2 * 12 + 8  # 68 at 5 layers
    write_published(tmp_path / "ckpt", tensors, shards=shards)
    model = load_checkpoint(tmp_path / "ckpt", *target.embedding_weights())
    c = model.config
    assert c.attention_type == "mla" and c.block_size == 7 and c.rope_interleaved and c.use_rope
    assert c.rope_scaling["factor"] == 4.0 and c.rope_theta == 50000.0 and c.target_layer_ids == (0, 2)
    for name, t in model.state_dict().items():
        assert torch.equal(t, tensors[name].float()), name
    prop = propose(model, target, torch.randint(0, 60, (11,)))
    assert prop.tokens.shape == (1, 7) and torch.isfinite(prop.probs).all()


def test_layout_errors_name_the_tensor(tmp_path):
    target = SyntheticTarget(seed=13)
    embed = target.embedding_weights()
    good = published_tensors(PUBLISHED_CONFIG)

    wrong = dict(good)
    wrong["layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(3, 16, dtype=torch.bfloat16)
    write_published(tmp_path / "wrong", wrong)
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.kv_b_proj\.weight: shape \(3, 16\), expected \(80, 16\)"):
        load_checkpoint(tmp_path / "wrong", *embed)

    missing = {k: v for k, v in good.items() if k != "final_norm.weight"}
    write_published(tmp_path / "missing", missing)
    with pytest.raises(ValueError, match=r"missing tensors \['final_norm\.weight'\]"):
        load_checkpoint(tmp_path / "missing", *embed)

    extra = {**good, "fc.weight": torch.zeros(2, 2)}  # DeepSpec naming is not this layout
    write_published(tmp_path / "extra", extra)
    with pytest.raises(ValueError, match=r"fc\.weight: not a parameter"):
        load_checkpoint(tmp_path / "extra", *embed)

    bad_embed = {**good, "embed_tokens.weight": torch.zeros(10, 48)}
    write_published(tmp_path / "embed", bad_embed)
    with pytest.raises(ValueError, match=r"embed_tokens\.weight: shape \(10, 48\)"):
        load_checkpoint(tmp_path / "embed", *embed)

    write_published(tmp_path / "nokey", good, config={k: v for k, v in PUBLISHED_CONFIG.items() if k != "markov_rank"})
    with pytest.raises(ValueError, match="markov_rank"):
        load_checkpoint(tmp_path / "nokey", *embed)

    small = dataclasses.replace(small_config(target, "mla"), hidden_size=32)
    with pytest.raises(ValueError, match=r"embed_tokens: shape \(64, 48\)"):
        DSparkModel(small, *embed)


def test_k3_dspark_config_json_carries_the_published_values():
    """The published K3 DSpark config.json fields (docs/kimi-k3.md §4) come out of K3_DSPARK unchanged."""
    from dspark.drafters.dspark import K3_DSPARK

    published = {
        "architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "hidden_size": 7168, "intermediate_size": 14336,
        "num_hidden_layers": 5, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": False,
        "mla_use_output_gate": False, "vocab_size": 163840, "rms_norm_eps": 1e-05, "max_position_embeddings": 1048576,
        "rope_theta": 50000.0, "num_target_layers": 5, "target_hidden_size": 7168, "target_num_hidden_layers": 93,
        "target_layer_ids": [2, 23, 47, 71, 89], "mask_token_id": 163837, "markov_rank": 256,
        "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
        "tie_word_embeddings": False, "draft_vocab_size": 163840,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768,
                            "rope_theta": 50000.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    }
    ours = K3_DSPARK.to_json_dict()
    for key, value in published.items():
        assert ours[key] == value, key
