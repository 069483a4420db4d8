"""The seams of the pipeline: Target and Drafter.

One speculative step (docs/architecture.md §5):

    drafter.propose -> policy.verify_lengths -> target.verify -> sampler -> target.commit, drafter.commit

Shapes use B = requests in the step, T = tokens verified per request (anchor + drafts), V = vocab,
d = the target's hidden size. Ragged batches are padded: each request r uses the first
`lengths[r]` columns and whatever sits past them is ignored and never committed.

Slots: a target preallocates per-request state for `max_slots` requests; the engine hands each
live request a slot in [0, max_slots) and releases it when the request ends.

A drafter subclasses `Drafter`, whose optional abilities (committing on the device, drafting
from DrawPools, stateless drafting) have documented defaults.

Optional accessor: `target.embedding_weights() -> (embed_tokens [V, d], lm_head [V, d])`, what a
DSpark drafter shares with its target and keeps frozen (docs/dspark-algorithm.md §2.4).
K3Target and LlamaTarget have it; targets that only serve drafters without a vocabulary head of
their own (n-gram, the toy target) need not.
"""
from __future__ import annotations

import abc
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

    # Optional, outside the protocol: causal_taps(sequences, tap_layers) -> {layer: [B, S, d]}, the
    # taps verify on free slots would return, from a stateless forward without logits (LlamaTarget).
    # A drafter's trainer uses it when present (drafters/dspark/capture.py capture, logits=False).


@dataclass
class Proposal:
    """A drafter's output for one step.

    tokens:     [B, k] long, draft tokens (columns >= num_drafts[r] are padding).
    num_drafts: [B] long, drafts actually proposed per request (an n-gram miss gives 0); or None
                when every request drafted all k (the engine then uses one shared tensor per
                shape, sparing a fill per step).
    probs:      [B, k, V] float32, the distribution each draft token was sampled from (after the
                request's temperature/top-k/top-p), or None for deterministic drafts, which the
                sampler treats as one-hot proposals.
    confidence: [B, k] float32 in [0, 1], predicted conditional acceptance of each position
                given the previous ones were accepted (DSpark's confidence head), calibrated
                (dspark.policy.calibrated_confidence), or None. The verification policies read it.
    confidence_logits: [B, k] the confidence head's raw logits before calibration, or None
                (what calibration fits its temperatures on).
    """

    tokens: torch.Tensor
    num_drafts: torch.Tensor | None
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    confidence_logits: torch.Tensor | None = None


class Drafter(abc.ABC):
    """What a drafter is to the engine: subclass it. The four abstract methods are the contract;
    everything else below is an optional ability with a default that asks nothing of the drafter
    (docs/architecture.md §4). The engine reads these attributes and calls
    these hooks directly: a drafter declares what it can do here, never by the engine probing it.

    One step, as the engine drives a drafter (B requests, slots[b] the slot of request b):
    propose -> (the target verifies [anchor, drafts] and accepts a prefix) -> commit of the kept
    tokens; start when a request enters, release when it leaves.
    """

    # Target layers whose hidden states this drafter reads (start's and commit's taps).
    tap_layers: tuple[int, ...] = ()
    # True: commit keeps nothing and propose reads no host value of the step before (its anchors
    # are a device tensor, written in stream order). The engine then skips commit and may launch
    # the next step on the device before reading this one back.
    stateless: bool = False
    # False: propose never reads its `anchors` argument, which the engine may then pass as None.
    reads_anchors: bool = True
    # True: the drafter commits on the device, inside the engine's step (dspark/step.py), through
    # reserve -> commit_on_device -> settle instead of commit; nothing the next draft needs then
    # waits for the host, so the engine may launch the next step before reading this one back.
    commits_on_device: bool = False

    @abc.abstractmethod
    def start(self, slot: int, prompt: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        """A request enters: its prompt [P] and the target's taps {layer: [P, d]} over it."""

    @abc.abstractmethod
    def propose(self, slots: list[int], anchors: torch.Tensor | None, k: int, sampling: list,
                generators: list[torch.Generator]) -> Proposal:
        """Draft up to k tokens after each anchor [B] (the last sampled token, a device tensor;
        None when reads_anchors is False). `sampling` holds each request's SamplingParams;
        probabilistic drafters sample with the request's generator so a seeded request is
        reproducible."""

    @abc.abstractmethod
    def commit(self, slots: list[int], tokens: torch.Tensor, num_tokens: torch.Tensor,
               taps: dict[int, torch.Tensor]) -> None:
        """The step's verified tokens [B, T] and taps {layer: [B, T, d]}; the first
        num_tokens[r] of row r were kept (anchor + accepted drafts) and become context. Called
        after the step is read back, for the requests that go on (unless stateless or
        commits_on_device)."""

    @abc.abstractmethod
    def release(self, slots: list[int]) -> None:
        """Forget the requests in these slots."""

    # ---- committing on the device (commits_on_device = True) --------------------------------

    def reserve(self, slots: list[int], width: int) -> None:
        """Host side, before a step of T = width tokens goes to the device: the step will commit
        up to width tokens of each slot on the device (commit_on_device) before the host knows how
        many. Default: nothing to note."""

    def commit_on_device(self, index: torch.Tensor, tokens: torch.Tensor, num_tokens: torch.Tensor,
                         taps: dict[int, torch.Tensor]) -> None:
        """commit as device work alone, run inside the engine's step (and captured into its CUDA
        graph): slots index [B], tokens [B, T], num_tokens [B], taps {layer: [B, T, d]}, all device
        tensors, none read on the host. A row with num_tokens 0 (a padding row, or any row while
        a graph is captured) must change nothing. Only called when commits_on_device is True."""
        raise NotImplementedError(f"{type(self).__name__}.commit_on_device: the drafter declares "
                                  "commits_on_device=True but does not implement it")

    def settle(self, slots: list[int], kept: list[int], width: int) -> None:
        """Host side, after the step's readback: the counts commit_on_device kept for these slots
        (the requests that go on) out of the width reserved. Default: nothing to note."""

    # ---- drawing drafts from DrawPools --------------------------------------------------------

    def draft_pool_shape(self, k: int) -> tuple[int, int] | None:
        """(steps, width) of the dspark.sampling.DrawPools a slot drafting k tokens draws from,
        for a drafter whose proposals are pool rows (draft_pools); None (the default): it has none."""
        return None

    def draft_pools(self, slots: list[int]) -> tuple | None:
        """The DrawPools whose latest draws (their first k columns) are the rows of the last
        proposal for these slots, one per slot; None (the default) when the rows are not pool
        draws. A graphed step then reads the rows on the device instead of having them copied in."""
        return None
