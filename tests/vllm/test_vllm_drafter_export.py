"""Drafter export against the real vLLM (0.32): config auto-detection and the model classes' own
weight loading, on the CPU.

Needs the venv from scripts/vllm_env.sh; skips where vllm is not importable. vLLM's DSpark runs
only on Model Runner V2, whose config check wants Triton; this machine has none, so the module sets
vllm.config.vllm.HAS_TRITON (the capability flag only) to build the VllmConfig the model classes
read, and a one-process gloo group for their (un-sharded) linear layers. Nothing runs a forward.
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    import vllm.config.vllm as vllm_config_module
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.torch_utils import set_default_torch_dtype
except Exception as exc:
    pytest.skip(f"vllm is not importable here ({exc!r}); build the venv with scripts/vllm_env.sh",
                allow_module_level=True)

from safetensors.torch import load_file

from dspark.drafters.dspark import K3_TINY_DSPARK, DSparkModel
from dspark.vllm import write_tiny_target
from dspark.vllm.export import export_drafter, import_drafter

# vLLM 0.32's own modules still define torch.jit script methods, which torch 2.13 deprecates: theirs to change.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

GQA_TINY = dataclasses.replace(K3_TINY_DSPARK, name="qwen3-tiny_dspark", attention_type="gqa", num_kv_heads=2,
                               head_dim=16, rope_interleaved=False, rope_scaling=None)
SEED = int(torch.randint(0, 2**31, ()))


def random_drafter(config, seed=SEED):
    g = torch.Generator().manual_seed(seed)
    shape = (config.vocab_size, config.hidden_size)
    model = DSparkModel(config, torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_tiny_target(tmp_path_factory.mktemp("target"), vocab_size=K3_TINY_DSPARK.vocab_size)
    return ModelConfig(model=path, skip_tokenizer_init=True, dtype="float32")


def spec_config(target, draft_dir, **extra):
    return SpeculativeConfig(model=str(draft_dir), num_speculative_tokens=K3_TINY_DSPARK.block_size,
                             target_model_config=target, target_parallel_config=ParallelConfig(), **extra)


@pytest.mark.parametrize("layout,folder,architecture", [
    ("k3", "k3-dspark", "K3DSparkModel"),
    ("deepspec_qwen3", "qwen3-drafter", "Qwen3DSparkModel"),  # detected by architecture, not path
])
def test_auto_detection_picks_dspark_and_the_architecture(tmp_path_factory, target, layout, folder, architecture):
    config = K3_TINY_DSPARK if layout == "k3" else GQA_TINY
    out = export_drafter(random_drafter(config), tmp_path_factory.mktemp(folder), layout=layout)
    sc = spec_config(target, out)
    assert sc.method == "dspark"
    assert sc.draft_model_config.architectures == [architecture]
    hf = sc.draft_model_config.hf_config
    assert hf.block_size == config.block_size and list(hf.target_layer_ids) == list(config.target_layer_ids)
    assert hf.markov_rank == config.markov_rank and hf.mask_token_id == config.mask_token_id
    # vLLM captures the stream entering layer L; our tap l is the output of layer l (docs/dspark-algorithm.md §2.1)
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    assert get_eagle3_aux_layers_from_config(sc) == tuple(t + 1 for t in config.target_layer_ids)


def test_k3_detection_needs_dspark_in_the_path(tmp_path_factory, target):
    """vLLM 0.32 auto-detects K3DSparkModel only by a "dspark" in the path; method="dspark" keeps
    the architecture (it is one of the DSpark classes vLLM does not rewrite to DeepSeek-V4)."""
    out = export_drafter(random_drafter(K3_TINY_DSPARK), tmp_path_factory.mktemp("k3-drafter"), layout="k3")
    assert "dspark" not in str(out).lower()
    assert spec_config(target, out).method != "dspark"
    explicit = spec_config(target, out, method="dspark")
    assert explicit.method == "dspark" and explicit.draft_model_config.architectures == ["K3DSparkModel"]


@pytest.fixture(scope="module")
def process_group(tmp_path_factory, target):
    # The model classes' linear layers ask for the tensor-parallel rank: one gloo process.
    with set_current_vllm_config(VllmConfig(model_config=target)):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tmp_path_factory.mktemp('pg')}/init")
        initialize_model_parallel(1, 1)
    yield


def load_into_vllm(target, draft_dir, model_class):
    """Build vLLM's draft model class for draft_dir (poisoned with NaN) and run its load_weights."""
    had_v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    had_triton, vllm_config_module.HAS_TRITON = vllm_config_module.HAS_TRITON, True
    try:
        vc = VllmConfig(model_config=target, speculative_config=spec_config(target, draft_dir, method="dspark"))
    finally:
        if had_v2 is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = had_v2
        vllm_config_module.HAS_TRITON = had_triton
    with set_current_vllm_config(vc), set_default_torch_dtype(torch.float32):
        model = model_class(vllm_config=vc)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.load_weights(iter(load_file(str(draft_dir / "model.safetensors")).items()))
    return dict(model.named_parameters()), model


def test_k3_export_loads_through_vllms_k3_dspark_loader(tmp_path, target, process_group):
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM

    ours = random_drafter(K3_TINY_DSPARK)
    out = export_drafter(ours, tmp_path / "k3-dspark", layout="k3")
    params, _ = load_into_vllm(target, out, K3DSparkForCausalLM)
    unloaded = [n for n, p in params.items() if torch.isnan(p).any()]
    assert unloaded == []
    w = {n: t for n, t in ours.state_dict().items()}
    assert torch.equal(params["model.context_proj.weight"], w["context_proj.weight"])
    assert torch.equal(params["model.final_norm.weight"], w["final_norm.weight"])
    for i in range(K3_TINY_DSPARK.num_layers):
        a, v = f"layers.{i}.self_attn.", f"model.layers.{i}.self_attn."
        assert torch.equal(params[v + "fused_qkv_a_proj.weight"],
                           torch.cat([w[a + "q_a_proj.weight"], w[a + "kv_a_proj_with_mqa.weight"]]))
        for name in ("q_b_proj", "kv_b_proj", "o_proj", "q_a_layernorm", "kv_a_layernorm"):
            assert torch.equal(params[v + name + ".weight"], w[a + name + ".weight"]), name
        assert torch.equal(params[f"model.layers.{i}.mlp.gate_up_proj.weight"],
                           torch.cat([w[f"layers.{i}.mlp.gate_proj.weight"], w[f"layers.{i}.mlp.up_proj.weight"]]))
    assert torch.equal(params["model.context_kv_proj.weight"],
                       torch.cat([w[f"layers.{i}.self_attn.kv_a_proj_with_mqa.weight"]
                                  for i in range(K3_TINY_DSPARK.num_layers)]))
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "confidence_head.proj.weight", "confidence_head.proj.bias"):
        assert torch.equal(params["model." + name], w[name]), name


def test_qwen3_export_loads_through_vllms_qwen3_dspark_loader(tmp_path, target, process_group):
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    ours = random_drafter(GQA_TINY)
    out = export_drafter(ours, tmp_path / "qwen3-dspark", layout="deepspec_qwen3")
    params, _ = load_into_vllm(target, out, Qwen3DSparkForCausalLM)
    # The target's embedding and lm_head are aliased in by vLLM's load_dspark_model afterwards;
    # mask_embedding is vLLM's unused placeholder.
    shared = ("model.embed_tokens.weight", "lm_head.weight", "model.mask_embedding")
    unloaded = [n for n, p in params.items() if torch.isnan(p).any() and n not in shared]
    assert unloaded == []
    w = ours.state_dict()
    assert torch.equal(params["model.fc.weight"], w["context_proj.weight"])
    assert torch.equal(params["model.hidden_norm.weight"], w["context_norm.weight"])
    assert torch.equal(params["model.norm.weight"], w["final_norm.weight"])
    for i in range(GQA_TINY.num_layers):
        a, v = f"layers.{i}.self_attn.", f"model.layers.{i}.self_attn."
        assert torch.equal(params[v + "qkv_proj.weight"],
                           torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]))
        for name in ("o_proj", "q_norm", "k_norm"):
            assert torch.equal(params[v + name + ".weight"], w[a + name + ".weight"]), name
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight",
                 "confidence_head.proj.weight", "confidence_head.proj.bias"):
        assert torch.equal(params["model." + name], w[name]), name


@pytest.mark.parametrize("layout", ["k3", "deepspec_qwen3"])
def test_vllms_rope_from_the_exported_config_rotates_like_ours(tmp_path, target, process_group, layout):
    """The RoPE and softmax scale vLLM builds from the exported config.json (K3: DeepSeek YaRN on interleaved pairs;
    Qwen3: rotate-halves) against our drafter's, on random queries at random positions. A layout
    mismatch does not fail loudly in vLLM, acceptance just collapses."""
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.models.kimi_k3.nvidia.dspark_mla import K3DSparkForCausalLM

    config, cls = (K3_TINY_DSPARK, K3DSparkForCausalLM) if layout == "k3" else (GQA_TINY, Qwen3DSparkForCausalLM)
    ours = random_drafter(config)
    _, theirs = load_into_vllm(target, export_drafter(ours, tmp_path / "dspark", layout=layout), cls)
    rope_ours = ours.layers[0].self_attn.rotary
    rope_vllm = theirs.model.layers[0].self_attn.rotary_emb
    attn_vllm = theirs.model.layers[0].self_attn
    # softmax scale, with YaRN's mscale(factor, mscale_all_dim)^2 for K3
    assert getattr(attn_vllm, "scale", getattr(attn_vllm, "scaling", None)) == pytest.approx(
        ours.layers[0].self_attn.scale, rel=1e-6)
    tokens, heads, dim = 16, config.num_heads, rope_ours.dim
    positions = torch.randint(0, 256, (tokens,))
    q, k = torch.randn(tokens, heads, dim, dtype=torch.float64), torch.randn(tokens, 1, dim, dtype=torch.float64)
    q_vllm, k_vllm = rope_vllm.forward_native(positions, q.float().clone(), k.float().clone())
    q_vllm, k_vllm = q_vllm.reshape(tokens, heads, dim), k_vllm.reshape(tokens, 1, dim)
    torch.testing.assert_close(rope_ours(q.float(), positions), q_vllm, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(rope_ours(k.float(), positions), k_vllm, atol=2e-4, rtol=1e-4)
    # the opposite pairing convention is far off, so the comparison can tell them apart
    rope_ours.interleaved = not rope_ours.interleaved
    assert (rope_ours(q.float(), positions) - q_vllm).abs().max() > 0.1


@pytest.mark.parametrize("layout,config", [("k3", K3_TINY_DSPARK), ("deepspec_qwen3", GQA_TINY)])
def test_round_trip_is_exact(tmp_path, layout, config):
    ours = random_drafter(config)
    back = import_drafter(export_drafter(ours, tmp_path / "d", layout=layout), ours.embed_tokens, ours.lm_head)
    theirs = back.state_dict()
    assert set(theirs) == set(ours.state_dict())
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_qwen3_export_of_the_dedicated_mask_id_embeds_it_in_vllm(tmp_path, target, process_group, monkeypatch):
    """mask_token_id = vocab_size (one row past the target's vocabulary): vLLM's own load_dspark_model
    keeps the drafter's V + 1-row embedding (it shares the target's only when the drafter's vocab_size
    fits it) and aliases the target's lm_head (draft_vocab_size = the target's); the drafter's
    embedding of the mask id and of real ids is then ours."""
    import vllm.model_executor.model_loader as model_loader
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    config = dataclasses.replace(GQA_TINY, mask_token_id=GQA_TINY.vocab_size)
    ours = random_drafter(config)
    out = export_drafter(ours, tmp_path / "qwen3-dspark", layout="deepspec_qwen3")
    params, theirs = load_into_vllm(target, out, Qwen3DSparkForCausalLM)
    unloaded = [n for n, p in params.items() if torch.isnan(p).any() and n not in ("lm_head.weight", "model.mask_embedding")]
    assert unloaded == []

    # A stand-in target with its own embedding and lm_head, poisoned differently from ours, and
    # get_model answering with the drafter loaded above (building it from files needs the runner).
    vocab, d = config.vocab_size, config.hidden_size
    stand_in = torch.nn.Module()
    stand_in.model = torch.nn.Module()
    stand_in.model.embed_tokens = torch.nn.Embedding(vocab, d)
    stand_in.lm_head = torch.nn.Linear(d, vocab, bias=False)
    with torch.no_grad():
        stand_in.model.embed_tokens.weight.fill_(float("inf"))
        stand_in.lm_head.weight.copy_(ours.lm_head)
    monkeypatch.setattr(model_loader, "get_model", lambda **kwargs: theirs)
    had_v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    try:
        vc = VllmConfig(model_config=target, speculative_config=spec_config(target, out, method="dspark"))
        with set_current_vllm_config(vc):
            drafter = load_dspark_model(stand_in, vc)
    finally:
        if had_v2 is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = had_v2
    assert drafter.model.embed_tokens is not stand_in.model.embed_tokens
    assert drafter.lm_head is stand_in.lm_head

    ids = torch.cat([torch.randint(0, vocab, (24,)), torch.full((8,), vocab)])[torch.randperm(32)]
    with torch.no_grad():
        torch.testing.assert_close(drafter.embed_input_ids(ids), ours.embed_block(ids), atol=0, rtol=0)
        sampled = torch.randint(0, vocab, (16,))
        torch.testing.assert_close(drafter.markov_embed(sampled), ours.markov_head.markov_w1(sampled), atol=0, rtol=0)
