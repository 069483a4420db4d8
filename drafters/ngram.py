"""N-gram prompt-lookup drafter (vLLM's `method="ngram"`): find the most recent earlier
occurrence of the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
and propose the tokens that followed it. Needs no training and no target hidden states; its
drafts are deterministic, so the sampler treats them as one-hot proposals."""
from __future__ import annotations

import numpy as np
import torch

from dspark.protocols import Drafter, Proposal


class NgramDrafter(Drafter):
    """Drafts from each request's own history on the host: it reads the anchors and keeps the
    committed tokens (dspark.protocols.Drafter's defaults: not stateless, commits on the host)."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not isinstance(min_n, int) or min_n < 1:
            raise ValueError(f"prompt_lookup_min={min_n!r}: must be an integer >= 1")
        if not isinstance(max_n, int) or max_n < min_n:
            raise ValueError(f"prompt_lookup_max={max_n!r}: must be an integer >= prompt_lookup_min={min_n}")
        self.min_n, self.max_n = min_n, max_n
        self._history: dict[int, list[int]] = {}

    def start(self, slot: int, prompt: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        self._history[slot] = prompt.tolist()

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix."""
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            suffix = seq[-n:]
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # starts 0..len-1-n
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = hits[-1] + n  # the token after the most recent earlier match
                return seq[start : start + k].tolist()
        return []

    def propose(self, slots, anchors, k, sampling, generators) -> Proposal:
        B = len(slots)
        # Columns past num_drafts (a miss, a short match) hold the anchor only because every
        # column must be a valid id for targets that embed the padded row; num_drafts keeps them
        # out of verification, so no padding is ever proposed as a draft.
        tokens = anchors[:, None].expand(B, k).clone()
        num = torch.zeros(B, dtype=torch.long)
        for i, (slot, anchor) in enumerate(zip(slots, anchors.tolist())):
            drafts = self.lookup(self._history[slot] + [anchor], k)
            if drafts:
                tokens[i, : len(drafts)] = torch.tensor(drafts)
                num[i] = len(drafts)
        return Proposal(tokens, num.to(anchors.device))

    def commit(self, slots, tokens, num_tokens, taps) -> None:
        for slot, row, n in zip(slots, tokens.tolist(), num_tokens.tolist()):
            self._history[slot].extend(row[:n])

    def release(self, slots) -> None:
        for slot in slots:
            self._history.pop(slot, None)
