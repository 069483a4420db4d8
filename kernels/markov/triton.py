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
"""
import torch

from ..registry import register
from ..triton_common import kernel_module, pdl_options, triton_available
from .reference import check_markov

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
