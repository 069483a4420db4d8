"""The reference acceptance, the contract of the `rejection_sample` and `synthetic_sample` ops:
lossless rejection sampling (greedy and standard) and the lossy synthetic mode.

Semantics follow vLLM's `rejection_sample_method="standard"` (docs/vllm-integration.md §6):
greedy requests accept a draft while it equals the target argmax and emit the target argmax at
the first mismatch; sampled requests accept draft x with probability min(1, p(x)/q(x)), draw the
replacement at the first rejection from normalise(max(p - q, 0)), and draw a bonus token from p
after the last position when every draft was accepted. Drafts without probabilities (n-gram) are
one-hot proposals, q(x) = 1. p and q are the temperature/top-k/top-p processed distributions.

Samplers are pure functions of tensors plus explicit noise, so a GPU implementation can be checked
decision for decision against these: `uniforms[b, i]` decides position i, and `race_noise[b]`
(Exp(1) variates over the vocabulary) draws the one token each request samples per step, by the
exponential race argmax_v p(v) / E_v, which picks v with probability p(v) / sum(p).

The synthetic sampler (`synthetic_sample`) is a separate function, never a flag of the lossless
one: it accepts position i with a configured probability whatever the tokens, so its output is
NOT the target's distribution. It exists to measure speed at a forced acceptance length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..registry import register


@dataclass
class SamplingTensors:
    """Per-request sampling parameters as tensors [B] on the logits' device (what the samplers
    take; dspark.sampling.SamplingTensors builds them from requests' SamplingParams)."""

    temperature: torch.Tensor  # float32, 0 = greedy
    top_k: torch.Tensor  # long, 0 = off
    top_p: torch.Tensor  # float32, 1 = off
    all_greedy: bool = False  # every row greedy: samplers take the argmax-only path
    filters: bool = True  # some row uses top-k or top-p (False skips the sort)

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    def expand(self, n: int) -> "SamplingTensors":
        """Repeat each request's parameters n times (one row per position)."""
        rows = (t.repeat_interleave(n) for t in (self.temperature, self.top_k, self.top_p))
        return type(self)(*rows, self.all_greedy, self.filters)


def processed_probs(logits: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """softmax(logits / temperature) restricted to the top-k and then the top-p nucleus.

    logits [N, V]; sampling holds one row per logits row. Greedy rows (temperature 0) come back
    as the one-hot of their argmax, so callers can treat every row alike.
    """
    logits = logits.float()
    greedy = sampling.greedy
    temperature = torch.where(greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    scaled = logits / temperature[:, None]
    if not sampling.filters:
        probs = scaled.softmax(dim=-1)
    else:
        probs = top_k_top_p(scaled, sampling)
    if greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def top_k_top_p(scaled: torch.Tensor, sampling: SamplingTensors) -> torch.Tensor:
    """softmax of temperature-scaled logits [N, V] restricted to each row's top-k, then to its
    top-p nucleus, renormalised (top_k 0 and top_p 1 switch a row's filters off)."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    drop = (sampling.top_k[:, None] > 0) & (rank >= sampling.top_k[:, None])
    sorted_logits = sorted_logits.masked_fill(drop, -math.inf)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
    # already reaches top_p (the most likely token is always kept).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_p = mass_before >= sampling.top_p[:, None]
    sorted_probs = sorted_probs.masked_fill(drop_p, 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.empty_like(sorted_probs).scatter_(-1, order, sorted_probs)


def race(probs: torch.Tensor, race_noise: torch.Tensor) -> torch.Tensor:
    """Sample one token per row of probs [N, V] with Exp(1) noise [N, V] (exponential race)."""
    return (probs / race_noise).argmax(dim=-1)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: SamplingTensors,
    uniforms: torch.Tensor,
    race_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless acceptance of one verified block per request.

    target_logits [B, T, V] for positions 0..T-1 (position i scores draft i; position num_drafts
    gives the bonus); draft_tokens [B, k] with k >= max(num_drafts) and T >= k + 1; num_drafts [B];
    draft_probs [B, k, V] or None (one-hot proposals); uniforms [B, k] in [0, 1);
    race_noise [B, V] Exp(1). Returns (num_accepted [B], next_token [B]).
    """
    B, T, V = target_logits.shape
    k = draft_tokens.shape[1]
    device = target_logits.device
    positions = torch.arange(k, device=device)
    valid = positions[None, :] < num_drafts[:, None]  # [B, k]
    if sampling.all_greedy:
        # Fast path (no softmax, sort or noise): accept while the draft is the target argmax.
        argmax = target_logits.argmax(dim=-1)  # [B, T]
        accept = (draft_tokens == argmax[:, :k]) & valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
        return num_accepted, argmax.gather(1, num_accepted[:, None]).squeeze(1)

    probs = processed_probs(target_logits.reshape(B * T, V), sampling.expand(T)).view(B, T, V)
    p_draft = probs[:, :k].gather(-1, draft_tokens[:, :, None]).squeeze(-1)  # p_i(x_i)  [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, draft_tokens[:, :, None]).squeeze(-1)
    # Greedy rows: probs are one-hot, so p(x) > u*q(x) holds iff x is the argmax (q = 1, u < 1).
    greedy = sampling.greedy
    accept_sampled = p_draft > uniforms * q_draft
    accept_greedy = p_draft == 1.0
    accept = torch.where(greedy[:, None], accept_greedy, accept_sampled) & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    rows = torch.arange(B, device=device)
    p_at = probs[rows, num_accepted]  # [B, V] target distribution where the next token is drawn
    rejected = num_accepted < num_drafts
    if rejected.any():
        stop = num_accepted.clamp(max=k - 1)  # k >= 1 whenever a request has drafts to reject
        if draft_probs is None:
            q_at = torch.zeros_like(p_at).scatter_(-1, draft_tokens[rows, stop][:, None], 1.0)
        else:
            q_at = draft_probs[rows, stop].float()
        residual = (p_at - q_at).clamp(min=0.0)
        mass = residual.sum(dim=-1, keepdim=True)
        # A residual with no mass only happens when p == q up to rounding: resample from p.
        residual = torch.where(mass > 1e-8, residual / mass.clamp(min=1e-30), p_at)
        p_at = torch.where(rejected[:, None], residual, p_at)
    next_token = torch.where(greedy, p_at.argmax(dim=-1), race(p_at, race_noise))
    return num_accepted, next_token


def synthetic_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_drafts: torch.Tensor,
    cond_rates: torch.Tensor,
    sampling: SamplingTensors,
    uniforms: torch.Tensor,
    race_noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LOSSY. Accept position i iff uniforms[:, i] < cond_rates[i], whatever the tokens; accepted
    positions keep their draft tokens. The next token is the target's own sample (argmax when
    greedy) at the first unaccepted position, so the verify cost equals real verification."""
    B, T, V = target_logits.shape
    k = draft_tokens.shape[1]
    positions = torch.arange(k, device=target_logits.device)
    accept = (uniforms < cond_rates[None, :k]) & (positions[None, :] < num_drafts[:, None])
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    rows = torch.arange(B, device=target_logits.device)
    p_at = processed_probs(target_logits[rows, num_accepted], sampling)
    next_token = torch.where(sampling.greedy, p_at.argmax(dim=-1), race(p_at, race_noise))
    return num_accepted, next_token


register("rejection_sample", "reference", priority=0, reads_device_values=True)(rejection_sample)
register("synthetic_sample", "reference", priority=0, reads_device_values=True)(synthetic_sample)
