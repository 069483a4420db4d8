"""SpecConfig <-> vLLM speculative_config.

`convert` builds the dict for `LLM(speculative_config=...)` / `vllm serve --speculative-config`
and lists what vLLM cannot express (never dropped silently) and what vLLM would do differently
(warnings); `from_vllm_config` reads such a dict back into a SpecConfig, so a config goes both ways.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
import socket
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from dspark.config import Profile, SpecConfig

from .versions import FIELDS, NEWEST_KNOWN_VLLM, format_version, parse_version

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

# A Hugging Face hub id: "org/name", not an existing local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def _fail(name: str, value, why: str) -> None:
    raise ValueError(f"SpecConfig.{name}={value!r}: {why}")


def field_label(vllm_field: str) -> str:
    """How an error names a vLLM field: our SpecConfig field, or the `--extra` key it came from."""
    return f"SpecConfig.{OUR_FIELD[vllm_field]}" if vllm_field in OUR_FIELD else f"--extra {vllm_field}"


@dataclass(frozen=True)
class VllmSpeculativeConfig:
    """The conversion result.

    config:          the dict for `LLM(speculative_config=...)` / `--speculative-config`.
    engine_args:     settings that vLLM takes elsewhere (`LLM(**engine_args)`, `vllm serve --seed`).
    not_carried:     one sentence per setting of ours that vLLM cannot express (dropped, with why).
    warnings:        one sentence per setting vLLM takes but treats differently from dspark's engine.
    passed_through:  the `extra` fields copied into config unchecked by us (vLLM validates them).
    """

    config: dict
    engine_args: dict
    not_carried: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    passed_through: tuple[str, ...] = ()


class NotCarriedOverWarning(UserWarning):
    """A SpecConfig setting that has no vLLM equivalent was left out of the vLLM config."""


class VllmDiffersWarning(UserWarning):
    """vLLM takes a setting but treats it differently from dspark's engine."""


def is_hub_id(path: str | os.PathLike) -> bool:
    return not Path(path).exists() and bool(_HUB_ID.match(str(path)))


# How long the one look at the hub may take before this machine counts as offline.
HUB_PROBE_SECONDS = 3.0


@functools.lru_cache(maxsize=None)
def hub_unreachable(endpoint: str, timeout: float = HUB_PROBE_SECONDS) -> str | None:
    """Why the Hugging Face hub at `endpoint` cannot be reached from here (None when a TCP
    connection opens), found once per process with one connection attempt and no retries: the
    hub client would otherwise retry for ~25 s, logging each attempt. Name resolution has no
    timeout of its own, so the attempt runs on a thread that is given up after `timeout`."""
    url = urlsplit(endpoint)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    if host is None:
        return f"{endpoint!r} names no host"
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{host}:{port}: {exc.strerror or exc}")

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"{host}:{port}: no answer within {timeout:g} s"


def drafter_config_file(drafter_path: str | os.PathLike) -> Path:
    """The drafter's config.json: in a local directory, or for a hub id (`Inferact/Kimi-K3-DSpark`)
    through huggingface_hub: its cache first, then the hub, when one quick connection shows it
    reachable (hub_unreachable); offline, one clear error naming --block-size."""
    if Path(drafter_path).is_dir():
        path = Path(drafter_path) / "config.json"
        if not path.is_file():
            raise ValueError(f"drafter_path={str(drafter_path)!r}: no config.json there")
        return path
    if not is_hub_id(drafter_path):
        raise ValueError(f"drafter_path={str(drafter_path)!r}: neither a local directory nor a Hugging Face hub id "
                         "(org/name); give the drafter's directory, or pass --block-size with its trained block")
    try:
        import huggingface_hub
        from huggingface_hub import constants as hub_constants
    except ImportError:
        raise ValueError(f"drafter_path={str(drafter_path)!r}: a Hugging Face hub id, and huggingface_hub is not "
                         "installed to read its config.json (pip install huggingface_hub, or download the drafter "
                         "and pass its directory, or pass --block-size)") from None
    cached = huggingface_hub.try_to_load_from_cache(str(drafter_path), "config.json")
    if isinstance(cached, str):
        return Path(cached)
    instead = ("pass --block-size with the drafter's trained block (or download the drafter and pass its "
               "directory)")
    if hub_constants.HF_HUB_OFFLINE:
        raise ValueError(f"drafter_path={str(drafter_path)!r}: a Hugging Face hub id, its config.json is not in the "
                         f"local cache and HF_HUB_OFFLINE is set; {instead}")
    why = hub_unreachable(hub_constants.ENDPOINT)
    if why is not None:
        raise ValueError(f"drafter_path={str(drafter_path)!r}: a Hugging Face hub id, and the hub cannot be reached "
                         f"from here ({why}); {instead}")
    try:
        return Path(huggingface_hub.hf_hub_download(str(drafter_path), "config.json", etag_timeout=HUB_PROBE_SECONDS))
    except Exception as exc:  # unknown repository, gated, a connection lost: the hub's reason, one line
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise ValueError(f"drafter_path={str(drafter_path)!r}: could not get its config.json from the Hugging Face "
                         f"hub ({type(exc).__name__}: {detail}); {instead}") from None


def read_drafter_config(drafter_path: str | os.PathLike) -> dict:
    path = drafter_config_file(drafter_path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"drafter_path={str(drafter_path)!r}: {path} is not JSON ({exc})") from None


def read_drafter_block_size(drafter_path: str | os.PathLike) -> int | None:
    """The trained block size from a DSpark drafter's config.json (`block_size`, or the
    DeepSeek-V4 name `dspark_block_size`; docs/dspark-algorithm.md §2.7), None if it has neither."""
    cfg = read_drafter_config(drafter_path)
    for key in ("block_size", "dspark_block_size"):
        if cfg.get(key) is not None:
            return int(cfg[key])
    return None


def convert(spec: SpecConfig, *, drafter_path: str | None = None, block_size: int | None = None,
            block_verification: bool = False, drafter_in_target: bool = False,
            extra: dict | None = None) -> VllmSpeculativeConfig:
    """Build vLLM's speculative_config from a SpecConfig.

    drafter_path overrides spec.drafter_path; block_size is the drafter's trained block size when
    it cannot be read from the drafter's config.json. block_verification=True asks vLLM for
    `rejection_sample_method="block"` (Sun et al. 2024, vLLM >= 0.25): a vLLM-only option, our
    engine has no block verifier, so it is a keyword here and not a SpecConfig field.
    drafter_in_target=True allows drafter='dspark' without a drafter path, for a target that ships
    its DSpark drafter in its own checkpoint (DeepSeek-V4); otherwise vLLM would build that
    DeepSeek-V4 drafter from any target, so it is refused.
    extra: vLLM SpeculativeConfig fields dspark has no setting for (draft_tensor_parallel_size,
    quantization, max_model_len, ...), copied as they are; the installed vLLM validates them.
    """
    spec.validate()
    k = spec.num_speculative_tokens
    if k == 0:
        _fail("num_speculative_tokens", 0, "plain decoding has no vLLM speculative_config; run vLLM without one")
    not_carried: list[str] = []
    notes: list[str] = []
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
            out["model"] = str(path)
        elif not drafter_in_target:
            _fail("drafter_path", None, "drafter='dspark' needs the drafter checkpoint (--drafter-path, e.g. the "
                  "published Inferact/Kimi-K3-DSpark for Kimi K3): without one vLLM builds the DeepSeek-V4 "
                  "in-checkpoint drafter from the target, which is wrong for any target that does not ship one "
                  "(pass --drafter-in-target if yours does)")
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

    _verification_length(spec, out, not_carried)
    if spec.drafter == "ngram":
        notes.extend(_ngram_ignores(spec))

    schedule, schedule_notes, schedule_warnings = _batch_size_schedule(spec)
    not_carried.extend(schedule_notes)
    notes.extend(schedule_warnings)
    if schedule is not None:
        out["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]

    if spec.max_speculative_seq_len is not None:
        not_carried.append(f"max_speculative_seq_len={spec.max_speculative_seq_len}: vLLM's V1/V2 engines have no "
                           "sequence-length gate for speculation (speculative_config.max_model_len only caps the "
                           "draft model); long sequences keep speculating")
    passed = _merge_extra(out, extra)
    return VllmSpeculativeConfig(config=out, engine_args={"seed": spec.seed}, not_carried=tuple(not_carried),
                                 warnings=tuple(notes), passed_through=passed)


def _verification_length(spec: SpecConfig, out: dict, not_carried: list[str]) -> None:
    """Verification length (docs/dspark-algorithm.md §5): vLLM's adaptive verification is the
    confidence scheduler; it profiles its own cost tables at start-up (docs/vllm-integration.md §2.5)."""
    if spec.verify_policy == "scheduler":
        out["enable_adaptive_verification"] = True
        if spec.sps_table_path is not None:
            not_carried.append(f"sps_table_path={spec.sps_table_path!r}: vLLM profiles its own step-cost tables at "
                               "start-up (VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN); ours is not used")
    elif spec.verify_policy == "threshold":
        not_carried.append(f"verify_policy='threshold' (confidence_threshold={spec.confidence_threshold}): vLLM has no "
                           "confidence-threshold policy; it verifies all k drafts (verify_policy='scheduler' maps to "
                           "enable_adaptive_verification)")


def _ngram_ignores(spec: SpecConfig) -> list[str]:
    """Settings vLLM's n-gram speculator accepts without error and then does not use."""
    notes = []
    if spec.verify_policy == "scheduler":
        notes.append("verify_policy='scheduler' with drafter='ngram': vLLM accepts enable_adaptive_verification "
                     "but its n-gram speculator has no confidence to schedule with and verifies every draft")
    if spec.draft_sample_method == "probabilistic":
        notes.append("draft_sample_method='probabilistic' with drafter='ngram': vLLM's n-gram speculator proposes "
                     "deterministically (no draft distribution), so this is the same as 'greedy' there")
    return notes


def vllm_only_fields(config: dict) -> dict:
    """The fields of a speculative_config that vLLM's release table (versions.FIELDS) has and
    dspark's SpecConfig does not (draft_tensor_parallel_size, max_model_len, ...): what `--extra`
    adds to a config."""
    return {name: value for name, value in config.items() if name in FIELDS and name not in OUR_FIELD}


def check_extra_fields(extra: dict | None, installed_vllm: str | None) -> None:
    """Refuse an `--extra` field that no vLLM release in the table has (a typo), unless a vLLM
    newer than the table is installed to judge it. installed_vllm: the version that will
    validate the config, None when none will (not installed, or --no-validate)."""
    if not extra or (installed_vllm is not None and parse_version(installed_vllm) > NEWEST_KNOWN_VLLM):
        return
    for name in extra:
        if name not in FIELDS:
            close = difflib.get_close_matches(name, list(FIELDS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"--extra {name!r}: not a SpeculativeConfig field of any vLLM release up to "
                             f"{format_version(NEWEST_KNOWN_VLLM)} (dspark/vllm/versions.py){hint}")


def _merge_extra(out: dict, extra: dict | None) -> tuple[str, ...]:
    if not extra:
        return ()
    if not isinstance(extra, dict):
        raise ValueError(f"--extra {extra!r}: must be a JSON object of vLLM SpeculativeConfig fields")
    clash = sorted(set(extra) & (set(out) | set(OUR_FIELD)))
    if clash:
        raise ValueError(f"--extra fields {clash}: set by dspark's own settings "
                         f"({', '.join(f'SpecConfig.{OUR_FIELD[name]}' for name in clash if name in OUR_FIELD)}); "
                         "use those instead of --extra")
    out.update(extra)
    return tuple(extra)


def speculative_config(spec: SpecConfig, **convert_kwargs) -> dict:
    """The dict for `LLM(speculative_config=...)`; settings vLLM cannot express are reported as
    NotCarriedOverWarning, settings it treats differently as VllmDiffersWarning (use `convert` to get
    them as lists, and the engine seed). Takes `convert`'s keywords."""
    result = convert(spec, **convert_kwargs)
    for note in result.not_carried:
        warnings.warn(f"not carried over to vLLM: {note}", NotCarriedOverWarning, stacklevel=2)
    for note in result.warnings:
        warnings.warn(note, VllmDiffersWarning, stacklevel=2)
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
    positions (docs/vllm-integration.md §2.1, PR #41834 comment: block 5 run with k=7). vLLM checks
    this only for Qwen3-Omni drafters, so we check it. Synthetic acceptance ignores draft quality (it
    accepts by coin flip), so a k sweep over one drafter stays allowed there."""
    trained = block_size
    if trained is None and drafter_path is not None:
        try:
            trained = read_drafter_block_size(drafter_path)
        except ValueError as exc:  # it already says what to pass instead
            raise ValueError(f"SpecConfig.{exc} (k is checked against the drafter's trained block)") from None
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


def vllm_schedule_k(schedule, batch_size: int, k: int) -> int:
    """vLLM's batch-size -> K rule (vllm/v1/spec_decode/dynamic/utils.py): a covered batch size takes
    its range's K, an uncovered one the K of the last range before it; K is capped at k."""
    before = [gate_k for start, _, gate_k in sorted(schedule) if start <= batch_size]
    return min(k, before[-1]) if before else k


def _batch1_notes(spec: SpecConfig) -> list[str]:
    profile, k = spec.batch1_profile, spec.num_speculative_tokens
    notes = []
    if profile.num_speculative_tokens > k:
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
    return notes


def _batch_size_schedule(spec: SpecConfig) -> tuple[list[tuple[int, int, int]] | None, list[str], list[str]]:
    """Our k rule (SpecConfig.k_for_batch) as vLLM's num_speculative_tokens_per_batch_size:
    (schedule or None, not-carried notes, warnings).

    The user's own gates go to vLLM as given when vLLM can take them (they start at batch 1 and no
    batch-1 profile changes batch 1), with a warning where vLLM's lookup differs from our engine's
    (ours: num_speculative_tokens for a batch no gate covers; vLLM: the previous range's K through
    gaps and past the last range). Otherwise the schedule is written out in full from our rule.
    """
    k = spec.num_speculative_tokens
    gates = spec.num_speculative_tokens_per_batch_size or ()
    profile = spec.batch1_profile
    notes = _batch1_notes(spec) if profile is not None else []
    # vLLM caps K at num_speculative_tokens, so a batch-1 k above it is reported and left out.
    rule = spec if profile is None or profile.num_speculative_tokens <= k else dataclasses.replace(spec, batch1_profile=None)
    # rule.k_for_batch is constant between these points; the last one lies past every gate.
    points = sorted({1, 2} | {start for start, _, _ in gates} | {end + 1 for _, end, _ in gates})

    if gates and gates[0][0] == 1 and rule.k_for_batch(1) == gates[0][2]:
        differ = [b for b in points if vllm_schedule_k(gates, b, k) != rule.k_for_batch(b)]
        warned = []
        if differ:
            where = ", ".join(f"batch {b}: dspark k={rule.k_for_batch(b)}, vLLM k={vllm_schedule_k(gates, b, k)}"
                              for b in differ)
            warned.append(f"num_speculative_tokens_per_batch_size={[list(g) for g in gates]} goes to vLLM as given, "
                          f"and vLLM reads it differently from dspark's engine from the batch sizes {where} on "
                          "(vLLM carries the previous range's K through gaps and past the last range; dspark uses "
                          f"num_speculative_tokens={k} where no range covers the batch)")
        return list(gates), notes, warned

    schedule: list[tuple[int, int, int]] = []
    for i, start in enumerate(points):
        end = points[i + 1] - 1 if i + 1 < len(points) else start
        seg_k = rule.k_for_batch(start)
        if schedule and schedule[-1][2] == seg_k:
            schedule[-1] = (schedule[-1][0], end, seg_k)
        else:
            schedule.append((start, end, seg_k))
    if len(schedule) == 1:  # k at every batch size: no schedule needed
        return None, notes, []
    return schedule, notes, []


# ---------------------------------------------------------------------------------------------
# vLLM speculative_config -> SpecConfig (`dspark generate/sweep --speculative-config`)
# ---------------------------------------------------------------------------------------------

_METHOD_TO_DRAFTER = {"ngram": "ngram", "dspark": "dspark"}
# vLLM's n-gram window when a bound is unset (SpeculativeConfig docstrings: the other bound, else 5).
_VLLM_LOOKUP_DEFAULT = 5


def speculative_config_json(text: str) -> dict:
    """A --speculative-config value: a JSON object, as vLLM takes it (one line naming the flag
    otherwise)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config {text!r}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config {text!r}: must be a JSON object like vLLM's")
    return config


def from_vllm_config(config: dict | str) -> tuple[SpecConfig, bool]:
    """A vLLM speculative_config (dict or JSON text) as (SpecConfig, block_verification).

    Only what dspark's engine has is accepted; a field it has no equivalent for is refused by
    name rather than dropped. vLLM's batch-size schedule is rewritten to our exact-gate reading
    (gaps take the previous range's K, the last range extends to every larger batch)."""
    config = speculative_config_json(config) if isinstance(config, str) else config
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config {config!r}: must be a JSON object like vLLM's")
    unknown = sorted(set(config) - set(OUR_FIELD))
    if unknown:
        raise ValueError(f"--speculative-config fields {unknown}: dspark's engine has no equivalent "
                         f"(it reads {sorted(OUR_FIELD)})")
    method = config.get("method", "dspark" if config.get("model") else None)
    if method not in _METHOD_TO_DRAFTER:
        raise ValueError(f"--speculative-config method={method!r}: dspark's engine drafts with 'ngram' or 'dspark'")
    if "num_speculative_tokens" not in config:
        raise ValueError("--speculative-config: num_speculative_tokens is required")
    lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    rejection = config.get("rejection_sample_method", "standard")
    schedule = config.get("num_speculative_tokens_per_batch_size")
    spec = SpecConfig(
        num_speculative_tokens=config["num_speculative_tokens"],
        drafter=_METHOD_TO_DRAFTER[method],
        drafter_path=config.get("model"),
        prompt_lookup_min=lo if lo is not None else (hi if hi is not None else _VLLM_LOOKUP_DEFAULT),
        prompt_lookup_max=hi if hi is not None else (lo if lo is not None else _VLLM_LOOKUP_DEFAULT),
        draft_sample_method=config.get("draft_sample_method", "greedy"),
        rejection_sample_method="standard" if rejection == "block" else rejection,
        synthetic_acceptance_length=config.get("synthetic_acceptance_length"),
        synthetic_acceptance_rates=(tuple(config["synthetic_acceptance_rates"])
                                    if config.get("synthetic_acceptance_rates") is not None else None),
        verify_policy="scheduler" if config.get("enable_adaptive_verification") else "fixed",
        num_speculative_tokens_per_batch_size=_gates_from_vllm(schedule) if schedule is not None else None,
    )
    return spec.validate(), rejection == "block"


# The end of the last gate, standing for vLLM's "and every larger batch size".
_ANY_LARGER_BATCH = 2**31 - 1


def _gates_from_vllm(schedule) -> tuple[tuple[int, int, int], ...]:
    try:
        entries = sorted(tuple(int(x) for x in entry) for entry in schedule)
    except (TypeError, ValueError):
        raise ValueError(f"--speculative-config num_speculative_tokens_per_batch_size={schedule!r}: "
                         "expected [[batch_start, batch_end, k], ...]") from None
    gates = []
    for i, (start, end, gate_k) in enumerate(entries):
        next_start = entries[i + 1][0] if i + 1 < len(entries) else _ANY_LARGER_BATCH + 1
        gates.append((start, max(end, next_start - 1), gate_k))
    return tuple(gates)
