"""Which vLLM releases take which speculative_config fields and values: the one statement of the
supported vLLM range (SUPPORTED_VLLM; pyproject's `vllm` extra and the README follow it, and
tests/test_vllm_config_nodeps.py checks that they do).

Facts from the released artifacts (docs/vllm-integration.md §1.1-1.2 for 0.9-0.33; 0.34.0 read from
its wheel's vllm/config/speculative.py and v1/worker/gpu/spec_decode/): "since" is the first
minor release whose SpeculativeConfig has the field or value, "until" the last one that still has it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

Version = tuple[int, int, int]

# The releases dspark's converter and validator are tested against (0.32.0 for real in
# tests/vllm/; 0.34.0 through this table, read from its source, because 0.33+ pulls a CUDA torch).
SUPPORTED_VLLM: tuple[Version, Version] = ((0, 30, 0), (0, 34, 0))
# The newest release this table has facts for; a newer installed vLLM gets a note.
NEWEST_KNOWN_VLLM: Version = (0, 34, 0)


@dataclass(frozen=True)
class Span:
    since: Version
    until: Version | None = None  # last release that has it; None: still there in NEWEST_KNOWN_VLLM


# Every SpeculativeConfig field dspark emits or lets through `--extra` ("<= 0.9.0" is written
# 0.9.0, the first dataclass-style SpeculativeConfig).
FIELDS: dict[str, Span] = {
    "method": Span((0, 9, 0)),
    "model": Span((0, 9, 0)),
    "num_speculative_tokens": Span((0, 9, 0)),
    "prompt_lookup_min": Span((0, 9, 0)),
    "prompt_lookup_max": Span((0, 9, 0)),
    "draft_tensor_parallel_size": Span((0, 9, 0)),
    "quantization": Span((0, 9, 0)),
    "max_model_len": Span((0, 9, 0)),
    "revision": Span((0, 9, 0)),
    "code_revision": Span((0, 9, 0)),
    "enforce_eager": Span((0, 11, 0)),
    "disable_padded_drafter_batch": Span((0, 11, 0), until=(0, 33, 0)),
    "use_local_argmax_reduction": Span((0, 17, 0)),
    "draft_load_config": Span((0, 17, 0)),
    "rejection_sample_method": Span((0, 18, 0)),
    "moe_backend": Span((0, 19, 0)),
    "synthetic_acceptance_length": Span((0, 20, 0)),
    "synthetic_acceptance_rates": Span((0, 20, 0)),
    "draft_sample_method": Span((0, 21, 0)),
    "attention_backend": Span((0, 21, 0)),
    "num_speculative_tokens_per_batch_size": Span((0, 24, 0)),
    "kv_cache_dtype": Span((0, 26, 0)),
    "enable_adaptive_verification": Span((0, 28, 0)),
    "dspark_draft_topk": Span((0, 28, 0)),
    "disable_eagle_block_drop": Span((0, 30, 0)),
    "disable_lookahead_block_hashes": Span((0, 33, 0)),
    "draft_lm_head_quantization": Span((0, 33, 0)),
    "draft_decode_context_parallel_size": Span((0, 34, 0)),
    "speculator_options": Span((0, 34, 0)),  # options of a registered custom method
}

# (field, value) pairs accepted later than the field, or no longer accepted.
VALUES: dict[tuple[str, object], Span] = {
    ("method", "ngram"): Span((0, 9, 0)),
    ("method", "dspark"): Span((0, 25, 0)),  # DSparkModelTypes, PR #46995
    ("method", "medusa"): Span((0, 9, 0), until=(0, 32, 0)),
    ("method", "mlp_speculator"): Span((0, 9, 0), until=(0, 32, 0)),
    # 0.34 replaces it by register_speculative_method (a registry of outside methods)
    ("method", "custom_class"): Span((0, 22, 0), until=(0, 33, 0)),
    ("rejection_sample_method", "standard"): Span((0, 21, 0)),  # "strict"/"probabilistic" in 0.18-0.20
    ("rejection_sample_method", "synthetic"): Span((0, 19, 0)),
    ("rejection_sample_method", "block"): Span((0, 25, 0)),
    ("rejection_sample_method", "fly"): Span((0, 33, 0)),
    ("draft_sample_method", "greedy"): Span((0, 21, 0)),
    ("draft_sample_method", "probabilistic"): Span((0, 22, 0)),  # "gumbel" in 0.21
}

# enable_adaptive_verification with a method other than dspark raised in 0.28-0.29 (§1.4).
ADAPTIVE_ANY_METHOD_SINCE: Version = (0, 30, 0)
# 0.34: `method` may name a method registered with register_speculative_method
# (vllm.v1.worker.gpu.spec_decode.speculator_config), configured through speculator_options.
METHOD_REGISTRY_SINCE: Version = (0, 34, 0)

# Draft architectures vLLM keeps as they are under method="dspark" (0.32-0.34); any other
# architecture is rewritten to the DeepSeek-V4 in-checkpoint class (§1.4 "Gotcha").
VLLM_DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "Qwen3OmniDSparkModel", "Gemma4DSparkModel", "K3DSparkModel")


def format_version(v: Version) -> str:
    return ".".join(str(x) for x in v)


def parse_version(text: str) -> Version:
    """'0.32.0', '0.32.0rc1.dev283+g1234' -> (0, 32, 0). A pre-release counts as its release."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"vllm version={text!r}: not a version number")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def supported_range_text() -> str:
    low, high = SUPPORTED_VLLM
    return f"{low[0]}.{low[1]}-{high[0]}.{high[1]}"


def required_versions(config: dict) -> list[tuple[str, str, Span]]:
    """(vLLM field, what needs it, the releases that have it) for every field and value of a
    config dict that this table knows; fields it does not know are left to the installed vLLM."""
    needs = []
    for name, value in config.items():
        if name not in FIELDS:
            continue
        needs.append((name, f"field {name}", FIELDS[name]))
        if isinstance(value, str) and (name, value) in VALUES:
            needs.append((name, f"{name}={value!r}", VALUES[(name, value)]))
    if config.get("enable_adaptive_verification") and config.get("method") != "dspark":
        needs.append(("enable_adaptive_verification",
                      f"enable_adaptive_verification with method={config.get('method')!r}",
                      Span(ADAPTIVE_ANY_METHOD_SINCE)))
    return needs


def unknown_fields(config: dict) -> list[str]:
    """Fields of a config dict this table has no release facts for (only vLLM itself can check them)."""
    return sorted(set(config) - set(FIELDS))


def minimum_vllm_version(config: dict) -> Version:
    return max((span.since for _, _, span in required_versions(config)), default=(0, 9, 0))


def version_problems(config: dict, installed: str) -> list[tuple[str, str]]:
    """(vLLM field, why) for every field/value the given release does not have."""
    have = parse_version(installed)
    problems = []
    for name, what, span in required_versions(config):
        if span.since > have:
            problems.append((name, f"{what} needs vLLM >= {format_version(span.since)} (installed {installed})"))
        elif span.until is not None and span.until < have:
            problems.append((name, f"{what} was removed after vLLM {format_version(span.until)} "
                                   f"(installed {installed})"))
    return problems
