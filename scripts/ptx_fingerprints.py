"""Fingerprints of the device code of the CuTe DSL skinny GEMM, MXFP4 expert and MLA kernels: one
line per build (kernel, shape, architecture) with the sha256 of its PTX, comments and debug-line
directives left out. A refactor of kernel source that claims to leave the device code alone shows
it by an empty diff, on a CPU (compile only, no GPU):

    python scripts/ptx_fingerprints.py > /tmp/before.txt    # then change the source
    python scripts/ptx_fingerprints.py | diff /tmp/before.txt -
"""
import hashlib
import os
import sys
import tempfile

import torch

from dspark.kernels import cute_common
from dspark.targets.kimi_k3.config import K3

KEEP_PTX = ("--keep-ptx",)


def device_code(ptx: str) -> str:
    return "\n".join(line for line in ptx.splitlines()
                     if not line.lstrip().startswith("//") and not line.lstrip().startswith((".file", ".loc")))


def builds():
    from dspark.kernels.linear import cute_sm90 as linear90, cute_sm100 as linear100
    from dspark.kernels.mla import cute_sm90 as mla90, cute_sm100 as mla100
    from dspark.kernels.moe import cute_sm90 as moe90, cute_sm100 as moe100

    for n, k in ((7168, 12288), (576, 7168)):  # split-K with a full tile; no split with an N tail
        for tokens in (8, 16):
            yield f"linear sm_90a {n}x{k} tokens={tokens}", linear90.compile_skinny_gemm(
                n, k, tokens, torch.bfloat16, "sm_90a", extra_options=KEEP_PTX)[0]
        yield f"linear sm_103a {n}x{k}", linear100.compile_skinny_gemm(
            n, k, torch.bfloat16, "sm_103a", extra_options=KEEP_PTX)[0]
    yield "linear sm_90a 7168x12288 fused split-K", linear90.compile_skinny_gemm(
        7168, 12288, 16, torch.bfloat16, "sm_90a", fused_reduce=True, extra_options=KEEP_PTX)[0]
    for glu in (True, False):
        rows, k = (K3.moe_intermediate_size, K3.latent_size) if glu else (K3.latent_size, K3.moe_intermediate_size)
        for tokens, loader in ((8, "tma"), (16, "registers")):
            yield f"moe sm_90a glu={glu} tokens={tokens} {loader}", moe90.compile_expert_gemm(
                K3.num_experts, rows, k, tokens, glu, "sm_90a", loader=loader, extra_options=KEEP_PTX)
        yield f"moe sm_103a glu={glu}", moe100.compile_expert_gemm(K3.num_experts, rows, k, glu, "sm_103a",
                                                                   extra_options=KEEP_PTX)
    mla_variants = ({}, {"qk_one_warpgroup": False}, {"l2_prefetch": True},
                    {"cluster_pairs": True, "partial_dtype": torch.bfloat16})
    for split_kv in (True, False):
        for flags in mla_variants:
            yield f"mla sm_90a split_kv={split_kv} {flags}", mla90.compile_mla_verify(
                K3.mla_num_heads, split_kv, torch.int64, "sm_90a", extra_options=KEEP_PTX, **flags)
        yield f"mla sm_103a split_kv={split_kv}", mla100.compile_mla_verify(K3.mla_num_heads, split_kv, torch.int64,
                                                                           "sm_103a", extra_options=KEEP_PTX)


def main() -> int:
    if not cute_common.cutlass_available():
        print("ptx_fingerprints: error: needs nvidia-cutlass-dsl", file=sys.stderr)
        return 2
    os.chdir(tempfile.mkdtemp())  # --keep-ptx writes its files into the working directory
    for name, compiled in builds():
        print(f"{hashlib.sha256(device_code(compiled.__ptx__).encode()).hexdigest()[:16]}  {name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
