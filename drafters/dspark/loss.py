"""The DSpark training objective (docs/dspark-algorithm.md §6.3) and its vocabulary-wide seam.

    L = 0.1 * CE + 0.9 * ||p_d - p_t||_1 + 1.0 * BCE(conf_logit, 1 - 0.5 * ||p_d - p_t||_1 (detached)),

each term a mean weighted by w_k = exp(-(k-1)/4) over supervised slots. The terms are summed over
sets of slots (`slot_sums` for [..., G] blocks, `row_sums` for the supervised rows of a batch) and
divided once (`finish_loss`), so a batch split into chunks gives the loss of the whole.

The vocabulary-wide work (a vanilla-Markov drafter's logits and the CE and L1 terms) is the op
draft_head_loss (kernels/draft_loss: on CUDA bf16 GEMMs tiled over the vocabulary with the losses
fused, never the float32 [rows, V] logits; docs/kernels.md §12); `teacher_probs` is its target side.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dspark.kernels import ops

# Rows of float32 teacher logits teacher_probs holds at once: 4096 x SmolLM2's 49,152 = 0.8 GB.
HEAD_CHUNK_ROWS = 4096
SUM_KEYS = ("ce", "l1", "conf", "weight", "accept", "slots", "tau", "blocks")


def _widened_product(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a @ weight.T in float32 or wider: a float32 weight takes a float32 product (TF32 where the
    caller allows it); a bf16 weight (K3's head) is used as it is and only the product widened, so
    no float32 copy of a [V, d] matrix is made per call."""
    dtype = torch.promote_types(a.dtype, torch.float32)
    if weight.dtype == dtype:
        return a.to(dtype) @ weight.t()
    return (a.to(weight.dtype) @ weight.t()).to(dtype)


@torch.no_grad()
def teacher_probs(final_hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """softmax(final_hidden @ lm_head^T) in float32, [M, d] -> [M, V], HEAD_CHUNK_ROWS rows at a
    time: the target's distribution at M positions from the LM head's input (TargetOutput's tap
    num_layers), as the target computes its own logits (docs/dspark-algorithm.md §6.1)."""
    out = torch.empty(final_hidden.shape[0], lm_head.shape[0], dtype=torch.float32, device=final_hidden.device)
    for start in range(0, final_hidden.shape[0], HEAD_CHUNK_ROWS):
        part = slice(start, start + HEAD_CHUNK_ROWS)
        out[part] = _widened_product(final_hidden[part], lm_head).float().softmax(dim=-1)
    return out


def _decay(G: int, cfg, device) -> torch.Tensor:
    return torch.exp(-torch.arange(G, dtype=torch.float32, device=device) / cfg.decay_gamma)


def slot_sums(ce, l1, conf_logits, eval_mask, cfg) -> dict[str, torch.Tensor]:
    """Weighted sums of the three terms and of the diagnostics over blocks [..., G] (ce, l1,
    conf_logits, eval_mask all [..., G]); sums of several chunks add up (finish_loss)."""
    soft_label = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft_label, reduction="none")
    mask_f = eval_mask.float()
    weight = _decay(eval_mask.shape[-1], cfg, eval_mask.device) * mask_f
    return {
        "ce": (ce * weight).sum(), "l1": (l1 * weight).sum(), "conf": (bce * weight).sum(), "weight": weight.sum(),
        # Diagnostics (docs/dspark-algorithm.md §6.3): accept_rate@k = mean soft label, tau = 1 + sum_k prod_{i<=k} c*_i.
        "accept": (soft_label * mask_f).flatten(0, -2).sum(0), "slots": mask_f.flatten(0, -2).sum(0),
        "tau": ((1 + (soft_label * mask_f).cumprod(dim=-1).sum(-1)) * mask_f[..., 0]).sum(), "blocks": mask_f[..., 0].sum(),
    }


def row_sums(ce, l1, conf_logits, slot, block, num_blocks: int, G: int, cfg) -> dict[str, torch.Tensor]:
    """slot_sums over the supervised slots of a batch given as rows: ce, l1, conf_logits [N], slot
    [N] (k - 1 of each row) and block [N] (its block among num_blocks). A block's supervised slots
    are a prefix of it (build_blocks' eval_mask), so its rows' soft labels, zero-filled to G, give
    the same tau as the [..., G] form. l1 None (a loss without the teacher's terms): the L1 and
    confidence sums and the diagnostics made from the soft label are NaN (finish_loss leaves out
    terms of weight 0)."""
    if l1 is None:
        l1 = torch.full_like(ce, float("nan"))
    soft_label = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft_label, reduction="none")
    weight = _decay(G, cfg, ce.device)[slot]
    ones = torch.ones_like(soft_label)
    grid = soft_label.new_zeros(num_blocks * G).index_put_((block * G + slot,), soft_label).view(num_blocks, G)
    starts = (slot == 0).float()
    tau_per_block = 1 + grid.cumprod(dim=-1).sum(-1)
    return {
        "ce": (ce * weight).sum(), "l1": (l1 * weight).sum(), "conf": (bce * weight).sum(), "weight": weight.sum(),
        "accept": soft_label.new_zeros(G).index_add_(0, slot, soft_label),
        "slots": soft_label.new_zeros(G).index_add_(0, slot, ones),
        "tau": (tau_per_block[block] * starts).sum(), "blocks": starts.sum(),
    }


def finish_loss(sums: dict[str, torch.Tensor], cfg) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """L = 0.1 CE + 0.9 L1 + 1.0 BCE, each a weighted mean (docs/dspark-algorithm.md §6.3), and the
    step's metrics as 0-d device tensors (metrics_to_floats reads them, one sync for all)."""
    denom = sums["weight"].detach().clamp(min=1e-12)
    ce, l1, conf = (sums[key] / denom for key in ("ce", "l1", "conf"))
    # A term of weight 0 is left out, not multiplied by 0: a step that skipped it has NaN there.
    loss = sum(w * term for w, term in ((cfg.ce_weight, ce), (cfg.l1_weight, l1), (cfg.conf_weight, conf)) if w)
    tau = torch.where(sums["blocks"] > 0, sums["tau"] / sums["blocks"].clamp(min=1), torch.ones_like(sums["tau"]))
    metrics = {"loss": loss.detach(), "ce": ce.detach(), "l1": l1.detach(), "conf": conf.detach(), "tau": tau.detach(),
               "accept": (sums["accept"] / sums["slots"].clamp(min=1)).detach()}
    return loss, metrics


def metrics_to_floats(metrics: dict) -> dict:
    """A step's metrics with every tensor read back (floats; accept a list rounded to 4 places); a
    NaN (a term the step did not compute: row_sums) becomes None, so the logs stay strict JSON."""
    def number(x: float):
        return None if math.isnan(x) else x

    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = [number(round(x, 4)) for x in value.tolist()] if value.dim() else number(value.item())
        out[key] = value
    return out


def dspark_loss(draft_logits, target_logits, labels, conf_logits, eval_mask, cfg):
    """The DSpark objective (docs/dspark-algorithm.md §6.3, §11 item 8) of blocks [..., G, V]: full L1
    (not halved), decay exp(-(k-1)/gamma_w), weighted means, soft confidence label detached,
    softmaxes in float32. Returns (loss, metrics as floats)."""
    V = draft_logits.shape[-1]
    ce, l1 = ops.draft_loss_terms(draft_logits.reshape(-1, V), target_logits.float().softmax(dim=-1).reshape(-1, V),
                                  None, labels.reshape(-1))
    loss, metrics = finish_loss(slot_sums(ce.view(labels.shape), l1.view(labels.shape), conf_logits, eval_mask, cfg), cfg)
    return loss, metrics_to_floats(metrics)
