"""The AttnRes mix norm's Triton kernel compiled for Hopper (sm_90a) on the CPU at K3's width and the
most candidates K3 reaches (8 sealed blocks and the current sum, docs/kimi-k3.md §7), with the residual
add's delta as the two split-K partials a rank's output projections leave: it must keep everything in
registers. At 16 warps it sits at the 128-register cap there, and ptxas already overlaps the candidates'
loads; builds that score checkpoints as 2-D tiles, or that take four or more partials, spill
(docs/kernels.md §10.9). Triton's bundled ptxas compiles; cuobjdump reads the stack frame
(tests/cubin_usage.py)."""
import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cubin_usage import MISSING, assert_no_spills, unavailable  # noqa: E402
from dspark.kernels.rmsnorm import triton as norm_triton  # noqa: E402

if unavailable():
    pytest.skip(MISSING, allow_module_level=True)

SIGNATURE = {"ckpt_ptr": "*bf16", "stride_cc": "i32", "stride_cm": "i32", "cur_ptr": "*bf16", "stride_m": "i32",
             "delta_ptr": "*fp32", "stride_dp": "i32", "stride_dm": "i32", "total_ptr": "*bf16", "stride_t": "i32",
             "mix_norm_ptr": "*bf16", "mix_proj_ptr": "*bf16", "out_norm_ptr": "*bf16", "out_ptr": "*bf16",
             "stride_o": "i32", "d": "i32", "eps": "fp32"}


def test_the_deepest_mix_of_a_rank_compiles_without_spills(tmp_path):
    block, warps = norm_triton._launch_shape(7168)
    constexprs = {"NUM_CKPT": 8, "BLOCK": block, "HAS_DELTA": True, "DELTA_PARTS": 2, "PDL": False}
    source = ASTSource(fn=norm_triton._kernels().attn_res_mix_norm_kernel,
                       signature={**SIGNATURE, **{name: "constexpr" for name in constexprs}}, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert_no_spills(compiled, tmp_path)
