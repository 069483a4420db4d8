"""Triton kernel of the K3 router's selection (imported on first use)."""
import triton
import triton.language as tl


@triton.jit
def route_kernel(logits_ptr, stride_l, bias_ptr, ids_ptr, weights_ptr, num_experts, scaling,
                 TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program per token: sigmoid scores, the top-k by score + bias (picked one at a time,
    the lowest index among equal keys), and the chosen raw scores over their sum times scaling."""
    row = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    inside = experts < num_experts
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=inside, other=0.0).to(tl.float32)
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
