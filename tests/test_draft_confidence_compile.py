"""The confidence head's kernel (kernels/markov/triton_kernels.py draft_confidence_kernel) compiled for Hopper
(sm_90) on the CPU at K3's drafter (hidden d = 7168, Markov rank r = 256, block G = 7) with the block sizes and
warps kernels/markov/triton.py launches it with (d in one 8192-wide step at 16 warps), bf16 and float32,
with and without the Markov input, bias and temperatures: each build must keep its registers without
spilling to local memory (tests/cubin_usage.py; Triton's bundled ptxas compiles, cuobjdump reads the stack
frame), and, specialised as a launch at K3's shapes is, reads 16 bytes a load. Under programmatic dependent
launch the prologue's wait comes before the first load."""
import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cubin_usage import MISSING, assert_no_spills, unavailable  # noqa: E402
from dspark.kernels.markov import triton as markov_triton  # noqa: E402
from dspark.kernels.markov import triton_kernels as markov_kernels  # noqa: E402

if unavailable():
    pytest.skip(MISSING, allow_module_level=True)

D, R = 7168, 256  # K3's drafter (drafters/dspark/config.py K3_DSPARK)
IDS = ("anchors_ptr", "tokens_ptr")
FP32_POINTERS = ("temps_ptr", "logits_ptr", "probs_ptr")
ALIGNED_INTS = ("stride_hb", "stride_hk", "stride_w1", "D", "R")


def _compile(dtype: str, markov: bool, bias: bool, temps: bool, pdl: bool = False, aligned: bool = False):
    """aligned: the launch's specialisation at K3's shapes (every pointer 16-byte aligned, hidden's and W1's
    strides and d, r multiples of 16), which a launch with torch's allocations gets; else none."""
    fn = markov_kernels.draft_confidence_kernel
    block_d, block_r, warps = markov_triton.confidence_launch(D, R if markov else 0)
    constexprs = {"HAS_W1": markov, "HAS_BIAS": bias, "HAS_TEMPS": temps, "BLOCK_D": block_d, "BLOCK_R": block_r,
                  "PDL": pdl}
    signature = {name: ("*i64" if name in IDS else "*fp32" if name in FP32_POINTERS else
                        f"*{dtype}" if name.endswith("_ptr") else "i32") for name in fn.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    multiples = [(i,) for i, name in enumerate(fn.arg_names) if name.endswith("_ptr") or name in ALIGNED_INTS]
    attrs = {path: [["tt.divisibility", 16]] for path in multiples} if aligned else None
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": pdl})


def test_k3_takes_one_step_of_d_at_16_warps():
    assert markov_triton.confidence_launch(D, R) == (8192, 256, 16)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("markov, bias, temps", [(True, True, True), (False, False, False)])
def test_draft_confidence_compiles_for_sm90_without_spills(dtype, markov, bias, temps, aligned, tmp_path):
    compiled = _compile(dtype, markov, bias, temps, aligned=aligned)
    assert_no_spills(compiled, tmp_path)
    if aligned:  # hidden's row and the weight read 16 bytes a load
        assert "ld.global.v4.b32" in compiled.asm["ptx"]


def test_under_pdl_the_wait_comes_before_the_first_load(tmp_path):
    compiled = _compile("bf16", True, True, True, pdl=True)
    assert_no_spills(compiled, tmp_path)
    ptx = compiled.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and ptx.index("griddepcontrol.wait") < ptx.index("ld.global")
