"""Validate a speculative_config dict against the installed vLLM: its release (the table in
versions.py) and its own SpeculativeConfig / VllmConfig, turning vLLM's errors into ValueErrors that
name OUR field.

vLLM is imported lazily, inside the functions that need it, so this module imports without it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .convert import OUR_FIELD, drafter_config_file, field_label, is_hub_id
from .versions import (
    NEWEST_KNOWN_VLLM,
    SUPPORTED_VLLM,
    VLLM_DSPARK_ARCHITECTURES,
    format_version,
    parse_version,
    unknown_fields,
    version_problems,
)


def check_vllm_version(config: dict, installed: str, passed_through=()) -> None:
    """Raise a ValueError naming every field/value the given vLLM release lacks. A field the table
    does not know is refused unless it was passed through (`--extra`), which vLLM itself validates."""
    unknown = [name for name in unknown_fields(config) if name not in passed_through]
    if unknown:
        raise ValueError(f"speculative_config fields={unknown!r}: not fields dspark emits or knows the vLLM "
                         "releases of; pass vLLM-only fields with --extra")
    problems = version_problems(config, installed)
    if problems:
        raise ValueError("; ".join(f"{field_label(name)}: {why}" for name, why in problems))


@dataclass(frozen=True)
class VllmValidation:
    """What validate_with_vllm checked.

    vllm_version:              the installed release.
    method, num_speculative_tokens, synthetic_acceptance_rates, draft_architectures: as vLLM
                               resolved them (draft_architectures is empty without a draft model).
    vllm_config_built:         whether the full VllmConfig (runner selection, feature checks) was built.
    vllm_config_skipped:       why not, when it was not (e.g. Model Runner V2 needs Triton with a GPU).
    """

    vllm_version: str
    method: str
    num_speculative_tokens: int
    synthetic_acceptance_rates: list[float] | None
    draft_architectures: tuple[str, ...]
    vllm_config_built: bool
    vllm_config_skipped: str | None = None
    notes: tuple[str, ...] = field(default=())


_TINY_TARGET = {  # a two-layer Qwen3: ModelConfig reads only config.json (skip_tokenizer_init)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def write_tiny_target(directory: str | os.PathLike, vocab_size: int = 1024) -> str:
    """Write a tiny local target model config (config.json only) for vLLM's ModelConfig."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / "config.json").write_text(json.dumps({**_TINY_TARGET, "vocab_size": vocab_size}))
    return str(directory)


@contextlib.contextmanager
def _env(updates: dict[str, str]):
    """Set environment variables the caller has not set, and restore them afterwards."""
    added = [name for name in updates if name not in os.environ]
    for name in added:
        os.environ[name] = updates[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


# How vLLM 0.32 words errors about a field without naming it (config/vllm.py, v1/spec_decode/dynamic/utils.py).
_VLLM_PHRASES = (
    (r"adaptive (draft )?verification", "enable_adaptive_verification"),
    (r"\bdspark speculative decoding\b|speculative method '", "method"),
    (r"batch-size range|num_speculative_tokens_per_batch_size", "num_speculative_tokens_per_batch_size"),
)


def _vllm_message(exc: Exception, config: dict | None = None) -> tuple[list[str], str]:
    """The fields of `config` an exception points at, and its message without pydantic's framing."""
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic ValidationError
        fields, messages = [], []
        for err in errors():
            loc = [str(x) for x in err.get("loc", ()) if isinstance(x, str)]
            fields.extend(loc)
            messages.append(re.sub(r"^Value error, ", "", str(err.get("msg", ""))))
        text = "; ".join(messages)
    else:
        fields, text = [], str(exc)
    known = set(OUR_FIELD) | set(config or ())
    mentioned = [name for name in sorted(known) if re.search(rf"\b{name}\b", text)]
    mentioned += [name for pattern, name in _VLLM_PHRASES if re.search(pattern, text, re.IGNORECASE)]
    return [f for f in fields if f in known] or mentioned, text


def _as_our_error(exc: Exception, config: dict, installed: str, stage: str) -> ValueError:
    fields, text = _vllm_message(exc, config)
    if fields:
        named = ", ".join(f"{field_label(f)} (vLLM {f}={config.get(f)!r})" for f in dict.fromkeys(fields))
    else:
        named = f"speculative_config {json.dumps(config)}"
    return ValueError(f"{named}: vLLM {installed} rejects it in {stage}: {text}")


def _check_draft_architecture(config: dict, spec_config, installed: str) -> None:
    """Under method="dspark" vLLM rewrites a draft architecture it does not know as a DSpark class
    into the DeepSeek-V4 in-checkpoint drafter (docs/vllm-integration.md §1.4), which would load our
    weights into the wrong model without a word. Refuse that."""
    path = config.get("model")
    if spec_config.method != "dspark" or path is None or not (Path(path) / "config.json").is_file():
        return
    on_disk = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    resolved = list(spec_config.draft_model_config.architectures or [])
    if resolved != on_disk and not set(resolved) & set(VLLM_DSPARK_ARCHITECTURES):
        raise ValueError(f"SpecConfig.drafter_path={path!r}: its architectures {on_disk} are not a DSpark drafter "
                         f"vLLM {installed} knows ({', '.join(VLLM_DSPARK_ARCHITECTURES)}); under method 'dspark' "
                         f"vLLM would load it as {resolved} (the DeepSeek-V4 in-checkpoint drafter)")


def _release_notes(installed: str) -> list[str]:
    have = parse_version(installed)
    if SUPPORTED_VLLM[0] <= have <= SUPPORTED_VLLM[1]:
        return []
    newer = f"; its fields past {format_version(NEWEST_KNOWN_VLLM)} are unknown to dspark" if have > NEWEST_KNOWN_VLLM else ""
    return [f"vLLM {installed} is outside the supported releases "
            f"{format_version(SUPPORTED_VLLM[0])}-{format_version(SUPPORTED_VLLM[1])}{newer}"]


def _local_drafter(config: dict) -> dict:
    """The config with a hub-id drafter replaced by its local config.json folder (huggingface_hub's
    cache), so vLLM reads the drafter's config without going online; local paths stay as they are."""
    model = config.get("model")
    if model is None or not is_hub_id(model):
        return config
    return {**config, "model": str(drafter_config_file(model).parent)}


def validate_with_vllm(config: dict, *, target_model: str | None = None, passed_through=()) -> VllmValidation:
    """Check a speculative_config dict with the installed vLLM's own SpeculativeConfig and, where
    it can be built here, VllmConfig. Raises ValueError naming our field on any rejection.

    target_model: a local model directory (config.json is enough); None writes a tiny Qwen3 one.
    passed_through: fields copied from `--extra`, which only vLLM checks.
    A hub-id drafter is read from huggingface_hub's copy of its config.json.
    Needs no GPU: without CUDA it sets VLLM_TARGET_DEVICE=cpu (vLLM reads it once, when it first
    picks its platform). dspark and adaptive verification run only on Model Runner V2, so
    VLLM_USE_V2_MODEL_RUNNER=1 is set while VllmConfig is built (docs/vllm-integration.md §5.3); neither variable
    is touched when the caller has set it.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    installed = vllm.__version__
    check_vllm_version(config, installed, passed_through)
    notes = _release_notes(installed)
    shown, config = config, _local_drafter(config)

    with tempfile.TemporaryDirectory(prefix="dspark-vllm-target-") as tmp:
        if target_model is None:
            vocab = 1024
            if config.get("model") is not None and (Path(config["model"]) / "config.json").is_file():
                vocab = json.loads((Path(config["model"]) / "config.json").read_text()).get("vocab_size", vocab)
            target_model = write_tiny_target(tmp, vocab)
        try:
            model_config = ModelConfig(model=target_model, skip_tokenizer_init=True)
        except Exception as exc:
            raise ValueError(f"target_model={target_model!r}: vLLM cannot read it: {exc}") from exc
        try:
            spec_config = SpeculativeConfig(**config, target_model_config=model_config,
                                            target_parallel_config=ParallelConfig())
        except Exception as exc:
            raise _as_our_error(exc, shown, installed, "SpeculativeConfig") from exc

        _check_draft_architecture(config, spec_config, installed)

        schedule = config.get("num_speculative_tokens_per_batch_size")
        if schedule is not None:
            # vLLM checks the schedule only when the scheduler starts; check it now.
            from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule
            try:
                validate_and_normalize_dynamic_sd_schedule(schedule)
            except ValueError as exc:
                raise _as_our_error(exc, shown, installed, "its batch-size schedule check") from exc

        needs_v2 = spec_config.method == "dspark" or spec_config.enable_adaptive_verification
        built, skipped = False, None
        with _env({"VLLM_USE_V2_MODEL_RUNNER": "1"} if needs_v2 else {}):
            try:
                VllmConfig(model_config=model_config, speculative_config=spec_config)
                built = True
            except Exception as exc:
                _, text = _vllm_message(exc)
                if "requires Triton" not in text:
                    raise _as_our_error(exc, shown, installed, "VllmConfig") from exc
                skipped = (f"VllmConfig not checked on this machine: {text.rstrip('.')} "
                           "(Model Runner V2 needs Triton with a GPU driver)")
    return VllmValidation(
        vllm_version=installed,
        method=spec_config.method,
        num_speculative_tokens=spec_config.num_speculative_tokens,
        synthetic_acceptance_rates=(list(spec_config.synthetic_acceptance_rates)
                                    if spec_config.synthetic_acceptance_rates is not None else None),
        draft_architectures=tuple(spec_config.draft_model_config.architectures or ())
        if spec_config.method not in ("ngram", "ngram_gpu") else (),
        vllm_config_built=built,
        vllm_config_skipped=skipped,
        notes=tuple(notes),
    )


def vllm_importable() -> bool:
    """Whether a vllm package is installed. A folder named vllm on sys.path without an __init__.py
    (this repository's tests/vllm/, when pytest puts tests/ on the path) is a namespace package
    with no origin, not vLLM."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


