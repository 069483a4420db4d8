"""N-gram where the request repeats itself, DSpark elsewhere (issue 33's optional hybrid row).

Each step, a request whose history (its committed tokens and the anchor) ends in an n-gram seen
earlier, at least `ngram.min_n` tokens long, drafts that n-gram's continuation (prompt lookup);
every other request drafts DSpark's block. Both drafters commit every kept token, so DSpark's
context never misses a step that n-gram drafted. Verification is the engine's, whichever drafter
proposed a row: the output is lossless as for either alone (n-gram drafts are deterministic,
one-hot proposals; docs/dspark-algorithm.md §4). It is reported as its own drafter, never as DSpark.
"""
from __future__ import annotations

import torch

from dspark.protocols import Drafter, Proposal

from .dspark.drafter import DSparkDrafter
from .ngram import NgramDrafter


class HybridDrafter(Drafter):
    """Wraps a DSparkDrafter that commits on the host (no CUDA graphs) and an NgramDrafter; DSpark
    drafts only the rows n-gram has no match for. Its proposals carry no confidence: DSpark's
    acceptance head says nothing about n-gram's drafts. `rows` counts the rows each drafted."""

    def __init__(self, dspark: DSparkDrafter, ngram: NgramDrafter):
        if dspark.commits_on_device:
            raise ValueError("HybridDrafter: the DSpark drafter commits on the device (cuda_graphs=True); "
                             "the hybrid commits on the host: build it with cuda_graphs=False")
        self.dspark, self.ngram = dspark, ngram
        self.tap_layers = dspark.tap_layers
        self.draft_sample_method = dspark.draft_sample_method
        self.rows = {"ngram": 0, "dspark": 0}

    def start(self, slot: int, prompt: torch.Tensor, taps: dict[int, torch.Tensor]) -> None:
        self.dspark.start(slot, prompt, taps)
        self.ngram.start(slot, prompt, taps)

    def propose(self, slots, anchors, k, sampling, generators) -> Proposal:
        looked_up = self.ngram.propose(slots, anchors, k, sampling, generators)
        matched = looked_up.num_drafts.tolist()
        rest = [i for i, n in enumerate(matched) if n == 0]
        self.rows["ngram"] += len(slots) - len(rest)
        self.rows["dspark"] += len(rest)
        tokens, num_drafts = looked_up.tokens, looked_up.num_drafts  # fresh tensors: edited in place
        probs = None
        if rest:
            at = torch.tensor(rest, device=tokens.device)
            drafted = self.dspark.propose([slots[i] for i in rest], anchors[at], k, [sampling[i] for i in rest],
                                          [generators[i] for i in rest])
            tokens[at] = drafted.tokens.to(tokens.device)
            num_drafts[at] = k
            if drafted.probs is not None:
                # n-gram rows (and their padding columns) propose one-hot distributions.
                probs = torch.nn.functional.one_hot(tokens, drafted.probs.shape[-1]).to(drafted.probs.dtype)
                probs[at] = drafted.probs
        return Proposal(tokens, num_drafts, probs=probs)

    def commit(self, slots, tokens, num_tokens, taps) -> None:
        self.dspark.commit(slots, tokens, num_tokens, taps)
        self.ngram.commit(slots, tokens, num_tokens, taps)

    def release(self, slots) -> None:
        self.dspark.release(slots)
        self.ngram.release(slots)
