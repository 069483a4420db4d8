"""One training step's loss: the batch's blocks (docs/dspark-algorithm.md §6.2) and two ways to run them.

- `reference_step_loss`: anchor chunks through the dense-masked SDPA attention, the heads and the
  loss on every slot of every block, the teacher's softmax at every position. The definition the
  other path is tested against (and the step rounds 1-7 trained with).
- `fast_step_loss`: all anchors in one pass (SDPA with the dense mask, or FlexAttention
  block-sparse: flex.py), the vocabulary-wide work only on the supervised slots (build_blocks'
  eval_mask) through the op draft_head_loss (docs/kernels.md §12), the teacher's softmax only at
  the positions they read. Its host-side indexes are made on the CPU from the sampled anchors and reach the
  device in one copy, so the step never waits for the device to learn a shape.

Shapes: B sequences, S padded length, A blocks per sequence, G block size, d hidden, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import flex
from .capture import BatchCapture
from .loss import SUM_KEYS, finish_loss, row_sums, slot_sums, teacher_probs
from dspark.kernels import ops


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, num_anchors: int, generator: torch.Generator):
    """Up to num_anchors distinct valid anchors per sequence, uniformly at random, sorted (docs/dspark-algorithm.md §6.2).

    Valid a: a <= len-2, loss_mask[a] and loss_mask[a+1]. Returns anchors [B, A] and keep [B, A]
    (False for padding blocks, whose anchor is 0)."""
    B, S = loss_mask.shape
    pos = torch.arange(S)
    valid = (pos < lengths[:, None] - 1) & loss_mask.bool()
    valid[:, :-1] &= loss_mask[:, 1:].bool()
    valid[:, -1] = False
    keys = torch.rand(B, S, generator=generator).masked_fill(~valid, 2.0)  # random keys, invalid last
    count = min(num_anchors, max(int(valid.sum(1).max()), 1))
    chosen = keys.topk(count, dim=1, largest=False).indices
    keep = valid.gather(1, chosen)
    anchors = torch.where(keep, chosen, torch.zeros_like(chosen))
    order = torch.where(keep, anchors, torch.full_like(anchors, S)).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def build_blocks(tokens, lengths, loss_mask, anchors, keep, block_size: int, mask_token_id: int):
    """Block inputs, positions, labels, teacher-forced previous tokens and the eval mask (docs/dspark-algorithm.md §6.2).

    Slot k (1..G) of the block at anchor a has input tok[a] (k = 1) or MASK, position a+k-1,
    label tok[a+k], previous token tok[a+k-1], and is supervised while every slot up to it is
    inside the sequence and the loss mask: eval_mask[k] = prod_{i<=k} (a+i < len and mask[a+i]).
    """
    B, S = tokens.shape
    offsets = torch.arange(block_size)
    positions = anchors[..., None] + offsets  # a + k - 1
    label_pos = positions + 1
    inside = label_pos < lengths[:, None, None]
    clamped = label_pos.clamp(max=S - 1)
    flat = lambda t, idx: t.gather(1, idx.flatten(1)).view(idx.shape)  # noqa: E731
    labels = flat(tokens, clamped)
    prev = flat(tokens, positions.clamp(max=S - 1))
    supervised = inside & flat(loss_mask, clamped).bool()
    eval_mask = supervised.long().cumprod(dim=-1).bool() & keep[..., None]
    block = torch.full_like(labels, mask_token_id)
    block[..., 0] = flat(tokens, anchors[..., None])[..., 0]
    return block, positions, labels, prev, eval_mask


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple else n


@dataclass
class Batch:
    """A batch's blocks on the host: tokens/mask [B, S] (S padded to cfg.length_bucket), anchors and
    keep [B, A] (A padded to cfg.anchor_bucket with padding blocks), the rest [B, A, G]."""

    lengths: torch.Tensor
    anchors: torch.Tensor
    keep: torch.Tensor
    block: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    prev: torch.Tensor
    eval_mask: torch.Tensor
    width: int  # S


def make_batch(sequences, loss_masks, cfg, generator: torch.Generator, block_size: int, mask_token_id: int) -> Batch:
    """Anchors sampled (at the unpadded width, so the buckets never change which are drawn), blocks
    built, and both padded to the buckets: every batch of a run then has one of a few shapes."""
    longest = max(s.shape[0] for s in sequences)
    width = _round_up(longest, cfg.length_bucket)
    tokens = torch.stack([F.pad(s, (0, width - s.shape[0])) for s in sequences])
    mask = torch.stack([F.pad(m, (0, width - m.shape[0])) for m in loss_masks])
    lengths = torch.tensor([s.shape[0] for s in sequences])
    anchors, keep = sample_anchors(mask[:, :longest], lengths, cfg.num_anchors, generator)
    count = min(_round_up(anchors.shape[1], cfg.anchor_bucket), _round_up(cfg.num_anchors, cfg.anchor_bucket))
    anchors, keep = F.pad(anchors, (0, count - anchors.shape[1])), F.pad(keep, (0, count - keep.shape[1]))
    parts = build_blocks(tokens, lengths, mask, anchors, keep, block_size, mask_token_id)
    return Batch(lengths, anchors, keep, *parts, width=width)


def _widened(captured: BatchCapture, width: int) -> BatchCapture:
    """The capture zero-padded to `width` positions (an online capture is as wide as its longest sequence)."""
    pad = lambda t: None if t is None else F.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]))  # noqa: E731
    if all(t.shape[1] == width for t in captured.taps.values()):
        return captured
    stacked = None if captured.stacked is None else (captured.stacked[0], pad(captured.stacked[1]))
    return BatchCapture({k: pad(t) for k, t in captured.taps.items()}, pad(captured.logits), stacked)


def _teacher_at(model, captured: BatchCapture, flat_positions: torch.Tensor | None, cfg) -> torch.Tensor:
    """The teacher's softmax float32 [M, V] at flat positions b * S + p (None: every position)."""
    if cfg.teacher == "lm_head":
        final = captured.taps.get(model.config.target_num_layers)
        if final is None:
            raise ValueError(f"teacher='lm_head': the capture lacks tap {model.config.target_num_layers} (the LM head's input)")
        rows = final.reshape(-1, final.shape[-1])
        return teacher_probs(rows if flat_positions is None else rows[flat_positions], model.lm_head)
    if captured.logits is None:
        raise ValueError("teacher='logits': the capture holds no logits")
    rows = captured.logits.reshape(-1, captured.logits.shape[-1])
    return (rows if flat_positions is None else rows[flat_positions]).float().softmax(dim=-1)


def reference_step_loss(model, captured: BatchCapture, batch: Batch, cfg):
    """Loss and metrics of one batch (forward only), anchor chunks of cfg.anchor_chunk through the
    dense-masked attention, the heads on every slot."""
    c = model.config
    device = model.context_proj.weight.device
    S = batch.width
    captured = _widened(captured.to(device), S)
    block, positions, labels, prev, eval_mask, anchors = (t.to(device) for t in (
        batch.block, batch.positions, batch.labels, batch.prev, batch.eval_mask, batch.anchors))
    B = block.shape[0]
    fused = model.fuse_features(captured.features(c.target_layer_ids))
    context_rows = model.context_rows(fused, torch.arange(S, device=device).expand(B, S))
    visible = torch.arange(S, device=device) < anchors[..., None]  # context strictly before the anchor
    # p_t once per position: a position is slot k of up to G blocks, and chunks are recomputed in backward.
    target_probs = _teacher_at(model, captured, None, cfg)

    def blocks_sums(start: int, stop: int, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        part = slice(start, stop)
        hidden = model.backbone(block[:, part], positions[:, part], list(rows), visible[:, part])
        draft_logits, conf_logits = model.head_outputs(hidden, prev[:, part])  # teacher-forced heads
        # p_t for slot k comes from the target after position a+k-1 (which predicts tok[a+k]):
        # row b * S + position of the flattened [B * S, V] softmax.
        index = positions[:, part].clamp(max=S - 1)
        target_rows = (index + S * torch.arange(B, device=device)[:, None, None]).reshape(-1)
        V = draft_logits.shape[-1]
        ce, l1 = ops.draft_loss_terms(draft_logits.reshape(-1, V), target_probs, target_rows, labels[:, part].reshape(-1))
        shape = labels[:, part].shape
        sums = slot_sums(ce.view(shape), l1.view(shape), conf_logits, eval_mask[:, part], cfg)
        return tuple(sums[key] for key in SUM_KEYS)

    num_blocks = block.shape[1]
    chunk = cfg.anchor_chunk or num_blocks
    totals = None
    for start in range(0, num_blocks, chunk):
        args = (start, min(start + chunk, num_blocks), *context_rows)
        # With recompute, chunks recompute their activations in backward: memory ~ one chunk of
        # [A, G, V] logits instead of all anchors at once (docs/dspark-algorithm.md §6.2 uses 512
        # anchors). Without it, chunks only bound the attention's masked block rows (model.py).
        recomputed = cfg.recompute and chunk < num_blocks
        part = checkpoint(blocks_sums, *args, use_reentrant=False) if recomputed else blocks_sums(*args)
        totals = part if totals is None else tuple(t + p for t, p in zip(totals, part))
    return finish_loss(dict(zip(SUM_KEYS, totals)), cfg)


def blocks_forward(model, features, block, positions, visible, flex_mask):
    """The drafter over every block of a batch, [B, S, taps * d] context features -> hidden
    [B, A, G, d]: what `fast_step_loss` compiles (one graph per bucketed shape)."""
    B, S = features.shape[:2]
    context_rows = model.context_rows(model.fuse_features(features), torch.arange(S, device=features.device).expand(B, S))
    return model.backbone(block, positions, context_rows, visible, flex_mask=flex_mask)


@dataclass
class RowPlan:
    """Where a batch's supervised slots are, made on the host: sel [N] into the flattened [B, A, G]
    slots, slot [N] (k - 1), block [N] (into B * A), teacher_positions [M] (b * S + a + k - 1, each
    once) and rows [N] (into them), labels and previous tokens [N]."""

    sel: torch.Tensor
    slot: torch.Tensor
    block: torch.Tensor
    teacher_positions: torch.Tensor
    rows: torch.Tensor
    labels: torch.Tensor
    prev: torch.Tensor

    @classmethod
    def of(cls, batch: Batch) -> "RowPlan":
        B, A, G = batch.block.shape
        sel = batch.eval_mask.flatten().nonzero().squeeze(1)
        teacher_flat = (sel // (A * G)) * batch.width + batch.positions.flatten()[sel]
        positions, rows = torch.unique(teacher_flat, return_inverse=True)
        return cls(sel, sel % G, sel // G, positions, rows, batch.labels.flatten()[sel], batch.prev.flatten()[sel])


def markov_bias_is_zero(model) -> bool:
    """Whether the vanilla Markov head's W2 is frozen and all zeros, so its logit bias is exactly 0.
    Read from the device once per change of W2 (its storage and version counter), not every step."""
    w2 = model.markov_head.markov_w2.weight
    if w2.requires_grad:
        return False
    key = (w2.data_ptr(), w2._version)
    known = model.__dict__.get("_markov_zero")
    if known is None or known[0] != key:
        known = model.__dict__["_markov_zero"] = (key, not bool(w2.any()))
    return known[1]


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Long tensors to the device in one copy (one pinned buffer on CUDA, not waited for)."""
    if device.type == "cpu":
        return tensors
    flat = torch.cat([t.reshape(-1).to(torch.long) for t in tensors])
    flat = flat.pin_memory().to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def fast_step_loss(model, captured: BatchCapture, batch: Batch, cfg, forward=None):
    """Loss and metrics of one batch (forward only), equal to reference_step_loss's up to float
    summation order: every anchor at once (cfg.attention 'sdpa' or 'flex'), the heads and the
    loss on the supervised slots only. forward: blocks_forward or a compiled one."""
    c = model.config
    device = model.context_proj.weight.device
    S, (B, A, G) = batch.width, batch.block.shape
    plan = RowPlan.of(batch)
    vocab = model.lm_head.shape[0]
    # Checked here, on the host, so the loss op need not read its indices back from the device (rows
    # are torch.unique's inverse: in range by construction).
    if plan.labels.numel() and (int(plan.labels.min()) < 0 or int(plan.labels.max()) >= vocab):
        raise ValueError(f"batch: labels (the sequences' next tokens) must lie in [0, {vocab}), got values in "
                         f"[{int(plan.labels.min())}, {int(plan.labels.max())}]")
    block, positions, anchors, sel, slot, block_of, teacher_positions, rows, labels, prev = to_device(
        [batch.block, batch.positions, batch.anchors, plan.sel, plan.slot, plan.block, plan.teacher_positions,
         plan.rows, plan.labels, plan.prev], device)
    captured = _widened(captured.to(device), S)
    if cfg.attention == "flex":
        visible, mask = None, flex.block_mask(batch.anchors, S, G, device)
    else:
        visible, mask = torch.arange(S, device=device) < anchors[..., None], None
    hidden = (forward or blocks_forward)(model, captured.features(c.target_layer_ids), block, positions, visible, mask)
    hidden = hidden.reshape(B * A * G, -1)[sel]  # [N, d]
    prev_embedding = model.markov_head.embed_previous(prev)
    # A loss with no L1 and no confidence term (the DFlash ablation's cross-entropy) needs no teacher:
    # the head then skips its L1 pass and never reads teacher rows.
    target = _teacher_at(model, captured, teacher_positions, cfg) if cfg.l1_weight or cfg.conf_weight else None
    if c.markov_head_type == "vanilla":
        w2 = model.markov_head.markov_w2.weight
        # A frozen all-zero W2 (the ablation's: docs/dspark-algorithm.md §6.4) adds exactly 0 to every
        # logit, so the head's GEMM leaves out its r columns.
        head_prev, head_w2 = (prev_embedding[:, :0], w2[:, :0]) if markov_bias_is_zero(model) else (prev_embedding, w2)
        ce, l1 = ops.draft_head_loss(hidden, head_prev, model.lm_head, head_w2, target,
                                     None if target is None else rows, labels, indices_checked=True)
    else:  # the gated head's bias depends on the hidden state: the existing (unfused) path
        logits, _ = model.head_outputs(hidden, prev)
        if target is None:
            ce, l1 = F.cross_entropy(logits.float(), labels, reduction="none"), None
        else:
            ce, l1 = ops.draft_loss_terms(logits, target, rows, labels)
    conf_logits = model.confidence_head(hidden, prev_embedding)
    return finish_loss(row_sums(ce, l1, conf_logits, slot, block_of, B * A, G, cfg), cfg)
