"""DSpark drafter checkpoints in the layouts vLLM's DSpark loader reads, and back.

Two layouts (read from vLLM 0.32.0's own loader code; docs/vllm-integration.md §2.2,
docs/dspark-algorithm.md §2.7 and §8, docs/kimi-k3.md §4):

* "k3": the Inferact/Kimi-K3-DSpark layout. config.json `architectures: ["K3DSparkModel"]`,
  `model_type: "k3_dspark"` (vLLM's K3DSparkConfig, a DeepseekV3Config: MLA dims, q_lora_rank,
  `target_layer_ids` with a matching `num_target_layers`, no `mla_use_nope`), weights read by
  `vllm.models.kimi_k3.nvidia.dspark_mla.K3DSparkForCausalLM`: context_proj, context_norm,
  layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
  kv_b_proj, o_proj}, layers.{i}.mlp.{gate,up,down}_proj, layers.{i}.{input,post_attention}_layernorm,
  final_norm, markov_head.markov_w{1,2}, confidence_head.proj.{weight,bias}. These are our
  DSparkModel's own names (drafters/dspark/checkpoint.py). vLLM's MLA rotates interleaved pairs
  (`is_neox_style=False`) over qk_rope_head_dim.
* "deepspec_qwen3": the DeepSpec layout (deepseek-ai/dspark_qwen3_*_block7). config.json
  `architectures: ["Qwen3DSparkModel"]`, `model_type: "qwen3"`, weights read by
  `vllm.model_executor.models.qwen3_dspark.Qwen3DSparkForCausalLM`: fc, hidden_norm,
  layers.{i}.self_attn.{q,k,v,o}_proj, {q,k}_norm, mlp.*, norm, markov_head.*, confidence_head.*.
  Grouped-query attention with per-head q/k RMSNorm; rotate-halves RoPE unless `is_neox_style`
  says otherwise; `layer_types` all "full_attention" = non-causal inside the block.

Both vLLM classes hard-code a vanilla Markov head and a confidence head with a bias, so a drafter
that differs there cannot be exported (ValueError naming the field). Embedding and lm_head are the
target's: export leaves them out (vLLM then shares the target's), import takes them as arguments or
from the checkpoint when it carries them (DeepSpec checkpoints do).

A dedicated mask id (mask_token_id = vocab_size: one frozen row past the target's vocabulary, the
mean of its rows; drafters/dspark/model.py) is embedded as follows in vLLM 0.32:
* Qwen3DSparkModel builds its own embed_tokens with config `vocab_size` rows and, when that exceeds
  the target's vocabulary, requires the checkpoint to carry it (qwen3_dspark.load_weights) and does
  not alias the target's (load_dspark_model); it drafts through `draft_vocab_size` rows of the
  target's lm_head. So the deepspec_qwen3 export writes vocab_size V + 1, draft_vocab_size V and
  embed_tokens = [the target's V rows; the mask row]. Its Markov head embeds the previously sampled
  token with nn.Embedding(vocab_size, r): markov_w1 gets a zero row for the mask id, never read
  because no lm_head row can draft it. (vLLM's separate `mask_embedding` parameter is a placeholder
  its DSpark loader drops.)
* K3DSparkModel always embeds with the target's embedding and drops a checkpoint's embed_tokens, so
  it cannot embed an id past the target's vocabulary: the k3 export refuses such a drafter.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.drafters.dspark.checkpoint import WEIGHTS_FILE, load_weights, read_tensors
from dspark.drafters.dspark.config import DSparkConfig
from dspark.drafters.dspark.model import DSparkModel
from dspark.targets.gguf_assets import GGUFFile

LAYOUTS = ("k3", "deepspec_qwen3")
K3_ARCHITECTURE = "K3DSparkModel"
QWEN3_ARCHITECTURE = "Qwen3DSparkModel"

# Our tensor names -> DeepSpec Qwen3 names (only the top-level modules differ).
_OURS_TO_QWEN3 = {"context_proj.": "fc.", "context_norm.": "hidden_norm.", "final_norm.": "norm."}
# Tensors of a checkpoint that are the target's (shared), or vLLM-only placeholders.
_SHARED = ("embed_tokens.weight", "lm_head.weight")
_IGNORED_ON_IMPORT = ("mask_embedding",)  # vLLM drops it too: DSpark masks via the vocab row


def _unsupported(layout: str, name: str, value, why: str) -> None:
    raise ValueError(f"DSparkConfig.{name}={value!r}: cannot be written in the {layout!r} layout: {why}")


def _check_common(c: DSparkConfig, layout: str) -> None:
    # vLLM's DSparkMarkovHead is the vanilla head only; its confidence head always has a bias
    # (qwen3_dspark.py / dspark_mla.py build DSparkConfidenceHead(..., bias=True)).
    if c.markov_head_type != "vanilla":
        _unsupported(layout, "markov_head_type", c.markov_head_type, "vLLM's DSpark Markov head is vanilla only")
    if not c.confidence_bias:
        _unsupported(layout, "confidence_bias", c.confidence_bias, "vLLM's DSpark confidence head has a bias")
    if not c.use_rope:
        _unsupported(layout, "use_rope", c.use_rope, "vLLM's DSpark drafters always apply RoPE")


def has_dedicated_mask_row(c: DSparkConfig) -> bool:
    """Whether the drafter's mask id is the extra embedding row past the target's vocabulary."""
    return c.mask_token_id == c.vocab_size


def k3_config_json(c: DSparkConfig) -> dict:
    """config.json for vLLM's K3DSparkModel (our DSparkConfig's own json form, checked)."""
    layout = "k3"
    _check_common(c, layout)
    if has_dedicated_mask_row(c):
        _unsupported(layout, "mask_token_id", c.mask_token_id,
                     f"= vocab_size, a row past the target's {c.vocab_size}-row embedding; vLLM's K3DSparkModel "
                     "always embeds with the target's embedding (it drops a checkpoint's embed_tokens), so it "
                     "cannot embed that id: use a mask id inside the vocabulary or the deepspec_qwen3 layout")
    if c.attention_type != "mla":
        _unsupported(layout, "attention_type", c.attention_type, "K3DSparkModel is dense MLA")
    if not c.rope_interleaved:
        _unsupported(layout, "rope_interleaved", c.rope_interleaved,
                     "vLLM's K3 MLA rotates interleaved pairs (is_neox_style=False)")
    d = c.to_json_dict()
    d["architectures"], d["model_type"] = [K3_ARCHITECTURE], "k3_dspark"
    return d


def qwen3_config_json(c: DSparkConfig) -> dict:
    """config.json for vLLM's Qwen3DSparkModel (DeepSpec keys, docs/dspark-algorithm.md §2.7)."""
    layout = "deepspec_qwen3"
    _check_common(c, layout)
    if c.attention_type != "gqa":
        _unsupported(layout, "attention_type", c.attention_type, "Qwen3DSparkModel is grouped-query attention")
    if c.rope_scaling is not None:
        _unsupported(layout, "rope_scaling", c.rope_scaling,
                     "our YaRN is DeepSeek's; Qwen3's rope_parameters would rotate differently")
    d = {
        "architectures": [QWEN3_ARCHITECTURE], "model_type": "qwen3",
        # input ids include the dedicated mask row; drafted ids are the target's vocabulary
        "vocab_size": c.vocab_size + 1 if has_dedicated_mask_row(c) else c.vocab_size,
        "draft_vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "hidden_act": c.hidden_act,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "attention_bias": False,
        "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        # vLLM's DFlash/DSpark Qwen3 layer reads is_neox_style (default True = rotate halves).
        "is_neox_style": not c.rope_interleaved,
        # all full attention = non-causal over [context ; block] (qwen3_dflash._dflash_layer_causal)
        "layer_types": ["full_attention"] * c.num_layers,
        "tie_word_embeddings": False,
        "block_size": c.block_size, "mask_token_id": c.mask_token_id,
        "target_layer_ids": list(c.target_layer_ids), "num_target_layers": c.num_taps,
        "target_hidden_size": c.target_hidden_size, "target_num_hidden_layers": c.target_num_layers,
        "sample_from_anchor": True,  # anchor-as-first-prediction (docs/dspark-algorithm.md §2.2)
        "markov_rank": c.markov_rank, "markov_head_type": c.markov_head_type,
        "enable_confidence_head": True, "confidence_head_with_markov": c.confidence_head_with_markov,
        "dspark_name": c.name,
    }
    if c.confidence_temperatures is not None:  # ours; vLLM ignores it
        d["confidence_temperatures"] = list(c.confidence_temperatures)
    return d


def _qwen3_name(ours: str) -> str:
    for old, new in _OURS_TO_QWEN3.items():
        if ours.startswith(old):
            return new + ours[len(old):]
    return ours


def _ours_from_qwen3(name: str) -> str:
    for ours, theirs in _OURS_TO_QWEN3.items():
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def _config_and_tensors(model_or_path, embed_tokens: torch.Tensor | None
                        ) -> tuple[DSparkConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """The drafter's config, its own tensors (our names; no target tensors) and the target's
    embedding where known: the model's, else embed_tokens, else the checkpoint's copy."""
    if isinstance(model_or_path, DSparkModel):
        if embed_tokens is not None:
            raise ValueError("embed_tokens: given with a DSparkModel, which carries the target's embedding "
                             "already; pass it only with a checkpoint directory")
        return model_or_path.config, dict(model_or_path.state_dict()), model_or_path.embed_tokens
    config, tensors = _read_checkpoint(model_or_path)
    if embed_tokens is None:
        embed_tokens = tensors.get("embed_tokens.weight")
    return config, {n: t for n, t in tensors.items() if n not in _SHARED}, embed_tokens


def _mask_row(embed_tokens: torch.Tensor) -> torch.Tensor:
    """The dedicated mask row our drafter derives from the target's embedding [V, d] -> [d]
    (DSparkModel.mask_embedding: the mean of the rows)."""
    return embed_tokens.detach().double().mean(dim=0).to(embed_tokens.dtype)


def _with_dedicated_mask_row(config: DSparkConfig, tensors: dict[str, torch.Tensor],
                             embed_tokens: torch.Tensor | None, layout: str) -> dict[str, torch.Tensor]:
    """The deepspec_qwen3 tensors of a drafter whose mask id is the row past the target's vocabulary:
    embed_tokens [V + 1, d] = the target's rows then the mask row, and markov_w1 with a zero row for
    the mask id (vLLM sizes both by config vocab_size; the Markov row is never read, as no lm_head
    row drafts the mask id)."""
    if embed_tokens is None:
        _unsupported(layout, "mask_token_id", config.mask_token_id,
                     "= vocab_size, the dedicated mask row, which vLLM embeds only from the checkpoint's own "
                     "embed_tokens, and the source carries no embedding: pass the target's "
                     "(export_drafter(..., embed_tokens=...), or --target-gguf)")
    shape = (config.vocab_size, config.hidden_size)
    if tuple(embed_tokens.shape) != shape:
        raise ValueError(f"embed_tokens: shape {tuple(embed_tokens.shape)} != (vocab_size, hidden_size) = {shape}")
    embed = torch.cat([embed_tokens.detach(), _mask_row(embed_tokens)[None]])
    w1 = tensors["markov_head.markov_w1.weight"]
    return {**tensors, "embed_tokens.weight": embed.to(tensors["context_proj.weight"].dtype),
            "markov_head.markov_w1.weight": torch.cat([w1, w1.new_zeros(1, w1.shape[1])])}


def _without_dedicated_mask_row(d: dict, tensors: dict[str, torch.Tensor], path: Path
                                ) -> tuple[dict, dict[str, torch.Tensor]]:
    """Inverse of _with_dedicated_mask_row for a Qwen3-layout config.json and its tensors (an
    unchanged pass-through unless vocab_size = draft_vocab_size + 1 = mask_token_id + 1). The mask row
    must be the one our drafter derives: it is rebuilt, not loaded."""
    vocab = d.get("draft_vocab_size")
    if vocab is None or d.get("vocab_size") != vocab + 1 or d.get("mask_token_id") != vocab:
        return d, tensors
    embed = tensors.get("embed_tokens.weight")
    if embed is None or embed.shape[0] != vocab + 1:
        raise ValueError(f"path={str(path)!r}: vocab_size={vocab + 1} = draft_vocab_size + 1 (a dedicated mask "
                         f"row) needs embed_tokens.weight with {vocab + 1} rows, found "
                         f"{None if embed is None else tuple(embed.shape)}")
    # A re-cast checkpoint (e.g. exported to bfloat16) rounds the rows and the mean apart: a few ulps.
    expected, stored = _mask_row(embed[:vocab]).double(), embed[vocab].double()
    allowed = 4 * torch.finfo(embed.dtype).eps * (expected.abs() + embed[:vocab].double().abs().mean(dim=0))
    if ((stored - expected).abs() > allowed).any():
        raise ValueError(f"path={str(path)!r}: embed_tokens.weight row {vocab} (mask_token_id={vocab}) is not the "
                         "mean of the other rows, and our drafter derives its mask row as that mean; max "
                         f"difference {(stored - expected).abs().max().item():.3g}")
    w1 = tensors["markov_head.markov_w1.weight"]
    return {**d, "vocab_size": vocab}, {**tensors, "embed_tokens.weight": embed[:vocab],
                                        "markov_head.markov_w1.weight": w1[:vocab]}


def _read_checkpoint(path) -> tuple[DSparkConfig, dict[str, torch.Tensor]]:
    """Config and tensors (renamed to ours, vLLM placeholders dropped) of a checkpoint directory in
    the K3 layout, the DeepSpec Qwen3 layout, or our own (drafters/dspark/checkpoint.py)."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"path={str(path)!r}: no config.json there")
    d = json.loads(config_path.read_text())
    archs = d.get("architectures") or []
    tensors = read_tensors(path)
    if QWEN3_ARCHITECTURE in archs:
        d, tensors = _without_dedicated_mask_row(d, tensors, path)
        config = _config_from_qwen3(d)
        tensors = {_ours_from_qwen3(n): t for n, t in tensors.items()}
    elif K3_ARCHITECTURE in archs or d.get("model_type") == "dspark":  # K3, or our own GQA drafter
        config = DSparkConfig.from_json_dict({"target_num_hidden_layers": _target_depth(d), **d})
    else:
        raise ValueError(f"path={str(path)!r}: architectures={archs!r}; expected {K3_ARCHITECTURE!r} or "
                         f"{QWEN3_ARCHITECTURE!r}")
    ignored = [n for n in tensors if any(re.search(rf"\b{x}\b", n) for x in _IGNORED_ON_IMPORT)]
    return config, {n: t for n, t in tensors.items() if n not in ignored}


def export_drafter(model_or_path, out_dir: str | Path, layout: str = "k3", *, dtype: torch.dtype | None = None,
                   embed_tokens: torch.Tensor | None = None) -> Path:
    """Write a DSpark drafter (a DSparkModel or one of our checkpoint directories) to out_dir as
    config.json + model.safetensors in `layout` ("k3" or "deepspec_qwen3"). Returns out_dir.

    embed_tokens: the target's embedding [V, d], needed to export a checkpoint directory whose drafter
    has the dedicated mask row (mask_token_id = vocab_size) and which carries no embedding itself.

    vLLM picks method "dspark" for a K3DSparkModel drafter only when the path contains "dspark"
    (SpeculativeConfig auto-detection); pass method="dspark" explicitly otherwise."""
    config, tensors, embed_tokens = _config_and_tensors(model_or_path, embed_tokens)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: must be one of {LAYOUTS}")
    if layout == "k3":
        config_json, rename = k3_config_json(config), (lambda n: n)
    else:
        config_json, rename = qwen3_config_json(config), _qwen3_name
        if has_dedicated_mask_row(config):
            tensors = _with_dedicated_mask_row(config, tensors, embed_tokens, layout)
    out = {rename(n): (t.detach().to(dtype) if dtype is not None else t.detach()).contiguous().cpu()
           for n, t in tensors.items()}
    if dtype is not None:
        config_json["torch_dtype"] = str(dtype).removeprefix("torch.")
    else:
        config_json["torch_dtype"] = str(next(iter(out.values())).dtype).removeprefix("torch.")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return out_dir


def _target_depth(d: dict) -> int:
    """The target's layer count. Published DeepSpec and Inferact configs do not record it; the taps
    need at least one untapped layer after the last (docs/dspark-algorithm.md §2.1: the final layer is never
    tapped), so that is the smallest depth they are consistent with."""
    if d.get("target_num_hidden_layers"):
        return int(d["target_num_hidden_layers"])
    taps = d.get("target_layer_ids") or [0]
    return max(int(d.get("num_target_layers") or 0), max(int(x) for x in taps) + 2)


def _config_from_qwen3(d: dict) -> DSparkConfig:
    """Our DSparkConfig from a DeepSpec Qwen3DSparkModel config.json."""
    if d.get("draft_vocab_size", d.get("vocab_size")) != d.get("vocab_size") or "d2t" in d:
        raise ValueError(f"drafter config.json: draft_vocab_size={d.get('draft_vocab_size')!r} differs from "
                         f"vocab_size={d.get('vocab_size')!r}; pruned draft vocabularies are not supported")
    layer_types = d.get("layer_types") or ["full_attention"] * d["num_hidden_layers"]
    if any(t != "full_attention" for t in layer_types) or d.get("is_causal"):
        raise ValueError(f"drafter config.json: layer_types={layer_types!r}: only full (non-causal) attention "
                         "layers are implemented")
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"drafter config.json: rope_parameters={rope!r}: only default RoPE is implemented "
                         "for the Qwen3 layout")
    if d.get("sample_from_anchor", True) is not True:
        raise ValueError("drafter config.json: sample_from_anchor=False (DFlash-style 1+N fill-in) is not "
                         "implemented; our blocks predict from the anchor slot")
    taps = [int(x) for x in d["target_layer_ids"]]
    ours = {
        **d,
        "attention_type": "gqa",
        "rope_interleaved": not d.get("is_neox_style", True),
        "rope_theta": rope.get("rope_theta", d.get("rope_theta", 1_000_000.0)),
        "target_num_hidden_layers": _target_depth(d),
        "num_target_layers": len(taps),
        "head_dim": d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
    }
    ours.pop("rope_parameters", None)
    ours.pop("rope_scaling", None)
    return DSparkConfig.from_json_dict(ours)


def import_drafter(path: str | Path, embed_tokens: torch.Tensor | None = None, lm_head: torch.Tensor | None = None,
                   *, dtype: torch.dtype | None = None) -> DSparkModel:
    """Read a DeepSpec (Qwen3DSparkModel) or Inferact/K3 (K3DSparkModel) checkpoint into our
    DSparkModel. embed_tokens / lm_head are the target's [V, d] tensors; when omitted they are taken
    from the checkpoint (a ValueError names them if it has none). dtype defaults to the checkpoint's."""
    config, tensors = _read_checkpoint(path)
    shared = {"embed_tokens": embed_tokens, "lm_head": lm_head}
    for name in shared:
        if shared[name] is None:
            if f"{name}.weight" not in tensors:
                raise ValueError(f"{name}=None: the checkpoint at {str(path)!r} has no {name}.weight; pass the "
                                 "target's tensor")
            shared[name] = tensors[f"{name}.weight"]
    if dtype is None:
        dtype = tensors["context_proj.weight"].dtype if "context_proj.weight" in tensors else torch.float32
    model = DSparkModel(config, shared["embed_tokens"], shared["lm_head"])
    model.to(dtype=dtype)
    model.embed_tokens, model.lm_head = shared["embed_tokens"], shared["lm_head"]  # the target's, not copies
    load_weights(model, tensors)
    return model


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags for a `dspark export-drafter` command."""
    parser.description = ("Write a DSpark drafter checkpoint (ours, or a K3/DeepSpec one) in a layout vLLM's "
                          "DSpark loader reads: --speculative-config '{\"method\": \"dspark\", \"model\": OUT}'")
    parser.add_argument("source", help="drafter checkpoint directory (config.json + safetensors)")
    parser.add_argument("out", help="output directory; vLLM auto-detects a K3 drafter only if the path contains 'dspark'")
    parser.add_argument("--layout", choices=LAYOUTS, default="k3")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="cast the weights (default: keep the checkpoint's)")
    parser.add_argument("--target-gguf", default=None,
                        help="the target's GGUF, whose embedding a drafter with the dedicated mask row "
                             "(mask_token_id = vocab_size) ships in the deepspec_qwen3 layout")
    return parser


def main(args: argparse.Namespace) -> int:
    """Export `source` (ours, K3 or DeepSpec layout) to `out`. Only the drafter's own weights are
    written, so no target is needed."""
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        embed_tokens = GGUFFile(args.target_gguf).tensor("token_embd.weight") if args.target_gguf else None
        out = export_drafter(args.source, args.out, layout=args.layout, dtype=dtype, embed_tokens=embed_tokens)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({args.layout} layout); vLLM: --speculative-config "
          f"'{json.dumps({'method': 'dspark', 'model': str(out)})}'")
    return 0
