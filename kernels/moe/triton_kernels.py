"""Triton kernels of the K3 MoE (imported on first use): the router's logits at decode's few rows
and its selection, the expert kernels' B operand (the slots' token rows, K-permuted and scaled),
the weighted combination of each token's expert outputs and the input of the block's output GEMM
(normed latent | shared activation)."""
import triton
import triton.language as tl

from ..triton_partials import split_k_sum
from ..triton_pdl import prologue


@triton.jit
def route_kernel(logits_ptr, stride_l, bias_ptr, ids_ptr, weights_ptr, num_experts, scaling,
                 TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One program per token: sigmoid scores, the top-k by score + bias (picked one at a time,
    the lowest index among equal keys), and the chosen raw scores over their sum times scaling.
    Each pick is one block-wide reduction (the argmax); the chosen scores are read back from the
    row's logits afterwards, all k in one load, instead of a second reduction per pick."""
    prologue(PDL)
    row = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    inside = experts < num_experts
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=inside, other=0.0).to(tl.float32)
    keys = tl.where(inside, tl.sigmoid(logits) + tl.load(bias_ptr + experts, mask=inside, other=0.0).to(tl.float32),
                    float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(keys, axis=0, tie_break_left=True)
        ids = tl.where(slots == k, best.to(tl.int64), ids)
        keys = tl.where(experts == best, float("-inf"), keys)
    keep = slots < TOP_K
    chosen = tl.sigmoid(tl.load(logits_ptr + row * stride_l + ids, mask=keep, other=0.0).to(tl.float32))
    chosen = tl.where(keep, chosen, 0.0)
    weights = chosen / tl.sum(chosen, axis=0) * scaling
    tl.store(ids_ptr + row * TOP_K + slots, ids, mask=keep)
    tl.store(weights_ptr + row * TOP_K + slots, weights, mask=keep)


@triton.jit
def router_logits_kernel(x_ptr, stride_x, w_ptr, stride_w, out_ptr, stride_o, M, K,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """out[m, e] = sum_k x[m, k] w[e, k] in float32 for expert e = program 0 and the M <= BLOCK_M
    rows: the weight row is read once, in chunks of BLOCK_K, and the products (exact in float32 for
    bf16 operands) stay elementwise until one reduction per row at the end."""
    prologue(PDL)
    e = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + cols
        k_ok = k < K
        w = tl.load(w_ptr + e.to(tl.int64) * stride_w + k, mask=k_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x.to(tl.float32) * w[None, :]
    tl.store(out_ptr + rows * stride_o + e, tl.sum(acc, axis=1), mask=row_ok)


@triton.jit
def combine_kernel(rows_ptr, stride_r, stride_split, position_ptr, weights_ptr, out_ptr, stride_o, width,
                   TOP_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum over j in top-k order of weights[t, j] * (the sum over the splits of
    rows[split, position[t, j]]), in float32; one program per (token, column block)."""
    prologue(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = tl.load(position_ptr + t * TOP_K + j)
        weight = tl.load(weights_ptr + t * TOP_K + j).to(tl.float32)
        pair = split_k_sum(rows_ptr + row * stride_r, cols, inside, stride_split, SPLITS)
        acc += weight * pair
    tl.store(out_ptr + t * stride_o + cols, acc, mask=inside)


@triton.jit
def gather_tokens_kernel(x_ptr, stride_x, slot_tokens_ptr, perm_ptr, out_ptr, K, scale,
                         PERIOD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out row r (= slot * tokens + t), columns of block pid 1: x[slot_tokens[r]] read through the
    K permutation (period PERIOD), times scale; one program per (row, column block)."""
    prologue(PDL)
    r = tl.program_id(0)
    _gather_block(x_ptr, stride_x, tl.load(slot_tokens_ptr + r), perm_ptr, out_ptr, r, K, tl.program_id(1) * BLOCK,
                  scale, PERIOD, BLOCK)


@triton.jit
def _gather_block(x_ptr, stride_x, token, perm_ptr, out_ptr, r, K, k0, scale, PERIOD: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Columns [k0, k0 + BLOCK) of operand row r: x[token] read through the K permutation (period
    PERIOD), times scale."""
    cols = k0 + tl.arange(0, BLOCK)
    inside = cols < K
    source = (cols // PERIOD) * PERIOD + tl.load(perm_ptr + cols % PERIOD, mask=inside, other=0)
    v = tl.load(x_ptr + token.to(tl.int64) * stride_x + source, mask=inside, other=0.0)
    tl.store(out_ptr + r.to(tl.int64) * K + cols, (v.to(tl.float32) * scale).to(v.dtype), mask=inside)


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1), as kernels/activation's situ_glu_kernel (the same bits)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _tail_norm_row(routed_ptr, stride_r, norm_ptr, out_ptr, stride_o, row, L, start, width, eps,
                   BLOCK_L: tl.constexpr):
    offs = tl.arange(0, BLOCK_L)
    inside = offs < L
    x = tl.load(routed_ptr + row * stride_r + offs, mask=inside, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / L + eps)
    w = tl.load(norm_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    keep = inside & (offs >= start) & (offs < start + width)
    tl.store(out_ptr + row * stride_o + tl.where(keep, offs - start, 0), (w * y).to(out_ptr.dtype.element_ty),
             mask=keep)


@triton.jit
def _tail_glu_block(gate_up_ptr, stride_gp, stride_g, out_ptr, stride_o, row, block, width, S, beta, linear_beta,
                    BLOCK: tl.constexpr, PARTS: tl.constexpr):
    offs = block * BLOCK + tl.arange(0, BLOCK)
    inside = offs < S
    # split-K partials: added in split order, rounded as a reduction would
    g = split_k_sum(gate_up_ptr + row * stride_g, offs, inside, stride_gp, PARTS)
    u = split_k_sum(gate_up_ptr + row * stride_g + S, offs, inside, stride_gp, PARTS)
    dtype = out_ptr.dtype.element_ty
    g, u = g.to(dtype).to(tl.float32), u.to(dtype).to(tl.float32)
    act = (beta * _tanh(g / beta) * tl.sigmoid(g)) * (linear_beta * _tanh(u / linear_beta))
    tl.store(out_ptr + row * stride_o + width + offs, act.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def tail_inputs_kernel(routed_ptr, stride_r, norm_ptr, gate_up_ptr, stride_gp, stride_g, out_ptr, stride_o, L, start,
                       width, S, eps, beta, linear_beta, BLOCK_L: tl.constexpr, BLOCK: tl.constexpr,
                       PARTS: tl.constexpr, PDL: tl.constexpr):
    """Program (row, 0): RMSNorm of the fp32 routed row over all L columns (rms_norm_kernel's
    rounding: fp32 input, so none before the store), columns [start, start + width) stored at
    out[row, 0:width]. Program (row, b > 0): SiTU-GLU of shared columns [(b-1)*BLOCK, b*BLOCK),
    stored after them (situ_glu_kernel's arithmetic). Each branch is its own function: Triton
    requires a name bound in both branches of an `if` to have one type, and the two parts' blocks
    differ in width. PARTS > 1: gate|up comes as a GEMM's split-K partials (ops.linear_partials)."""
    prologue(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    if part == 0:
        _tail_norm_row(routed_ptr, stride_r, norm_ptr, out_ptr, stride_o, row, L, start, width, eps, BLOCK_L)
    else:
        _tail_glu_block(gate_up_ptr, stride_gp, stride_g, out_ptr, stride_o, row, part - 1, width, S, beta,
                        linear_beta, BLOCK, PARTS)


@triton.jit
def dispatch_inputs_kernel(parts_ptr, stride_p, stride_m, logits_ptr, latent_ptr, N, R, copies,
                           SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row, column block) of the router | latent-down partials [SPLITS, M, N]: their sum in split
    order in fp32; router columns [0, R) stored as they are at logits[row, c * R + col], the latent
    columns rounded to latent's dtype at latent[row, c * (N - R) + col - R], for every copy c."""
    prologue(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    total = split_k_sum(parts_ptr + row * stride_m, cols, inside, stride_p, SPLITS)
    router = inside & (cols < R)
    latent = inside & (cols >= R)
    L = N - R
    router_cols = tl.where(router, cols, 0)
    latent_cols = tl.where(latent, cols - R, 0)
    rounded = total.to(latent_ptr.dtype.element_ty)
    for c in range(copies):
        tl.store(logits_ptr + (row * copies + c) * R + router_cols, total, mask=router)
        tl.store(latent_ptr + (row * copies + c) * L + latent_cols, rounded, mask=latent)



@triton.jit
def lists_gather_kernel(ids_ptr, P, x_ptr, stride_x, perm_ptr, out_ptr, K, scale, slot_expert_ptr, slot_tokens_ptr,
                        pair_position_ptr, SLOTS, TOP_K: tl.constexpr, TILE: tl.constexpr, PERIOD: tl.constexpr,
                        BLOCK_P: tl.constexpr, CHUNK_Q: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
    """The expert lists and the expert kernels' B operand in one launch, a program per operand row
    r = slot * TILE + t. Every program derives the lists from the P = T * TOP_K pair ids, as the CuTe list
    kernel does: a pair's rank is the number of earlier pairs of its expert, a pair of rank 0 opens a
    slot, and its slot is the number of opening pairs of a smaller expert; the pair sits at row
    slot * TILE + rank. Row r's token is then the token of the pair at r (token 0 for a padding row),
    gathered through the K permutation and scaled, all K columns in blocks of BLOCK (one program a row,
    so the lists are derived once a row, not once a column block). Program r stores its row's token;
    program 0 also every pair's row and each slot's expert (-1 unused)."""
    prologue(PDL)
    r = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    valid = p < P
    ids = tl.load(ids_ptr + p, mask=valid, other=-1)
    # ranks and slots against the ids in chunks of CHUNK_Q: a [BLOCK_P, CHUNK_Q] comparison at a time. Along
    # the rows, pair p's rank (earlier pairs q of its expert); along the columns, whether pair q opens a
    # slot (no earlier pair p of its expert), and then p's slot (opening pairs q of a smaller expert).
    rank = tl.zeros([BLOCK_P], dtype=tl.int32)
    slot = tl.zeros([BLOCK_P], dtype=tl.int32)
    for q0 in range(0, P, CHUNK_Q):
        q = q0 + tl.arange(0, CHUNK_Q)
        other = tl.load(ids_ptr + q, mask=q < P, other=-1)
        same = (ids[:, None] == other[None, :]) & valid[:, None] & (q[None, :] < P)
        rank += tl.sum((same & (q[None, :] < p[:, None])).to(tl.int32), axis=1)
        opener = (q < P) & (tl.sum((same & (p[:, None] < q[None, :])).to(tl.int32), axis=0) == 0)
        slot += tl.sum(((other[None, :] < ids[:, None]) & opener[None, :]).to(tl.int32), axis=1)
    opens = valid & (rank == 0)
    position = slot * TILE + rank
    token = tl.sum(tl.where(valid & (position == r), p // TOP_K, 0), axis=0)
    for k0 in range(0, K, BLOCK):
        _gather_block(x_ptr, stride_x, token, perm_ptr, out_ptr, r, K, k0, scale, PERIOD, BLOCK)
    tl.store(slot_tokens_ptr + r, token.to(tl.int64))
    if r == 0:
        tl.store(pair_position_ptr + p, position.to(tl.int64), mask=valid)
        tl.store(slot_expert_ptr + slot, ids.to(tl.int32), mask=opens)
        s = tl.arange(0, BLOCK_S)
        used = tl.sum(opens.to(tl.int32), axis=0)  # slots [0, used) are the opened ones: disjoint from these
        tl.store(slot_expert_ptr + s, tl.full([BLOCK_S], -1, tl.int32), mask=(s >= used) & (s < SLOTS))
