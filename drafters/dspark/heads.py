"""DSpark's sequential-stage heads: the Markov head and the confidence head.

Design notes: docs/dspark-algorithm.md §2.5 (Markov head), §2.6 (confidence head).
"""
from __future__ import annotations

import torch
from torch import nn

# DeepSpec's start for every Linear and Embedding of its drafter (docs/dspark-algorithm.md §6.6).
DEEPSPEC_INIT_STD = 0.02


def init_like_deepspec(module: nn.Module, std: float = DEEPSPEC_INIT_STD) -> None:
    """Every Linear and Embedding under `module` to weights ~ N(0, std) and zero biases, as
    DeepSpec's drafters start (transformers' PreTrainedModel._init_weights with the target
    config's initializer_range = 0.02; docs/dspark-algorithm.md §6.6). torch's own defaults give
    the Markov head's W1 (an nn.Embedding) N(0, 1): 50x that."""
    if not std > 0:
        raise ValueError(f"std={std!r}: must be > 0")
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, (nn.Linear, nn.Embedding)):
                sub.weight.normal_(0.0, std)
            if isinstance(sub, nn.Linear) and sub.bias is not None:
                sub.bias.zero_()


class MarkovHead(nn.Module):
    """Low-rank first-order correction of the block logits (docs/dspark-algorithm.md §2.5, paper eq. 5).

    vanilla: Z_k = U_k + W2^T W1[x_{k-1}]
    gated:   Z_k = U_k + W2^T (g ⊙ W1[x_{k-1}]),  g = sigmoid(gate_proj([h_k ; W1[x_{k-1}]]))
    with x_0 = the anchor, so slot 1 is biased by the anchor too.
    Names and torch layouts follow the published checkpoints: markov_w1.weight [V, r],
    markov_w2.weight [V, r].
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str = "vanilla"):
        super().__init__()
        if kind not in ("vanilla", "gated"):
            raise ValueError(f"MarkovHead.kind={kind!r}: must be 'vanilla' or 'gated'")
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if kind == "gated" else None

    def embed_previous(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """W1[x_{k-1}]: [...] token ids -> [..., r] (also the confidence head's Markov input)."""
        return self.markov_w1(prev_tokens)

    def bias(self, prev_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[..., r] previous-token embedding and [..., d] draft hidden -> [..., V] logit bias."""
        if self.gate_proj is not None:
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_embedding], dim=-1)))
            prev_embedding = gate * prev_embedding
        return self.markov_w2(prev_embedding)


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(w^T [h_k ; W1[x_{k-1}]] + b) (docs/dspark-algorithm.md §2.6, paper eq. 7); returns the logit.

    The conditional probability that draft k is accepted given drafts 1..k-1 were.
    """

    def __init__(self, hidden_size: int, markov_rank: int, with_markov: bool = True, bias: bool = True):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (markov_rank if with_markov else 0), 1, bias=bias)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor) -> torch.Tensor:
        features = torch.cat([hidden, prev_embedding], dim=-1) if self.with_markov else hidden
        return self.proj(features).squeeze(-1)

