"""Triton kernels of markov_greedy_draft and draft_confidence (kernels/markov/triton.py says why and how)."""
import triton
import triton.language as tl

from ..triton_pdl import prologue


@triton.jit
def _previous(anchors_ptr, part_val_ptr, part_idx_ptr, row, k, B, NB, NB_P2: tl.constexpr):
    """The id slot k is biased by: the anchor for k = 0, else slot k - 1's argmax, reduced from
    its per-block partials (the largest value, the lowest index among equal ones)."""
    if k == 0:
        prev = tl.load(anchors_ptr + row).to(tl.int64)
    else:
        blocks = tl.arange(0, NB_P2)
        inside = blocks < NB
        base = ((k - 1) * B + row) * NB
        vals = tl.load(part_val_ptr + base + blocks, mask=inside, other=float("-inf"))
        idxs = tl.load(part_idx_ptr + base + blocks, mask=inside, other=2147483647)
        best = tl.max(vals, axis=0)
        prev = tl.min(tl.where(inside & (vals == best), idxs, 2147483647), axis=0).to(tl.int64)
    return prev


@triton.jit
def markov_step_kernel(base_ptr, stride_bb, stride_bk, anchors_ptr, w1_ptr, stride_w1, w2_ptr, stride_w2,
                       part_val_ptr, part_idx_ptr, tokens_ptr, k, B, G, V, R, NB,
                       BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, NB_P2: tl.constexpr, PDL: tl.constexpr):
    """Slot k of row pid 0 over vocabulary block pid 1: bias = W2[block] W1[prev] (fp32 sums,
    rounded to W2's dtype), logits = base[row, k, block] + bias, and the block's (max, argmax)
    written as a partial. Block 0 also stores slot k - 1's token."""
    prologue(PDL)
    row = tl.program_id(0)
    block = tl.program_id(1)
    prev = _previous(anchors_ptr, part_val_ptr, part_idx_ptr, row, k, B, NB, NB_P2)
    if k > 0:
        if block == 0:
            tl.store(tokens_ptr + row * G + k - 1, prev)
    vocab = block * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = vocab < V
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        ranks = r0 + tl.arange(0, BLOCK_R)
        in_rank = ranks < R
        e = tl.load(w1_ptr + prev * stride_w1 + ranks, mask=in_rank, other=0.0).to(tl.float32)
        w = tl.load(w2_ptr + vocab[:, None].to(tl.int64) * stride_w2 + ranks[None, :],
                    mask=inside[:, None] & in_rank[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * e[None, :], axis=1)
    bias = acc.to(w2_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.load(base_ptr + row * stride_bb + k * stride_bk + vocab, mask=inside, other=0.0).to(tl.float32) + bias
    logits = tl.where(inside, logits, float("-inf"))
    best = tl.max(logits, axis=0)
    at = tl.argmax(logits, axis=0, tie_break_left=True)
    tl.store(part_val_ptr + (k * B + row) * NB + block, best)
    tl.store(part_idx_ptr + (k * B + row) * NB + block, (block * BLOCK_V + at).to(tl.int32))


@triton.jit
def markov_last_kernel(anchors_ptr, part_val_ptr, part_idx_ptr, tokens_ptr, B, G, NB,
                       NB_P2: tl.constexpr, PDL: tl.constexpr):
    """The last slot's token of row pid 0, from its partials."""
    prologue(PDL)
    row = tl.program_id(0)
    tl.store(tokens_ptr + row * G + G - 1, _previous(anchors_ptr, part_val_ptr, part_idx_ptr, row, G, B, NB, NB_P2))


@triton.jit
def draft_confidence_kernel(hidden_ptr, stride_hb, stride_hk, anchors_ptr, stride_a, tokens_ptr, stride_tb,
                            stride_tk, w1_ptr, stride_w1, weight_ptr, bias_ptr, temps_ptr, stride_t, logits_ptr,
                            probs_ptr, G, D, R, HAS_W1: tl.constexpr, HAS_BIAS: tl.constexpr,
                            HAS_TEMPS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                            PDL: tl.constexpr):
    """Slot k of row b for program pid 0 = b * G + k: the logit w[:D] . hidden[b, k] (+ w[D:] . W1[x_{k-1}],
    x_{-1} the anchor, else tokens[b, k - 1]) (+ bias), summed in float32, rounded to hidden's dtype
    (the Linear's output) and widened; its probability sigmoid(logit / T_k) in float32."""
    prologue(PDL)
    pid = tl.program_id(0)
    row = pid // G
    k = pid % G
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    h_row = hidden_ptr + row.to(tl.int64) * stride_hb + k.to(tl.int64) * stride_hk
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        inside = cols < D
        h = tl.load(h_row + cols, mask=inside, other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        acc += h * w
    total = tl.sum(acc, axis=0)
    if HAS_W1:
        if k == 0:
            prev = tl.load(anchors_ptr + row.to(tl.int64) * stride_a).to(tl.int64)
        else:
            prev = tl.load(tokens_ptr + row.to(tl.int64) * stride_tb + (k - 1).to(tl.int64) * stride_tk).to(tl.int64)
        acc_r = tl.zeros([BLOCK_R], dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            ranks = r0 + tl.arange(0, BLOCK_R)
            in_rank = ranks < R
            e = tl.load(w1_ptr + prev * stride_w1 + ranks, mask=in_rank, other=0.0).to(tl.float32)
            w = tl.load(weight_ptr + D + ranks, mask=in_rank, other=0.0).to(tl.float32)
            acc_r += e * w
        total += tl.sum(acc_r, axis=0)
    if HAS_BIAS:
        total += tl.load(bias_ptr).to(tl.float32)
    logit = total.to(hidden_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + pid, logit)
    if HAS_TEMPS:
        scaled = tl.math.div_rn(logit, tl.load(temps_ptr + k * stride_t))
    else:
        scaled = logit
    tl.store(probs_ptr + pid, tl.sigmoid(scaled))
