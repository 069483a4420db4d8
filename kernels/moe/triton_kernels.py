"""Triton kernels of the K3 router (imported on first use): the router GEMM as split-K partial
sums, and the selection, which adds the partials up as it reads them."""
import triton
import triton.language as tl


@triton.jit
def router_partials_kernel(x_ptr, stride_x, w_ptr, stride_w, partials_ptr, num_rows, num_experts, width,
                           BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """partials[s, m, e] = sum over k in split s of x[m, k] * w[e, k], in float32.

    Grid (experts / BLOCK_E, width / BLOCK_K): each program loads its [BLOCK_E, BLOCK_K] weight
    tile once, in the weights' own dtype (bf16 widens to float32 exactly, so nothing is cast
    ahead of the launch), and dots it with every row. The many small programs keep the whole
    weight in flight at once, which a per-row GEMV of a few hundred programs does not."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(1)
    cols = split * BLOCK_K + tl.arange(0, BLOCK_K)
    expert_in = experts < num_experts
    col_in = cols < width
    w = tl.load(w_ptr + experts[:, None] * stride_w + cols[None, :], mask=expert_in[:, None] & col_in[None, :],
                other=0.0).to(tl.float32)
    for m in range(num_rows):
        x = tl.load(x_ptr + m * stride_x + cols, mask=col_in, other=0.0).to(tl.float32)
        tl.store(partials_ptr + (split * num_rows + m) * num_experts + experts, tl.sum(w * x[None, :], axis=1),
                 mask=expert_in)


@triton.jit
def route_kernel(logits_ptr, stride_l, num_parts, stride_part, bias_ptr, ids_ptr, weights_ptr, num_experts, scaling,
                 TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per token: the logits (the sum of num_parts partial rows, in order), sigmoid
    scores, the top-k by score + bias (picked one at a time, the lowest index among equal keys),
    and the chosen raw scores over their sum times scaling."""
    row = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    inside = experts < num_experts
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for part in range(num_parts):
        logits += tl.load(logits_ptr + part * stride_part + row * stride_l + experts, mask=inside,
                          other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    keys = tl.where(inside, scores + tl.load(bias_ptr + experts, mask=inside, other=0.0).to(tl.float32),
                    float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(keys, axis=0, tie_break_left=True)
        score = tl.sum(tl.where(experts == best, scores, 0.0), axis=0)
        ids = tl.where(slots == k, best.to(tl.int64), ids)
        chosen = tl.where(slots == k, score, chosen)
        keys = tl.where(experts == best, float("-inf"), keys)
    weights = chosen / tl.sum(chosen, axis=0) * scaling
    keep = slots < TOP_K
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=keep)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=keep)
