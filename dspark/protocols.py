"""The seams of the pipeline: Target and Drafter.

One speculative step (docs/architecture.md):

    drafter.propose -> policy.verify_lengths -> target.verify -> sampler -> target.commit, drafter.commit

Shapes use B = requests in the step, T = tokens verified per request (anchor + drafts), V = vocab,
d = the target's hidden size. Ragged batches are padded: each request r uses the first
`lengths[r]` columns and whatever sits past them is ignored and never committed.

Slots: a target preallocates per-request state for `max_slots` requests; the engine hands each
live request a slot in [0, max_slots) and releases it when the request ends.

Optional accessor: `target.embedding_weights() -> (embed_tokens [V, d], lm_head [V, d])`, what a
DSpark drafter shares with its target and keeps frozen (docs/dspark-algorithm.md §2.4).
K3Target and LlamaTarget have it; targets that only serve drafters without a vocabulary head of
their own (n-gram, the toy target) need not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class TargetOutput:
    """What `prefill` and `verify` return.

    logits: [B, T, V] float32, the next-token logits after each fed position (verify), or
            [B, 1, V] after each prompt's last token (prefill).
    taps:   {layer: [B, T, d]} the residual stream after that (0-based) decoder layer, only for
            the layers the caller asked for (a drafter's tap layers); -1 means the embeddings
            and num_layers the LM head's input (after the final norm), from which a trainer
            computes the target's distribution at every position.
    """

    logits: torch.Tensor
    taps: dict[int, torch.Tensor]


@runtime_checkable
class Target(Protocol):
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_seq_len: int
    max_slots: int
    device: torch.device

    def prefill(
        self, slots: list[int], prompts: list[torch.Tensor], tap_layers: tuple[int, ...] = ()
    ) -> TargetOutput:
        """Run whole prompts into fresh slots and commit them, in chunks of a bounded number of
        tokens (dspark/targets/prefill.py), so memory follows the chunk, not the prompt.

        Returns logits [B, 1, V] after each prompt's last token (the engine samples the first
        output token from them) and taps [B, Pmax, d] padded to the longest prompt.
        """

    def verify(
        self,
        slots: list[int],
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        tap_layers: tuple[int, ...] = (),
    ) -> TargetOutput:
        """Feed tokens [B, T] (request r uses tokens[r, :lengths[r]]) after each slot's committed
        prefix (empty for a free slot) without changing the committed state. The first token of each row is the anchor
        (the last sampled token, not yet seen by the target); the rest are drafts."""

    def commit(self, slots: list[int], num_tokens: torch.Tensor) -> None:
        """Keep the first num_tokens[r] tokens of the last verify (accepted drafts + 1 for the
        anchor; 0 keeps nothing). Afterwards every piece of state (KDA recurrent state, conv
        window, MLA cache, position) is exactly what feeding only those tokens one by one would
        have produced; rejected positions leave no trace."""

    def release(self, slots: list[int]) -> None:
        """Forget the requests in these slots so the slots can be reused."""


@dataclass
class Proposal:
    """A drafter's output for one step.

    tokens:     [B, k] long, draft tokens (columns >= num_drafts[r] are padding).
    num_drafts: [B] long, drafts actually proposed per request (an n-gram miss gives 0).
    probs:      [B, k, V] float32, the distribution each draft token was sampled from (after the
                request's temperature/top-k/top-p), or None for deterministic drafts, which the
                sampler treats as one-hot proposals.
    confidence: [B, k] float32 in [0, 1], predicted conditional acceptance of each position
                given the previous ones were accepted (DSpark's confidence head), calibrated
                (dspark.policy.calibrated_confidence), or None. The verification policies read it.
    confidence_logits: [B, k] the confidence head's raw logits before calibration, or None
                (what calibration fits its temperatures on).
    token_pools: when row b of tokens is (the first k columns of) the latest draw of
                token_pools[b], a dspark.sampling.DrawPool: a graphed step then reads the rows on
                the device (DrawMirror) instead of having tokens copied in; None otherwise.
    """

    tokens: torch.Tensor
    num_drafts: torch.Tensor
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None
    token_pools: tuple | None = None


_full_counts: dict[tuple[int, int, torch.device], torch.Tensor] = {}
_full_count_ids: set[int] = set()


def full_draft_counts(batch: int, k: int, device: torch.device) -> torch.Tensor:
    """num_drafts for a step where every request drafts k: a [batch] long tensor of k, made once
    per (batch, k, device) and never written. A drafter that returns it spares a fill launch per
    step, and the engine's graph step copies it into its inputs only when it changes
    (`is_full_draft_counts`)."""
    key = (batch, k, torch.device(device))
    counts = _full_counts.get(key)
    if counts is None:
        counts = _full_counts[key] = torch.full((batch,), k, dtype=torch.long, device=device)
        _full_count_ids.add(id(counts))
    return counts


def is_full_draft_counts(counts: torch.Tensor) -> bool:
    """Whether `counts` is one of full_draft_counts' tensors (immutable, so a copy of it stays valid)."""
    return id(counts) in _full_count_ids


@runtime_checkable
class Drafter(Protocol):
    # Target layers whose hidden states this drafter reads (empty for drafters that need none).
    tap_layers: tuple[int, ...]
    # An optional class attribute `stateless` (False when absent, so not a member the protocol
    # checks): True says commit keeps nothing and propose reads no host value of the step before
    # (anchors are a device tensor, written in stream order). The engine then skips commit and may
    # launch the next step before reading this one back.
    # An optional attribute `reads_anchors` (True when absent): False says propose never reads its
    # `anchors` argument, which the engine may then pass as None.
    # An optional attribute `commits_on_device` (False when absent): True says the drafter has
    # `commit_on_device(slots, tokens, num_tokens, taps)`, a commit that reads none of its
    # arguments on the host, and `settle(slots, kept, width)`, which gives it the kept counts once
    # the host has read them. A graphed engine step then commits the drafter right after its
    # launch, settles it after the readback, and may launch the next step before that readback.

    def start(self, slot: int, prompt: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        """A request enters: its prompt [P] and the target's taps {layer: [P, d]} over it."""

    def propose(
        self,
        slots: list[int],
        anchors: torch.Tensor,
        k: int,
        sampling: "list",
        generators: list[torch.Generator],
    ) -> Proposal:
        """Draft up to k tokens after each anchor [B] (the last sampled token). `sampling` holds
        each request's SamplingParams; probabilistic drafters sample with the request's
        generator so a seeded request is reproducible."""

    def commit(
        self,
        slots: list[int],
        tokens: torch.Tensor,
        num_tokens: torch.Tensor,
        taps: dict[int, torch.Tensor],
    ) -> None:
        """The step's verified tokens [B, T] and taps {layer: [B, T, d]}; the first
        num_tokens[r] of row r were kept (anchor + accepted drafts) and become context."""

    def release(self, slots: list[int]) -> None:
        """Forget the requests in these slots."""
