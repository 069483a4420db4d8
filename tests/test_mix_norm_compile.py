"""The AttnRes mix + RMSNorm kernel (kernels/rmsnorm/triton_kernels.py) compiled for Hopper (sm_90) on the
CPU at K3's width and a layer's checkpoint counts (up to 8 sealed blocks and the current sum,
docs/kimi-k3.md §7), with the residual add's delta as one part or as the two split-K partials a rank's
output projections leave: each build must keep its registers without spilling to local memory
(tests/cubin_usage.py; Triton's bundled ptxas compiles, cuobjdump reads the stack frame). At 16 warps the
deepest mix sits at the 128-register cap, and ptxas already overlaps the candidates' loads; four or more
partials spill, and so would tiles of four past four checkpoints (kernels/rmsnorm/triton.py score_tile)."""
import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cubin_usage import MISSING, assert_no_spills, unavailable  # noqa: E402
from dspark.kernels.rmsnorm import triton as norm_triton  # noqa: E402
from dspark.kernels.rmsnorm import triton_kernels as norm_kernels  # noqa: E402

if unavailable():
    pytest.skip(MISSING, allow_module_level=True)

K3_WIDTH = 7168
POINTERS = ("ckpt_ptr", "cur_ptr", "delta_ptr", "total_ptr", "mix_norm_ptr", "mix_proj_ptr", "out_norm_ptr", "out_ptr")


@pytest.mark.parametrize("num_checkpoints, delta_parts, tiles", [
    (2, 1, False), (5, 1, False), (8, 1, False), (8, 2, False), (4, 2, True), (8, 2, True)])
def test_the_mix_compiles_for_sm90_without_spills(num_checkpoints, delta_parts, tiles, tmp_path, monkeypatch):
    """delta_parts 2: delta as a split GEMM's fp32 partials (ops.linear_partials); tiles: the checkpoints
    scored in 2-D tiles as score_tile picks them (one of four at 4, four of two at 8)."""
    monkeypatch.setattr(norm_triton, "MIX_SCORE_TILES", tiles)
    fn = norm_kernels.attn_res_mix_norm_kernel
    block, warps = norm_triton._launch_shape(K3_WIDTH)
    constexprs = {"NUM_CKPT": num_checkpoints, "TILE": norm_triton.score_tile(num_checkpoints), "BLOCK": block,
                  "HAS_DELTA": True, "DELTA_PARTS": delta_parts, "PDL": False}
    assert (constexprs["TILE"] > 0) is tiles
    signature = {name: ("*bf16" if name in POINTERS else "fp32" if name == "eps" else "i32") for name in fn.arg_names}
    if delta_parts > 1:
        signature["delta_ptr"] = "*fp32"
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps})
    assert_no_spills(compiled, tmp_path)
