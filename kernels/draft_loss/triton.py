"""draft_loss_terms as two Triton kernels with an autograd backward (contract: reference.py).

Why: the reference materialises several [N, V] float32 tensors per chunk of drafted positions
(the log-softmax, its exp, the gathered target rows, their difference and its absolute value),
and autograd keeps or recomputes them for the backward. At the SmolLM2 recipe's sizes (16
sequences x 128 anchors x 7 slots per chunk, V = 49,152) each is ~2.8 GB. These kernels read the
logits twice and the target rows once going forward, and each once more going backward, writing
only the gradient: four numbers per position are all they keep.

The default on CUDA: it matches the float64 reference under autograd on the GPU
(tests/gpu/test_draft_loss_gpu.py) and makes the SmolLM2 recipe's training step cheaper than the
reference (experiments/results/h200/smollm2_profile_train_*_loss.json). The reference stays a choice
(registry.use("draft_loss_terms", "reference"), DSPARK_KERNELS, the recipe's --reference-loss).
"""
import torch

from ..registry import register
from ..triton_common import kernel_module, triton_available

BLOCK = 2048
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    return kernel_module(__package__)


class _DraftLossTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target_probs, rows, labels):
        N, V = logits.shape
        ce, l1, lse, signed_mass = (torch.empty(N, dtype=torch.float32, device=logits.device) for _ in range(4))
        if N:
            _kernels().draft_loss_forward_kernel[(N,)](
                logits, logits.stride(0), target_probs, target_probs.stride(0), rows, labels,
                ce, l1, lse, signed_mass, V, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(logits, target_probs, rows, labels, lse, signed_mass)
        return ce, l1

    @staticmethod
    def backward(ctx, grad_ce, grad_l1):
        logits, target_probs, rows, labels, lse, signed_mass = ctx.saved_tensors
        N, V = logits.shape
        zeros = torch.zeros(N, dtype=torch.float32, device=logits.device)
        grad_ce = zeros if grad_ce is None else grad_ce.float().contiguous()
        grad_l1 = zeros if grad_l1 is None else grad_l1.float().contiguous()
        grad = torch.empty_like(logits)
        if N:
            _kernels().draft_loss_backward_kernel[(N, -(-V // BLOCK))](
                logits, logits.stride(0), target_probs, target_probs.stride(0), rows, labels, lse, signed_mass,
                grad_ce, grad_l1, grad, grad.stride(0), V, BLOCK=BLOCK, num_warps=8)
        return grad, None, None, None


def draft_loss_terms(draft_logits: torch.Tensor, target_probs: torch.Tensor, rows: torch.Tensor | None,
                     labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if rows is None:
        rows = torch.arange(draft_logits.shape[0], device=draft_logits.device)
    return _DraftLossTerms.apply(draft_logits, target_probs, rows.contiguous(), labels.contiguous())


def supports(draft_logits, target_probs, rows, labels) -> bool:
    return (draft_logits.dim() == 2 and target_probs.dim() == 2 and draft_logits.shape[1] == target_probs.shape[1]
            and draft_logits.dtype in _DTYPES and target_probs.dtype == torch.float32
            and draft_logits.stride(1) == 1 and target_probs.stride(1) == 1)


# Above the reference where it runs (see the module's docstring).
register("draft_loss_terms", "triton", devices=("cuda",), priority=1, available=triton_available,
         supports=supports)(draft_loss_terms)
