"""draft_head_loss's Triton kernels compiled for Hopper (sm_90a) on the CPU, with every tile of
their autotune lists: each must compile (TMA loads, wgmma) and keep its registers without
spilling to local memory (a spilling config would only lose the autotuning, slowly; one that
spills everywhere would make the op slow). Triton's bundled ptxas compiles; cuobjdump reads the
stack frame, which is where spills go (tests/cubin_usage.py). The GPU runs another Triton version, so this checks the
kernels' shape, not the GPU's exact code."""
import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cubin_usage import MISSING, assert_no_spills, unavailable  # noqa: E402
from dspark.kernels.draft_loss import head_kernels, head_triton  # noqa: E402

if head_kernels.INTERPRET or unavailable():
    pytest.skip(MISSING, allow_module_level=True)


def _signature(fn, block_m: int, block_v: int, target: str):
    """Argument types as the launcher specialises them: 16-divisible pointers, strides and sizes
    (the recipe's sizes all are), TMA descriptors with the config's boxes."""
    descriptors = {"x_desc": (block_m, head_triton.BLOCK_K), "w_desc": (block_v, head_triton.BLOCK_K),
                   "grad_desc": (block_m, block_v)}
    # target "none": the gradient pass without a teacher (cross-entropy alone; its pointer unread).
    constexprs = {"BLOCK_M": block_m, "BLOCK_V": block_v, "BLOCK_K": head_triton.BLOCK_K,
                  "GROUP_M": head_triton.GROUP_M, "WITH_L1": target != "none"}
    target = "*fp32" if target == "none" else target
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in descriptors:
            signature[name] = "tensordesc<bf16[{}, {}]>".format(*descriptors[name])
            continue
        if name.endswith("_ptr"):
            signature[name] = {"target_ptr": target, "target_rows_ptr": "*i64", "labels_ptr": "*i64"}.get(name, "*fp32")
        else:
            signature[name] = "i32"
        attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, {k: v for k, v in constexprs.items() if k in fn.arg_names}, attrs


CASES = [(kernel, config, target)
         for kernel in ("head_lse_kernel", "head_l1_kernel", "head_grad_kernel")
         for config in getattr(head_kernels, kernel).configs
         for target in {"head_lse_kernel": ("*fp32",), "head_l1_kernel": ("*bf16", "*fp32"),
                        "head_grad_kernel": ("*bf16", "*fp32", "none")}[kernel]]


@pytest.mark.parametrize("kernel,config,target", CASES,
                         ids=[f"{k}-{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_V']}-w{c.num_warps}s{c.num_stages}-{t.lstrip('*')}"
                              for k, c, t in CASES])
def test_compiles_for_sm90_without_spills(kernel, config, target, tmp_path):
    fn = getattr(head_kernels, kernel).fn
    signature, constexprs, attrs = _signature(fn, config.kwargs["BLOCK_M"], config.kwargs["BLOCK_V"], target)
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    assert "wgmma.mma_async" in compiled.asm["ptx"] and "cp.async.bulk.tensor" in compiled.asm["ptx"]
    assert_no_spills(compiled, tmp_path)
