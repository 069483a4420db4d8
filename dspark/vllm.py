"""Our SpecConfig as vLLM's `speculative_config` (the drop-in: no plugin, our config becomes theirs).

Released vLLM (0.25 and later) already ships `method: "dspark"`, synthetic acceptance (0.20+),
block verification (0.25+) and adaptive verification (0.28+), but no registry for outside
speculative methods (../shared/spec/vllm-integration.md "Key takeaways" 1-3). So this module:

1. converts a SpecConfig to the dict for `LLM(speculative_config=...)` /
   `vllm serve --speculative-config`, and lists what vLLM cannot express (never dropped silently);
2. knows which vLLM release introduced each field/value we emit (spec §1.1-1.2), and validates a
   dict against the installed vLLM, turning its errors into ValueErrors naming OUR field;
3. is the `dspark vllm-config` command (configure_parser / main).

vLLM is imported lazily, inside the functions that need it, so `import dspark.vllm` works without it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from dspark.config import Profile, SpecConfig

Version = tuple[int, int, int]

# vLLM releases this module was checked against (spec §0: wheels 0.30-0.33, sdists 0.8-0.33).
CHECKED_VLLM_RANGE = ((0, 9, 0), (0, 33, 0))

# First vLLM release whose SpeculativeConfig has each field we emit (spec §1.2; "<= 0.9.0" is
# written 0.9.0, the first dataclass-style SpeculativeConfig).
FIELD_SINCE: dict[str, Version] = {
    "method": (0, 9, 0),
    "model": (0, 9, 0),
    "num_speculative_tokens": (0, 9, 0),
    "prompt_lookup_min": (0, 9, 0),
    "prompt_lookup_max": (0, 9, 0),
    "synthetic_acceptance_length": (0, 20, 0),
    "synthetic_acceptance_rates": (0, 20, 0),
    "draft_sample_method": (0, 21, 0),
    "rejection_sample_method": (0, 18, 0),
    "num_speculative_tokens_per_batch_size": (0, 24, 0),
    "enable_adaptive_verification": (0, 28, 0),
}

# First release accepting each (field, value) we emit, where that is later than the field (spec §1.1).
VALUE_SINCE: dict[tuple[str, object], Version] = {
    ("method", "ngram"): (0, 9, 0),
    ("method", "dspark"): (0, 25, 0),  # DSparkModelTypes, PR #46995
    ("rejection_sample_method", "standard"): (0, 21, 0),  # was "strict"/"probabilistic" in 0.18-0.20
    ("rejection_sample_method", "synthetic"): (0, 19, 0),
    ("rejection_sample_method", "block"): (0, 25, 0),
    ("draft_sample_method", "greedy"): (0, 21, 0),
    ("draft_sample_method", "probabilistic"): (0, 22, 0),  # was "gumbel" in 0.21
}

# enable_adaptive_verification with a method other than dspark raised in 0.28-0.29 (spec §1.4).
ADAPTIVE_ANY_METHOD_SINCE: Version = (0, 30, 0)

# vLLM field -> the SpecConfig field a user sets to get it (for error messages that name OUR field).
OUR_FIELD = {
    "method": "drafter",
    "model": "drafter_path",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_min": "prompt_lookup_min",
    "prompt_lookup_max": "prompt_lookup_max",
    "draft_sample_method": "draft_sample_method",
    "rejection_sample_method": "rejection_sample_method",
    "synthetic_acceptance_length": "synthetic_acceptance_length",
    "synthetic_acceptance_rates": "synthetic_acceptance_rates",
    "enable_adaptive_verification": "verify_policy",
    "num_speculative_tokens_per_batch_size": "num_speculative_tokens_per_batch_size",
}

# Architectures vLLM 0.32 keeps as-is under method="dspark"; any other draft architecture is
# rewritten to the DeepSeek-V4 class (spec §1.4 "Gotcha for out-of-tree architectures").
VLLM_DSPARK_ARCHITECTURES = ("Qwen3DSparkModel", "Qwen3OmniDSparkModel", "Gemma4DSparkModel", "K3DSparkModel")


def _fail(name: str, value, why: str) -> None:
    raise ValueError(f"SpecConfig.{name}={value!r}: {why}")


def format_version(v: Version) -> str:
    return ".".join(str(x) for x in v)


def parse_version(text: str) -> Version:
    """'0.32.0', '0.32.0rc1.dev283+g1234' -> (0, 32, 0). A pre-release counts as its release."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", text)
    if m is None:
        raise ValueError(f"vllm version={text!r}: not a version number")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


# ---------------------------------------------------------------------------------------------
# 1. SpecConfig -> vLLM speculative_config
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmSpeculativeConfig:
    """The conversion result.

    config:       the dict for `LLM(speculative_config=...)` / `--speculative-config`.
    engine_args:  settings that vLLM takes elsewhere (`LLM(**engine_args)`, `vllm serve --seed`).
    not_carried:  one sentence per setting of ours that vLLM cannot express (dropped, with why).
    """

    config: dict
    engine_args: dict
    not_carried: tuple[str, ...] = ()


class NotCarriedOverWarning(UserWarning):
    """A SpecConfig setting that has no vLLM equivalent was left out of the vLLM config."""


def read_drafter_block_size(drafter_path: str | os.PathLike) -> int | None:
    """The trained block size from a DSpark drafter's config.json (`block_size`, or the
    DeepSeek-V4 name `dspark_block_size`; spec dspark-algorithm §2.7), None if it has neither."""
    path = Path(drafter_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"drafter_path={str(drafter_path)!r}: no config.json there")
    cfg = json.loads(path.read_text())
    for key in ("block_size", "dspark_block_size"):
        if cfg.get(key) is not None:
            return int(cfg[key])
    return None


def convert(spec: SpecConfig, *, drafter_path: str | None = None, block_size: int | None = None,
            block_verification: bool = False) -> VllmSpeculativeConfig:
    """Build vLLM's speculative_config from a SpecConfig.

    drafter_path overrides spec.drafter_path; block_size is the drafter's trained block size when
    it cannot be read from the drafter's config.json. block_verification=True asks vLLM for
    `rejection_sample_method="block"` (Sun et al. 2024, vLLM >= 0.25): a vLLM-only option, our
    engine has no block verifier, so it is a keyword here and not a SpecConfig field.
    """
    spec.validate()
    k = spec.num_speculative_tokens
    if k == 0:
        _fail("num_speculative_tokens", 0, "plain decoding has no vLLM speculative_config; run vLLM without one")
    not_carried: list[str] = []
    out: dict = {}

    path = drafter_path if drafter_path is not None else spec.drafter_path
    if spec.drafter == "ngram":
        if path is not None:
            _fail("drafter_path", path, "the n-gram drafter has no checkpoint; use drafter='dspark'")
        out.update(method="ngram", num_speculative_tokens=k,
                   prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)
    else:
        out["method"] = "dspark"
        if path is not None:
            out["model"] = str(path)  # None: vLLM drafts from the target checkpoint (DeepSeek-V4 style)
        out["num_speculative_tokens"] = k
        _check_block_size(spec, path, block_size)

    out["draft_sample_method"] = spec.draft_sample_method
    if block_verification:
        if spec.rejection_sample_method != "standard":
            _fail("rejection_sample_method", spec.rejection_sample_method,
                  "block verification replaces the standard verifier; it cannot be combined with synthetic acceptance")
        out["rejection_sample_method"] = "block"
    else:
        out["rejection_sample_method"] = spec.rejection_sample_method
    if spec.synthetic_acceptance_length is not None:
        out["synthetic_acceptance_length"] = float(spec.synthetic_acceptance_length)
    if spec.synthetic_acceptance_rates is not None:
        out["synthetic_acceptance_rates"] = [float(r) for r in spec.synthetic_acceptance_rates]

    # Verification length (spec dspark-algorithm §5): vLLM's adaptive verification is the
    # confidence scheduler; it profiles its own cost tables at start-up (spec vllm §2.5).
    if spec.verify_policy == "scheduler":
        out["enable_adaptive_verification"] = True
        if spec.sps_table_path is not None:
            not_carried.append(f"sps_table_path={spec.sps_table_path!r}: vLLM profiles its own step-cost tables at "
                               "start-up (VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN); ours is not used")
    elif spec.verify_policy == "threshold":
        not_carried.append(f"verify_policy='threshold' (confidence_threshold={spec.confidence_threshold}): vLLM has no "
                           "confidence-threshold policy; it verifies all k drafts (verify_policy='scheduler' maps to "
                           "enable_adaptive_verification)")

    schedule, schedule_notes = _batch_size_schedule(spec)
    not_carried.extend(schedule_notes)
    if schedule is not None:
        out["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]

    if spec.max_speculative_seq_len is not None:
        not_carried.append(f"max_speculative_seq_len={spec.max_speculative_seq_len}: vLLM's V1/V2 engines have no "
                           "sequence-length gate for speculation (speculative_config.max_model_len only caps the "
                           "draft model); long sequences keep speculating")
    return VllmSpeculativeConfig(config=out, engine_args={"seed": spec.seed}, not_carried=tuple(not_carried))


def speculative_config(spec: SpecConfig, *, drafter_path: str | None = None, block_size: int | None = None,
                       block_verification: bool = False) -> dict:
    """The dict for `LLM(speculative_config=...)`; settings vLLM cannot express are reported as
    NotCarriedOverWarning (use `convert` to get them as a list, and the engine seed)."""
    result = convert(spec, drafter_path=drafter_path, block_size=block_size, block_verification=block_verification)
    for note in result.not_carried:
        warnings.warn(f"not carried over to vLLM: {note}", NotCarriedOverWarning, stacklevel=2)
    return result.config


def sampling_params_not_carried(params) -> list[str]:
    """Per-request settings of our SamplingParams that vLLM's SamplingParams cannot express."""
    if params.speculate:
        return []
    return ["SamplingParams.speculate=False: vLLM has no per-request opt-out of speculation; "
            "this request is speculated like the others"]


def _check_block_size(spec: SpecConfig, drafter_path: str | None, block_size: int | None) -> None:
    """A DSpark drafter drafts exactly its trained block: fewer query slots than trained shifts
    every slot's non-causal attention out of distribution, more slots collapse acceptance at all
    positions (spec vllm §2.1, PR #41834 comment: block 5 run with k=7). vLLM checks this only for
    Qwen3-Omni drafters, so we check it. Synthetic acceptance ignores draft quality (it accepts by
    coin flip), so a k sweep over one drafter stays allowed there."""
    trained = block_size
    if trained is None and drafter_path is not None:
        if not Path(drafter_path).is_dir():
            _fail("drafter_path", drafter_path, "not a local directory, so its trained block size cannot be read; "
                  "pass block_size (the block the drafter was trained with) so k can be checked against it")
        trained = read_drafter_block_size(drafter_path)
    if trained is None or spec.rejection_sample_method == "synthetic":
        return
    k = spec.num_speculative_tokens
    if k < trained:
        _fail("num_speculative_tokens", k, f"below the drafter's trained block size {trained}: vLLM's DSpark drafts "
              f"one block of k query slots, and a drafter trained on {trained} slots drafts badly with fewer; "
              f"use k={trained} (verify fewer with num_speculative_tokens_per_batch_size or verify_policy='scheduler')")
    if k > trained:
        _fail("num_speculative_tokens", k, f"above the drafter's trained block size {trained}: slots past the "
              "trained block were never trained and acceptance collapses at all positions; "
              f"use k={trained}")


def _batch_size_schedule(spec: SpecConfig) -> tuple[list[tuple[int, int, int]] | None, list[str]]:
    """Our batch-size gates (and the batch-1 profile's k) as vLLM's num_speculative_tokens_per_batch_size.

    The edges differ, so the schedule is written out in full: our engine uses
    num_speculative_tokens for a batch size no gate covers and the batch-1 profile's k at batch
    size 1 (Engine.step_k); vLLM requires the first range to start at 1 and carries the previous
    range's K through gaps and past the last range (vllm/v1/spec_decode/dynamic/utils.py).
    """
    k = spec.num_speculative_tokens
    gates = spec.num_speculative_tokens_per_batch_size or ()
    notes: list[str] = []
    profile = spec.batch1_profile
    batch1_k = None
    if profile is not None:
        if profile.num_speculative_tokens <= k:
            batch1_k = profile.num_speculative_tokens
        else:
            notes.append(f"batch1_profile.num_speculative_tokens={profile.num_speculative_tokens}: above "
                         f"num_speculative_tokens={k}, and vLLM caps every batch size's K at num_speculative_tokens")
        # What the profile changes at batch 1: its policy against the top-level one, its engine
        # settings (CUDA graphs, kernel choices) against the defaults.
        reference = {"verify_policy": spec.verify_policy, "confidence_threshold": spec.confidence_threshold,
                     "cuda_graphs": Profile().cuda_graphs, "kernels": Profile().kernels}
        differs = [f"{name}={getattr(profile, name)!r}" for name, value in reference.items()
                   if getattr(profile, name) != value]
        if differs:
            notes.append(f"batch1_profile ({', '.join(differs)}): vLLM has one profile for all batch sizes; only "
                         "the batch-1 k is expressible (as a batch-size range)")

    def k_at(batch_size: int) -> int:
        if batch_size == 1 and batch1_k is not None:
            return batch1_k
        for start, end, gate_k in gates:
            if start <= batch_size <= end:
                return gate_k
        return k

    # k_at is constant between these points; the last one lies past every gate, where k applies
    # and vLLM carries it on to every larger batch.
    points = sorted({1, 2} | {start for start, _, _ in gates} | {end + 1 for _, end, _ in gates})
    schedule: list[tuple[int, int, int]] = []
    for i, start in enumerate(points):
        end = points[i + 1] - 1 if i + 1 < len(points) else start
        seg_k = k_at(start)
        if schedule and schedule[-1][2] == seg_k:
            schedule[-1] = (schedule[-1][0], end, seg_k)
        else:
            schedule.append((start, end, seg_k))
    if len(schedule) == 1:  # k at every batch size: no schedule needed
        return None, notes
    return schedule, notes


# ---------------------------------------------------------------------------------------------
# 2. vLLM versions and validation against the installed vLLM
# ---------------------------------------------------------------------------------------------


def required_versions(config: dict) -> list[tuple[str, str, Version]]:
    """(vLLM field, what needs it, first release) for every field and value in a config dict."""
    unknown = sorted(set(config) - set(FIELD_SINCE))
    if unknown:
        raise ValueError(f"speculative_config fields={unknown!r}: not fields this module emits "
                         f"(known: {sorted(FIELD_SINCE)})")
    needs = []
    for name, value in config.items():
        needs.append((name, f"field {name}", FIELD_SINCE[name]))
        if isinstance(value, str) and (name, value) in VALUE_SINCE:
            needs.append((name, f"{name}={value!r}", VALUE_SINCE[(name, value)]))
    if config.get("enable_adaptive_verification") and config.get("method") != "dspark":
        needs.append(("enable_adaptive_verification",
                      f"enable_adaptive_verification with method={config.get('method')!r}", ADAPTIVE_ANY_METHOD_SINCE))
    return needs


def minimum_vllm_version(config: dict) -> Version:
    return max(since for _, _, since in required_versions(config))


def check_vllm_version(config: dict, installed: str) -> None:
    """Raise a ValueError naming every field/value the installed vLLM release is too old for."""
    have = parse_version(installed)
    too_new = [(name, what, since) for name, what, since in required_versions(config) if since > have]
    if too_new:
        lines = [f"SpecConfig.{OUR_FIELD[name]}: {what} needs vLLM >= {format_version(since)} (installed {installed})"
                 for name, what, since in too_new]
        raise ValueError("; ".join(lines))


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


def _vllm_message(exc: Exception) -> tuple[list[str], str]:
    """The vLLM field names an exception points at, and its message without pydantic's framing."""
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
    mentioned = [name for name in OUR_FIELD if re.search(rf"\b{name}\b", text)]
    mentioned += [name for pattern, name in _VLLM_PHRASES if re.search(pattern, text, re.IGNORECASE)]
    return [f for f in fields if f in OUR_FIELD] or mentioned, text


def _as_our_error(exc: Exception, config: dict, installed: str, stage: str) -> ValueError:
    fields, text = _vllm_message(exc)
    if fields:
        named = ", ".join(f"SpecConfig.{OUR_FIELD[f]} (vLLM {f}={config.get(f)!r})" for f in dict.fromkeys(fields))
    else:
        named = f"speculative_config {json.dumps(config)}"
    return ValueError(f"{named}: vLLM {installed} rejects it in {stage}: {text}")


def _check_draft_architecture(config: dict, spec_config, installed: str) -> None:
    """Under method="dspark" vLLM rewrites a draft architecture it does not know as a DSpark class
    into the DeepSeek-V4 in-checkpoint drafter (spec vllm §1.4), which would load our weights into
    the wrong model without a word. Refuse that."""
    path = config.get("model")
    if spec_config.method != "dspark" or path is None or not (Path(path) / "config.json").is_file():
        return
    on_disk = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    resolved = list(spec_config.draft_model_config.architectures or [])
    if resolved != on_disk and not set(resolved) & set(VLLM_DSPARK_ARCHITECTURES):
        raise ValueError(f"SpecConfig.drafter_path={path!r}: its architectures {on_disk} are not a DSpark drafter "
                         f"vLLM {installed} knows ({', '.join(VLLM_DSPARK_ARCHITECTURES)}); under method 'dspark' "
                         f"vLLM would load it as {resolved} (the DeepSeek-V4 in-checkpoint drafter)")


def validate_with_vllm(config: dict, *, target_model: str | None = None) -> VllmValidation:
    """Check a speculative_config dict with the installed vLLM's own SpeculativeConfig and, where
    it can be built here, VllmConfig. Raises ValueError naming our field on any rejection.

    target_model: a local model directory (config.json is enough); None writes a tiny Qwen3 one.
    Needs no GPU: without CUDA it sets VLLM_TARGET_DEVICE=cpu (vLLM reads it once, when it first
    picks its platform). dspark and adaptive verification run only on Model Runner V2, so
    VLLM_USE_V2_MODEL_RUNNER=1 is set while VllmConfig is built (spec vllm §5.3); neither variable
    is touched when the caller has set it.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig, VllmConfig

    installed = vllm.__version__
    check_vllm_version(config, installed)
    notes = []
    if not CHECKED_VLLM_RANGE[0] <= parse_version(installed) <= CHECKED_VLLM_RANGE[1]:
        notes.append(f"vLLM {installed} is outside the releases this table was checked against "
                     f"({format_version(CHECKED_VLLM_RANGE[0])}-{format_version(CHECKED_VLLM_RANGE[1])})")

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
            raise _as_our_error(exc, config, installed, "SpeculativeConfig") from exc

        _check_draft_architecture(config, spec_config, installed)

        schedule = config.get("num_speculative_tokens_per_batch_size")
        if schedule is not None:
            # vLLM checks the schedule only when the scheduler starts; check it now.
            from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule
            try:
                validate_and_normalize_dynamic_sd_schedule(schedule)
            except ValueError as exc:
                raise _as_our_error(exc, config, installed, "its batch-size schedule check") from exc

        needs_v2 = spec_config.method == "dspark" or spec_config.enable_adaptive_verification
        built, skipped = False, None
        with _env({"VLLM_USE_V2_MODEL_RUNNER": "1"} if needs_v2 else {}):
            try:
                VllmConfig(model_config=model_config, speculative_config=spec_config)
                built = True
            except Exception as exc:
                _, text = _vllm_message(exc)
                if "requires Triton" not in text:
                    raise _as_our_error(exc, config, installed, "VllmConfig") from exc
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


# ---------------------------------------------------------------------------------------------
# 3. CLI: dspark vllm-config
# ---------------------------------------------------------------------------------------------


def _rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _gates(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        entries = json.loads(text)
        return tuple(tuple(int(x) for x in entry) for entry in entries)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON like [[1, 4, 7], [5, 64, 3]]") from None


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Flags for `dspark vllm-config` (SpecConfig fields, same names as vLLM where vLLM has them)."""
    d = SpecConfig()
    parser.description = ("Print the JSON for `vllm serve --speculative-config` (or LLM(speculative_config=...)) "
                          "built from a dspark SpecConfig, and validate it with the installed vLLM when there is one.")
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=d.num_speculative_tokens)
    parser.add_argument("--drafter", choices=("ngram", "dspark"), default=d.drafter)
    parser.add_argument("--drafter-path", default=None, help="DSpark drafter checkpoint directory (vLLM `model`)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="the drafter's trained block size, if its config.json is not at hand")
    parser.add_argument("--prompt-lookup-min", type=int, default=d.prompt_lookup_min)
    parser.add_argument("--prompt-lookup-max", type=int, default=d.prompt_lookup_max)
    parser.add_argument("--draft-sample-method", choices=("greedy", "probabilistic"), default=d.draft_sample_method)
    parser.add_argument("--rejection-sample-method", choices=("standard", "synthetic", "block"),
                        default=d.rejection_sample_method, help="'block' is vLLM-only (block verification)")
    parser.add_argument("--synthetic-acceptance-length", type=float, default=None)
    parser.add_argument("--synthetic-acceptance-rates", type=_rates, default=None, help="e.g. 1,1,0.8,0.5")
    parser.add_argument("--verify-policy", choices=("fixed", "threshold", "scheduler"), default=d.verify_policy)
    parser.add_argument("--confidence-threshold", type=float, default=d.confidence_threshold)
    parser.add_argument("--sps-table-path", default=None)
    parser.add_argument("--num-speculative-tokens-per-batch-size", type=_gates, default=None,
                        help="JSON [[batch_start, batch_end, k], ...]")
    parser.add_argument("--max-speculative-seq-len", type=int, default=None)
    parser.add_argument("--batch1-num-speculative-tokens", type=int, default=None,
                        help="k of the batch-1 profile (its other settings keep their defaults)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--target-model", default=None,
                        help="local target model directory for validation (default: a tiny generated one)")
    parser.add_argument("--no-validate", action="store_true", help="do not validate with the installed vLLM")
    return parser


def spec_from_args(args: argparse.Namespace) -> tuple[SpecConfig, bool]:
    """The SpecConfig and the block_verification flag the parsed flags describe."""
    block = args.rejection_sample_method == "block"
    spec = SpecConfig(
        num_speculative_tokens=args.num_speculative_tokens,
        drafter=args.drafter,
        drafter_path=args.drafter_path,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
        draft_sample_method=args.draft_sample_method,
        rejection_sample_method="standard" if block else args.rejection_sample_method,
        synthetic_acceptance_length=args.synthetic_acceptance_length,
        synthetic_acceptance_rates=args.synthetic_acceptance_rates,
        verify_policy=args.verify_policy,
        confidence_threshold=args.confidence_threshold,
        sps_table_path=args.sps_table_path,
        num_speculative_tokens_per_batch_size=args.num_speculative_tokens_per_batch_size,
        max_speculative_seq_len=args.max_speculative_seq_len,
        batch1_profile=(Profile(num_speculative_tokens=args.batch1_num_speculative_tokens)
                        if args.batch1_num_speculative_tokens is not None else None),
        seed=args.seed,
    )
    return spec, block


def main(args: argparse.Namespace) -> int:
    """Print the speculative_config JSON on stdout; notes and validation status on stderr.
    Exit status 0 when valid, 2 when the config is rejected (by us or by vLLM)."""
    try:
        spec, block = spec_from_args(args)
        result = convert(spec, block_size=args.block_size, block_verification=block)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.config))
    print(f"needs vLLM >= {format_version(minimum_vllm_version(result.config))}; "
          f"engine arguments: {json.dumps(result.engine_args)} (vllm serve --seed {spec.seed})", file=sys.stderr)
    for note in result.not_carried:
        print(f"not carried over to vLLM: {note}", file=sys.stderr)
    if args.no_validate:
        print("not validated (--no-validate)", file=sys.stderr)
        return 0
    if not vllm_importable():
        print("not validated: vllm is not importable in this environment", file=sys.stderr)
        return 0
    try:
        checked = validate_with_vllm(result.config, target_model=args.target_model)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    what = "SpeculativeConfig and VllmConfig accept it" if checked.vllm_config_built else "SpeculativeConfig accepts it"
    print(f"validated with vLLM {checked.vllm_version}: {what} "
          f"(method={checked.method}, num_speculative_tokens={checked.num_speculative_tokens})", file=sys.stderr)
    for note in (checked.vllm_config_skipped, *checked.notes):
        if note:
            print(note, file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# 4. `dspark sweep --backend vllm`: tokens/s against synthetic acceptance length, measured by vLLM
# ---------------------------------------------------------------------------------------------

# vLLM's spec-decode counters as LLM.get_metrics() names them (spec vllm §4.1; "_total" is only
# added at Prometheus scrape time).
SPEC_DECODE_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                        "vllm:spec_decode_num_accepted_tokens")
SPEC_DECODE_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_decode_counts(metrics) -> dict:
    """Sum vLLM's spec-decode counters over their labels (engines): {"num_drafts", "num_draft_tokens",
    "num_accepted_tokens", "accepted_per_pos": [..]} from an LLM.get_metrics() snapshot."""
    counts = {name.removeprefix("vllm:spec_decode_"): 0 for name in SPEC_DECODE_COUNTERS}
    per_pos: list[int] = []
    for metric in metrics:
        if metric.name in SPEC_DECODE_COUNTERS:
            counts[metric.name.removeprefix("vllm:spec_decode_")] += int(metric.value)
        elif metric.name == SPEC_DECODE_PER_POSITION:
            values = list(metric.values)
            per_pos = [a + b for a, b in zip(per_pos + [0] * (len(values) - len(per_pos)), values)]
    counts["accepted_per_pos"] = per_pos
    return counts


def count_difference(after: dict, before: dict) -> dict:
    """Counters of one measurement: vLLM's counters are cumulative over the LLM's lifetime."""
    out = {name: after[name] - before[name] for name in after if name != "accepted_per_pos"}
    pos_before = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], pos_before)]
    return out


def acceptance_summary(counts: dict) -> dict:
    """Mean acceptance length (bonus token included: 1 + accepted / drafts), acceptance rate and
    per-position acceptance (accepted at position i / drafts), as vLLM's own logger computes them
    (spec vllm §4.1)."""
    drafts = counts["num_drafts"]
    if drafts == 0:
        return {"al_measured": None, "draft_tokens_per_draft": None, "acceptance_rate": None,
                "per_position_acceptance": []}
    return {
        "al_measured": 1.0 + counts["num_accepted_tokens"] / drafts,
        # below k when the drafter proposed short drafts (n-gram without a long enough match)
        "draft_tokens_per_draft": counts["num_draft_tokens"] / drafts,
        "acceptance_rate": counts["num_accepted_tokens"] / max(counts["num_draft_tokens"], 1),
        "per_position_acceptance": [a / drafts for a in counts["accepted_per_pos"]],
    }


def synthetic_prompts(batch: int, context: int, vocab_size: int, seed: int) -> list[dict]:
    """Token-id prompts of a short repeated pattern per request: the n-gram drafter then always
    finds a continuation, so it proposes k tokens every step and synthetic acceptance decides the rest."""
    import random

    rng = random.Random(seed)
    prompts = []
    for _ in range(batch):
        period = [rng.randrange(100, max(101, vocab_size - 100)) for _ in range(8)]
        prompts.append({"prompt_token_ids": (period * (context // len(period) + 1))[:context]})
    return prompts


def sweep_points(ks: list[int], als: list[float]) -> list[tuple[int, float | None]]:
    """(k, AL) engine configurations: plain decoding (k = 0) and every AL reachable with k (<= k + 1)."""
    return [(0, None)] + [(k, al) for k in ks for al in als if 1 <= al <= k + 1]


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """The `dspark sweep` flags of the vLLM backend."""
    parser.add_argument("--backend", choices=("dspark", "vllm"), default="dspark",
                        help="dspark: our engine; vllm: drive vllm.LLM with synthetic acceptance (needs a GPU; "
                             "--target is then a model vLLM loads)")
    parser.add_argument("--drafter-path", default=None,
                        help="--backend vllm: a DSpark drafter for the target (vLLM method dspark); "
                             "default: vLLM's n-gram drafter on repetitive prompts")


def vllm_sweep_main(args) -> int:
    """`dspark sweep --backend vllm`: one vllm.LLM per (k, AL) with synthetic acceptance
    (rejection_sample_method="synthetic", spec vllm §1.3), each batch size measured by one
    generate() call; acceptance and per-position counts from llm.get_metrics(). Results in
    --out/sweep-vllm.json and .csv. Stops before anything loads when there is no GPU or no vLLM."""
    import torch

    if not torch.cuda.is_available():
        print("error: dspark sweep --backend vllm needs a CUDA GPU: the vLLM engine cannot run on this machine "
              "(the PyPI vLLM wheel has no CPU kernels; spec vllm §5.3). No model was loaded. "
              "Use --backend dspark here, or run on a GPU machine.", file=sys.stderr)
        return 2
    if not vllm_importable():
        print("error: dspark sweep --backend vllm needs the vllm package (pip install vllm); no model was loaded",
              file=sys.stderr)
        return 2
    if args.target is None:
        print("error: --target: the vLLM backend needs a model vLLM can load (a Hugging Face name or local "
              "directory), e.g. --target Qwen/Qwen3-8B", file=sys.stderr)
        return 2
    drafter_path = getattr(args, "drafter_path", None)
    ks = [int(x) for x in args.k.split(",") if x]
    batches = [int(x) for x in args.batch.split(",") if x]
    als = [float(x) for x in args.al.split(",") if x]
    for bad in [k for k in ks if k < 1]:
        print(f"error: --k {bad}: each k must be >= 1 (plain decoding is always measured)", file=sys.stderr)
        return 2
    context = args.context or 1024
    max_tokens = args.max_tokens or 256
    configs = sweep_points(ks, als)
    # Every speculative config is checked by our own rules before the first model loads.
    spec_configs = {}
    for k, al in configs:
        if k == 0:
            continue
        spec = SpecConfig(num_speculative_tokens=k, drafter="dspark" if drafter_path else "ngram",
                          drafter_path=drafter_path, rejection_sample_method="synthetic",
                          synthetic_acceptance_length=al, seed=args.seed)
        try:
            spec_configs[(k, al)] = convert(spec).config
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    import gc

    from vllm import LLM, SamplingParams as VllmSamplingParams

    from .sweep import run_meta

    out = Path(args.out or f"runs/sweep-vllm-{Path(args.target).name}")
    out.mkdir(parents=True, exist_ok=True)
    meta = run_meta("cuda", target=args.target, backend="vllm", vllm=__import__("vllm").__version__,
                    context=context, max_tokens=max_tokens, drafter_path=drafter_path)
    sampling = VllmSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    points = []
    for k, al in configs:
        llm = LLM(model=args.target, speculative_config=spec_configs.get((k, al)), disable_log_stats=False,
                  seed=args.seed, max_num_seqs=max(batches), max_model_len=context + max_tokens + 16)
        vocab = llm.model_config.get_vocab_size()
        for batch in batches:
            prompts = synthetic_prompts(batch, context, vocab, args.seed + batch)
            llm.generate(prompts[:1], VllmSamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
            before = spec_decode_counts(llm.get_metrics())
            start = time.perf_counter()
            outputs = llm.generate(prompts, sampling, use_tqdm=False)
            elapsed = time.perf_counter() - start
            counts = count_difference(spec_decode_counts(llm.get_metrics()), before)
            produced = sum(len(o.outputs[0].token_ids) for o in outputs)
            point = {"key": f"b{batch}-k{k}-" + ("plain" if al is None else f"al{al:g}"), "batch": batch, "k": k,
                     "al_target": al, "tokens_per_s": produced / elapsed, "elapsed_s": elapsed,
                     "output_tokens": produced, **counts, **acceptance_summary(counts)}
            points.append(point)
            print(f"batch {batch:>3} k {k} AL set {'plain' if al is None else f'{al:g}':>5} "
                  f"got {point['al_measured'] or 1.0:.2f}  {point['tokens_per_s']:.1f} tok/s", flush=True)
            _write_vllm_sweep(out, meta, points)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    print(f"wrote {out / 'sweep-vllm.json'} and {out / 'sweep-vllm.csv'}")
    return 0


def _write_vllm_sweep(out: Path, meta: dict, points: list[dict]) -> None:
    import csv

    (out / "sweep-vllm.json").write_text(json.dumps({"schema": "dspark.sweep-vllm/1", "meta": meta,
                                                    "points": points}, indent=1))
    fields = [f for f in points[0] if f not in ("accepted_per_pos", "per_position_acceptance")]
    with open(out / "sweep-vllm.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields + ["per_position_acceptance"])
        writer.writeheader()
        for p in points:
            writer.writerow({**{name: p[name] for name in fields},
                             "per_position_acceptance": " ".join(f"{a:.4f}" for a in p["per_position_acceptance"])})
