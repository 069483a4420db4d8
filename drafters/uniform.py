"""A drafter that costs nothing: k tokens drawn uniformly from the vocabulary with the request's
generator. With synthetic acceptance it makes every step verify the full k + 1 tokens, so a sweep
measures the target's verify path at a forced acceptance length without any drafter cost in it."""
from __future__ import annotations

import torch

from dspark.protocols import Drafter, Proposal
from dspark.sampling import DrawPool


class UniformDrafter(Drafter):
    """confidence: optional per-position conditional acceptance to report (a sweep passes the
    synthetic mode's conditional rates, which are then exactly calibrated confidences, so the
    threshold and scheduler policies can be swept too)."""

    # What it keeps depends on the request's generator alone, and it drafts from nothing the step
    # before produced: the engine skips its commit and may launch a step before the previous one is
    # read back (dspark.protocols.Drafter).
    stateless = True
    # It never reads the anchors: the engine need not gather them for it (an index_select, and
    # host time, per step).
    reads_anchors = False

    def __init__(self, vocab_size: int, confidence: list[float] | None = None):
        self.vocab_size = vocab_size
        self.confidence = None if confidence is None else torch.tensor(confidence, dtype=torch.float32)
        # Each slot's draws, 64 steps per launch (dspark.sampling.DrawPool), for the request whose
        # generator made them: a new request in the slot brings a new generator.
        self._pools: dict[int, DrawPool] = {}

    def start(self, slot, prompt, taps) -> None:
        pass

    def _pool(self, slot: int, generator: torch.Generator, k: int) -> DrawPool:
        pool = self._pools.get(slot)
        if pool is None or pool.generator is not generator or pool.width < k:
            pool = self._pools[slot] = DrawPool.tokens(generator, k, self.vocab_size)
        return pool

    def draft_pool_shape(self, k: int) -> tuple[int, int]:
        """(steps, width) of the pools a slot first drafting k tokens draws from: what an engine
        captures its graphs for (dspark.graph_step, GraphKey.draft_pools)."""
        return DrawPool.STEPS, k

    def draft_pools(self, slots: list[int]) -> tuple[DrawPool, ...]:
        """Each slot's pool: the last proposal's row for the slot is its latest draw."""
        return tuple(self._pools[s] for s in slots)

    def propose(self, slots, anchors, k, sampling, generators) -> Proposal:
        pools = tuple(self._pool(s, g, k) for s, g in zip(slots, generators))
        draws = [pool.next() for pool in pools]
        # At batch 1 the pool's row itself (a cat is a launch and host time of its own).
        tokens = draws[0] if len(draws) == 1 else torch.cat(draws)
        if tokens.shape[1] != k:
            tokens = tokens[:, :k]
        if self.confidence is None:
            return Proposal(tokens, None)  # every request drafts k
        conf = self.confidence[:k].to(tokens.device).expand(len(slots), -1).clone()
        return Proposal(tokens, None, confidence=conf)

    def commit(self, slots, tokens, num_tokens, taps) -> None:
        pass

    def release(self, slots) -> None:
        for slot in slots:
            self._pools.pop(slot, None)
