"""Triton kernels of draft_head_loss (contract: head_reference.py; wrapper and why: head_triton.py).

Every kernel recomputes tiles of the logits z = x w^T, with x = [hidden ; prev_embedding] [n, Kp]
and w = [lm_head ; markov_w2] [V, Kp] (one GEMM over K = d + r, zero-padded to a multiple of
BLOCK_K), accumulated in float32 and used where it is computed: no [n, V] float32 tensor is
ever written. Three passes over the vocabulary, each a GEMM's worth of tiles:

  head_lse_kernel     the online max and sum of exp(z) per row and vocabulary split, z[label];
  head_l1_kernel      with log-sum-exp known: sum_v |p_v - t_v| and S = sum_v sign(p_v - t_v) p_v;
  head_grad_kernel    dL/dz = g_ce (p - onehot(label)) + g_l1 p (sign(p - t) - S), stored in bf16
                      (the wrapper multiplies it out with cuBLAS).
"""
import os

import triton
import triton.language as tl

# Under the interpreter (TRITON_INTERPRET=1, the CPU tests) a single small tile, so every mask is
# exercised at small shapes and the autotuner times nothing.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _configs() -> list:
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_V": 64}, num_warps=1, num_stages=1)]
    # (BLOCK_M, BLOCK_V, warps, stages): Hopper tiles whose operand stages fit the shared memory
    # (stage = (BLOCK_M + BLOCK_V) x 64 bf16); the autotuner keeps the fastest per (V, Kp), and
    # drops a config that fails to compile for lack of resources.
    shapes = ((128, 128, 8, 3), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4), (64, 256, 4, 4))
    return [triton.Config({"BLOCK_M": m, "BLOCK_V": v}, num_warps=w, num_stages=s) for m, v, w, s in shapes]


# The widest BLOCK_V: the wrapper cuts the vocabulary into splits of a multiple of it, so no tile
# straddles two splits.
MAX_BLOCK_V = max(config.kwargs["BLOCK_V"] for config in _configs())


@triton.jit
def _logits_tile(x_ptr, stride_x, w_ptr, stride_w, rows, row_ok, cols, col_ok, Kp,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """z[rows, cols] = x[rows] . w[cols] in float32, [BLOCK_M, BLOCK_V]; masked rows and columns
    read as zero. Kp is a multiple of BLOCK_K (the wrapper pads K with zeros)."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for _ in range(0, Kp, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.autotune(configs=_configs(), key=["V", "Kp"])
@triton.jit
def head_lse_kernel(x_ptr, stride_x, w_ptr, stride_w, labels_ptr, part_max_ptr, part_sum_ptr, label_logit_ptr,
                    n, V, Kp, split_width,
                    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block, vocabulary split): over the split's columns, the running max and the
    sum of exp(z - max) per row (partials [splits, n], combined by the wrapper), and z[label]
    for the rows whose label falls in the split (exactly one split writes each row's)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    split = tl.program_id(1)
    v_begin = split * split_width
    v_end = tl.minimum(v_begin + split_width, V)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    label_logit = tl.zeros([BLOCK_M], tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _logits_tile(x_ptr, stride_x, w_ptr, stride_w, rows, row_ok, cols, col_ok, Kp, BLOCK_M, BLOCK_V, BLOCK_K)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        # Every tile has a column inside the split, so new_max is finite and exp(-inf) = 0 on the first.
        new_max = tl.maximum(running_max, tl.max(z, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), axis=1)
        running_max = new_max
        # A label past v_end may meet a masked (-inf) column here; that row's value is not stored.
        label_logit += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)
    part = split.to(tl.int64) * n + rows
    tl.store(part_max_ptr + part, running_max, mask=row_ok)
    tl.store(part_sum_ptr + part, running_sum, mask=row_ok)
    tl.store(label_logit_ptr + rows, label_logit, mask=row_ok & (labels >= v_begin) & (labels < v_end))


@triton.autotune(configs=_configs(), key=["V", "Kp"])
@triton.jit
def head_l1_kernel(x_ptr, stride_x, w_ptr, stride_w, target_ptr, stride_t, target_rows_ptr, lse_ptr,
                   part_l1_ptr, part_mass_ptr, n, V, Kp, split_width,
                   BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block, vocabulary split): with p = exp(z - lse), the split's part of
    sum_v |p_v - t_v| and of S = sum_v sign(p_v - t_v) p_v (sign(0) = 0, as autograd's |x|),
    partials [splits, n] summed by the wrapper."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    split = tl.program_id(1)
    v_begin = split * split_width
    v_end = tl.minimum(v_begin + split_width, V)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    target = target_ptr + tl.load(target_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64) * stride_t
    l1 = tl.zeros([BLOCK_M], tl.float32)
    mass = tl.zeros([BLOCK_M], tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _logits_tile(x_ptr, stride_x, w_ptr, stride_w, rows, row_ok, cols, col_ok, Kp, BLOCK_M, BLOCK_V, BLOCK_K)
        p = tl.where(col_ok[None, :], tl.exp(z - lse[:, None]), 0.0)
        t = tl.load(target[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        diff = p - t.to(tl.float32)
        l1 += tl.sum(tl.abs(diff), axis=1)
        mass += tl.sum(tl.where(diff > 0, p, tl.where(diff < 0, -p, 0.0)), axis=1)
    part = split.to(tl.int64) * n + rows
    tl.store(part_l1_ptr + part, l1, mask=row_ok)
    tl.store(part_mass_ptr + part, mass, mask=row_ok)


@triton.autotune(configs=_configs(), key=["V", "Kp"])
@triton.jit
def head_grad_kernel(x_ptr, stride_x, w_ptr, stride_w, target_ptr, stride_t, target_rows_ptr, labels_ptr,
                     lse_ptr, mass_ptr, grad_ce_ptr, grad_l1_ptr, grad_ptr, stride_g, n, V, Kp,
                     BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """One [BLOCK_M, BLOCK_V] tile of dL/dz = g_ce (p - [v = label]) + g_l1 p (sign(p - t) - S)
    per program, stored in grad's dtype (docs/dspark-algorithm.md §6.3). Programs run in groups
    of GROUP_M row blocks sweeping the vocabulary together, so the w tiles they share (and their
    x rows) are read from L2."""
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(n, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(V, BLOCK_V)
    first_block = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(row_blocks - first_block, GROUP_M)
    rows = (first_block + (pid % per_group) % group_rows) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = ((pid % per_group) // group_rows) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n
    col_ok = cols < V
    z = _logits_tile(x_ptr, stride_x, w_ptr, stride_w, rows, row_ok, cols, col_ok, Kp, BLOCK_M, BLOCK_V, BLOCK_K)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    p = tl.where(col_ok[None, :], tl.exp(z - lse[:, None]), 0.0)
    target = target_ptr + tl.load(target_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64) * stride_t
    ok = row_ok[:, None] & col_ok[None, :]
    diff = p - tl.load(target[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    grad_ce = tl.load(grad_ce_ptr + rows, mask=row_ok, other=0.0)
    grad_l1 = tl.load(grad_l1_ptr + rows, mask=row_ok, other=0.0)
    mass = tl.load(mass_ptr + rows, mask=row_ok, other=0.0)
    grad = (grad_ce[:, None] * (p - tl.where(cols[None, :] == labels[:, None], 1.0, 0.0))
            + grad_l1[:, None] * p * (sign - mass[:, None]))
    tl.store(grad_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :], grad.to(grad_ptr.dtype.element_ty),
             mask=ok)
