"""Named synthetic-acceptance presets from published curves, with their sources.

A preset turns into a SpecConfig with rejection_sample_method="synthetic" for a given k, so a
sweep can say "the Kimi K3 DSpark golden curve at k = 5" instead of a bare number."""
from __future__ import annotations

from dataclasses import dataclass

from .config import SpecConfig


@dataclass(frozen=True)
class SyntheticPreset:
    name: str
    source: str
    lengths: dict[int, float] | None = None  # k -> acceptance length
    rates: dict[int, tuple[float, ...]] | None = None  # k -> unconditional per-position rates

    def acceptance_length(self, k: int) -> float:
        if self.lengths and k in self.lengths:
            return self.lengths[k]
        if self.rates and k in self.rates:
            return 1.0 + sum(self.rates[k])
        raise ValueError(f"synthetic preset {self.name!r} has no value for k={k}; it covers k in {sorted((self.lengths or self.rates))}")

    def spec(self, k: int, **fields) -> SpecConfig:
        if self.rates and k in self.rates:
            return SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                              synthetic_acceptance_rates=self.rates[k], **fields).validate()
        return SpecConfig(num_speculative_tokens=k, rejection_sample_method="synthetic",
                          synthetic_acceptance_length=self.acceptance_length(k), **fields).validate()


SYNTHETIC_PRESETS: dict[str, SyntheticPreset] = {
    p.name: p
    for p in (
        SyntheticPreset(
            "kimi-k3-dspark-golden",
            "SemiAnalysis InferenceX golden AL for Kimi K3 + Inferact/Kimi-K3-DSpark, SPEED-Bench coding, "
            "thinking on, B300, probabilistic draft + block verify (docs/kimi-k3.md §4)",
            lengths={1: 1.85, 2: 2.51, 3: 3.00, 4: 3.36, 5: 3.62, 6: 3.75, 7: 3.84, 8: 4.00},
        ),
        SyntheticPreset(
            "kimi-k3-dspark-greedy",
            "the plain/greedy golden curve at k = 7 (InferenceX#2361/#2368; docs/kimi-k3.md §4)",
            lengths={7: 3.78},
        ),
        SyntheticPreset(
            "seed-al6-k7",
            "AL = 6 at k = 7, the optimistic operating point of the seed's GB300 target "
            "(vLLM's minimum-variance schedule gives rates [1,1,1,1,1,0,0]; docs/kimi-k3.md §5.3)",
            rates={7: (1, 1, 1, 1, 1, 0, 0)},
        ),
    )
}
