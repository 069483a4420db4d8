"""Drafter export -> import round trip in vLLM's layouts (dspark.vllm_export), without vLLM.

Exact: every tensor comes back torch.equal, and the config comes back equal. The checks against
vLLM's own loader are in tests/vllm/test_vllm_drafter_export.py."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from dspark.drafters.dspark import K3_TINY_DSPARK, DSparkModel, save_checkpoint
from dspark.vllm.export import export_drafter, import_drafter

GQA_TINY = dataclasses.replace(K3_TINY_DSPARK, name="qwen3-tiny_dspark", attention_type="gqa", num_kv_heads=2,
                               head_dim=16, rope_interleaved=False, rope_scaling=None)


MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _relevant(config):
    """The config without the fields its attention type does not use (a Qwen3 layout has no MLA dims)."""
    return dataclasses.replace(config, **{f: None for f in MLA_ONLY}) if config.attention_type == "gqa" else config


def random_drafter(config, seed):
    g = torch.Generator().manual_seed(seed)
    shape = (config.vocab_size, config.hidden_size)
    model = DSparkModel(config, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    with torch.no_grad():
        for p in model.parameters():  # fresh values everywhere (norm weights start at one)
            p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("layout,config", [("k3", K3_TINY_DSPARK), ("deepspec_qwen3", GQA_TINY)])
def test_round_trip_is_exact(tmp_path, layout, config):
    model = random_drafter(config, seed=int(torch.randint(0, 2**31, ())))
    out = export_drafter(model, tmp_path / f"{layout}-dspark", layout=layout)
    back = import_drafter(out, model.embed_tokens, model.lm_head)
    assert _relevant(back.config) == _relevant(model.config)
    ours, theirs = model.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    assert back.embed_tokens is model.embed_tokens and back.lm_head is model.lm_head


def test_qwen3_layout_names_and_shared_tensors_from_checkpoint(tmp_path):
    model = random_drafter(GQA_TINY, seed=1)
    out = export_drafter(model, tmp_path / "q", layout="deepspec_qwen3")
    tensors = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= set(tensors)
    assert not any(n.startswith(("context_", "final_norm", "embed_tokens", "lm_head")) for n in tensors)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["is_neox_style"] is True
    # A DeepSpec checkpoint carries its own embedding and lm_head; import takes them from there.
    tensors["embed_tokens.weight"] = model.embed_tokens.clone()
    tensors["lm_head.weight"] = model.lm_head.clone()
    tensors["mask_embedding"] = torch.randn(GQA_TINY.hidden_size)  # vLLM's placeholder, ignored
    from safetensors.torch import save_file
    save_file(tensors, str(out / "model.safetensors"))
    back = import_drafter(out)
    assert torch.equal(back.embed_tokens, model.embed_tokens) and torch.equal(back.lm_head, model.lm_head)
    assert torch.equal(back.context_proj.weight, model.context_proj.weight)


def test_export_from_our_checkpoint_directory(tmp_path):
    model = random_drafter(K3_TINY_DSPARK, seed=2)
    save_checkpoint(model, tmp_path / "ours")
    out = export_drafter(tmp_path / "ours", tmp_path / "k3-dspark", layout="k3", dtype=torch.bfloat16)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back = import_drafter(out, model.embed_tokens, model.lm_head)
    assert back.context_proj.weight.dtype == torch.bfloat16
    assert torch.equal(back.context_proj.weight, model.context_proj.weight.to(torch.bfloat16))


@pytest.mark.parametrize("layout,change,field", [
    ("k3", {"attention_type": "gqa", "num_kv_heads": 2, "head_dim": 16}, "attention_type"),
    ("k3", {"rope_interleaved": False}, "rope_interleaved"),
    ("k3", {"markov_head_type": "gated"}, "markov_head_type"),
    ("k3", {"confidence_bias": False}, "confidence_bias"),
    ("k3", {"use_rope": False}, "use_rope"),
    ("deepspec_qwen3", {}, "attention_type"),
    ("deepspec_qwen3", {"attention_type": "gqa", "num_kv_heads": 2, "head_dim": 16}, "rope_scaling"),
])
def test_unexpressible_drafters_name_the_field(tmp_path, layout, change, field):
    model = random_drafter(dataclasses.replace(K3_TINY_DSPARK, **change), seed=3)
    with pytest.raises(ValueError, match=rf"DSparkConfig\.{field}="):
        export_drafter(model, tmp_path / "x", layout=layout)
    with pytest.raises(ValueError, match="layout="):
        export_drafter(model, tmp_path / "x", layout="eagle")


def test_import_needs_the_target_tensors_or_a_checkpoint_copy(tmp_path):
    out = export_drafter(random_drafter(K3_TINY_DSPARK, seed=4), tmp_path / "k3-dspark")
    with pytest.raises(ValueError, match="embed_tokens=None"):
        import_drafter(out)


def test_import_of_a_published_k3_layout_without_our_extra_keys(tmp_path):
    """An Inferact/Kimi-K3-DSpark-style checkpoint: no target depth, no attention_type or
    rope_interleaved keys, and an (unused) copy of the target embedding but no lm_head."""
    model = random_drafter(K3_TINY_DSPARK, seed=5)
    out = export_drafter(model, tmp_path / "k3-dspark", layout="k3")
    cfg = json.loads((out / "config.json").read_text())
    for ours_only in ("target_num_hidden_layers", "attention_type", "rope_interleaved", "dspark_name",
                      "confidence_bias", "head_dim", "target_hidden_size"):
        cfg.pop(ours_only)
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"] = model.embed_tokens.clone()
    from safetensors.torch import save_file
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head=None"):
        import_drafter(out)
    back = import_drafter(out, lm_head=model.lm_head)
    taps = K3_TINY_DSPARK.target_layer_ids
    assert back.config.target_num_layers == max(taps) + 2
    assert back.config.attention_type == "mla" and back.config.rope_interleaved
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_export_command_from_our_gqa_checkpoint_and_from_a_deepspec_one(tmp_path, capsys):
    import argparse

    from dspark.vllm.export import configure_parser, main

    model = random_drafter(GQA_TINY, seed=6)
    save_checkpoint(model, tmp_path / "ours")  # our own format: architectures DSparkDraftModel
    parser = configure_parser(argparse.ArgumentParser())
    assert main(parser.parse_args([str(tmp_path / "ours"), str(tmp_path / "q1"), "--layout", "deepspec_qwen3"])) == 0
    assert '"method": "dspark"' in capsys.readouterr().out
    assert main(parser.parse_args([str(tmp_path / "q1"), str(tmp_path / "q2"), "--layout", "deepspec_qwen3"])) == 0
    back = import_drafter(tmp_path / "q2", model.embed_tokens, model.lm_head)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    assert main(parser.parse_args([str(tmp_path / "q1"), str(tmp_path / "k3"), "--layout", "k3"])) == 2
    assert "DSparkConfig.attention_type='gqa'" in capsys.readouterr().err


# The dedicated mask id: one embedding row past the target's vocabulary (drafters/dspark/model.py).
GQA_MASK_ROW = dataclasses.replace(GQA_TINY, mask_token_id=GQA_TINY.vocab_size)


def test_qwen3_export_ships_the_mask_row_in_its_own_embedding(tmp_path):
    """vLLM's Qwen3DSparkModel embeds ids past the target's vocabulary only from the checkpoint's
    embed_tokens (config vocab_size rows), drafting from draft_vocab_size rows of the target's lm_head."""
    model = random_drafter(GQA_MASK_ROW, seed=int(torch.randint(0, 2**31, ())))
    vocab = GQA_MASK_ROW.vocab_size
    out = export_drafter(model, tmp_path / "q", layout="deepspec_qwen3")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["vocab_size"], cfg["draft_vocab_size"], cfg["mask_token_id"]) == (vocab + 1, vocab, vocab)
    tensors = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # drafted ids are the target's: vLLM shares its lm_head
    embed = tensors["embed_tokens.weight"]
    assert embed.shape == (vocab + 1, GQA_MASK_ROW.hidden_size)
    assert torch.equal(embed[:vocab], model.embed_tokens)
    # vLLM's embedding of the mask id is our drafter's embedding of it
    mask_block = torch.full((1, 1), vocab)
    assert torch.equal(embed[vocab], model.embed_block(mask_block)[0, 0])
    assert not torch.equal(embed[vocab], embed[0])
    w1 = tensors["markov_head.markov_w1.weight"]
    assert torch.equal(w1[:vocab], model.markov_head.markov_w1.weight)
    assert torch.equal(w1[vocab], torch.zeros(GQA_MASK_ROW.markov_rank))
    for target_tensors in ((model.embed_tokens, model.lm_head), (None, model.lm_head)):
        back = import_drafter(out, *target_tensors)
        assert _relevant(back.config) == _relevant(model.config)
        assert torch.equal(back.embed_tokens, model.embed_tokens)
        assert torch.equal(back.mask_embedding, model.mask_embedding)
        for name, tensor in model.state_dict().items():
            assert torch.equal(back.state_dict()[name], tensor), name


def test_mask_row_export_in_bfloat16_imports_back(tmp_path):
    model = random_drafter(GQA_MASK_ROW, seed=7)
    out = export_drafter(model, tmp_path / "q", layout="deepspec_qwen3", dtype=torch.bfloat16)
    back = import_drafter(out, lm_head=model.lm_head)
    assert torch.equal(back.embed_tokens, model.embed_tokens.to(torch.bfloat16))
    # the bfloat16 rows are each within 2^-8 relative, so their mean is within 2^-8 x mean |row|,
    # plus its own rounding (2^-8 relative)
    atol = 2 ** -8 * model.embed_tokens.abs().mean().item()
    torch.testing.assert_close(back.mask_embedding.float(), model.mask_embedding, atol=atol, rtol=2 ** -8)


def test_import_refuses_a_mask_row_our_drafter_would_not_derive(tmp_path):
    model = random_drafter(GQA_MASK_ROW, seed=8)
    out = export_drafter(model, tmp_path / "q", layout="deepspec_qwen3")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["embed_tokens.weight"][-1] += 0.01  # a trained mask row: we would silently replace it
    from safetensors.torch import save_file
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"row {GQA_MASK_ROW.vocab_size} \(mask_token_id="):
        import_drafter(out)


def test_k3_layout_refuses_the_mask_row(tmp_path):
    """vLLM's K3DSparkModel always embeds with the target's embedding: it cannot embed id V."""
    model = random_drafter(dataclasses.replace(K3_TINY_DSPARK, mask_token_id=K3_TINY_DSPARK.vocab_size), seed=9)
    with pytest.raises(ValueError, match=r"DSparkConfig\.mask_token_id=.*K3DSparkModel"):
        export_drafter(model, tmp_path / "k3-dspark", layout="k3")
    assert not (tmp_path / "k3-dspark").exists()


def test_mask_row_export_from_our_checkpoint_needs_the_target_embedding(tmp_path):
    model = random_drafter(GQA_MASK_ROW, seed=10)
    save_checkpoint(model, tmp_path / "ours")  # carries no embedding
    with pytest.raises(ValueError, match=r"DSparkConfig\.mask_token_id=.*embed_tokens"):
        export_drafter(tmp_path / "ours", tmp_path / "q", layout="deepspec_qwen3")
    with pytest.raises(ValueError, match=r"embed_tokens: shape"):
        export_drafter(tmp_path / "ours", tmp_path / "q", layout="deepspec_qwen3", embed_tokens=model.embed_tokens[1:])
    with pytest.raises(ValueError, match=r"embed_tokens: given with a DSparkModel"):
        export_drafter(model, tmp_path / "q", layout="deepspec_qwen3", embed_tokens=model.embed_tokens)
    from_dir = export_drafter(tmp_path / "ours", tmp_path / "q", layout="deepspec_qwen3", embed_tokens=model.embed_tokens)
    from_model = export_drafter(model, tmp_path / "q-model", layout="deepspec_qwen3")
    a, b = load_file(str(from_dir / "model.safetensors")), load_file(str(from_model / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    # re-exporting an export takes the embedding from the checkpoint's own copy
    again = export_drafter(from_dir, tmp_path / "q-again", layout="deepspec_qwen3")
    c = load_file(str(again / "model.safetensors"))
    assert set(c) == set(a) and all(torch.equal(a[n], c[n]) for n in a)


def test_export_command_takes_the_target_embedding_from_a_gguf(tmp_path, capsys):
    import argparse

    gguf = pytest.importorskip("gguf")
    from dspark.vllm.export import configure_parser, main

    model = random_drafter(GQA_MASK_ROW, seed=11)
    save_checkpoint(model, tmp_path / "ours")
    writer = gguf.GGUFWriter(str(tmp_path / "target.gguf"), "llama")
    writer.add_tensor("token_embd.weight", model.embed_tokens.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parser = configure_parser(argparse.ArgumentParser())
    assert main(parser.parse_args([str(tmp_path / "ours"), str(tmp_path / "q"), "--layout", "deepspec_qwen3"])) == 2
    assert "mask_token_id=" in capsys.readouterr().err
    assert main(parser.parse_args([str(tmp_path / "ours"), str(tmp_path / "q"), "--layout", "deepspec_qwen3",
                                   "--target-gguf", str(tmp_path / "target.gguf")])) == 0
    back = import_drafter(tmp_path / "q", lm_head=model.lm_head)
    assert torch.equal(back.embed_tokens, model.embed_tokens)
    assert torch.equal(back.mask_embedding, model.mask_embedding)
