"""K3 checkpoint I/O: a k3-tiny checkpoint written in the released layout (real tensor names,
MXFP4-packed experts) loads back to the same logits; naming/shape errors name the tensor."""
import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark.targets.kimi_k3 import K3_TINY, K3Model, load_target, save_checkpoint
from dspark.kernels.mxfp4 import dequantise, pack
from dspark.threads import one_cpu_thread


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = K3Model.random(K3_TINY, seed=int(torch.randint(0, 2**31 - 1, ())), dtype=torch.float32)
    # Re-pack one expert from float weights so the file holds pack()'s output too.
    moe = model.moe[1]
    w1 = torch.randn(K3_TINY.moe_intermediate_size, K3_TINY.latent_size) * 0.2
    moe.w1_packed[3], moe.w1_scale[3] = pack(w1)
    directory = tmp_path_factory.mktemp("k3-tiny-ckpt")
    save_checkpoint(model, directory)
    return model, directory


def only_shard(directory):
    (shard,) = sorted(directory.glob("*.safetensors"))
    return shard


def test_checkpoint_has_real_names_dtypes_and_mxfp4_packing(checkpoint):
    model, directory = checkpoint
    config = json.loads((directory / "config.json").read_text())
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    with safe_open(str(only_shard(directory)), framework="pt") as f:
        names = set(f.keys())
        e = "language_model.model.layers.1.block_sparse_moe.experts.3.w1"
        packed, scale = f.get_tensor(f"{e}.weight_packed"), f.get_tensor(f"{e}.weight_scale")
    assert packed.dtype == torch.uint8 and packed.shape == (K3_TINY.moe_intermediate_size, K3_TINY.latent_size // 2)
    assert scale.shape == (K3_TINY.moe_intermediate_size, K3_TINY.latent_size // 32)
    assert torch.equal(dequantise(packed, scale), dequantise(model.moe[1].w1_packed[3], model.moe[1].w1_scale[3]))
    for name in ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
                 "language_model.model.layers.0.self_attn.q_conv1d.weight",
                 "language_model.model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
                 "language_model.model.layers.0.mlp.gate_proj.weight",
                 "language_model.model.layers.2.block_sparse_moe.gate.e_score_correction_bias",
                 "language_model.model.layers.4.self_attention_res_proj.weight"):
        assert name in names, name


def test_checkpoint_loads_to_the_same_logits(checkpoint, tmp_path):
    model, directory = checkpoint
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    prompt = torch.randint(0, K3_TINY.vocab_size, (6,), generator=gen)
    from dspark.targets.kimi_k3 import K3Target

    original = K3Target(model, max_slots=1, max_seq_len=16).prefill([0], [prompt]).logits
    loaded = load_target(str(directory), max_slots=1, max_seq_len=16, dtype=torch.float32)
    assert loaded.model.cfg.mla_layers == K3_TINY.mla_layers
    assert torch.equal(loaded.prefill([0], [prompt]).logits, original)
    bf16 = K3Model.from_checkpoint(directory, dtype=torch.bfloat16)
    assert bf16.tensors["language_model.model.layers.0.self_attn.A_log"].dtype == torch.float32
    assert bf16.tensors["language_model.model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("damage", ["rename", "reshape"])
def test_damaged_checkpoint_raises_naming_the_tensor(checkpoint, tmp_path, damage):
    _, directory = checkpoint
    tensors = load_file(str(only_shard(directory)))
    name = "language_model.model.layers.3.self_attn.q_b_proj.weight"
    if damage == "rename":
        tensors["language_model.model.layers.3.self_attn.q_b.weight"] = tensors.pop(name)
    else:
        tensors[name] = tensors[name][:-1].contiguous()
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(name)):
        load_target(str(tmp_path), max_slots=1, max_seq_len=8, dtype=torch.float32)
