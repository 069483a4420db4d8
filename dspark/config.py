"""User-facing configuration: per-request sampling and the speculative-decoding setup.

Field names follow vLLM's SamplingParams / SpeculativeConfig where vLLM has the same notion, so
a SpecConfig converts to a vLLM `speculative_config` without renaming surprises
(docs/vllm-integration.md §1). Every check raises a ValueError that names the field
and the offending value; nothing is clamped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

DraftSampleMethod = Literal["greedy", "probabilistic"]
RejectionSampleMethod = Literal["standard", "synthetic"]
VerifyPolicyName = Literal["fixed", "threshold", "scheduler"]
DrafterName = Literal["ngram", "dspark"]


def _fail(owner: str, name: str, value, why: str) -> None:
    raise ValueError(f"{owner}.{name}={value!r}: {why}")


def _is_int(value) -> bool:
    """An integer that is not a bool (True would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# Below this a positive temperature overflows float32 logits / temperature (vLLM treats
# temperatures under the same 1e-5 as greedy; here they are refused rather than changed).
MIN_TEMPERATURE = 1e-5
# The most drafts one step may verify: past a few dozen the verify cost grows while the chance
# that every draft is accepted vanishes. A target with a shorter context bounds k further.
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 means greedy (argmax); a positive temperature below
    MIN_TEMPERATURE is refused (vLLM would decode it greedily; here nothing changes silently)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1 disables nucleus sampling
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    speculate: bool = True  # per-request opt-out of speculation

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        own = "SamplingParams"
        if not (_is_number(self.temperature) and math.isfinite(self.temperature)) or self.temperature < 0:
            _fail(own, "temperature", self.temperature, "must be a finite number >= 0 (0 = greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            # logits / temperature overflows float32 and the probabilities become NaN.
            _fail(own, "temperature", self.temperature, f"must be 0 (greedy) or >= {MIN_TEMPERATURE:g}")
        if not _is_int(self.top_k) or self.top_k < 0:
            _fail(own, "top_k", self.top_k, "must be an integer >= 0 (0 disables top-k)")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            _fail(own, "top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            _fail(own, "max_tokens", self.max_tokens, "must be an integer >= 1")
        if self.seed is not None and not _is_int(self.seed):
            _fail(own, "seed", self.seed, "must be an integer or None")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(_is_int(t) for t in self.stop_token_ids):
            _fail(own, "stop_token_ids", self.stop_token_ids, "must be a tuple of integer token ids")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    _fail(own, "stop_token_ids", self.stop_token_ids, f"token {t} outside the vocabulary [0, {vocab_size})")
        return self


@dataclass(frozen=True)
class Profile:
    """Settings for one regime of the engine (the batch-1 latency path or the batched path).

    cuda_graphs: on a CUDA target, steps of up to 8 requests replay CUDA graphs of verify +
    acceptance + commit (dspark/graph_step.py); False runs them eagerly. A CPU target has
    nothing to capture and always runs eagerly."""

    num_speculative_tokens: int = 7
    verify_policy: VerifyPolicyName = "fixed"
    confidence_threshold: float = 0.0  # for verify_policy="threshold"
    cuda_graphs: bool = True
    kernels: tuple[tuple[str, str], ...] = ()  # (op, implementation) overrides

    def validate(self, owner: str = "Profile") -> "Profile":
        if not _is_int(self.num_speculative_tokens) or not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            _fail(owner, "num_speculative_tokens", self.num_speculative_tokens,
                  f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] (0 = no speculation)")
        if self.verify_policy not in ("fixed", "threshold", "scheduler"):
            _fail(owner, "verify_policy", self.verify_policy, "must be 'fixed', 'threshold' or 'scheduler'")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            _fail(owner, "confidence_threshold", self.confidence_threshold, "must be in [0, 1]")
        return self


@dataclass(frozen=True)
class SpecConfig:
    """The speculative-decoding setup of an engine.

    num_speculative_tokens (k) = 0 is plain decoding through the same loop.
    """

    num_speculative_tokens: int = 7
    drafter: DrafterName = "ngram"
    drafter_path: str | None = None  # a DSpark drafter checkpoint directory
    prompt_lookup_min: int = 1  # n-gram drafter
    prompt_lookup_max: int = 4
    draft_sample_method: DraftSampleMethod = "greedy"
    rejection_sample_method: RejectionSampleMethod = "standard"
    # Synthetic acceptance (speed measurement only; lossy): exactly one of the two.
    synthetic_acceptance_length: float | None = None
    synthetic_acceptance_rates: tuple[float, ...] | None = None
    verify_policy: VerifyPolicyName = "fixed"
    confidence_threshold: float = 0.0
    sps_table_path: str | None = None  # steps/s vs verified tokens, for the confidence scheduler
    # vLLM's (batch_start, batch_end_inclusive, k) gates; k = 0 switches speculation off.
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    # Speculation off for requests whose sequence is longer than this.
    max_speculative_seq_len: int | None = None
    # A separate profile for batch size 1 (the latency path); None = use the fields above.
    batch1_profile: Profile | None = None
    seed: int = 0

    def validate(self) -> "SpecConfig":
        own = "SpecConfig"
        k = self.num_speculative_tokens
        if not _is_int(k) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            _fail(own, "num_speculative_tokens", k, f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}] (0 = plain decoding)")
        if self.drafter not in ("ngram", "dspark"):
            _fail(own, "drafter", self.drafter, "must be 'ngram' or 'dspark'")
        if not isinstance(self.prompt_lookup_min, int) or self.prompt_lookup_min < 1:
            _fail(own, "prompt_lookup_min", self.prompt_lookup_min, "must be an integer >= 1")
        if not isinstance(self.prompt_lookup_max, int) or self.prompt_lookup_max < self.prompt_lookup_min:
            _fail(own, "prompt_lookup_max", self.prompt_lookup_max, f"must be an integer >= prompt_lookup_min={self.prompt_lookup_min}")
        if self.draft_sample_method not in ("greedy", "probabilistic"):
            _fail(own, "draft_sample_method", self.draft_sample_method, "must be 'greedy' or 'probabilistic'")
        if self.rejection_sample_method not in ("standard", "synthetic"):
            _fail(own, "rejection_sample_method", self.rejection_sample_method, "must be 'standard' or 'synthetic'")
        self._validate_synthetic()
        if self.verify_policy not in ("fixed", "threshold", "scheduler"):
            _fail(own, "verify_policy", self.verify_policy, "must be 'fixed', 'threshold' or 'scheduler'")
        if not 0.0 <= self.confidence_threshold <= 1.0:
            _fail(own, "confidence_threshold", self.confidence_threshold, "must be in [0, 1]")
        self._validate_gates()
        if self.max_speculative_seq_len is not None and (
            not isinstance(self.max_speculative_seq_len, int) or self.max_speculative_seq_len < 1
        ):
            _fail(own, "max_speculative_seq_len", self.max_speculative_seq_len, "must be an integer >= 1 or None")
        if self.batch1_profile is not None:
            self.batch1_profile.validate("SpecConfig.batch1_profile")
        return self

    def _validate_synthetic(self) -> None:
        own = "SpecConfig"
        L, rates, k = self.synthetic_acceptance_length, self.synthetic_acceptance_rates, self.num_speculative_tokens
        if self.rejection_sample_method != "synthetic":
            if L is not None:
                _fail(own, "synthetic_acceptance_length", L, "needs rejection_sample_method='synthetic'")
            if rates is not None:
                _fail(own, "synthetic_acceptance_rates", rates, "needs rejection_sample_method='synthetic'")
            return
        if (L is None) == (rates is None):
            _fail(own, "rejection_sample_method", "synthetic",
                  "needs exactly one of synthetic_acceptance_length and synthetic_acceptance_rates")
        if L is not None:
            if not (isinstance(L, (int, float)) and 1.0 <= L <= k + 1):
                _fail(own, "synthetic_acceptance_length", L, f"must be in [1, k+1] = [1, {k + 1}]")
        else:
            if len(rates) != k:
                _fail(own, "synthetic_acceptance_rates", rates, f"must have k={k} entries, has {len(rates)}")
            if self.max_k > k:
                _fail(own, "batch1_profile.num_speculative_tokens", self.max_k,
                      f"synthetic_acceptance_rates has rates for {k} positions only; give synthetic_acceptance_length "
                      "or a batch-1 k <= num_speculative_tokens")
            for i, r in enumerate(rates):
                if not (isinstance(r, (int, float)) and 0.0 <= r <= 1.0):
                    _fail(own, "synthetic_acceptance_rates", rates, f"entry {i} = {r!r} outside [0, 1]")
            for i in range(1, len(rates)):
                if rates[i] > rates[i - 1]:
                    _fail(own, "synthetic_acceptance_rates", rates,
                          f"must be non-increasing (unconditional rates), but entry {i} = {rates[i]} > entry {i - 1} = {rates[i - 1]}")

    def _validate_gates(self) -> None:
        own = "SpecConfig"
        gates = self.num_speculative_tokens_per_batch_size
        if gates is None:
            return
        prev_end = 0
        for gate in gates:
            if len(gate) != 3 or not all(isinstance(x, int) for x in gate):
                _fail(own, "num_speculative_tokens_per_batch_size", gates, f"entry {gate!r} is not (batch_start, batch_end, k)")
            start, end, gk = gate
            if start < 1 or end < start:
                _fail(own, "num_speculative_tokens_per_batch_size", gates, f"entry {gate!r} needs 1 <= batch_start <= batch_end")
            if start <= prev_end:
                _fail(own, "num_speculative_tokens_per_batch_size", gates, f"entry {gate!r} overlaps or is out of order")
            if not 0 <= gk <= self.num_speculative_tokens:
                _fail(own, "num_speculative_tokens_per_batch_size", gates,
                      f"entry {gate!r} has k outside [0, num_speculative_tokens={self.num_speculative_tokens}]")
            prev_end = end

    def k_for_batch(self, batch_size: int) -> int:
        """k for a step of this many requests: the batch-1 profile's k at batch size 1 when one is
        set, else the gate covering the batch size (vLLM's (start, end, k) triples), else
        num_speculative_tokens. The one rule for k: the engine, the vLLM converter and the
        synthetic rates all ask here."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1")
        if batch_size == 1 and self.batch1_profile is not None:
            return self.batch1_profile.num_speculative_tokens
        for start, end, k in self.num_speculative_tokens_per_batch_size or ():
            if start <= batch_size <= end:
                return k
        return self.num_speculative_tokens

    def synthetic_rates(self, k: int) -> tuple[float, ...]:
        """Unconditional acceptance rates of the k draft positions of a step under synthetic
        acceptance: the first k entries of the schedule over the largest k (max_k), so every
        batch size sees the same per-position rates (a smaller k is capped, never rescaled)."""
        from .sampling import acceptance_length_to_rates  # sampling imports this module

        if self.rejection_sample_method != "synthetic":
            raise ValueError(f"SpecConfig.rejection_sample_method={self.rejection_sample_method!r}: no synthetic rates")
        if not 0 <= k <= self.max_k:
            raise ValueError(f"k={k!r}: must be in [0, max_k={self.max_k}]")
        if self.synthetic_acceptance_rates is not None:
            return tuple(self.synthetic_acceptance_rates[:k])
        return tuple(acceptance_length_to_rates(self.synthetic_acceptance_length, self.max_k)[:k])

    @property
    def max_k(self) -> int:
        """The largest number of drafts any step may verify (sizes the buffers)."""
        k = self.num_speculative_tokens
        if self.batch1_profile is not None:
            k = max(k, self.batch1_profile.num_speculative_tokens)
        return k
