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

    def __init__(self, vocab_size: int, confidence: list[float] | None = None):
        self.vocab_size = vocab_size
        self.confidence = None if confidence is None else torch.tensor(confidence, dtype=torch.float32)

    def start(self, slot, prompt, taps) -> None:
        pass

    def propose(self, slots, anchors, k, sampling, generators) -> Proposal:
        tokens = torch.stack(
            [torch.randint(0, self.vocab_size, (k,), generator=g, device=g.device) for g in generators]
        ).to(anchors.device)
        num = torch.full((len(slots),), k, dtype=torch.long, device=anchors.device)
        if self.confidence is None:
            return Proposal(tokens, num)
        conf = self.confidence[:k].to(anchors.device).expand(len(slots), -1).clone()
        return Proposal(tokens, num, confidence=conf)

    def commit(self, slots, tokens, num_tokens, taps) -> None:
        pass

    def release(self, slots) -> None:
        pass
