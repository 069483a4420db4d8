"""Triton kernels of draft_head_loss (contract: head_reference.py; wrapper and why: head_triton.py).

Every kernel recomputes tiles of the logits z = x w^T, with x = [hidden ; prev_embedding] [n, Kp]
and w = [lm_head ; markov_w2] [V, Kp] (one GEMM over K = d + r, zero-padded to a multiple of
BLOCK_K), accumulated in float32 and used where it is computed: no [n, V] float32 tensor is
ever written. Three passes over the vocabulary, each a GEMM's worth of tiles:

  head_lse_kernel     the online max and sum of exp(z) per row and vocabulary split;
  head_l1_kernel      with log-sum-exp known: sum_v |p_v - t_v| and S = sum_v sign(p_v - t_v) p_v;
  head_grad_kernel    dL/dz = g_ce (p - onehot(label)) + g_l1 p (sign(p - t) - S), stored in bf16
                      (the wrapper multiplies it out with cuBLAS).

Without a teacher (cross-entropy alone: the DFlash ablation's loss) the L1 pass is skipped and the
gradient pass reads no teacher row (WITH_L1 = False).
"""
import os

import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

# Under the interpreter (TRITON_INTERPRET=1, the CPU tests) a single small tile, so every mask is
# exercised at small shapes and the autotuner times nothing.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _set_boxes(nargs: dict) -> None:
    """The configs' pre_hook: the TMA descriptors' boxes are the config's tiles."""
    block_m, block_v, block_k = nargs["BLOCK_M"], nargs["BLOCK_V"], nargs["BLOCK_K"]
    nargs["x_desc"].block_shape = [block_m, block_k]
    nargs["w_desc"].block_shape = [block_v, block_k]
    if "grad_desc" in nargs:
        nargs["grad_desc"].block_shape = [block_m, block_v]


# (BLOCK_M, BLOCK_V, warps, stages) on Hopper: operand stages ((BLOCK_M + BLOCK_V) x 64 bf16 each)
# that fit the shared memory, and tiles whose epilogue fits the registers without spilling
# (tests/test_draft_loss_head_compile.py compiles each for sm_90). The log-sum-exp pass keeps
# little besides the accumulator, so it also takes the wider tiles; the autotuner keeps the
# fastest per (V, Kp).
TILES = ((128, 128, 8, 3), (128, 128, 8, 4), (64, 256, 8, 3), (64, 128, 4, 4))
WIDE_TILES = ((128, 256, 8, 3), (256, 128, 8, 3))


def _configs(shapes) -> list:
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_V": 64}, num_warps=1, num_stages=1, pre_hook=_set_boxes)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_V": v}, num_warps=w, num_stages=s, pre_hook=_set_boxes)
            for m, v, w, s in shapes]


# The widest BLOCK_V: the wrapper cuts the vocabulary into splits of a multiple of it, so no tile
# straddles two splits.
MAX_BLOCK_V = max(config.kwargs["BLOCK_V"] for config in _configs(TILES + WIDE_TILES))


def descriptor(matrix) -> TensorDescriptor:
    """A TMA descriptor of a row-major matrix (rows 16-byte aligned); its box is set per config
    (_set_boxes), and rows or columns past the matrix read as zero and are not written."""
    return TensorDescriptor(matrix, list(matrix.shape), list(matrix.stride()), [16, 16])


@triton.jit
def _logits_tile(x_desc, w_desc, row0, col0, Kp,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """z[row0 : row0 + BLOCK_M, col0 : col0 + BLOCK_V] = x . w in float32; rows and columns past
    the operands read as zero (TMA). Kp is a multiple of BLOCK_K (the wrapper pads K with zeros)."""
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for k in range(0, Kp, BLOCK_K):
        acc = tl.dot(x_desc.load([row0, k]), w_desc.load([col0, k]).T, acc)
    return acc


@triton.autotune(configs=_configs(TILES + WIDE_TILES), key=["V", "Kp"])
@triton.jit
def head_lse_kernel(x_desc, w_desc, part_max_ptr, part_sum_ptr, n, V, Kp, split_width,
                    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block, vocabulary split): over the split's columns, the running max and the
    sum of exp(z - max) per row (partials [splits, n], combined by the wrapper)."""
    row0 = tl.program_id(0) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    split = tl.program_id(1)
    v_begin = split * split_width
    v_end = tl.minimum(v_begin + split_width, V)
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        z = _logits_tile(x_desc, w_desc, row0, v0, Kp, BLOCK_M, BLOCK_V, BLOCK_K)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        # Every tile has a column inside the split, so new_max is finite and exp(-inf) = 0 on the first.
        new_max = tl.maximum(running_max, tl.max(z, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(z - new_max[:, None]), axis=1)
        running_max = new_max
    part = split.to(tl.int64) * n + rows
    tl.store(part_max_ptr + part, running_max, mask=row_ok)
    tl.store(part_sum_ptr + part, running_sum, mask=row_ok)


@triton.autotune(configs=_configs(TILES), key=["V", "Kp"])
@triton.jit
def head_l1_kernel(x_desc, w_desc, target_ptr, stride_t, target_rows_ptr, lse_ptr,
                   part_l1_ptr, part_mass_ptr, n, V, Kp, split_width,
                   BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row block, vocabulary split): with p = exp(z - lse), the split's part of
    sum_v |p_v - t_v| and of S = sum_v sign(p_v - t_v) p_v (sign(0) = 0, as autograd's |x|),
    partials [splits, n] summed by the wrapper."""
    row0 = tl.program_id(0) * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
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
        # The teacher's tile is loaded before the GEMM, in flight while the tensor cores make the logits
        # (experiments/draft_loss_bench.py timed both orders: before is faster here, after in the gradient).
        t = tl.load(target[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        z = _logits_tile(x_desc, w_desc, row0, v0, Kp, BLOCK_M, BLOCK_V, BLOCK_K)
        p = tl.where(col_ok[None, :], tl.exp(z - lse[:, None]), 0.0)
        diff = p - t.to(tl.float32)
        l1 += tl.sum(tl.abs(diff), axis=1)
        mass += tl.sum(tl.where(diff > 0, p, tl.where(diff < 0, -p, 0.0)), axis=1)
    part = split.to(tl.int64) * n + rows
    tl.store(part_l1_ptr + part, l1, mask=row_ok)
    tl.store(part_mass_ptr + part, mass, mask=row_ok)


@triton.autotune(configs=_configs(TILES), key=["V", "Kp"])
@triton.jit
def head_grad_kernel(x_desc, w_desc, target_ptr, stride_t, target_rows_ptr, labels_ptr, lse_ptr, mass_ptr,
                     grad_ce_ptr, grad_l1_ptr, grad_desc, n, V, Kp,
                     BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     WITH_L1: tl.constexpr):
    """One [BLOCK_M, BLOCK_V] tile of dL/dz = g_ce (p - [v = label]) + g_l1 p (sign(p - t) - S)
    per program, stored in bf16 (docs/dspark-algorithm.md §6.3); the descriptor clips the tile at
    the matrix's edges. Programs run in groups of GROUP_M row blocks sweeping the vocabulary
    together, so the w tiles they share (and their x rows) are read from L2. WITH_L1 False: the
    cross-entropy term alone; the teacher's pointers are not read."""
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(n, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(V, BLOCK_V)
    first_block = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(row_blocks - first_block, GROUP_M)
    row0 = (first_block + (pid % per_group) % group_rows) * BLOCK_M
    col0 = ((pid % per_group) // group_rows) * BLOCK_V
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_V)
    row_ok = rows < n
    col_ok = cols < V
    if WITH_L1:
        ok = row_ok[:, None] & col_ok[None, :]
        target = target_ptr + tl.load(target_rows_ptr + rows, mask=row_ok, other=0).to(tl.int64) * stride_t
    z = _logits_tile(x_desc, w_desc, row0, col0, Kp, BLOCK_M, BLOCK_V, BLOCK_K)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    p = tl.where(col_ok[None, :], tl.exp(z - lse[:, None]), 0.0)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    grad_ce = tl.load(grad_ce_ptr + rows, mask=row_ok, other=0.0)
    grad = grad_ce[:, None] * (p - tl.where(cols[None, :] == labels[:, None], 1.0, 0.0))
    if WITH_L1:
        # Loaded after the GEMM: a tile loaded before it held registers through the GEMM, and the kernel
        # ran slower (experiments/draft_loss_bench.py timed both orders).
        t = tl.load(target[:, None] + cols[None, :], mask=ok, other=0.0)
        diff = p - t.to(tl.float32)
        sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        grad_l1 = tl.load(grad_l1_ptr + rows, mask=row_ok, other=0.0)
        mass = tl.load(mass_ptr + rows, mask=row_ok, other=0.0)
        grad += grad_l1[:, None] * p * (sign - mass[:, None])
    grad_desc.store([row0, col0], grad.to(tl.bfloat16))
