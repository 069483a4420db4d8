"""K3 checkpoint layout: tensor names, shapes and dtypes of the released Hugging Face checkpoint,
random initialisation in that layout, and safetensors load/save.

Names (docs/kimi-k3.md §1.3): the text model sits under `language_model.` of
KimiK3ForConditionalGeneration, layers as `language_model.model.layers.{i}.…`. KDA and MLA
tensors are under `self_attn`, the dense layer-0 FFN under `mlp`, the latent MoE under
`block_sparse_moe` (the Kimi-Linear module name), with routed experts
`experts.{e}.w{1,2,3}.weight_packed / weight_scale`. The per-layer suffixes follow two
independent K3 loaders read with the search tool (a Rust K3 layer-weight loader that lists
every layer tensor with dtype and shape, and the pie CUDA driver's K3 weight contract, whose
manifest names `block_sparse_moe.gate.e_score_correction_bias` and
`block_sparse_moe.routed_expert_down_proj.weight`). Dtypes: BF16 except the fp32 KDA conv
taps, A_log, dt_bias, o_norm and router bias, and the uint8 MXFP4 experts (docs/kimi-k3.md §1.2).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from dspark.checkpoint_files import CheckpointError, iter_safetensors, read_json, require_directory
from .config import K3Config
from .sharding import Shard, shard_shape, shard_view
from dspark.kernels.mxfp4 import E2M1_MAGNITUDES, E8M0_BIAS, GROUP_SIZE

PREFIX = "language_model.model"
LM_HEAD = "language_model.lm_head.weight"
EMBED = f"{PREFIX}.embed_tokens.weight"
FINAL_NORM = f"{PREFIX}.norm.weight"
OUTPUT_RES_NORM = f"{PREFIX}.output_attn_res_norm.weight"
OUTPUT_RES_PROJ = f"{PREFIX}.output_attn_res_proj.weight"

# Tensor kinds: "float" = the model dtype (bf16 in the checkpoint), "fp32" = always float32,
# "u8" = MXFP4 bytes.
FP32_SUFFIXES = ("_conv1d.weight", ".A_log", ".dt_bias", ".o_norm.weight", ".e_score_correction_bias")


def layer_prefix(i: int) -> str:
    return f"{PREFIX}.layers.{i}"


def expert_prefix(i: int, e: int) -> str:
    return f"{layer_prefix(i)}.block_sparse_moe.experts.{e}"


# A routed expert's tensor: layer, expert, weight (w1/w2/w3), part (weight_packed/weight_scale).
EXPERT_NAME = re.compile(re.escape(PREFIX) + r"\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale)")
EXPERT_WEIGHTS = ("w1", "w3", "w2")


def expert_shapes(cfg: K3Config) -> dict[str, tuple[int, int]]:
    """"{w}.{part}" -> shape of one routed expert's MXFP4 tensor: w1, w3 [I, latent], w2 [latent, I] as
    packed codes [N, K/2] and scales [N, K/32] (docs/kimi-k3.md §1.3)."""
    inter, latent = cfg.moe_intermediate_size, cfg.latent_size
    shapes = {}
    for w, (n, k) in zip(EXPERT_WEIGHTS, ((inter, latent), (inter, latent), (latent, inter))):
        shapes[f"{w}.weight_packed"] = (n, k // 2)
        shapes[f"{w}.weight_scale"] = (n, k // GROUP_SIZE)
    return shapes


def expert_stack_views(cfg: K3Config, i: int, stacks: dict[str, torch.Tensor], experts: range) -> dict[str, torch.Tensor]:
    """The checkpoint-layout names of layer i's experts as views of its stacks [len(experts), ...]:
    a model built from them takes the stacks as they are (K3Model._stack_moe), so the routed
    experts, most of the bytes, are never held twice (a per-expert tensor stacked by copying
    leaves its freed block in the caching allocator, which cannot serve the larger stack)."""
    return {f"{expert_prefix(i, e)}.{key}": stack[j] for key, stack in stacks.items() for j, e in enumerate(experts)}


def tensor_specs(cfg: K3Config, shard: Shard | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the checkpoint: name -> (shape, kind); with `shard`, the tensors that rank
    holds (its experts only) in the shapes it holds them (sharding.py)."""
    specs = _full_specs(cfg)
    if shard is None or shard.world == 1:
        return specs
    mine = shard.experts(cfg)
    held = {}
    for name, (shape, kind) in specs.items():
        expert = EXPERT_NAME.fullmatch(name)
        if expert is None:
            held[name] = (shard_shape(cfg, shard, name, shape), kind)
        elif int(expert.group(2)) in mine:
            held[name] = (shape, kind)
    return held


def _full_specs(cfg: K3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    D, V = cfg.hidden_size, cfg.vocab_size
    specs: dict[str, tuple[tuple[int, ...], str]] = {}

    def add(name, *shape):
        kind = "fp32" if name.endswith(FP32_SUFFIXES) else "float"
        specs[name] = (tuple(shape), kind)

    add(EMBED, V, D)
    add(FINAL_NORM, D)
    add(OUTPUT_RES_NORM, D)
    add(OUTPUT_RES_PROJ, 1, D)
    add(LM_HEAD, V, D)
    W, H, Dh = cfg.kda_width, cfg.kda_num_heads, cfg.kda_head_dim
    for i in range(cfg.num_layers):
        p = layer_prefix(i)
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            add(f"{p}.{norm}.weight", D)
        add(f"{p}.self_attention_res_proj.weight", 1, D)
        add(f"{p}.mlp_res_proj.weight", 1, D)
        a = f"{p}.self_attn"
        if cfg.layer_type(i) == "kda":
            for proj in ("q", "k", "v", "g"):
                add(f"{a}.{proj}_proj.weight", W, D)
            for proj in ("q", "k", "v"):
                add(f"{a}.{proj}_conv1d.weight", W, 1, cfg.kda_conv_size)
            add(f"{a}.f_a_proj.weight", cfg.kda_gate_rank, D)
            add(f"{a}.f_b_proj.weight", W, cfg.kda_gate_rank)
            add(f"{a}.b_proj.weight", H, D)
            add(f"{a}.dt_bias", W)
            add(f"{a}.A_log", cfg.kda_a_log_size)
            add(f"{a}.o_norm.weight", Dh)
            add(f"{a}.o_proj.weight", D, W)
        else:
            Hm = cfg.mla_num_heads
            add(f"{a}.q_a_proj.weight", cfg.q_lora_rank, D)
            add(f"{a}.q_a_layernorm.weight", cfg.q_lora_rank)
            add(f"{a}.q_b_proj.weight", Hm * cfg.qk_head_dim, cfg.q_lora_rank)
            add(f"{a}.kv_a_proj_with_mqa.weight", cfg.kv_cache_width, D)
            add(f"{a}.kv_a_layernorm.weight", cfg.kv_lora_rank)
            add(f"{a}.kv_b_proj.weight", Hm * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
            add(f"{a}.g_proj.weight", Hm * cfg.v_head_dim, D)
            add(f"{a}.o_proj.weight", D, Hm * cfg.v_head_dim)
        if cfg.ffn_type(i) == "dense":
            add(f"{p}.mlp.gate_proj.weight", cfg.intermediate_size, D)
            add(f"{p}.mlp.up_proj.weight", cfg.intermediate_size, D)
            add(f"{p}.mlp.down_proj.weight", D, cfg.intermediate_size)
        else:
            m, Lt, S = f"{p}.block_sparse_moe", cfg.latent_size, cfg.shared_intermediate_size
            add(f"{m}.gate.weight", cfg.num_experts, D)
            add(f"{m}.gate.e_score_correction_bias", cfg.num_experts)
            add(f"{m}.routed_expert_down_proj.weight", Lt, D)
            add(f"{m}.routed_expert_norm.weight", Lt)
            add(f"{m}.routed_expert_up_proj.weight", D, Lt)
            add(f"{m}.shared_experts.gate_proj.weight", S, D)
            add(f"{m}.shared_experts.up_proj.weight", S, D)
            add(f"{m}.shared_experts.down_proj.weight", D, S)
            for e in range(cfg.num_experts):
                for key, shape in expert_shapes(cfg).items():
                    specs[f"{expert_prefix(i, e)}.{key}"] = (shape, "u8")
    return specs


def tensor_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    return {"float": dtype, "fp32": torch.float32, "u8": torch.uint8}[kind]


# ---------------------------------------------------------------------------- random init
def _random_expert_stacks(cfg: K3Config, experts: int, gen: torch.Generator, device) -> dict[str, torch.Tensor]:
    """One layer's routed experts drawn straight into their stacks [experts, ...]: uniform random
    E2M1 codes with one power-of-two scale per weight chosen so its std is about fan_in^-1/2
    (uniform codes have an rms of sqrt(mean(m^2)) over the 8 magnitudes)."""
    code_rms = math.sqrt(sum(m * m for m in E2M1_MAGNITUDES) / len(E2M1_MAGNITUDES))
    shapes = expert_shapes(cfg)
    stacks = {}
    for w in EXPERT_WEIGHTS:
        n, half_k = shapes[f"{w}.weight_packed"]
        exponent = round(math.log2((2 * half_k) ** -0.5 / code_rms))
        stacks[f"{w}.weight_packed"] = torch.randint(0, 256, (experts, n, half_k), generator=gen, device=device,
                                                     dtype=torch.uint8)
        stacks[f"{w}.weight_scale"] = torch.full((experts, *shapes[f"{w}.weight_scale"]), exponent + E8M0_BIAS,
                                                 dtype=torch.uint8, device=device)
    return stacks


def random_tensors(cfg: K3Config, seed: int, dtype: torch.dtype, device,
                   shard: Shard | None = None) -> dict[str, torch.Tensor]:
    """A random checkpoint whose activations stay O(1): linear weights ~ N(0, 1/fan_in) on
    RMS-normalised inputs, norms near 1, logits of unit scale (varied argmax). Each MoE layer's
    experts are views of one stack per tensor kind (expert_stack_views). With `shard`, only that
    rank's tensors, drawn in its shapes (fan-in that of the whole matrix); they are not slices of
    the whole model of the same seed (shard_tensors makes those)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    shard = shard or Shard()
    experts = shard.experts(cfg)
    held = tensor_specs(cfg, shard)
    tensors: dict[str, torch.Tensor] = {}
    for name, (full_shape, kind) in tensor_specs(cfg).items():
        if name not in held:
            continue
        if kind == "u8":
            if name not in tensors:  # the layer's first expert tensor: draw all of them
                layer = int(EXPERT_NAME.fullmatch(name).group(1))
                stacks = _random_expert_stacks(cfg, len(experts), gen, device)
                tensors.update(expert_stack_views(cfg, layer, stacks, experts))
            continue
        shape = held[name][0]
        target = tensor_dtype(kind, dtype)

        def normal(std, mean=0.0):
            # drawn in the tensor's own dtype: a float32 draw of the embedding or lm_head would
            # leave a transient twice their size in the caching allocator
            return torch.empty(shape, dtype=target, device=device).normal_(mean, std, generator=gen)

        if name.endswith(("norm.weight", "layernorm.weight")):
            value = normal(0.1, mean=1.0)
        elif name.endswith("_conv1d.weight"):
            value = normal(0.5)
        elif name.endswith(".A_log"):
            # FLA's init: A in [1, 16]; entries past the head count are storage padding (zero).
            value = torch.zeros(shape, dtype=target, device=device)
            heads = min(cfg.kda_num_heads, shape[0])
            value[:heads] = torch.log(1 + 15 * torch.rand(heads, generator=gen, device=device))
        elif name.endswith(".dt_bias"):
            value = normal(0.5)
        elif name.endswith(".e_score_correction_bias"):
            value = normal(0.1)
        elif name == EMBED:
            value = normal(1.0)
        else:  # projections [out, in], including the AttnRes pseudo-queries [1, D]
            value = normal(full_shape[-1] ** -0.5)
        tensors[name] = value
    return tensors


def shard_tensors(cfg: K3Config, tensors: dict[str, torch.Tensor], shard: Shard) -> dict[str, torch.Tensor]:
    """Rank `shard`'s tensors cut from a whole checkpoint-layout dict (copies: the whole model
    may be freed): its part of every tensor (sharding.py) and its experts, stacked per layer."""
    shard.validate(cfg)
    mine = shard.experts(cfg)
    held = {}
    for name, (shape, kind) in tensor_specs(cfg, shard).items():
        expert = EXPERT_NAME.fullmatch(name)
        if expert is None:
            held[name] = shard_view(cfg, shard, name, tensors[name]).clone()
        elif name not in held:
            layer = int(expert.group(1))
            stacks = {key: torch.stack([tensors[f"{expert_prefix(layer, e)}.{key}"] for e in mine])
                      for key in expert_shapes(cfg)}
            held.update(expert_stack_views(cfg, layer, stacks, mine))
    return held


def check_tensors(cfg: K3Config, tensors: dict[str, torch.Tensor], shard: Shard | None = None) -> None:
    """Raise ValueError on a missing, unexpected or misshapen tensor, naming it (the tensors of
    rank `shard` when given)."""
    specs = tensor_specs(cfg, shard)
    missing = [n for n in specs if n not in tensors]
    if missing:
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r} (expected shape {specs[missing[0]][0]}; "
                         f"{len(missing)} missing in all)")
    unexpected = [n for n in tensors if n not in specs]
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor {unexpected[0]!r} with shape "
                         f"{tuple(tensors[unexpected[0]].shape)} ({len(unexpected)} unexpected in all)")
    for name, (shape, kind) in specs.items():
        found = tuple(tensors[name].shape)
        if found != shape:
            raise ValueError(f"tensor {name!r}: expected shape {shape}, found {found}")
        if kind == "u8" and tensors[name].dtype != torch.uint8:
            raise ValueError(f"tensor {name!r}: expected dtype uint8 (MXFP4), found {tensors[name].dtype}")


# ---------------------------------------------------------------------------- config.json
def config_to_json(cfg: K3Config) -> dict:
    text = {
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.mla_num_heads,
        "num_key_value_heads": cfg.mla_num_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "first_k_dense_replace": cfg.first_k_dense,
        "intermediate_size": cfg.intermediate_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_expert_hidden_size": cfg.latent_size,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "hidden_act": "situ",
        "activation_situ_beta": cfg.situ_beta,
        "activation_situ_linear_beta": cfg.situ_linear_beta,
        "attn_res_block_size": cfg.attn_res_block_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in cfg.kda_layers],  # 1-based in the released config
            "full_attn_layers": [i + 1 for i in cfg.mla_layers],
            "num_heads": cfg.kda_num_heads,
            "head_dim": cfg.kda_head_dim,
            "short_conv_kernel_size": cfg.kda_conv_size,
            "use_full_rank_gate": True,
            "gate_lower_bound": cfg.kda_gate_lower_bound,
        },
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": cfg.mxfp4_group_size,
                                                       "scale_dtype": "uint8", "symmetric": True}}},
        },
    }
    # Sizes the released config leaves implicit (both equal head_dim = 128 in K3).
    if cfg.kda_gate_rank != cfg.kda_head_dim:
        text["dspark_kda_gate_rank"] = cfg.kda_gate_rank
    if cfg.kda_a_log_size != cfg.kda_head_dim:
        text["dspark_kda_a_log_size"] = cfg.kda_a_log_size
    return {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": text}


def config_from_json(data: dict, name: str = "checkpoint") -> K3Config:
    """A K3Config from the released config.json (its text_config). A missing key or a value of the
    wrong type is a ValueError naming the key (with its JSON path) and the value."""
    nested = "text_config" in data
    t = _section(data, "text_config") if nested else data
    where = "text_config." if nested else ""
    lin = _section(t, "linear_attn_config", where)
    lin_where = f"{where}linear_attn_config."

    def need(section, key, kind=int, prefix=where):
        if key not in section:
            raise ValueError(f"missing key {prefix + key!r}")
        return _typed(section[key], kind, prefix + key)

    def get(section, key, default, kind=int, prefix=where):
        return _typed(section[key], kind, prefix + key) if key in section else default

    group_size = 32
    quant = get(t, "quantization_config", {}, dict)
    for group_name, group in get(quant, "config_groups", {}, dict, f"{where}quantization_config.").items():
        prefix = f"{where}quantization_config.config_groups.{group_name}."
        weights = get(_typed(group, dict, prefix[:-1]), "weights", {}, dict, prefix)
        group_size = get(weights, "group_size", group_size, prefix=prefix + "weights.")
    full_attn = need(lin, "full_attn_layers", list, lin_where)
    for i in full_attn:
        _typed(i, int, f"{lin_where}full_attn_layers[]")
    head_dim = need(lin, "head_dim", prefix=lin_where)
    return K3Config(
        name=name,
        vocab_size=need(t, "vocab_size"),
        hidden_size=need(t, "hidden_size"),
        num_layers=need(t, "num_hidden_layers"),
        mla_layers=tuple(i - 1 for i in full_attn),
        kda_num_heads=need(lin, "num_heads", prefix=lin_where),
        kda_head_dim=head_dim,
        kda_conv_size=get(lin, "short_conv_kernel_size", 4, prefix=lin_where),
        kda_gate_rank=get(t, "dspark_kda_gate_rank", head_dim),
        kda_gate_lower_bound=get(lin, "gate_lower_bound", -5.0, float, lin_where),
        kda_a_log_size=get(t, "dspark_kda_a_log_size", head_dim),
        mla_num_heads=need(t, "num_attention_heads"),
        q_lora_rank=need(t, "q_lora_rank"),
        kv_lora_rank=need(t, "kv_lora_rank"),
        qk_nope_head_dim=need(t, "qk_nope_head_dim"),
        qk_rope_head_dim=need(t, "qk_rope_head_dim"),
        v_head_dim=need(t, "v_head_dim"),
        first_k_dense=need(t, "first_k_dense_replace"),
        intermediate_size=need(t, "intermediate_size"),
        num_experts=need(t, "num_experts"),
        num_experts_per_token=need(t, "num_experts_per_token"),
        num_shared_experts=need(t, "num_shared_experts"),
        moe_intermediate_size=need(t, "moe_intermediate_size"),
        latent_size=need(t, "routed_expert_hidden_size"),
        routed_scaling_factor=get(t, "routed_scaling_factor", 1.0, float),
        situ_beta=need(t, "activation_situ_beta", float),
        situ_linear_beta=need(t, "activation_situ_linear_beta", float),
        mxfp4_group_size=group_size,
        attn_res_block_size=need(t, "attn_res_block_size"),
        rms_norm_eps=need(t, "rms_norm_eps", float),
        max_position_embeddings=need(t, "max_position_embeddings"),
        bos_token_id=get(t, "bos_token_id", 0),
        eos_token_id=get(t, "eos_token_id", 0),
        pad_token_id=get(t, "pad_token_id", 0),
        tie_word_embeddings=get(t, "tie_word_embeddings", False, bool),
    ).validate()


def _section(data: dict, key: str, prefix: str = "") -> dict:
    if key not in data:
        raise ValueError(f"missing key {prefix + key!r}")
    return _typed(data[key], dict, prefix + key)


def _typed(value, kind: type, key: str):
    """`value` when it is a JSON value of `kind` (int for int, int or float for float; bools only
    for bool), else ValueError naming the key."""
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ValueError(f"{key}={value!r}: expected {'a number' if kind is float else kind.__name__}")
    return float(value) if kind is float else value


# ---------------------------------------------------------------------------- safetensors I/O
def load_checkpoint(path, dtype: torch.dtype, device) -> tuple[K3Config, dict[str, torch.Tensor]]:
    """config.json + *.safetensors in `path` -> (config, tensors in the model's dtypes).

    Every problem with the files (missing directory or config.json, config that is not JSON or
    lacks a key, a truncated or corrupt safetensors file, a missing or misshapen tensor) is one
    CheckpointError naming the file."""
    path = require_directory(path, "K3 checkpoint")
    config_file = path / "config.json"
    try:
        cfg = config_from_json(read_json(config_file, "K3 checkpoint"), name=path.name)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{str(config_file)!r}: {e}") from None
    if cfg.mxfp4_group_size != GROUP_SIZE:
        raise CheckpointError(f"{str(config_file)!r}: quantization_config group_size={cfg.mxfp4_group_size}: "
                              f"only {GROUP_SIZE} is supported")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"K3 checkpoint {str(path)!r}: no *.safetensors files")
    specs = tensor_specs(cfg)
    tensors: dict[str, torch.Tensor] = {}
    stacks: dict[int, dict[str, torch.Tensor]] = {}  # per MoE layer, its experts' stacks, filled as read
    for file in files:
        # The vision tower and projector are not part of the text target.
        for name, tensor in iter_safetensors(file, keep=lambda n: n.startswith("language_model.")):
            kind = specs[name][1] if name in specs else "float"
            if kind == "u8" and tensor.dtype == torch.uint8 and tuple(tensor.shape) == specs[name][0]:
                # Read into its place in the layer's stack (expert_stack_views), never held twice.
                layer, expert = (int(g) for g in EXPERT_NAME.fullmatch(name).group(1, 2))
                if layer not in stacks:
                    stacks[layer] = {key: torch.empty((cfg.num_experts, *shape), dtype=torch.uint8, device=device)
                                     for key, shape in expert_shapes(cfg).items()}
                key = name[len(expert_prefix(layer, expert)) + 1 :]
                tensors[name] = stacks[layer][key][expert]
                tensors[name].copy_(tensor)
                continue
            tensors[name] = tensor.to(device=device, dtype=tensor_dtype(kind, dtype) if kind != "u8" else tensor.dtype)
    try:
        check_tensors(cfg, tensors)
    except ValueError as e:
        raise CheckpointError(f"K3 checkpoint {str(path)!r}: {e}") from None
    return cfg, tensors


def save_checkpoint(model, directory, shard_bytes: int = 4 << 30) -> None:
    """Write `model` as config.json + model-0000N.safetensors in the real K3 layout."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config_to_json(model.cfg), indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in model.named_tensors():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    for k, shard in enumerate(shards):
        save_file(shard, str(directory / f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"))
