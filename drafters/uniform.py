"""A drafter that costs nothing: k tokens drawn uniformly from the vocabulary with the request's
generator. With synthetic acceptance it makes every step verify the full k + 1 tokens, so a sweep
measures the target's verify path at a forced acceptance length without any drafter cost in it."""
from __future__ import annotations

import torch

from dspark.protocols import Proposal


class UniformDrafter:
    tap_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def start(self, slot, prompt, taps) -> None:
        pass

    def propose(self, slots, anchors, k, sampling, generators) -> Proposal:
        tokens = torch.stack(
            [torch.randint(0, self.vocab_size, (k,), generator=g, device=g.device) for g in generators]
        ).to(anchors.device)
        return Proposal(tokens, torch.full((len(slots),), k, dtype=torch.long, device=anchors.device))

    def commit(self, slots, tokens, num_tokens, taps) -> None:
        pass

    def release(self, slots) -> None:
        pass
