"""Test helpers for the DSpark drafter: a small synthetic Target and matching drafter configs.

SyntheticTarget is a fixed random tiny causal model implementing dspark.protocols.Target. Its
residual stream is a real causal computation (each layer mixes a token's row with the previous
token's row), so the taps carry the current and earlier tokens; its next-token logits are
    logits[t] = table[tok[t]] + 0.3 * lm_head @ rmsnorm(h_last[t]),
with table = 5 * onehot(perm) + 0.5 * noise. The greedy next token is (almost always)
perm[tok[t]], a deterministic function a drafter can learn; sampled at temperature 1 about a
third of the positions are noise. Verify recomputes from the committed prefix and never
changes state, so rollback is exact by construction.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.protocols import TargetOutput
from dspark.threads import one_cpu_thread
from dspark.drafters.dspark.config import DSparkConfig


class SyntheticTarget:
    def __init__(self, vocab_size=64, hidden_size=48, num_layers=4, max_seq_len=512, max_slots=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.hidden_size, self.num_layers = vocab_size, hidden_size, num_layers
        self.max_seq_len, self.max_slots, self.device = max_seq_len, max_slots, torch.device("cpu")
        self.embedding = torch.randn(vocab_size, hidden_size, generator=g)
        self.lm_head = torch.randn(vocab_size, hidden_size, generator=g) / hidden_size**0.5
        scale = 1.0 / hidden_size**0.5
        self.mix_self = [torch.randn(hidden_size, hidden_size, generator=g) * scale for _ in range(num_layers)]
        self.mix_prev = [torch.randn(hidden_size, hidden_size, generator=g) * scale for _ in range(num_layers)]
        self.perm = torch.randperm(vocab_size, generator=g)
        self.table = 5.0 * torch.nn.functional.one_hot(self.perm, vocab_size).float()
        self.table += 0.5 * torch.randn(vocab_size, vocab_size, generator=g)
        self._committed: dict[int, torch.Tensor] = {}
        self._pending: dict[int, torch.Tensor] = {}

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed_tokens [V, d], lm_head [V, d]): what the drafter shares with the target."""
        return self.embedding, self.lm_head

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """tokens [S] -> logits [S, V], taps {-1..num_layers-1: [S, d]}."""
        h = self.embedding[tokens]
        taps = {-1: h}
        for layer in range(self.num_layers):
            prev = torch.cat([torch.zeros_like(h[:1]), h[:-1]])
            h = h + torch.tanh(h @ self.mix_self[layer] + prev @ self.mix_prev[layer])
            taps[layer] = h
        normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.table[tokens] + 0.3 * normed @ self.lm_head.t(), taps

    def _batch(self, rows: list[tuple[torch.Tensor, dict]], tap_layers, width: int | None = None) -> TargetOutput:
        width = width or max(r[0].shape[0] for r in rows)
        logits = torch.zeros(len(rows), width, self.vocab_size)
        taps = {layer: torch.zeros(len(rows), width, self.hidden_size) for layer in tap_layers}
        for i, (lg, tp) in enumerate(rows):
            logits[i, : lg.shape[0]] = lg
            for layer in tap_layers:
                taps[layer][i, : lg.shape[0]] = tp[layer]
        return TargetOutput(logits, taps)

    def prefill(self, slots, prompts, tap_layers=()):
        rows = []
        for slot, prompt in zip(slots, prompts):
            if slot in self._committed:
                raise ValueError(f"slot={slot}: in use")
            self._committed[slot] = prompt.clone()
            rows.append(self.forward(prompt))
        out = self._batch(rows, tap_layers)
        last = torch.tensor([len(p) - 1 for p in prompts])
        return TargetOutput(out.logits[torch.arange(len(prompts)), last][:, None], out.taps)  # [B, 1, V]

    def verify(self, slots, tokens, lengths, tap_layers=()):
        rows = []
        for i, slot in enumerate(slots):
            new = tokens[i, : int(lengths[i])]
            self._pending[slot] = new.clone()
            logits, taps = self.forward(torch.cat([self._committed.get(slot, new[:0]), new]))  # free: empty prefix
            n = new.shape[0]
            rows.append((logits[-n:], {layer: t[-n:] for layer, t in taps.items()}))
        return self._batch(rows, tap_layers, tokens.shape[1])  # [B, T, ...] as Target.verify promises

    def commit(self, slots, num_tokens):
        for i, slot in enumerate(slots):
            self._committed[slot] = torch.cat([self._committed[slot], self._pending.pop(slot)[: int(num_tokens[i])]])

    def release(self, slots):
        for slot in slots:
            self._committed.pop(slot, None)
            self._pending.pop(slot, None)


def small_config(target: SyntheticTarget, attention_type: str = "gqa", **overrides) -> DSparkConfig:
    """A drafter config for SyntheticTarget, small enough to train in seconds on a CPU."""
    base = DSparkConfig(
        name=f"synthetic-{attention_type}",
        vocab_size=target.vocab_size,
        hidden_size=target.hidden_size,
        num_layers=2,
        num_heads=4,
        intermediate_size=96,
        attention_type=attention_type,
        num_kv_heads=2,
        head_dim=16,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        rope_theta=10000.0,
        rope_interleaved=attention_type == "mla",
        max_position_embeddings=target.max_seq_len,
        target_hidden_size=target.hidden_size,
        target_num_layers=target.num_layers,
        target_layer_ids=(0, 2),
        block_size=7,
        mask_token_id=target.vocab_size - 1,
        markov_rank=32,
    )
    return dataclasses.replace(base, **overrides).validate()


single_thread = one_cpu_thread  # these tiny ops are launch-bound: dspark.threads


@pytest.fixture(autouse=True)
def one_thread():
    """Import into a test module to run each of its tests under `single_thread`."""
    with single_thread():
        yield
