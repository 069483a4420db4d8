"""Drafters for tests: a probabilistic one with its own Markov table, and one that replays a
known continuation with chosen corruptions (to force ragged acceptance where we want it)."""
from __future__ import annotations

import torch

from dspark.protocols import Drafter, Proposal
from dspark.sampling import SamplingTensors, processed_probs


class TableDrafter(Drafter):
    """Samples drafts from its own order-1 Markov table q (not the target's), after the request's
    temperature/top-k/top-p, and returns q: the proposal a probabilistic drafter hands the
    rejection sampler."""

    tap_layers: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, seed: int = 1, scale: float = 1.0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab_size, vocab_size, generator=g) * scale

    def start(self, slot, prompt, taps):
        pass

    def propose(self, slots, anchors, k, sampling, generators):
        B = len(slots)
        st = SamplingTensors.from_params(sampling, "cpu")
        tokens = torch.zeros(B, k, dtype=torch.long)
        probs = torch.zeros(B, k, self.table.shape[1])
        prev = anchors.clone()
        for i in range(k):
            q = processed_probs(self.table[prev], st)
            for b in range(B):
                tokens[b, i] = torch.multinomial(q[b], 1, generator=generators[b])
            probs[:, i] = q
            prev = tokens[:, i]
        return Proposal(tokens, torch.full((B,), k), probs)

    def commit(self, slots, tokens, num_tokens, taps):
        pass

    def release(self, slots):
        pass


class ScriptedDrafter(Drafter):
    """Proposes the continuation a previous greedy run produced, with every `corrupt_every`-th
    proposed token replaced by a wrong one, so acceptance is long but ragged."""

    tap_layers: tuple[int, ...] = ()

    def __init__(self, continuations: dict[int, list[int]], vocab_size: int, corrupt_every: int = 5):
        self.continuations = continuations  # prompt key -> expected output tokens
        self.vocab_size = vocab_size
        self.corrupt_every = corrupt_every
        self._pos: dict[int, tuple[list[int], int]] = {}
        self._calls = 0

    def start(self, slot, prompt, taps):
        self._pos[slot] = (self.continuations[tuple(prompt.tolist())], 1)  # token 0 came from prefill

    def propose(self, slots, anchors, k, sampling, generators):
        B = len(slots)
        tokens = anchors[:, None].expand(B, k).clone()
        num = torch.zeros(B, dtype=torch.long)
        for b, slot in enumerate(slots):
            cont, pos = self._pos[slot]
            drafts = cont[pos : pos + k]
            for i, t in enumerate(drafts):
                self._calls += 1
                if self._calls % self.corrupt_every == 0:
                    t = (t + 1) % self.vocab_size
                tokens[b, i] = t
            num[b] = len(drafts)
        return Proposal(tokens, num)

    def commit(self, slots, tokens, num_tokens, taps):
        for slot, n in zip(slots, num_tokens.tolist()):
            cont, pos = self._pos[slot]
            self._pos[slot] = (cont, pos + n)

    def release(self, slots):
        for s in slots:
            self._pos.pop(s, None)


class ConfidenceDrafter(ScriptedDrafter):
    """A ScriptedDrafter that also reports given per-position confidences (the shape a DSpark
    drafter's confidence head produces), for testing verification policies through the engine."""

    def __init__(self, continuations, vocab_size, confidences: list[float], corrupt_every: int = 5):
        super().__init__(continuations, vocab_size, corrupt_every)
        self.confidences = confidences
        self.seen_lengths: list[int] = []

    def propose(self, slots, anchors, k, sampling, generators):
        prop = super().propose(slots, anchors, k, sampling, generators)
        prop.confidence = torch.tensor(self.confidences[:k]).expand(len(slots), k).clone()
        return prop
