"""draft_head_loss: the DSpark loss's vocabulary-wide terms from the draft head's inputs
(docs/dspark-algorithm.md §6.3), the logits' GEMM included.

hidden [N, d], prev_embedding [N, r] (the vanilla Markov head's W1[x_{k-1}]), lm_head [V, d]
(the target's, frozen), markov_w2 [V, r], target_probs [M, V] (the target's softmax, float32 or
bfloat16), rows [N] long (slot n is compared with target_probs[rows[n]]; None: row n, M = N),
labels [N] long. With the draft logits

    z_n = hidden_n lm_head^T + prev_embedding_n markov_w2^T

returns (ce [N], l1 [N]):

    ce[n] = logsumexp(z_n) - z_n[labels[n]]
    l1[n] = sum_v |softmax(z_n)_v - target_probs[rows[n], v]|

target_probs None (and rows None): cross-entropy alone, (ce, None), for a loss with no teacher term
(the DFlash ablation's); r may be 0 (no Markov bias: prev_embedding [N, 0], markov_w2 [V, 0]).

differentiable in hidden, prev_embedding and markov_w2. lm_head is frozen: one that requires
grad is an error, never a silently dropped gradient. The reference is the computation this op
replaces (float32 logits, log_softmax, gather, |p - t| summed), in float32, or float64 when an
operand is float64.
"""
from __future__ import annotations

import torch

from ..registry import register

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _matrix(name: str, tensor, rows: int | None = None, cols: int | None = None) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.dtype not in _FLOATS:
        what = f"shape {tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"draft_head_loss: {name} must be a 2-D floating-point tensor, got {what}")
    for axis, want in ((0, rows), (1, cols)):
        if want is not None and tensor.shape[axis] != want:
            raise ValueError(f"draft_head_loss: {name} has shape {tuple(tensor.shape)}; dimension {axis} must be {want}")


def _indices(name: str, tensor, length: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.long or tuple(tensor.shape) != (length,):
        what = f"shape {tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"draft_head_loss: {name} must be a [{length}] long tensor, got {what}")


def check_arguments(hidden, prev_embedding, lm_head, markov_w2, target_probs, rows, labels,
                    check_ranges: bool = True) -> None:
    """ValueError naming the argument for a shape, dtype, device or index out of contract.
    The index ranges are checked on the device with one synchronisation, unless check_ranges is
    False (the caller checked them: ops.draft_head_loss's indices_checked)."""
    _matrix("hidden", hidden)
    N, d = hidden.shape
    _matrix("prev_embedding", prev_embedding, rows=N)
    _matrix("lm_head", lm_head, cols=d)
    V, r = lm_head.shape[0], prev_embedding.shape[1]
    _matrix("markov_w2", markov_w2, rows=V, cols=r)
    if target_probs is None:
        if rows is not None:
            raise ValueError("draft_head_loss: rows index target_probs, which is None (cross-entropy alone); "
                             "pass rows=None")
    else:
        _matrix("target_probs", target_probs, cols=V)
        if target_probs.dtype not in (torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"draft_head_loss: target_probs must be float32 or bfloat16 (float64 for a float64 "
                             f"reference), got {target_probs.dtype}")
    if lm_head.requires_grad:
        raise ValueError("draft_head_loss: lm_head requires grad, but it is the target's frozen head and gets no "
                         "gradient here; pass lm_head.detach()")
    _indices("labels", labels, N)
    if rows is None:
        if target_probs is not None and target_probs.shape[0] != N:
            raise ValueError(f"draft_head_loss: rows is None, so target_probs needs one row per slot ({N}), "
                             f"got {target_probs.shape[0]}")
    else:
        _indices("rows", rows, N)
    tensors = {"hidden": hidden, "prev_embedding": prev_embedding, "lm_head": lm_head, "markov_w2": markov_w2,
               "labels": labels, **({} if target_probs is None else {"target_probs": target_probs}),
               **({} if rows is None else {"rows": rows})}
    for name, tensor in tensors.items():
        if tensor.device != hidden.device:
            raise ValueError(f"draft_head_loss: {name} is on {tensor.device}, hidden on {hidden.device}")
    if N and check_ranges:
        _check_ranges(labels, V, rows, 0 if target_probs is None else target_probs.shape[0])


def _check_ranges(labels: torch.Tensor, V: int, rows: torch.Tensor | None, M: int) -> None:
    indices = [("labels", labels, V)] + ([] if rows is None else [("rows", rows, M)])
    ends = torch.stack([e for _, t, _ in indices for e in (t.min(), t.max())]).tolist()
    for (name, _, bound), low, high in zip(indices, ends[0::2], ends[1::2]):
        if low < 0 or high >= bound:
            raise ValueError(f"draft_head_loss: {name} must lie in [0, {bound}), got values in [{low}, {high}]")


@register("draft_head_loss", "reference", priority=0)
def draft_head_loss(hidden: torch.Tensor, prev_embedding: torch.Tensor, lm_head: torch.Tensor,
                    markov_w2: torch.Tensor, target_probs: torch.Tensor | None, rows: torch.Tensor | None,
                    labels: torch.Tensor, *, indices_checked: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_arguments(hidden, prev_embedding, lm_head, markov_w2, target_probs, rows, labels,
                    check_ranges=not indices_checked)
    operands = (hidden, prev_embedding, lm_head, markov_w2)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in operands) else torch.float32
    logits = hidden.to(dtype) @ lm_head.to(dtype).t() + prev_embedding.to(dtype) @ markov_w2.to(dtype).t()
    log_p = logits.log_softmax(dim=-1)
    ce = -log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if target_probs is None:
        return ce, None
    target = (target_probs if rows is None else target_probs[rows]).to(dtype)
    l1 = (log_p.exp() - target).abs().sum(dim=-1)
    return ce, l1
