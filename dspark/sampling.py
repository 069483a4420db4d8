"""Request-level sampling helpers: the samplers' parameter tensors built from requests'
SamplingParams, a request's random draws made many steps at a time, and the synthetic acceptance
rates of the speed-measurement mode.

The acceptance math itself (processed_probs, rejection_sample, synthetic_sample) is the
reference of the acceptance ops, kernels/acceptance/reference.py; it is re-exported here.
"""
from __future__ import annotations

import math

import torch

from .config import SamplingParams
from .kernels.acceptance import reference
from .kernels.acceptance.reference import processed_probs, rejection_sample, synthetic_sample

__all__ = [
    "SamplingTensors", "DrawPool", "processed_probs", "rejection_sample", "synthetic_sample",
    "acceptance_length_to_rates", "conditional_rates",
]


class SamplingTensors(reference.SamplingTensors):
    """The samplers' per-request parameter tensors, built from requests' SamplingParams."""

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str) -> SamplingTensors:
        values = torch.tensor([[p.temperature, p.top_k, p.top_p] for p in params], dtype=torch.float64)
        return cls(
            temperature=values[:, 0].to(device=device, dtype=torch.float32),
            top_k=values[:, 1].to(device=device, dtype=torch.long),
            top_p=values[:, 2].to(device=device, dtype=torch.float32),
            all_greedy=all(p.greedy for p in params),
            filters=any(p.top_k > 0 or p.top_p < 1.0 for p in params),
        )


class DrawPool:
    """One generator's per-step draws of `width` values, made `steps` steps at a time: one launch
    per `steps` steps instead of one per step (a torch.rand or torch.randint call is a large part
    of a step's host time, experiments/engine_host_profile.py). `next()` hands out the next step's
    row, a [1, width] view made with the pool (no torch call per step). The draws are the
    generator's alone, so a seeded request reproduces whatever else is in its batch; they differ
    from drawing each step separately. A graphed step reads a pool's rows on the device
    (dspark.graph_step.DrawMirror), the same values an eager step reads."""

    STEPS = 64

    def __init__(self, generator: torch.Generator, width: int, draw, steps: int = STEPS):
        if width < 1 or steps < 1:
            raise ValueError(f"DrawPool: width={width} and steps={steps} must be >= 1")
        self.generator, self.width, self.steps = generator, width, steps
        self._draw = draw  # (generator, count) -> a 1-D tensor of `count` draws
        self.block: torch.Tensor | None = None  # [steps, width]: the current draw, cut into rows
        self._rows: tuple[torch.Tensor, ...] = ()
        self._next = 0

    @classmethod
    def uniform(cls, generator: torch.Generator, width: int, steps: int = STEPS) -> "DrawPool":
        """Uniforms in [0, 1) on the generator's device."""
        return cls(generator, width, lambda g, n: torch.rand(n, generator=g, device=g.device), steps)

    @classmethod
    def tokens(cls, generator: torch.Generator, width: int, vocab_size: int, steps: int = STEPS) -> "DrawPool":
        """Token ids uniform over [0, vocab_size) on the generator's device."""
        return cls(generator, width,
                   lambda g, n: torch.randint(0, vocab_size, (n,), generator=g, device=g.device), steps)

    def next(self) -> torch.Tensor:
        if self._next == len(self._rows):
            self.block = self._draw(self.generator, self.steps * self.width).view(self.steps, self.width)
            self._rows = self.block.view(self.steps, 1, self.width).unbind(0)
            self._next = 0
        row = self._rows[self._next]
        self._next += 1
        return row

    @property
    def latest_row(self) -> int:
        """The index in `block` of the row the last next() handed out."""
        if self.block is None:
            raise RuntimeError("DrawPool.latest_row: nothing drawn yet")
        return self._next - 1


# ---- synthetic acceptance (speed measurement only) ------------------------------------------


def acceptance_length_to_rates(length: float, k: int) -> list[float]:
    """vLLM's minimum-variance schedule: [1]*floor(L-1) + [frac] + [0]*rest, length k
    (docs/vllm-integration.md §1.3; L=2.5, k=4 -> [1, 0.5, 0, 0])."""
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"synthetic_acceptance_length={length!r}: must be in [1, k+1] = [1, {k + 1}]")
    whole = int(math.floor(length - 1.0))
    rates = [1.0] * min(whole, k)
    if len(rates) < k:
        rates.append(length - 1.0 - whole)
    rates += [0.0] * (k - len(rates))
    return rates


def conditional_rates(unconditional: list[float]) -> list[float]:
    """c_i = p_i / p_{i-1} (p_{-1} = 1; 0 once a rate reaches 0), as vLLM's
    unconditional_to_conditional_rates."""
    out, prev = [], 1.0
    for p in unconditional:
        out.append(p / prev if prev > 0 else 0.0)
        prev = p
    return out


def nonfinite_rows(logits: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[B] bool on the logits' device, no host read: whether row b has a NaN or infinite logit
    among its verified positions (the first lengths[b] of logits [B, T, V]; all when None).
    The engine reads it with the step's other results and refuses to sample from such rows."""
    finite = torch.isfinite(logits).all(dim=-1)  # [B, T]
    if lengths is not None:
        finite = finite | (torch.arange(logits.shape[1], device=logits.device)[None, :] >= lengths[:, None])
    return ~finite.all(dim=1)
