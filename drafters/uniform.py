"""A drafter that costs nothing: k tokens drawn uniformly from the vocabulary with the request's
generator. With synthetic acceptance it makes every step verify the full k + 1 tokens, so a sweep
measures the target's verify path at a forced acceptance length without any drafter cost in it."""
from __future__ import annotations

import torch

from dspark.protocols import Proposal


class UniformDrafter:
    """confidence: optional per-position conditional acceptance to report (a sweep passes the
    synthetic mode's conditional rates, which are then exactly calibrated confidences, so the
    threshold and scheduler policies can be swept too)."""

    tap_layers: tuple[int, ...] = ()
    # It keeps nothing and draws from the request's generator alone: the engine skips its commit and
    # may launch a step before the previous one is read back (dspark/protocols.py, Drafter).
    stateless = True

    def __init__(self, vocab_size: int, confidence: list[float] | None = None):
        self.vocab_size = vocab_size
        self.confidence = None if confidence is None else torch.tensor(confidence, dtype=torch.float32)
        # Draft counts by (batch, k, device), made once: read-only downstream, and a sweep should
        # not pay a fill launch per step for a drafter that is meant to cost nothing.
        self._counts: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def start(self, slot, prompt, taps) -> None:
        pass

    def propose(self, slots, anchors, k, sampling, generators) -> Proposal:
        draws = [torch.randint(0, self.vocab_size, (k,), generator=g, device=g.device) for g in generators]
        # At batch 1 a view, not a stack (a launch and ~30 us of host time on the H200).
        tokens = (draws[0][None] if len(draws) == 1 else torch.stack(draws)).to(anchors.device)
        key = (len(slots), k, anchors.device)
        if key not in self._counts:
            self._counts[key] = torch.full((len(slots),), k, dtype=torch.long, device=anchors.device)
        num = self._counts[key]
        if self.confidence is None:
            return Proposal(tokens, num)
        conf = self.confidence[:k].to(anchors.device).expand(len(slots), -1).clone()
        return Proposal(tokens, num, confidence=conf)

    def commit(self, slots, tokens, num_tokens, taps) -> None:
        pass

    def release(self, slots) -> None:
        pass
