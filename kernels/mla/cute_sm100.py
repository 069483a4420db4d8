"""Absorbed-MLA multi-token verify attention for Blackwell (sm_100a B200/GB200, sm_103a B300/GB300).

NEVER RUN: no Blackwell GPU was available. It compiles for sm_100a and sm_103a in CI
(tests/test_mla_cute_compile.py); tests/gpu/test_mla_gpu.py is what must pass on a B200/GB300
before it is trusted.

What it is: the Hopper kernel of cute_sm90.py (same tiling, TMA pipeline, shared-memory
layouts, online softmax, split-KV and combine; see that module's docstring) with its two WGMMAs
replaced by warp-level mma.sync m16n8k16 (bf16 -> fp32) fed from shared memory by ldmatrix
(ldmatrix.trans for the MN-major V view). WGMMA does not exist on sm_100; the native Blackwell
path, tcgen05 UMMA with S and O in tensor memory (as in CUTLASS's Blackwell MLA decode example),
was out of reach in the time available, so this variant gives correct-by-construction coverage
at a fraction of the Blackwell tensor-core rate, not the performance design.
"""
import torch

from . import cute_sm90


def compile_mla_verify(heads: int, split_kv: bool, index: torch.dtype, arch: str, extra_options: tuple = ()):
    """The mma.sync build of the verify kernel for arch in (sm_100a, sm_103a); cached like cute_sm90's."""
    if arch not in ("sm_100a", "sm_103a"):
        raise ValueError(f"arch={arch!r}: the Blackwell MLA kernel targets sm_100a or sm_103a")
    return cute_sm90.compile_mla_verify(heads, split_kv, index, arch, extra_options, warp_mma=True)


def mla_verify_into(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale: float, out: torch.Tensor,
                    splits: int | None = None, partials=None) -> torch.Tensor:
    """Same contract as cute_sm90.mla_verify_into."""
    return cute_sm90.mla_verify_into(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale, out,
                                     splits=splits, partials=partials, warp_mma=True)


def mla_verify_attention(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale: float) -> torch.Tensor:
    out = torch.empty_like(q_latent)
    return mla_verify_into(q_latent, q_pe, kv_cache, slots, cache_lens, lengths, scale, out)
