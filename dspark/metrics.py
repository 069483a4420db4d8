"""Speculative-decoding metrics, counted the way vLLM counts them (docs/vllm-integration.md §4.1).

A "draft" is one verify step of one request that verified at least one draft token. Acceptance
length (AL) = 1 + accepted draft tokens / drafts: tokens emitted per verify step, bonus included.
Per-position acceptance is unconditional: accepted at position i / drafts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("draft", "verify", "accept", "commit")


@dataclass
class SpecMetrics:
    num_steps: int = 0  # engine steps (one verify of the whole batch each)
    num_verifies: int = 0  # request-steps, speculative or not
    num_drafts: int = 0  # request-steps that verified >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafts_per_position: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    num_launched_ahead: int = 0  # steps launched before the step before them was read back
    phase_seconds: dict[str, float] = field(default_factory=lambda: {p: 0.0 for p in PHASES})
    step_seconds: list[float] = field(default_factory=list)  # wall time of each engine step
    step_tokens: list[int] = field(default_factory=list)  # tokens emitted by each engine step
    start_time: float = field(default_factory=time.perf_counter)

    def observe(self, num_verified_drafts: list[int], num_accepted: list[int]) -> None:
        """One request-step per entry: drafts it verified and how many of them were accepted."""
        for drafted, accepted in zip(num_verified_drafts, num_accepted):
            self.num_verifies += 1
            if drafted == 0:
                continue
            self.num_drafts += 1
            self.num_draft_tokens += drafted
            self.num_accepted_tokens += accepted
            self._grow(drafted)
            for i in range(drafted):
                self.drafts_per_position[i] += 1
            for i in range(accepted):
                self.accepted_per_position[i] += 1

    def _grow(self, n: int) -> None:
        while len(self.accepted_per_position) < n:
            self.accepted_per_position.append(0)
            self.drafts_per_position.append(0)

    @property
    def acceptance_length(self) -> float:
        """vLLM's mean acceptance length: 1 + accepted / drafts (1.0 when nothing was drafted)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def per_position_acceptance(self) -> list[float]:
        """Unconditional acceptance at each draft position: accepted there / drafts."""
        return [a / self.num_drafts for a in self.accepted_per_position] if self.num_drafts else []

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start_time

    def summary(self) -> dict:
        elapsed = self.elapsed
        return {
            "steps": self.num_steps,
            "output_tokens": self.num_output_tokens,
            "acceptance_length": self.acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_launched_ahead": self.num_launched_ahead,
            "elapsed_s": elapsed,
            "tokens_per_s": self.num_output_tokens / elapsed if elapsed > 0 else 0.0,
            "phase_seconds": dict(self.phase_seconds),
        }
