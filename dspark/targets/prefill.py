"""Prefill as chunks of verify + commit, shared by the targets (dspark.protocols.Target.prefill).

Why chunks: a forward over a whole prompt holds activations (and, for the vocabulary head,
[tokens, V] float32 logits: 5.4 GB for an 8k prompt at K3's vocabulary) in proportion to the
prompt. Fed as consecutive verify + commit calls of at most `chunk_tokens` tokens across the
batch, prefill's peak activation memory follows the chunk, not the prompt. A target's verify +
commit of n tokens leaves exactly the state that feeding them one by one would, so the chunks
compute what one pass computes (on the CPU, where the reference ops are token-invariant, bit for
bit: tests/test_prefill_chunks.py).
"""
from __future__ import annotations

import torch

from dspark.protocols import TargetOutput


def checked_chunk_tokens(chunk_tokens) -> int:
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise ValueError(f"prefill_chunk_tokens={chunk_tokens!r}: must be an integer >= 1")
    return chunk_tokens


def prefill_in_chunks(target, slots: list[int], prompts: list[torch.Tensor], tap_layers: tuple[int, ...],
                      chunk_tokens: int) -> TargetOutput:
    """Feed each prompt into its (fresh, already checked) slot by verify + commit, at most
    max(1, chunk_tokens // len(slots)) columns of the batch at a time, and return the logits
    after each prompt's last token [B, 1, V] and the taps over every prompt position
    [B, longest prompt, d] (zero past a prompt's end)."""
    lengths = [len(p) for p in prompts]
    longest = max(lengths)
    width = max(1, chunk_tokens // len(prompts))
    last_logits: list[torch.Tensor | None] = [None] * len(prompts)
    taps: dict[int, torch.Tensor] = {}
    for start in range(0, longest, width):
        rows = [r for r, n in enumerate(lengths) if n > start]
        counts = [min(width, lengths[r] - start) for r in rows]
        tokens = torch.zeros(len(rows), max(counts), dtype=torch.long)
        for i, (r, n) in enumerate(zip(rows, counts)):
            tokens[i, :n] = prompts[r][start : start + n].cpu()
        chunk_slots = [slots[r] for r in rows]
        out = target.verify(chunk_slots, tokens, counts, tap_layers)
        target.commit(chunk_slots, counts)
        for i, (r, n) in enumerate(zip(rows, counts)):
            if start + n == lengths[r]:
                last_logits[r] = out.logits[i, n - 1]
            for layer, t in out.taps.items():
                if layer not in taps:
                    taps[layer] = t.new_zeros(len(prompts), longest, t.shape[-1])
                taps[layer][r, start : start + n] = t[i, :n]
    return TargetOutput(logits=torch.stack(last_logits)[:, None], taps=taps)
