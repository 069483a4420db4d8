"""Drafter checkpoints: safetensors weights + config.json, plus the trainer state for resuming.

Tensor names are those of the published Kimi K3 DSpark drafter (docs/kimi-k3.md §4; 68 tensors for
5 layers): context_proj, context_norm, layers.{i}.{input_layernorm, post_attention_layernorm,
self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj}, mlp.{gate,up,down}_proj}, final_norm, markov_head.markov_w{1,2},
confidence_head.proj.{weight,bias}. The published file also carries an unused copy of the
target embedding (embed_tokens.weight); loading checks its shape and skips it, saving leaves it
out: the embedding and lm_head always come from the target.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import DSparkConfig
from .model import DSparkModel

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TRAINER_STATE_FILE = "trainer_state.pt"
# Tensors a checkpoint may carry that belong to the target, not the drafter.
SHARED_TENSORS = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}


def save_checkpoint(
    model: DSparkModel,
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
    trainer_state: dict | None = None,
) -> Path:
    """Write config.json and model.safetensors (and trainer_state.pt when given)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.detach().to(dtype) if dtype is not None else t.detach()).contiguous().cpu()
        for name, t in model.state_dict().items()
    }
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    model.config.save(directory)
    if trainer_state is not None:
        torch.save(trainer_state, directory / TRAINER_STATE_FILE)
    return directory


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (one model.safetensors or an index of shards)."""
    directory = Path(directory)
    if (directory / WEIGHTS_FILE).exists():
        return load_file(str(directory / WEIGHTS_FILE))
    if (directory / INDEX_FILE).exists():
        shards = sorted(set(json.loads((directory / INDEX_FILE).read_text())["weight_map"].values()))
        tensors: dict[str, torch.Tensor] = {}
        for shard in shards:
            tensors.update(load_file(str(directory / shard)))
        return tensors
    raise ValueError(f"checkpoint directory {str(directory)!r}: has neither {WEIGHTS_FILE} nor {INDEX_FILE}")


def load_weights(model: DSparkModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy checkpoint tensors into the model; every mismatch is a ValueError naming the tensor."""
    expected = model.state_dict()
    for name, tensor in tensors.items():
        if name in SHARED_TENSORS:
            shared = getattr(model, SHARED_TENSORS[name])
            if tuple(tensor.shape) != tuple(shared.shape):
                raise ValueError(f"checkpoint tensor {name}: shape {tuple(tensor.shape)} != the target's {tuple(shared.shape)}")
            continue
        if name not in expected:
            raise ValueError(f"checkpoint tensor {name}: not a parameter of this drafter config")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"checkpoint tensor {name}: shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"checkpoint is missing tensors {missing}")
    with torch.no_grad():
        for name, target in expected.items():
            target.copy_(tensors[name].to(target.dtype))


def load_checkpoint(
    directory: str | Path,
    embed_tokens: torch.Tensor,
    lm_head: torch.Tensor,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> DSparkModel:
    """Build the drafter described by directory/config.json around the target's embedding and
    lm_head, and load its weights."""
    config = DSparkConfig.load(directory)
    model = DSparkModel(config, embed_tokens, lm_head)
    model.to(dtype=dtype)
    model.embed_tokens, model.lm_head = embed_tokens, lm_head  # keep sharing the target's tensors
    if device is not None:
        model.to(device)
    load_weights(model, read_tensors(directory))
    return model


def load_trainer_state(directory: str | Path) -> dict | None:
    path = Path(directory) / TRAINER_STATE_FILE
    return torch.load(path, weights_only=False) if path.exists() else None
