"""markov_greedy_draft on CUDA in G + 1 launches (contract: reference.markov_greedy_draft).

Why: the reference runs each block slot as its own handful of launches (the W1 row's lookup, the
[r] x [r, V] product, its widening, the add, the argmax and the token's store), about six per
slot, 42 a block at K3's G = 7, each tiny: at a TP16 rank the drafter's whole propose reads
~0.15 ms of bytes (docs/kimi-k3.md §8.6), so its launches set its time.

How: one kernel per slot, its grid (rows, vocabulary blocks). Each program finds the id its slot
is biased by (the anchor, or the previous slot's argmax reduced from that slot's per-block
partials, the largest value and the lowest index among equal ones, torch.argmax's choice), forms
its block's logits and writes the block's (max, argmax) partial. Block 0 stores the previous
slot's token; a last one-program-per-row kernel stores the final slot's. No atomics and no host
reads, so the result is deterministic and a CUDA graph captures it.

Numerics: the bias is summed in float32 over r in another order than cuBLAS's, then rounded to
W2's dtype as the reference's product is, so a bf16 bias can differ from the reference's by one
unit in the last place and an argmax whose top two logits are that close can differ. A draft is
only a proposal: the verification keeps decoding lossless either way.

draft_confidence (contract: reference.draft_confidence), the confidence head of the same greedy
block in one launch, is below markov_greedy_draft with its own why, how and numerics.
"""
import torch

from ..registry import register
from ..triton_common import kernel_module, pdl_options, triton_available
from .reference import check_confidence, check_markov

BLOCK_R = 64  # Markov ranks per loop step: 64 x BLOCK_V products per program step
MAX_BLOCK_V = 256
MAX_BLOCKS = 1024  # the partials a program reduces in one vector
# base as the LM head's product leaves it (bf16 / fp16, widened as loaded) or already float32
BASE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def vocab_block(V: int) -> int:
    """Vocabulary entries per program: the power of two at or above V / 256, within 32 to
    MAX_BLOCK_V, so that even one row spreads over the SMs (160 blocks at a TP16 rank's 10,240,
    640 at K3's 163,840)."""
    return max(32, min(MAX_BLOCK_V, 1 << max(0, (-(-V // 256) - 1).bit_length())))


def markov_greedy_draft(base: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """out: an optional contiguous [B, G] long output (tests poison it first)."""
    check_markov(base, anchors, w1, w2)
    B, G, V = base.shape
    R = w2.shape[1]
    block_v = vocab_block(V)
    blocks = -(-V // block_v)
    if blocks > MAX_BLOCKS:
        raise ValueError(f"markov_greedy_draft: V={V} needs {blocks} vocabulary blocks, more than {MAX_BLOCKS}")
    for name, t in (("base", base), ("w1", w1), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"markov_greedy_draft: {name} needs a contiguous last dimension, got stride {t.stride()}")
    tokens = torch.empty(B, G, dtype=torch.long, device=base.device) if out is None else out
    if tuple(tokens.shape) != (B, G) or tokens.dtype != torch.long or not tokens.is_contiguous():
        raise ValueError(f"markov_greedy_draft: out must be a contiguous long [{B}, {G}], got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    if B == 0 or G == 0:
        return tokens
    part_val = torch.empty(G, B, blocks, dtype=torch.float32, device=base.device)
    part_idx = torch.empty(G, B, blocks, dtype=torch.int32, device=base.device)
    kernels, nb_p2 = kernel_module(__package__), 1 << (blocks - 1).bit_length()
    anchors = anchors.contiguous()
    for k in range(G):
        kernels.markov_step_kernel[(B, blocks)](
            base, base.stride(0), base.stride(1), anchors, w1, w1.stride(0), w2, w2.stride(0), part_val, part_idx,
            tokens, k, B, G, V, R, blocks, BLOCK_V=block_v, BLOCK_R=BLOCK_R, NB_P2=nb_p2, **pdl_options(),
            num_warps=4)
    kernels.markov_last_kernel[(B,)](anchors, part_val, part_idx, tokens, B, G, blocks, NB_P2=nb_p2,
                                     **pdl_options(), num_warps=4)
    return tokens


def supports_markov(base: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    return (base.dim() == 3 and base.dtype in BASE_DTYPES and base.stride(-1) == 1 and w1.dim() == 2
            and w2.dim() == 2 and w1.stride(-1) == 1 and w2.stride(-1) == 1
            and -(-base.shape[-1] // vocab_block(base.shape[-1])) <= MAX_BLOCKS)


register("markov_greedy_draft", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_markov)(markov_greedy_draft)


# draft_confidence: the confidence head of the greedy block in one launch, one program per (row, slot).
# Why: the drafter's torch path ends every greedy draft with ~6 small launches (the previous tokens'
# cat, the W1 lookup, the features' cat, the [d + r] GEMV, the float cast, the sigmoid) around a
# product of B * G * (d + r) multiply-adds; at a deployment rank the propose's time is its launch
# count. How: each program sums hidden[b, k] . w[:d] over d in BLOCK_D steps (one step at K3's d of
# 7168) and W1[x_{k-1}] . w[d:] over r, adds the bias, rounds the sum to hidden's dtype and widens it
# (the Linear's output as the model has it), then sigmoid(logit / T_k) in float32.
# Numerics: float32 sums in another order than cuBLAS's (or the CPU GEMM's), so a bf16 logit can
# differ from the reference's by one unit in the last place (fp32 hidden: float32 rounding only),
# and the probability by that over 4 T_k. The confidence only sets how many drafts are verified,
# never a token: decoding stays lossless either way.
CONF_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CONF_MAX_BLOCK_D = 8192  # K3's d = 7168 in one step: 16 values a thread at 16 warps
CONF_MAX_BLOCK_R = 1024


def confidence_launch(d: int, r: int) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_R, num_warps): d's power of two up to CONF_MAX_BLOCK_D, 512 values a warp
    (16 a thread), 1 to 16 warps; r's power of two up to CONF_MAX_BLOCK_R (at least 16)."""
    block_d = min(CONF_MAX_BLOCK_D, 1 << (max(d, 16) - 1).bit_length())
    block_r = min(CONF_MAX_BLOCK_R, 1 << (max(r, 16) - 1).bit_length())
    return block_d, block_r, max(1, min(16, block_d // 512))


def draft_confidence(hidden: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor, w1: torch.Tensor | None,
                     weight: torch.Tensor, bias: torch.Tensor | None, temperatures: torch.Tensor | None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """out: optional contiguous float32 [B, G] (logits, probs) outputs (tests poison them first)."""
    check_confidence(hidden, anchors, tokens, w1, weight, bias, temperatures)
    B, G, d = hidden.shape
    r = 0 if w1 is None else w1.shape[1]
    for name, t in (("hidden", hidden), ("w1", w1), ("weight", weight)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"draft_confidence: {name} needs a contiguous last dimension, got stride {t.stride()}")
    if out is None:
        out = tuple(torch.empty(B, G, dtype=torch.float32, device=hidden.device) for _ in range(2))
    for name, t in zip(("logits", "probs"), out):
        if tuple(t.shape) != (B, G) or t.dtype != torch.float32 or not t.is_contiguous() or t.device != hidden.device:
            raise ValueError(f"draft_confidence: out's {name} must be a contiguous float32 [{B}, {G}] on "
                             f"{hidden.device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
    logits, probs = out
    if B == 0 or G == 0:
        return logits, probs
    block_d, block_r, warps = confidence_launch(d, r)
    dummy = weight  # an unread pointer where w1, bias or temperatures is absent (their constexpr is off)
    kernel_module(__package__).draft_confidence_kernel[(B * G,)](
        hidden, hidden.stride(0), hidden.stride(1), anchors, anchors.stride(0), tokens, tokens.stride(0),
        tokens.stride(1), dummy if w1 is None else w1, 0 if w1 is None else w1.stride(0), weight,
        dummy if bias is None else bias, dummy if temperatures is None else temperatures,
        0 if temperatures is None else temperatures.stride(0), logits, probs, G, d, r, HAS_W1=w1 is not None,
        HAS_BIAS=bias is not None, HAS_TEMPS=temperatures is not None, BLOCK_D=block_d, BLOCK_R=block_r,
        **pdl_options(), num_warps=warps)
    return logits, probs


def supports_confidence(hidden: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor, w1: torch.Tensor | None,
                        weight: torch.Tensor, bias: torch.Tensor | None, temperatures: torch.Tensor | None) -> bool:
    """The layouts the kernel reads: hidden in CONF_DTYPES, hidden's, w1's and weight's last dims
    contiguous (other calls, malformed ones included, go to the reference, whose check names them)."""
    return (hidden.dim() == 3 and hidden.dtype in CONF_DTYPES and hidden.stride(-1) == 1
            and weight.dim() == 1 and weight.stride(0) == 1
            and (w1 is None or (w1.dim() == 2 and w1.stride(-1) == 1)))


register("draft_confidence", "triton", devices=("cuda",), priority=10, available=triton_available,
         supports=supports_confidence)(draft_confidence)
