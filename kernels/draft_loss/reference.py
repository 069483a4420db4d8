"""The DSpark loss's two vocabulary-wide terms per drafted position (docs/dspark-algorithm.md §6.3).

draft_logits [N, V] (any float dtype), target_probs [M, V] float32 (the target's softmax, taken
once per position), rows [N] long (position n is compared with target_probs[rows[n]]; None: row n),
labels [N] long. Returns (ce [N], l1 [N]) in float32:

    ce[n] = -log softmax(draft_logits[n])[labels[n]]
    l1[n] = sum_v |softmax(draft_logits[n])_v - target_probs[rows[n], v]|

both differentiable in draft_logits (the target is a constant). Softmaxes in float32.
"""
from __future__ import annotations

import torch

from ..registry import register


@register("draft_loss_terms", "reference", priority=0)
def draft_loss_terms(draft_logits: torch.Tensor, target_probs: torch.Tensor, rows: torch.Tensor | None,
                     labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    log_pd = draft_logits.float().log_softmax(dim=-1)
    target = target_probs if rows is None else target_probs[rows]
    ce = -log_pd.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    l1 = (log_pd.exp() - target).abs().sum(dim=-1)
    return ce, l1
