"""draft_head_loss with Triton kernels and cuBLAS: bf16 operands, float32 logits that live only
in registers (contract: head_reference.py; kernels: head_kernels.py).

Why: the computation it replaces multiplies out float32 logits [rows, V] (TF32 GEMMs), which
draft_loss_terms then reads, and autograd keeps them and writes their float32 gradient of the
same size; at the SmolLM2 recipe's sizes that is ~2.8 GB per tensor per 128-anchor chunk. Here
the head's two products are one GEMM, [hidden ; prev_embedding] [lm_head ; markov_w2]^T over
K = d + r, recomputed tile by tile wherever the logits are needed:

  forward   head_lse_kernel (log-sum-exp), then head_l1_kernel (the L1 distance and
            S = sum_v sign(p_v - t_v) p_v, which the backward needs): 2 GEMMs' worth of tiles
            (1 without a teacher: cross-entropy alone skips the L1 pass);
            z[label] = x . w[label] row by row in torch;
  backward  head_grad_kernel writes dL/dz in bf16 into a buffer of at most GRAD_BUFFER_BYTES,
            rows in chunks (1 GEMM's worth), and cuBLAS (bf16 in, float32 out) multiplies each
            chunk out: d[hidden ; prev] = dz [lm_head ; markov_w2], d markov_w2 += dz^T prev.

Memory beyond the inputs: the bf16 operands (N x Kp and V x Kp, kept for the backward), four
float32 numbers per row and vocabulary split, for a moment x and w[labels] in float32 (N x Kp
each, for z[label]), the gradient buffer (rows_chunk x V bf16 <= GRAD_BUFFER_BYTES), and the
float32 gradients themselves; never an [N, V] float32 tensor.

Numerics: every operand is rounded to bf16 once (relative error <= 2^-8; float32 inputs
included); the products are exact in float32 and summed in float32, so z is float32 and never
rounded to bf16. Softmax, L1 and S in float32. dL/dz is rounded to bf16 once (<= 2^-8 relative
per element) before the float32-accumulated cuBLAS products. The tests bound the error against
float64 on the bf16-rounded operands (tests/triton_interpret_checks.py, head_loss_expected).
"""
from __future__ import annotations

import importlib

import torch

from ..registry import register
from ..triton_common import triton_available
from .head_reference import check_arguments

BLOCK_K = 64  # the K step of every tile; K = d + r is zero-padded to a multiple of it
GRAD_BUFFER_BYTES = 1 << 30  # the bf16 dL/dz chunk: ~10,900 rows at V = 49,152
GROUP_M = 8  # row blocks that sweep the vocabulary together in the backward (L2 reuse of w tiles)
# Forward: vocabulary splits so that the programs fill the SMs about WAVES times over (short
# last wave), each split at least MIN_SPLIT_COLUMNS wide (its partials stay a small overhead).
WAVES = 8
MIN_SPLIT_COLUMNS = 1024
_OPERAND_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    return importlib.import_module(f"{__package__}.head_kernels")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _operand_pair(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """[left ; right] along the columns, rounded to bf16, zero columns up to a multiple of BLOCK_K.
    On the CPU (the Triton interpreter) the bf16 values are held in float32: the interpreter's
    bf16 tl.dot multiplies the raw bit patterns as integers; products of bf16 values are exact
    in float32, so the arithmetic is the GPU's."""
    rows, K = left.shape[0], left.shape[1] + right.shape[1]
    dtype = torch.bfloat16 if left.is_cuda else torch.float32
    out = torch.empty(rows, _cdiv(K, BLOCK_K) * BLOCK_K, dtype=dtype, device=left.device)
    out[:, : left.shape[1]] = left.to(torch.bfloat16)
    out[:, left.shape[1] : K] = right.to(torch.bfloat16)
    out[:, K:] = 0
    return out


def _product_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with a float32 result (cuBLAS: bf16 operands, float32 accumulation and output)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def vocab_splits(n: int, V: int, device: torch.device, splits: int | None, align: int) -> tuple[int, int]:
    """(splits, columns per split) of the forward kernels' vocabulary: `splits` if given, else
    enough that cdiv(n, 128) row blocks x splits fill the SMs about WAVES times; each split a
    multiple of `align` columns (the widest tile), the last one shorter."""
    if splits is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        splits = max(1, min(_cdiv(WAVES * sms, _cdiv(n, 128)), V // MIN_SPLIT_COLUMNS))
    width = _cdiv(_cdiv(V, splits), align) * align
    return _cdiv(V, width), width


def _forward(x, w, target_probs, rows, labels, splits: int | None):
    """(lse, ce, l1, S) per row, float32, from the two forward kernels (l1 and S None without a
    teacher: the L1 pass is skipped)."""
    kernels = _kernels()
    n, Kp = x.shape
    V = w.shape[0]
    splits, width = vocab_splits(n, V, x.device, splits, kernels.MAX_BLOCK_V)
    part = torch.empty(4, splits, n, dtype=torch.float32, device=x.device)

    def grid(meta):
        return (_cdiv(n, meta["BLOCK_M"]), splits)

    x_desc, w_desc = kernels.descriptor(x), kernels.descriptor(w)
    kernels.head_lse_kernel[grid](x_desc, w_desc, part[0], part[1], n, V, Kp, width, BLOCK_K=BLOCK_K)
    top = part[0].max(dim=0).values
    lse = top + torch.log((part[1] * torch.exp(part[0] - top)).sum(dim=0))
    l1 = mass = None
    if target_probs is not None:
        kernels.head_l1_kernel[grid](x_desc, w_desc, target_probs, target_probs.stride(0), rows, lse, part[2], part[3],
                                     n, V, Kp, width, BLOCK_K=BLOCK_K)
        l1, mass = part[2].sum(dim=0), part[3].sum(dim=0)
    # z[label] = x . w[label]: products of bf16 values are exact in float32, summed in float32.
    label_logit = (x.float() * w[labels].float()).sum(dim=1)
    return lse, lse - label_logit, l1, mass


def _grad_logits(x, w, labels, lse, grad_ce, teacher, out: torch.Tensor) -> None:
    """out [m, V] (bf16, rows 16-byte aligned) = dL/dz of rows x [m, Kp]; teacher: (target_probs, rows,
    mass, grad_l1) of the L1 term, or None for the cross-entropy term alone."""
    kernels = _kernels()
    m, Kp = x.shape
    V = w.shape[0]

    def grid(meta):
        return (_cdiv(m, meta["BLOCK_M"]) * _cdiv(V, meta["BLOCK_V"]),)

    # Without a teacher the kernel reads none of the L1 term's pointers; lse stands in for them.
    target, rows, mass, grad_l1 = teacher if teacher is not None else (lse,) * 4
    kernels.head_grad_kernel[grid](kernels.descriptor(x), kernels.descriptor(w), target, target.stride(0),
                                   rows, labels, lse, mass, grad_ce, grad_l1, kernels.descriptor(out), m, V, Kp,
                                   BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, WITH_L1=teacher is not None)


def grad_chunk_rows(n: int, V: int, limit: int | None = None) -> int:
    """Rows per backward chunk: at most `limit` (default: what fits GRAD_BUFFER_BYTES of bf16
    rows of V), the chunks of n made equal."""
    limit = max(1, GRAD_BUFFER_BYTES // (2 * V)) if limit is None else limit
    return _cdiv(n, _cdiv(n, limit)) if n else 1


class _DraftHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, prev_embedding, lm_head, markov_w2, target_probs, rows, labels, splits, chunk_rows):
        x = _operand_pair(hidden, prev_embedding)
        w = _operand_pair(lm_head, markov_w2)
        n = hidden.shape[0]
        if n:
            lse, ce, l1, mass = _forward(x, w, target_probs, rows, labels, splits)
        else:
            lse, ce, l1, mass = (torch.empty(0, dtype=torch.float32, device=hidden.device) for _ in range(4))
            if target_probs is None:
                l1 = mass = None
        ctx.save_for_backward(x, w, target_probs, rows, labels, lse, mass)
        ctx.widths = (hidden.shape[1], prev_embedding.shape[1])
        ctx.dtypes = (hidden.dtype, prev_embedding.dtype, markov_w2.dtype)
        ctx.chunk_rows = chunk_rows
        return ce, l1

    @staticmethod
    def backward(ctx, grad_ce, grad_l1):
        x, w, target_probs, rows, labels, lse, mass = ctx.saved_tensors
        d, r = ctx.widths
        n, V = x.shape[0], w.shape[0]
        needs_hidden, needs_prev, _, needs_w2 = ctx.needs_input_grad[:4]
        # The columns of [hidden ; prev] whose gradient is wanted: d x = dz w[:, cols].
        cols = slice(0 if needs_hidden else d, d + r if needs_prev else d)
        zeros = torch.zeros(n, dtype=torch.float32, device=x.device)
        grad_ce = zeros if grad_ce is None else grad_ce.float().contiguous()
        if target_probs is not None:
            grad_l1 = zeros if grad_l1 is None else grad_l1.float().contiguous()
        d_x = torch.empty(n, cols.stop - cols.start, dtype=torch.float32, device=x.device)
        d_w2 = torch.zeros(V, r, dtype=torch.float32, device=x.device) if needs_w2 else None
        chunk = grad_chunk_rows(n, V, ctx.chunk_rows)
        # Rows padded to 8 elements: TMA stores need 16-byte aligned rows.
        buffer = torch.empty(min(chunk, n), _cdiv(V, 8) * 8, dtype=torch.bfloat16, device=x.device)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            grad_z = buffer[: stop - start, :V]
            part = slice(start, stop)
            teacher = None if target_probs is None else (target_probs, rows[part], mass[part], grad_l1[part])
            _grad_logits(x[part], w, labels[part], lse[part], grad_ce[part], teacher, grad_z)
            if cols.stop > cols.start:
                d_x[part] = _product_float32(grad_z, w[:, cols])
            if needs_w2:
                d_w2 += _product_float32(grad_z.t(), x[part, d : d + r])
        hidden_dtype, prev_dtype, w2_dtype = ctx.dtypes
        d_hidden = d_x[:, :d].to(hidden_dtype) if needs_hidden else None
        d_prev = d_x[:, d_x.shape[1] - r :].to(prev_dtype) if needs_prev else None
        return d_hidden, d_prev, None, None if d_w2 is None else d_w2.to(w2_dtype), None, None, None, None, None


def draft_head_loss(hidden: torch.Tensor, prev_embedding: torch.Tensor, lm_head: torch.Tensor,
                    markov_w2: torch.Tensor, target_probs: torch.Tensor | None, rows: torch.Tensor | None,
                    labels: torch.Tensor, *, indices_checked: bool = False, splits: int | None = None,
                    chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The op (contract: head_reference.py; indices_checked: ops.draft_head_loss). splits: the forward's
    vocabulary splits (default: vocab_splits' choice); chunk_rows: the backward's rows per chunk
    (default: GRAD_BUFFER_BYTES). Both change the work's partition only; the tests set them to reach
    every path at small sizes."""
    check_arguments(hidden, prev_embedding, lm_head, markov_w2, target_probs, rows, labels,
                    check_ranges=not indices_checked)
    for name, value in (("splits", splits), ("chunk_rows", chunk_rows)):
        if value is not None and value < 1:
            raise ValueError(f"draft_head_loss: {name} must be >= 1, got {value}")
    if target_probs is not None:
        if rows is None:
            rows = torch.arange(hidden.shape[0], device=hidden.device)
        rows = rows.contiguous()
        if target_probs.stride(1) != 1:
            target_probs = target_probs.contiguous()
    return _DraftHeadLoss.apply(hidden, prev_embedding, lm_head, markov_w2, target_probs, rows,
                                labels.contiguous(), splits, chunk_rows)


def supports(hidden, prev_embedding, lm_head, markov_w2, target_probs, rows, labels) -> bool:
    """bf16/fp16/fp32 operands and a float32 or bf16 target (or none); float64 goes to the reference."""
    operands = (hidden, prev_embedding, lm_head, markov_w2)
    return (all(t.dim() == 2 and t.dtype in _OPERAND_DTYPES for t in operands)
            and (target_probs is None or (target_probs.dim() == 2 and target_probs.dtype in (torch.float32, torch.bfloat16))))


# The default on CUDA: the reference's float32 logits are what this op exists to avoid.
register("draft_head_loss", "triton", devices=("cuda",), priority=1, available=triton_available,
         supports=supports)(draft_head_loss)
