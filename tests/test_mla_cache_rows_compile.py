"""MLA's cache-rows kernel (kernels/mla/triton_kernels.py cache_rows_kernel) compiled for Hopper (sm_90) on the
CPU at K3's widths (kv_lora_rank R = 512, the rope part P = 64, q_lora_rank Q = 1536) with the launch's 4 warps,
as kernels/mla/triton.py launches it for the K3 target (Q_NORM: the query's c_q normalised in the same program,
its 2048-wide block beside the cache row's) and without the query's norm, with and without the drafter's
rope tables: each build must keep its registers without spilling to local memory (tests/cubin_usage.py;
Triton's bundled ptxas compiles, cuobjdump reads the stack frame)."""
import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cubin_usage import MISSING, assert_no_spills, unavailable  # noqa: E402
from dspark.kernels.mla import triton_kernels as mla_kernels  # noqa: E402

if unavailable():
    pytest.skip(MISSING, allow_module_level=True)

R, P, Q = 512, 64, 1536  # K3's (dspark/targets/kimi_k3/config.py)
INDEX_POINTERS = ("slots_ptr", "cache_lens_ptr", "lengths_ptr")
TABLES = ("cos_ptr", "sin_ptr")


def _block(width: int) -> int:
    return 1 << (width - 1).bit_length()


PARTIALS = ("kv_ptr", "q_ptr")  # float32 split-K partials with PARTS > 1


def _compile(q_norm: bool, rope: bool, parts: int = 1):
    fn = mla_kernels.cache_rows_kernel
    constexprs = {"BLOCK_R": _block(R), "BLOCK_P": _block(P), "BLOCK_Q": _block(Q) if q_norm else 1, "ROPE": rope,
                  "INTERLEAVED": False, "Q_NORM": q_norm, "PARTS": parts, "PDL": False}
    signature = {name: ("*i64" if name in INDEX_POINTERS else "*fp32" if name in TABLES else
                        "*fp32" if parts > 1 and name in PARTIALS else
                        "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps" else
                        "i64" if name == "stride_slot" else "i32") for name in fn.arg_names}
    signature.update({name: "constexpr" for name in constexprs})
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})


@pytest.mark.parametrize("q_norm, rope, parts", [(True, False, 1), (True, True, 1), (False, False, 1),
                                                 (True, True, 14), (True, False, 14)])
def test_cache_rows_compile_for_sm90_without_spills(q_norm, rope, parts, tmp_path):
    """parts 14: the drafter's q_a | kv_a GEMM's split-K partials at a TP16 share (K = 7168), summed in
    the program."""
    assert_no_spills(_compile(q_norm, rope, parts), tmp_path)


def test_the_query_norm_is_in_the_q_norm_build_only():
    """Q_NORM adds the c_q row's norm (one more rsqrt, more loads and stores); off, it is compiled out."""
    with_q, without = (_compile(q_norm, False).asm["ptx"] for q_norm in (True, False))
    assert with_q.count("rsqrt") == without.count("rsqrt") + 1
    for op in ("ld.global", "st.global"):
        assert with_q.count(op) > without.count(op), op
