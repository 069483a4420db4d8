"""The reference of `markov_greedy_draft`: the sequential stage of a greedy DSpark draft
(docs/dspark-algorithm.md §2.5, §3), one block slot after another.

    tokens[:, k] = argmax_v (base[:, k, v] + bias_k[v]),  bias_k = W2 W1[x_{k-1}] in W2's dtype,
    x_{-1} = the anchor, x_k = tokens[:, k]

W1 [V1, r] is the Markov head's previous-token embedding, W2 [V, r] its output rows (the
vanilla head's markov_w1 / markov_w2). The bias is a product in W2's dtype, widened to
float32 before the add, as the drafter's model computes it; argmax takes the lowest index among
equal maxima. Ids must be rows of W1 (as for an embedding lookup: on CUDA an id out of range is a
device-side assert, not a Python error).

Beside it, the reference of `draft_confidence`: the confidence head of the same greedy block
(docs/dspark-algorithm.md §2.6, §5.2), c_k = sigmoid((w^T [h_k ; W1[x_{k-1}]] + b) / T_k), the
drafter's ops on the block's tokens once the Markov stage has drafted them.
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
    """(tokens [B, G] long) of base [B, G, V] (float32 or wider, or a lower precision widened by the add
    to the float32 bias), anchors [B], w1 [V1, r], w2 [V, r]."""
    check_markov(base, anchors, w1, w2)
    B, G, _ = base.shape
    tokens = torch.empty(B, G, dtype=torch.long, device=base.device)
    prev = anchors.long()
    for k in range(G):
        logits = base[:, k] + F.linear(F.embedding(prev, w1), w2).float()
        tokens[:, k] = logits.argmax(dim=-1)
        prev = tokens[:, k]
    return tokens


def _integer(t: torch.Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_confidence(hidden: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor, w1: torch.Tensor | None,
                     weight: torch.Tensor, bias: torch.Tensor | None, temperatures: torch.Tensor | None) -> None:
    """The arguments every implementation of draft_confidence takes: ValueError naming the first bad one."""
    if hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"draft_confidence: hidden must be [B, G, d] floating, got {hidden.dtype} "
                         f"{tuple(hidden.shape)}")
    B, G, d = hidden.shape
    if anchors.shape != (B,) or not _integer(anchors):
        raise ValueError(f"draft_confidence: anchors must be [{B}] integer ids, got {anchors.dtype} "
                         f"{tuple(anchors.shape)}")
    if tokens.shape != (B, G) or not _integer(tokens):
        raise ValueError(f"draft_confidence: tokens must be [{B}, {G}] integer ids, got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    r = 0
    if w1 is not None:
        if w1.dim() != 2 or w1.dtype != hidden.dtype:
            raise ValueError(f"draft_confidence: w1 must be [V1, r] in hidden's {hidden.dtype}, got {w1.dtype} "
                             f"{tuple(w1.shape)}")
        r = w1.shape[1]
    if weight.shape != (d + r,) or weight.dtype != hidden.dtype:
        what = f"[{d} + {r}] (d + w1's r)" if w1 is not None else f"[{d}] (d: no w1)"
        raise ValueError(f"draft_confidence: weight must be {what} in hidden's {hidden.dtype}, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if bias is not None and (bias.shape != (1,) or bias.dtype != hidden.dtype):
        raise ValueError(f"draft_confidence: bias must be [1] in hidden's {hidden.dtype}, got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    if temperatures is not None and (temperatures.shape != (G,) or temperatures.dtype != torch.float32):
        raise ValueError(f"draft_confidence: temperatures must be [{G}] float32, got {temperatures.dtype} "
                         f"{tuple(temperatures.shape)}")
    for name, t in (("anchors", anchors), ("tokens", tokens), ("w1", w1), ("weight", weight), ("bias", bias),
                    ("temperatures", temperatures)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"draft_confidence: {name} is on {t.device}, hidden on {hidden.device}")


@register("draft_confidence", "reference", priority=0)
def draft_confidence(hidden: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor, w1: torch.Tensor | None,
                     weight: torch.Tensor, bias: torch.Tensor | None,
                     temperatures: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The confidence head of a greedy block (drafters/dspark/heads.py ConfidenceHead, then the model's
    calibrated sigmoid) with the ops the model runs: x_{k-1} = the anchor for slot 0, else tokens[:, k - 1];
    logits = Linear([hidden ; W1[x_{k-1}]]) (features hidden alone with w1 None) in hidden's dtype, widened
    to float32; probs = sigmoid(logits / temperatures) in float32 (no division with temperatures None).
    Ids must be rows of w1 (as for an embedding lookup)."""
    check_confidence(hidden, anchors, tokens, w1, weight, bias, temperatures)
    features = hidden
    if w1 is not None:
        prev = torch.cat([anchors[:, None].long(), tokens[:, :-1].long()], dim=1)[:, : hidden.shape[1]]
        features = torch.cat([hidden, F.embedding(prev, w1)], dim=-1)
    logits = F.linear(features, weight[None, :], bias).squeeze(-1).float()
    probs = torch.sigmoid(logits if temperatures is None else logits / temperatures)
    return logits, probs
