"""The reference of `markov_greedy_draft`: the sequential stage of a greedy DSpark draft
(docs/dspark-algorithm.md §2.5, §3), one block slot after another.

    tokens[:, k] = argmax_v (base[:, k, v] + bias_k[v]),  bias_k = W2 W1[x_{k-1}] in W2's dtype,
    x_{-1} = the anchor, x_k = tokens[:, k]

W1 [V1, r] is the Markov head's previous-token embedding, W2 [V, r] its output rows (the
vanilla head's markov_w1 / markov_w2). The bias is a product in W2's dtype, widened to
float32 before the add, as the drafter's model computes it; argmax takes the lowest index among
equal maxima. Ids must be rows of W1 (as for an embedding lookup: on CUDA an id out of range is a
device-side assert, not a Python error).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import register


def check_markov(base: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> None:
    """The arguments every implementation takes: ValueError naming the first bad one."""
    if base.dim() != 3 or not base.is_floating_point():
        raise ValueError(f"markov_greedy_draft: base must be [B, G, V] floating, got {base.dtype} {tuple(base.shape)}")
    B, _, V = base.shape
    if anchors.shape != (B,) or anchors.is_floating_point():
        raise ValueError(f"markov_greedy_draft: anchors must be [{B}] integer ids, got {anchors.dtype} "
                         f"{tuple(anchors.shape)}")
    if w1.dim() != 2 or w2.dim() != 2 or w1.shape[1] != w2.shape[1]:
        raise ValueError(f"markov_greedy_draft: w1 [V1, r] and w2 [V, r] must share r, got {tuple(w1.shape)} "
                         f"and {tuple(w2.shape)}")
    if w2.shape[0] != V:
        raise ValueError(f"markov_greedy_draft: w2 has {w2.shape[0]} rows for base's {V} logits per slot")
    if w1.shape[0] < V:
        raise ValueError(f"markov_greedy_draft: w1 has {w1.shape[0]} rows, fewer than the {V} ids a draft can emit")


@register("markov_greedy_draft", "reference", priority=0)
def markov_greedy_draft(base: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """(tokens [B, G] long) of base [B, G, V] (float32 or wider), anchors [B], w1 [V1, r], w2 [V, r]."""
    check_markov(base, anchors, w1, w2)
    B, G, _ = base.shape
    tokens = torch.empty(B, G, dtype=torch.long, device=base.device)
    prev = anchors.long()
    for k in range(G):
        logits = base[:, k] + F.linear(F.embedding(prev, w1), w2).float()
        tokens[:, k] = logits.argmax(dim=-1)
        prev = tokens[:, k]
    return tokens
