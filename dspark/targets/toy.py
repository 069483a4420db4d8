"""A toy target: an order-2 Markov language model with a random logit table.

It implements the Target protocol with almost no arithmetic, which makes it the right target
for (a) statistical tests of the sampling pipeline, where 20,000 sequences must be generated
quickly and the exact sequence distribution is known in closed form, and (b) measuring the
engine's own host overhead per step. Its only "hidden state" is the token embedding (every tap).
"""
from __future__ import annotations

import torch

from dspark.protocols import TargetOutput


class MarkovTarget:
    num_layers = 1

    def __init__(self, vocab_size: int = 8, *, seed: int = 0, scale: float = 1.5, max_slots: int = 64,
                 max_seq_len: int = 256, hidden_size: int = 8, device: str | torch.device = "cpu"):
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size!r}: must be >= 2")
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.max_slots, self.max_seq_len = max_slots, max_seq_len
        self.device = torch.device(device)
        # Row index vocab_size stands for "no token yet" at the start of a sequence.
        self.table = (torch.randn(vocab_size + 1, vocab_size + 1, vocab_size, generator=g) * scale).to(self.device)
        self.embedding = torch.randn(vocab_size, hidden_size, generator=g).to(self.device)
        # A vocabulary head for drafters that share one with their target (DSpark); the toy's own
        # logits come from its table, not from this head.
        self.head = (torch.randn(vocab_size, hidden_size, generator=g) * hidden_size**-0.5).to(self.device)
        self.prev = torch.full((max_slots, 2), vocab_size, dtype=torch.long, device=self.device)
        self.length = torch.zeros(max_slots, dtype=torch.long, device=self.device)
        self._last: tuple[dict[int, int], torch.Tensor] | None = None  # (slot -> its row, the rows' context)

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embedding, self.head

    def next_logits(self, prev2: torch.Tensor, prev1: torch.Tensor) -> torch.Tensor:
        return self.table[prev2, prev1]

    def _run(self, slots, tokens, lengths, tap_layers):
        B, T = tokens.shape
        if (tokens < 0).any() or (tokens >= self.vocab_size).any():
            raise ValueError(f"tokens: ids outside the vocabulary [0, {self.vocab_size})")
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        if (self.length[idx] + lengths > self.max_seq_len).any():
            raise ValueError(f"verify past max_seq_len={self.max_seq_len}")
        ctx = torch.cat([self.prev[idx], tokens], dim=1)  # [B, 2 + T]
        logits = self.next_logits(ctx[:, 1:-1], ctx[:, 2:])
        taps = {layer: self.embedding[tokens] for layer in tap_layers}
        self._last = ({s: row for row, s in enumerate(slots)}, ctx)
        return TargetOutput(logits, taps)

    def prefill(self, slots, prompts, tap_layers=()):
        T = max(len(p) for p in prompts)
        tokens = torch.zeros(len(prompts), T, dtype=torch.long, device=self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        self.release(slots)
        out = self._run(slots, tokens, lengths, tap_layers)
        self.commit(slots, lengths)
        last = (lengths - 1)[:, None, None].expand(-1, 1, out.logits.shape[-1])
        return TargetOutput(out.logits.gather(1, last), out.taps)  # the protocol's [B, 1, V]

    def verify(self, slots, tokens, lengths, tap_layers=()):
        return self._run(slots, tokens, lengths, tap_layers)

    def commit(self, slots, num_tokens):
        row_of, ctx = self._last
        rows = torch.tensor([row_of[s] for s in slots], device=self.device)
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        n = num_tokens.to(self.device)
        # After keeping n tokens the context's last two are ctx[n], ctx[n + 1] (ctx starts with
        # the two previous tokens).
        self.prev[idx, 0] = ctx[rows, n]
        self.prev[idx, 1] = ctx[rows, n + 1]
        self.length[idx] += n

    def release(self, slots):
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.prev[idx] = self.vocab_size
        self.length[idx] = 0
